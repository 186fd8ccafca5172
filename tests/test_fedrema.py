"""FedReMa: the logit similarity, maximum difference segmentation, the server's per-client
classifier combination in and after the critical co-learning period, the probes."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedrema import FedReMa, FedReMaHyper, logit_similarity, mds
from protofl.messages import Record


def test_logit_similarity_by_hand():
    # softmax(0, 0) = (1/2, 1/2), softmax(log 3, 0) = (3/4, 1/4): cos = 4 / sqrt(2 * 10) = 2 / sqrt(5)
    logits = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]])  # (K=2, M=1, C=2)
    S = logit_similarity(logits)
    torch.testing.assert_close(S, torch.tensor([[1.0, 2 / 5 ** 0.5], [2 / 5 ** 0.5, 1.0]], dtype=torch.float64))
    # T = 1/2 squares the odds: (9/10, 1/10) against (1/2, 1/2): cos = 10 / sqrt(2 * 82)
    assert float(logit_similarity(logits, 0.5)[0, 1]) == pytest.approx(10 / 164 ** 0.5)
    # two probes: the mean of the two cosines (the second probe: identical predictions, cos 1)
    two = torch.tensor([[[0.0, 0.0], [1.0, 2.0]], [[math.log(3.0), 0.0], [1.0, 2.0]]])
    assert float(logit_similarity(two)[0, 1]) == pytest.approx((2 / 5 ** 0.5 + 1) / 2)


def test_mds_cuts_at_the_largest_gap_below_the_top_one():
    # sorted: 0.2 (4), 0.3 (3), 0.85 (2), 0.9 (1), 1 (0); gaps 0.1, 0.55, 0.05 (the top one, 0.1, not counted)
    chosen, gap = mds(torch.tensor([1.0, 0.9, 0.85, 0.3, 0.2]), 0)
    assert chosen == [0, 1, 2] and gap == pytest.approx(0.55)
    # the largest gap is the top one (0.9, to i itself): it is not a cut, so i keeps at least one peer;
    # the first of the equal gaps 0.05, 0.05 wins
    chosen, gap = mds(torch.tensor([1.0, 0.1, 0.05, 0.0]), 0)
    assert chosen == [0, 1, 2] and gap == pytest.approx(0.05)
    # K = 3: one gap below the top one; i is not first in the row
    assert mds(torch.tensor([0.5, 1.0, 0.4]), 1) == ([0, 1], pytest.approx(0.1))
    # a peer tied with i at 1: i ranks last, so the cut never drops it
    assert mds(torch.tensor([1.0, 1.0, 0.2]), 1)[0] == [0, 1]
    # K <= 2: every client, no gap
    assert mds(torch.tensor([1.0, 0.3]), 0) == ([0, 1], None)
    assert mds(torch.tensor([1.0]), 0) == ([0], None)


def info(C=2, N=5):
    return TaskInfo(num_classes=C, num_clients=N, feature_dim=2, input_shape=(2,), seed=0, rounds=3)


def server(hp=None, N=5):
    algo = FedReMa(hp or FedReMaHyper(), info(N=N))
    init = {"body.w": torch.zeros(1), "head.weight": torch.zeros(2, 2), "head.bias": torch.zeros(2)}
    logged = {}
    ctx = SimpleNamespace(device=torch.device("cpu"), log=logged.__setitem__,
                          init_weights=lambda: {k: v.clone() for k, v in init.items()},
                          rng=lambda rnd, *keys: np.random.default_rng([rnd, *[hash(k) % 1000 for k in keys]]))
    return algo, ctx, logged, algo.server_init(ctx)


def reply(n, bias, body=None):
    # a zero weight matrix: the logits are the bias whatever the probe, so the choice is known by hand
    r = Record(weights={"body.w": torch.full((1,), float(n if body is None else body))},
               arrays={"head": {"head.weight": torch.zeros(2, 2), "head.bias": torch.tensor([bias, 0.0])}})
    r.num_samples = n
    return r


def test_ccp_round_combines_each_client_with_its_most_relevant_peers():
    algo, ctx, logged, state = server()
    assert algo.configure_client(state, 1, 0, ctx) is None  # nothing combined yet: the client's own classifier
    biases = {0: 0.0, 1: 0.1, 2: 5.0, 3: 5.1}
    # arrival order permuted (the authors' code mixes arrival order with client ids; here it must not matter)
    replies = [(c, reply(10 * (c + 1), biases[c])) for c in (3, 0, 2, 1)]
    assert all(algo.check_reply(r, Record()) is None for _, r in replies)
    new = algo.aggregate(state, 1, replies, ctx)
    torch.testing.assert_close(new.weights["body.w"], torch.tensor([30.0]))  # sum n^2 / sum n = 3000 / 100
    # 0 and 1 are each other's peers, 2 and 3 likewise: each classifier is the mean of its pair's
    for c, b in ((0, 0.05), (1, 0.05), (2, 5.05), (3, 5.05)):
        msg = algo.configure_client(new, 2, c, ctx)
        torch.testing.assert_close(msg.weights["head.bias"], torch.tensor([b, 0.0]))
        torch.testing.assert_close(msg.weights["head.weight"], torch.zeros(2, 2))
    assert algo.configure_client(new, 2, 4, ctx) is None  # client 4 was not in the round
    A = torch.zeros(5, 5, dtype=torch.float64)
    A[:2, :2] = 1
    A[2:4, 2:4] = 1
    torch.testing.assert_close(new.depend, A)
    # g_1 = the mean of the four cut gaps s_(3) - s_(2) (sorted rows: other pair < own peer < itself)
    S = logit_similarity(torch.tensor([[[biases[c], 0.0]] for c in range(4)]))
    gaps = [S[0, 1] - S[0, 2], S[1, 0] - S[1, 2], S[2, 3] - S[2, 1], S[3, 2] - S[3, 1]]
    assert float(new.peak) == pytest.approx(float(sum(gaps) / 4)) == pytest.approx(logged["rema_gap"])
    assert bool(new.ccp) and logged["rema_ccp"] == 1.0 and logged["rema_peers"] == 2.0
    # round 2: identical classifiers, every gap 0 < delta * G: the period ends (for good)
    after = algo.aggregate(new, 2, [(c, reply(10, 1.0)) for c in range(4)], ctx)
    assert not bool(after.ccp) and float(after.peak) == float(new.peak) and logged["rema_ccp"] == 0.0


def test_after_the_ccp_the_dependency_map_weighs_the_round_classifiers():
    algo, ctx, logged, state = server(N=4)
    A = torch.tensor([[2.0, 1.0, 0.0, 5.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0] * 4], dtype=torch.float64)
    state.depend, state.ccp = A, torch.tensor(False)
    new = algo.aggregate(state, 5, [(0, reply(1, 0.0)), (1, reply(1, 3.0)), (2, reply(1, 6.0))], ctx)
    # client 0: (2 * 0 + 1 * 3) / 3 (client 3 is absent, its count renormalized away);
    # client 1: its only count is for the absent client 3: its own; client 2: (0 + 3 + 6) / 3
    for c, b in ((0, 1.0), (1, 3.0), (2, 3.0)):
        torch.testing.assert_close(algo.configure_client(new, 6, c, ctx).weights["head.bias"], torch.tensor([b, 0.0]))
    torch.testing.assert_close(new.depend, A)  # no MDS after the period: the map stays
    assert logged["rema_peers"] == pytest.approx(2.0)  # (2 + 1 + 3) / 3 peers with weight > 0


def test_fewer_than_three_clients_combine_all_and_add_no_gap():
    algo, ctx, logged, state = server()
    new = algo.aggregate(state, 1, [(0, reply(1, 0.0)), (4, reply(3, 4.0))], ctx)
    for c in (0, 4):
        torch.testing.assert_close(algo.configure_client(new, 2, c, ctx).weights["head.bias"], torch.tensor([2.0, 0.0]))
    assert float(new.peak) == 0.0 and bool(new.ccp) and "rema_gap" not in logged


def test_prototype_probes_are_the_plain_mean_of_the_class_means():
    algo, ctx, _, _ = server(FedReMaHyper(probe="prototypes"))

    def r(proto, counts):
        return Record(arrays={"proto": torch.tensor(proto), "counts": torch.tensor(counts)})

    replies = [(0, r([[1.0, 0.0], [0.0, 0.0]], [3, 0])), (1, r([[3.0, 0.0], [0.0, 2.0]], [1, 2]))]
    probes = algo.probes(replies, 1, ctx)
    # class 0: (1 + 3) / 2 (uniform over the holders, not count-weighted 1.5); class 1: client 1's only
    assert len(probes) == 2
    torch.testing.assert_close(probes[0], torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=torch.float64))
    only = algo.probes([(0, r([[1.0, 0.0], [0.0, 0.0]], [3, 0]))], 1, ctx)
    torch.testing.assert_close(only[0], torch.tensor([[1.0, 0.0]], dtype=torch.float64))  # class 1: no probe


def test_random_probes_are_one_uniform_draw_per_client():
    algo, ctx, _, _ = server(FedReMaHyper(probe_scale=0.5))
    probes = algo.probes([(0, None), (3, None)], 7, ctx)
    assert [tuple(p.shape) for p in probes] == [(1, 2), (1, 2)]
    assert all(bool(((p >= 0) & (p < 0.5)).all()) for p in probes) and not torch.equal(probes[0], probes[1])
    torch.testing.assert_close(algo.probes([(3, None)], 7, ctx)[0], probes[1])  # from the round's stream


def test_a_reply_without_its_classifier_or_prototypes_is_refused():
    algo = FedReMa(FedReMaHyper(), info())
    assert "head" in algo.check_reply(Record(weights={"body.w": torch.zeros(1)}), Record())
    bad = reply(1, 0.0)
    bad.arrays["head"] = {"head.weight": torch.zeros(2, 3)}
    assert "shape" in algo.check_reply(bad, Record())
    proto = FedReMa(FedReMaHyper(probe="prototypes"), info())
    assert "must carry" in proto.check_reply(reply(1, 0.0), Record())
    ok = reply(1, 0.0)
    ok.arrays.update(proto=torch.zeros(2, 2), counts=torch.tensor([1, 0]))
    assert proto.check_reply(ok, Record()) is None
    ok.arrays["proto"] = torch.zeros(3, 2)
    assert "proto" in proto.check_reply(ok, Record())


@pytest.mark.parametrize("bad", ["algorithm.delta=0", "algorithm.delta=1.5", "algorithm.probe=logits",
                                 "algorithm.temperature=0", "algorithm.probe_scale=-1"])
def test_bad_hyper_parameter_is_a_config_error(digits_cfg, bad):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
        digits_cfg("algorithm.name=fedrema", bad)


def test_prototype_probe_runs_and_batches(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    cfg = digits_cfg("algorithm.name=fedrema", "algorithm.probe=prototypes", "rounds=3", "partition.num_clients=4",
                     "participation.fraction=1.0", "eval.final_all_clients=false")
    rows = {}
    for ex in ("sequential", "batched"):
        res = Simulation(cfg.replace(**{"execution.executor": ex}), run_dir=tmp_path / ex).run()
        assert res.summary["status"] == "complete" and all(r["rejected"] == 0 for r in res.rows)
        rows[ex] = res.rows
    assert 2.0 <= rows["sequential"][0]["rema_peers"] <= 3.0  # round 1 is MDS's: 4 clients, 2 to 3 heads
    for ra, rb in zip(rows["sequential"], rows["batched"]):
        assert ra["rema_ccp"] == rb["rema_ccp"] and ra["rema_peers"] == rb["rema_peers"]
        assert math.isclose(ra["train_loss"], rb["train_loss"], rel_tol=1e-5)


def test_replies_with_another_classifier_are_left_out_with_a_warning_under_fedremas_logger(caplog):
    from protofl.algorithms.fedpac import model_heads_only

    heads = {"weight": torch.zeros(3, 2, 4), "bias": torch.zeros(3, 2)}  # 3 clients, a 4 -> 2 head
    good = Record(weights={}, arrays={"head": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}})
    odd = Record(weights={}, arrays={"head": {"weight": torch.zeros(2, 4)}})  # no bias
    with caplog.at_level("WARNING"):
        kept = model_heads_only([(0, good), (2, odd)], heads, "FedReMa")
    assert [cid for cid, _ in kept] == [0]
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("protofl.algorithms.fedrema",
         "FedReMa: left out the replies of clients [2], whose classifier entries are not the model's")]
