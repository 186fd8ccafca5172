"""FedProto: prototypes, aggregation, the L_R term, message contents, heterogeneous models."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedproto import FedProto, FedProtoHyper, ProtoState, dense, sparse
from protofl.nn.prototypes import NearestPrototype
from protofl.messages import Record
from protofl.models import FLModel

from conftest import record_run, shared_data

INFO = TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(2,), seed=0, rounds=1)


def reply(protos, classes, counts):
    return Record(arrays={"protos": torch.tensor(protos), "classes": torch.tensor(classes),
                          "counts": torch.tensor(counts)}, num_samples=sum(counts))


# ---------------------------------------------------------------------------------------
# server: aggregation
# ---------------------------------------------------------------------------------------
def test_aggregation_weighted_by_class_counts_and_unweighted():
    a = reply([[1.0, 0.0], [0.0, 2.0]], [0, 1], [1, 3])  # client 0 holds classes 0 and 1
    b = reply([[3.0, 0.0]], [0], [3])  # client 1 holds class 0
    prev = ProtoState(torch.tensor([[0.0, 0.0], [0.0, 0.0], [7.0, 7.0]]), torch.tensor([0, 0, 5]))
    w = FedProto(FedProtoHyper(weighting="counts"), INFO).aggregate(prev, 2, [(0, a), (1, b)], None)
    # class 0: (1 * 1 + 3 * 3) / 4 = 2.5; class 1: only client 0; class 2: nobody -> kept
    torch.testing.assert_close(w.protos, torch.tensor([[2.5, 0.0], [0.0, 2.0], [7.0, 7.0]]))
    assert w.counts.tolist() == [4, 3, 5]
    u = FedProto(FedProtoHyper(weighting="uniform"), INFO).aggregate(prev, 2, [(0, a), (1, b)], None)
    torch.testing.assert_close(u.protos[0], torch.tensor([2.0, 0.0]))  # (1 + 3) / 2
    # nobody arrived: the state is unchanged
    assert FedProto(FedProtoHyper(), INFO).aggregate(prev, 2, [], None) is prev


def test_local_prototypes_hand_computed():
    from protofl.nn.prototypes import class_means

    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    protos, counts = class_means(z, torch.tensor([0, 0, 2]), 3)
    msg = sparse(protos, counts)  # what a client sends: only the classes it holds
    assert msg["classes"].tolist() == [0, 2] and msg["counts"].tolist() == [2, 1]
    torch.testing.assert_close(msg["protos"], torch.tensor([[2.0, 3.0], [5.0, 6.0]]))


def test_sparse_messages_round_trip():
    protos = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    counts = torch.tensor([2, 0, 1])
    arrays = sparse(protos, counts)
    assert arrays["classes"].tolist() == [0, 2] and arrays["protos"].shape == (2, 2)
    p, c = dense(Record(arrays=arrays), 3, 2)
    torch.testing.assert_close(p, protos)
    assert c.tolist() == [2, 0, 1]


# ---------------------------------------------------------------------------------------
# client: the local loss
# ---------------------------------------------------------------------------------------
def tiny_model():
    head = nn.Linear(2, 3)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        head.bias.copy_(torch.tensor([0.0, 0.5, -1.0]))
    return FLModel(nn.Identity(), head, 2, 3)


@pytest.mark.parametrize("distance", ["mse", "sq_l2", "l2"])
def test_local_loss_is_ce_plus_lambda_times_distance_to_global_prototype(distance):
    model = tiny_model()
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 1.0]])  # body = identity: z = x
    y = torch.tensor([0, 1, 2])
    c_bar = torch.tensor([[0.0, 0.0], [1.0, 1.0], [9.0, 9.0]])
    has = torch.tensor([True, True, False])  # class 2 has no global prototype: L_R = 0 for it
    loss_fn, extras = FedProto(FedProtoHyper(lam=0.5, distance=distance), INFO).local_objective(c_bar, has)
    loss = loss_fn(model, x, y, extras)
    sq = [1.0 + 4.0, 4.0 + 1.0]  # ||z - c||^2 of the first two samples
    per = {"mse": [s / 2 for s in sq], "sq_l2": sq, "l2": [math.sqrt(s) for s in sq]}[distance]
    l_r = (per[0] + per[1] + 0.0) / 3  # batch mean, the third sample counts as 0
    expected = F.cross_entropy(model(x), y) + 0.5 * l_r
    torch.testing.assert_close(loss, expected)
    # before any global prototype exists L_R = 0
    none, extras = FedProto(FedProtoHyper(lam=0.5, distance=distance), INFO).local_objective(
        c_bar, torch.zeros(3, dtype=torch.bool))
    torch.testing.assert_close(none(model, x, y, extras), F.cross_entropy(model(x), y))


def test_nearest_global_prototype_rule():
    protos = torch.tensor([[0.0, 0.0], [4.0, 0.0]])  # classes 0 and 2; class 1 has none
    pred = NearestPrototype(nn.Identity(), protos, torch.tensor([0, 2]), 3)
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 3.0]])
    s = pred(x)
    assert torch.isinf(s[:, 1]).all() and (s[:, 1] < 0).all()
    torch.testing.assert_close(s[:, [0, 2]], -torch.tensor([[1.0, 3.0], [3.0, 1.0], [3.0, 5.0]]))
    assert s.argmax(1).tolist() == [0, 2, 0]


# ---------------------------------------------------------------------------------------
# end to end on digits: prototypes, messages, bytes
# ---------------------------------------------------------------------------------------
def test_local_prototypes_are_class_means_of_the_trained_embeddings(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedproto", "rounds=2", "participation.fraction=0.3")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    rt = sim.runtime
    for rnd, cid, msg, rep, state in seen:
        model = rt.models.get({**cfg.model.params}, state.weights).eval()
        x, y = rt.client_train_data(cid)
        with torch.no_grad():
            z = model.body(x)
        classes = sorted(set(y.tolist()))
        assert rep.arrays["classes"].tolist() == classes
        assert rep.arrays["counts"].tolist() == [int((y == c).sum()) for c in classes]
        for c, p in zip(classes, rep.arrays["protos"]):
            torch.testing.assert_close(p, z[y == c].mean(0), atol=1e-5, rtol=1e-5)


def test_messages_carry_only_prototypes_and_bytes_are_prototype_sized(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedproto", "rounds=3")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    weight_keys = set(sim.runtime.models.get(dict(cfg.model.params)).state_dict())
    d = sim.info.feature_dim
    n_params = sum(v.numel() for v in sim.runtime.models.get(dict(cfg.model.params)).state_dict().values())
    for rnd, cid, msg, rep, state in seen:
        for rec in (msg, rep):
            assert set(rec.arrays) == {"protos", "classes", "counts"}
            assert not set(rec.arrays) & weight_keys
            m = len(rec.arrays["classes"])
            assert rec.arrays["protos"].shape == (m, d)
        assert not rep.metrics and not rep.weights and rep.num_samples == len(sim.fed.train_idx[cid])
        assert set(state.weights) == weight_keys  # the model stays on the client
    for row in res.rows:
        msgs = [(m, r) for rnd, _, m, r, _ in seen if rnd == row["round"]]
        # float32 prototypes + int64 classes and counts (+ 8 bytes for the sample count upstream)
        assert row["bytes_down"] == sum(len(m.arrays["classes"]) * (4 * d + 16) for m, _ in msgs)
        assert row["bytes_up"] == sum(len(r.arrays["classes"]) * (4 * d + 16) + 8 for _, r in msgs)
        assert row["bytes_up"] < 4 * n_params  # less than one model's weights for all clients together
    assert res.rows[0]["bytes_down"] == 0  # round 1: no global prototype exists yet
    assert res.rows[1]["bytes_down"] > 0
    for key in ("pa", "pa@own", "pa@logits", "acc", "acc@own", "acc@logits"):
        assert 0.0 <= res.rows[-1][key] <= 1.0


def test_own_class_predictor_is_restricted_to_the_clients_classes(digits_cfg, tmp_path):
    from protofl.engine.client import ClientContext, run_update
    from protofl.engine.simulation import Simulation

    sim = Simulation(digits_cfg("algorithm.name=fedproto"), run_dir=tmp_path / "r")
    algo, C, d = sim.algorithm, sim.info.num_classes, sim.info.feature_dim
    glob = ProtoState(torch.randn(C, d), torch.ones(C, dtype=torch.int64))  # every class has one
    ctx = ClientContext(sim.runtime, 3, 2)
    res = run_update(algo, algo.configure(glob, 2, sim.server), algo.client_init(ctx), ctx)
    own = torch.nonzero(ctx.class_counts > 0).flatten()
    assert list(res.personal) == ["proto", "own", "logits"]
    assert res.personal["proto"].labels.tolist() == list(range(C))
    assert res.personal["own"].labels.tolist() == own.tolist() and len(own) < C
    with torch.no_grad():  # its argmin never leaves the client's classes
        pred = res.personal["own"](ctx.data[0]).argmax(1)
    assert set(pred.tolist()) <= set(own.tolist())


def test_heterogeneous_mlps_on_digits(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedproto", "rounds=3", "model.per_client={hidden: [[32], [64], [96]]}")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    assert res.summary["status"] == "complete" and len(res.rows) == 3
    widths = {cid: state.weights["body.1.weight"].shape[0] for _, cid, _, _, state in seen}
    expected = {cid: [32, 64, 96][min(2, cid * 3 // 10)] for cid in widths}  # thirds of 10 clients
    assert widths == expected and len(set(widths.values())) == 3


def test_weight_averaging_methods_reject_heterogeneous_models(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError):
        digits_cfg("algorithm.name=mpfedcl", "model.per_client={hidden: [[32], [64]]}")


def test_heterogeneous_cnn_mnist_18_20_22_three_rounds(tmp_path):
    from protofl.config import from_dict

    root = shared_data()
    if not (root / "mnist").exists():
        pytest.skip("MNIST not available under shared data")
    cfg = from_dict({
        "seed": 0, "rounds": 3,
        "data": {"name": "mnist", "root": str(root)},
        "partition": {"name": "nway_kshot", "num_clients": 6, "ways": 3, "shots": 20, "stdev": 1},
        "model": {"name": "cnn_mnist", "per_client": {"channels": [18, 20, 22]}},
        "training": {"lr": 0.01, "momentum": 0.5, "epochs": 1, "batch_size": 8},
        "algorithm": {"name": "fedproto"},
        "eval": {"personal": False},  # no evaluation: this test is about the architectures
        "execution": {"threads": 1},
        "output": {"dir": str(tmp_path), "progress": False},
    })
    sim, res, seen = record_run(cfg, tmp_path / "r")
    assert res.summary["status"] == "complete" and len(res.rows) == 3
    channels = {cid: state.weights["body.3.weight"].shape[0] for _, cid, _, _, state in seen}  # the second conv
    assert channels == {0: 18, 1: 18, 2: 20, 3: 20, 4: 22, 5: 22}
    for _, _, msg, rep, _ in seen:
        assert rep.arrays["protos"].shape[1] == 50  # feature dim shared by all architectures
    assert all(math.isfinite(r["train_loss"]) for r in res.rows)
    assert res.rows[-1]["bytes_up"] < 6 * 10 * (50 * 4 + 16) + 6 * 8 + 1


def test_registered():
    assert ALGORITHMS.get("fedproto") is FedProto
    assert FedProto.has_global_model is False and FedProto.heterogeneous_models is True


def test_a_reply_with_a_class_index_outside_0_to_C_is_refused():
    algo = FedProto(FedProtoHyper(), INFO)

    def reply(classes):
        n = len(classes)
        return Record(arrays={"protos": torch.zeros(n, 2), "classes": torch.tensor(classes, dtype=torch.int64),
                              "counts": torch.ones(n, dtype=torch.int64)})

    assert algo.check_reply(reply([0, 2]), Record()) is None
    for bad in ([3], [-1], [0, -3]):  # -1 would index the last class's prototype
        assert "outside the class indices" in algo.check_reply(reply(bad), Record())


@pytest.mark.parametrize("name", ["fedproto", "fedtgp", "fedgh", "fedpcl", "fpl"])  # FedProto's check, shared
def test_a_reply_without_the_prototype_arrays_is_refused_and_an_empty_client_is_accepted(name):
    algo = ALGORITHMS.get(name)(ALGORITHMS.get(name).Hyper(), INFO)
    good = {"protos": torch.zeros(1, 2), "classes": torch.tensor([1]), "counts": torch.tensor([4])}
    assert algo.check_reply(Record(arrays=dict(good)), Record()) is None
    # a client without data replies m_i = 0 rows of each (sparse of an all-zero count table)
    empty = Record(arrays=sparse(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64)))
    assert algo.check_reply(empty, Record()) is None
    dense(empty, 3, 2)  # the server reads it
    for k in good:  # dense() and the aggregates index every one of them
        assert "must carry" in algo.check_reply(Record(arrays={n: t for n, t in good.items() if n != k}), Record())
    for k in ("classes", "counts"):  # a float index / count table breaks dense()'s index_put
        assert "int64" in algo.check_reply(Record(arrays={**good, k: good[k].float()}), Record())
    assert "shape" in algo.check_reply(Record(arrays={**good, "classes": torch.tensor(1)}), Record())
    assert "shape" in algo.check_reply(Record(arrays={**good, "counts": torch.tensor([4, 4])}), Record())
    twice = {"protos": torch.zeros(2, 2), "classes": torch.tensor([1, 1]), "counts": torch.tensor([4, 4])}
    assert "more than once" in algo.check_reply(Record(arrays=twice), Record())
