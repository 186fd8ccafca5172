"""MP-FedCL / SP-FedCL / DP-FedCL: contrastive loss eq. (11), pool and padding eq. (10),
nearest-prototype inference eq. (13), FedAvg aggregation of the weights."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import TaskInfo
from protofl.nn.prototypes import NearestPrototype
from protofl.algorithms.mpfedcl import (DPFedCL, MPFedCL, MPFedCLHyper, PoolState, SPFedCL,
                                        build_pool)
from protofl.messages import Record
from protofl.nn.contrastive import prototype_supcon_loss

from conftest import record_run

INFO = TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(2,), seed=0, rounds=1)


# ---------------------------------------------------------------------------------------
# eq. (11): the supervised contrastive term, against a direct computation
# ---------------------------------------------------------------------------------------
def unit(v):
    n = math.sqrt(sum(a * a for a in v))
    return [a / n for a in v]


def reference_supcon(z, y, protos, labels, tau, positives):
    """Plain-Python loops over samples and prototypes."""
    losses = []
    for zi, yi in zip(z, y):
        zi = unit(zi)
        s = [sum(a * b for a, b in zip(zi, unit(u))) / tau for u in protos]
        den = sum(math.exp(v) for v in s)
        pos = [k for k, lab in enumerate(labels) if lab == yi]
        if not pos:
            continue
        if positives == "mean_log":
            losses.append(-sum(math.log(math.exp(s[k]) / den) for k in pos) / len(pos))
        else:
            losses.append(-math.log(sum(math.exp(s[k]) for k in pos) / den))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("positives", ["mean_log", "log_sum"])
def test_contrastive_loss_equals_direct_computation_on_3_samples(positives):
    z = [[1.0, 0.0], [0.5, 2.0], [-1.0, 1.0]]
    y = [0, 1, 0]
    protos = [[2.0, 0.1], [0.0, 1.0], [1.0, 1.0], [-0.5, 0.3]]  # classes 0, 1, 1, 2
    labels = [0, 1, 1, 2]
    tau = 0.5
    got = prototype_supcon_loss(torch.tensor(z, dtype=torch.float64), torch.tensor(y),
                                torch.tensor(protos, dtype=torch.float64), torch.tensor(labels), tau, positives)
    assert float(got) == pytest.approx(reference_supcon(z, y, protos, labels, tau, positives), rel=1e-12)


def test_contrastive_loss_ignores_samples_without_positives_and_keeps_the_graph():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    protos, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64), torch.tensor([0, 1])
    only_first = prototype_supcon_loss(z, torch.tensor([0, 2]), protos, labels, 0.5)  # class 2: no prototype
    ref = reference_supcon([[1.0, 0.0]], [0], [[1.0, 0.0], [0.0, 1.0]], [0, 1], 0.5, "mean_log")
    assert float(only_first.detach()) == pytest.approx(ref, rel=1e-12)
    none = prototype_supcon_loss(z, torch.tensor([2, 2]), protos, labels, 0.5)
    assert float(none.detach()) == 0.0
    none.backward()  # a zero that still belongs to the graph
    assert torch.equal(z.grad, torch.zeros_like(z))


# ---------------------------------------------------------------------------------------
# eq. (13): nearest pool prototype, several per class
# ---------------------------------------------------------------------------------------
def test_multi_prototype_inference_hand_made():
    pool = torch.tensor([[0.0, 0.0], [10.0, 0.0],  # class 0: two prototypes far apart
                         [5.0, 0.0]])  # class 1: one in between; class 2: none
    pred = NearestPrototype(nn.Identity(), pool, torch.tensor([0, 0, 1]), 3)
    x = torch.tensor([[9.0, 0.0], [6.0, 0.0], [1.0, 0.0]])
    s = pred(x)
    # class 0 score: minus the distance to its *nearest* prototype
    torch.testing.assert_close(s[:, :2], -torch.tensor([[1.0, 4.0], [4.0, 1.0], [1.0, 4.0]]))
    assert (s[:, 2] == float("-inf")).all()
    assert s.argmax(1).tolist() == [0, 1, 0]  # a single class mean (5, 0) would say 1 for the first


# ---------------------------------------------------------------------------------------
# server: padding eq. (10), pool, FedAvg weights
# ---------------------------------------------------------------------------------------
def test_build_pool_pads_each_client_group_to_k_with_the_pool_mean():
    groups = {1: [torch.tensor([[1.0, 1.0], [3.0, 1.0]]), torch.tensor([[5.0, 4.0]])],
              0: [torch.tensor([[0.0, 2.0]])]}
    pool, labels = build_pool(groups, 2, 2)
    assert labels.tolist() == [0, 0, 1, 1, 1, 1]
    torch.testing.assert_close(pool, torch.tensor([[0.0, 2.0], [0.0, 2.0],  # pad = the only one
                                                   [1.0, 1.0], [3.0, 1.0],
                                                   [5.0, 4.0], [3.0, 2.0]]))  # pad = mean of 3
    # size None (DP-FedCL): pad to the largest group of the class
    pool, labels = build_pool(groups, None, 2)
    assert labels.tolist() == [0, 1, 1, 1, 1]


def test_aggregate_weights_like_fedavg_and_builds_the_pool():
    algo = MPFedCL(MPFedCLHyper(k=2), INFO)
    state = PoolState({"w": torch.zeros(2)}, torch.tensor([[9.0, 9.0]]), torch.tensor([2]))

    def rep(w, n, protos, labels):
        return Record(weights={"w": torch.tensor(w)}, arrays={"protos": torch.tensor(protos),
                                                              "labels": torch.tensor(labels)}, num_samples=n)

    replies = [(0, rep([1.0, 0.0], 10, [[1.0, 0.0], [3.0, 0.0]], [0, 0])),
               (1, rep([0.0, 4.0], 30, [[0.0, 1.0]], [1]))]
    new = algo.aggregate(state, 1, replies, None)
    torch.testing.assert_close(new.weights["w"], torch.tensor([0.25, 3.0]))  # (10 w0 + 30 w1) / 40
    # eq. (10): every arriving client gets K = 2 prototypes of every class some client sent.
    # class 0: client 0's two, then client 1 (no class 0): 2 x U_bar_0 = mean((1,0), (3,0)) = (2,0);
    # class 1: client 0 (no class 1): 2 x U_bar_1 = (0,1), client 1's one padded with (0,1);
    # class 2: nobody sent it, kept from before
    assert new.labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    torch.testing.assert_close(new.pool, torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [2.0, 0.0],
                                                       [0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0],
                                                       [9.0, 9.0]]))
    assert algo.aggregate(state, 1, [], None) is state


def rep_protos(protos, labels, d=2):
    return Record(weights={"w": torch.zeros(2)}, num_samples=10,
                  arrays={"protos": torch.tensor(protos).reshape(-1, d), "labels": torch.tensor(labels, dtype=torch.int64)})


# client 0 sends class 0: (4,0); client 1 sends class 1: (0,2), (2,6). U_bar_0 = (4,0), U_bar_1 = (1,4)
FILL_CASES = {
    # K = 3: each client's group of each class has 3 rows
    "mpfedcl": (MPFedCL(MPFedCLHyper(k=3), INFO),
                [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
                [[4, 0], [4, 0], [4, 0],  # class 0, client 0: its own, padded with U_bar_0
                 [4, 0], [4, 0], [4, 0],  # class 0, client 1 (none): 3 x U_bar_0
                 [1, 4], [1, 4], [1, 4],  # class 1, client 0 (none): 3 x U_bar_1
                 [0, 2], [2, 6], [1, 4]]),  # class 1, client 1: its own two, padded
    # DP-FedCL: each class's groups padded to the class's largest group (class 0: 1, class 1: 2)
    "dpfedcl": (DPFedCL(DPFedCL.Hyper(), INFO),
                [0, 0, 1, 1, 1, 1],
                [[4, 0], [4, 0], [1, 4], [1, 4], [0, 2], [2, 6]]),
}


@pytest.mark.parametrize("case", sorted(FILL_CASES))
def test_aggregate_fills_a_missing_class_with_copies_of_the_pool_mean_eq10(case):
    """Eq. (10): a client without class j gets the pool average U_bar_j in all its slots."""
    algo, labels, pool = FILL_CASES[case]
    state = PoolState({"w": torch.zeros(2)}, torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))
    replies = [(0, rep_protos([[4.0, 0.0]], [0])), (1, rep_protos([[0.0, 2.0], [2.0, 6.0]], [1, 1]))]
    new = algo.aggregate(state, 1, replies, None)
    assert new.labels.tolist() == labels
    torch.testing.assert_close(new.pool, torch.tensor(pool, dtype=torch.float32))


def test_spfedcl_missing_class_gets_one_copy_of_the_class_mean():
    algo = SPFedCL(SPFedCL.Hyper(), INFO)
    state = PoolState({"w": torch.zeros(2)}, torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))
    replies = [(0, rep_protos([[4.0, 0.0], [1.0, 1.0]], [0, 2])), (1, rep_protos([[0.0, 2.0], [3.0, 3.0]], [1, 2]))]
    new = algo.aggregate(state, 1, replies, None)
    assert new.labels.tolist() == [0, 0, 1, 1, 2, 2]
    torch.testing.assert_close(new.pool, torch.tensor([[4.0, 0.0], [4.0, 0.0], [0.0, 2.0], [0.0, 2.0],
                                                       [1.0, 1.0], [3.0, 3.0]]))


def test_check_reply_requires_protos_and_labels():
    algo = MPFedCL(MPFedCLHyper(k=2), INFO)
    good = rep_protos([[1.0, 0.0]], [0])
    assert algo.check_reply(good, None) is None
    assert algo.check_reply(rep_protos([], []), None) is None  # a client without data: 0 rows
    for drop in ("protos", "labels"):
        r = Record(weights=good.weights, num_samples=10, arrays={k: v for k, v in good.arrays.items() if k != drop})
        assert "must carry the arrays 'protos' and 'labels'" in algo.check_reply(r, None)
    r = Record(weights=good.weights, num_samples=10, arrays={"protos": good.arrays["protos"], "labels": torch.tensor(0)})
    assert "expected (m,)" in algo.check_reply(r, None)
    r = Record(weights=good.weights, num_samples=10, arrays={"protos": torch.zeros(2, 2), "labels": torch.tensor([0])})
    assert "shape" in algo.check_reply(r, None)


# ---------------------------------------------------------------------------------------
# end to end on digits
# ---------------------------------------------------------------------------------------
def client_embeddings(sim, cid, weights):
    rt = sim.runtime
    model = rt.models.get(dict(sim.cfg.model.params), weights).eval()
    x, y = rt.client_train_data(cid)
    with torch.no_grad():
        return model.body(x), y


def test_mpfedcl_clients_send_k_kmeans_centroids_per_class(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=mpfedcl", "algorithm.k=3", "rounds=2", "participation.fraction=0.3")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    for rnd, cid, msg, rep, _ in seen:
        z, y = client_embeddings(sim, cid, rep.weights)
        for j in torch.unique(y).tolist():
            c = rep.arrays["protos"][rep.arrays["labels"] == j]
            n_distinct = len(torch.unique(z[y == j], dim=0))
            assert len(c) == min(3, n_distinct)
            # Lloyd fixed point: each centroid is the mean of the embeddings nearest to it
            assign = torch.cdist(z[y == j], c).argmin(1)
            for k in range(len(c)):
                torch.testing.assert_close(c[k], z[y == j][assign == k].mean(0), atol=1e-4, rtol=1e-4)
        pool_labels = msg.arrays["pool"]["labels"]
        if rnd == 1:
            assert len(pool_labels) == 0
        else:  # padded: every class holds a multiple of K prototypes
            assert all(int((pool_labels == j).sum()) % 3 == 0 for j in pool_labels.unique().tolist())
    assert all(0.0 <= r["gm"] <= 1.0 and 0.0 <= r["gm@logits"] <= 1.0 for r in res.rows)


def test_spfedcl_prototypes_are_class_means(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=spfedcl", "rounds=1", "participation.fraction=0.3")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    for rnd, cid, msg, rep, _ in seen:
        z, y = client_embeddings(sim, cid, rep.weights)
        classes = torch.unique(y)
        assert rep.arrays["labels"].tolist() == classes.tolist()
        for j, p in zip(classes.tolist(), rep.arrays["protos"]):
            torch.testing.assert_close(p, z[y == j].mean(0), atol=1e-5, rtol=1e-5)


def test_dpfedcl_runs_with_data_chosen_cluster_counts(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=dpfedcl", "algorithm.eps=0.05", "algorithm.min_samples=2",
                     "algorithm.max_clusters=4", "rounds=2", "participation.fraction=0.3")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    counts = []
    for rnd, cid, msg, rep, _ in seen:
        labels = rep.arrays["labels"]
        per_class = [int((labels == j).sum()) for j in labels.unique().tolist()]
        assert all(1 <= n <= 4 for n in per_class)
        counts += per_class
    assert res.summary["status"] == "complete"
    assert len(set(counts)) > 1  # the number of prototypes varies with the data


def test_round_one_global_weights_equal_fedavg(digits_cfg, tmp_path):
    """No pool exists in round 1, so L_R = 0 and the averaged model is FedAvg's exactly."""
    fedavg = record_run(digits_cfg("algorithm.name=fedavg", "rounds=1"), tmp_path / "a")[1]
    for name in ("mpfedcl", "spfedcl"):
        res = record_run(digits_cfg(f"algorithm.name={name}", "rounds=1"), tmp_path / name)[1]
        assert torch.equal(torch.as_tensor(res.server_state.weights["head.weight"]),
                           torch.as_tensor(fedavg.server_state.weights["head.weight"]))
        assert res.rows[0]["gm@logits"] == fedavg.rows[0]["gm"]


def test_registered_variants():
    assert ALGORITHMS.get("mpfedcl") is MPFedCL
    assert ALGORITHMS.get("spfedcl") is SPFedCL
    assert ALGORITHMS.get("dpfedcl") is DPFedCL
    sp = SPFedCL(SPFedCL.Hyper(), INFO)
    z = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    torch.testing.assert_close(sp.class_prototypes(z, np.random.default_rng(0)), torch.tensor([[2.0, 4.0]]))
