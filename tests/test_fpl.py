"""FPL: FINCH's partitions, the cluster and unbiased prototypes, CPCL + UPCR, the server's pool."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fpl import FPL, FPLHyper, cluster_prototypes, unbiased_prototypes
from protofl.algorithms.mpfedcl import PoolState
from protofl.messages import Record
from protofl.models.base import FLModel
from protofl.nn.clustering import finch, first_neighbor_partition


def test_finch_hierarchy_by_hand_euclidean():
    # first neighbours: 0<->1, 4<->5, 20<->21, 24<->25 -> 4 clusters; their means 0.5, 4.5, 20.5,
    # 24.5 pair up -> 2 clusters; the next step would leave one cluster, so it is not kept
    x = torch.tensor([[0.0], [1.0], [4.0], [5.0], [20.0], [21.0], [24.0], [25.0]])
    parts = finch(x, "euclidean")
    assert [p.tolist() for p in parts] == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]]


def test_finch_links_points_that_share_a_first_neighbour():
    # 3's first neighbour is 1 (distance 2 < 7) and 13's is 11: {0, 1, 3}, {10, 11, 13}
    x = torch.tensor([[0.0], [1.0], [3.0], [10.0], [11.0], [13.0]])
    assert [p.tolist() for p in finch(x, "euclidean")] == [[0, 0, 0, 1, 1, 1]]


def test_finch_cosine_ignores_length_and_small_inputs():
    x = torch.tensor([[1.0, 0.0], [5.0, 0.4], [0.0, 1.0], [0.2, 3.0]])  # two directions, any length
    assert [p.tolist() for p in finch(x)] == [[0, 0, 1, 1]]
    assert [p.tolist() for p in finch(x[:1])] == [[0]]  # one point: one cluster
    assert [p.tolist() for p in finch(x[:2])] == [[0, 0]]  # two points are each other's neighbour
    # ties go to the lower index: 3 is at distance 2 from both 1 and 5, and joins 1's cluster
    pts = np.array([[0.0], [1.0], [3.0], [5.0], [6.0]])
    assert first_neighbor_partition(pts, "euclidean").tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        finch(torch.zeros(0, 2))
    with pytest.raises(ValueError):
        finch(x, "manhattan")


def test_cluster_and_unbiased_prototypes_by_hand():
    protos = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])  # one class, two domains
    c = cluster_prototypes(protos)
    torch.testing.assert_close(c, torch.tensor([[0.95, 0.05], [0.05, 0.95]]))
    pool = torch.cat([c, torch.tensor([[2.0, 2.0]])])
    u, has = unbiased_prototypes(pool, torch.tensor([0, 0, 2]), 3)
    torch.testing.assert_close(u, torch.tensor([[0.5, 0.5], [0.0, 0.0], [2.0, 2.0]]))
    assert has.tolist() == [True, False, True]


def identity_model(C):
    head = nn.Linear(2, C)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return FLModel(nn.Identity(), head, 2, C)


def info(C=3, N=3):
    return TaskInfo(num_classes=C, num_clients=N, feature_dim=2, input_shape=(2,), seed=0, rounds=2)


def test_cpcl_and_upcr_by_hand():
    algo = FPL(FPLHyper(tau=0.5), info())
    pool, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])  # classes 0 and 1, one each
    loss, extras = algo.local_objective(pool, labels)
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    y = torch.tensor([0, 1, 2])  # class 2 has no prototype: it adds 0 to both terms
    got = loss(identity_model(3), x, y, extras)
    cpcl = math.log(1 + math.exp(-2.0))  # -log(e^{1/0.5} / (e^{1/0.5} + e^{0})) for either of the first two
    upcr = 0.5  # ||(0, 2) - (0, 1)||^2 / d; the first sample sits on its unbiased prototype
    expected = math.log(3) + (2 * cpcl + upcr) / 3  # CE of zero logits; both terms summed, / B
    assert float(got.detach()) == pytest.approx(expected, rel=1e-6)
    algo_no = FPL(FPLHyper(tau=0.5, cpcl=False), info())
    assert float(algo_no.local_objective(pool, labels)[0](identity_model(3), x, y, extras).detach()) == pytest.approx(
        math.log(3) + upcr / 3, rel=1e-6)
    assert algo.local_objective(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))[1] == {}  # round 1: CE


def reply(protos, classes, n=10):
    r = Record(weights={"w": torch.full((1,), float(n))},
               arrays={"protos": torch.tensor(protos), "classes": torch.tensor(classes),
                       "counts": torch.ones(len(classes), dtype=torch.int64)})
    r.num_samples = n
    return r


def test_server_clusters_each_class_and_keeps_absent_classes():
    algo = FPL(FPLHyper(), info())
    state = PoolState({"w": torch.zeros(1)}, torch.tensor([[7.0, 7.0]]), torch.tensor([2]))
    replies = [(0, reply([[1.0, 0.0], [0.0, 3.0]], [0, 1], n=10)), (1, reply([[0.9, 0.1]], [0], n=30)),
               (2, reply([[0.0, 1.0], [0.1, 0.9]], [0, 0], n=10))]
    new = algo.aggregate(state, 1, replies, SimpleNamespace(device=torch.device("cpu"), log=lambda k, v: None))
    torch.testing.assert_close(new.weights["w"], torch.tensor([(10 * 10 + 30 * 30 + 10 * 10) / 50.0]))  # FedAvg
    assert new.labels.tolist() == [0, 0, 1, 2]  # two clusters of class 0, one prototype of 1, class 2 kept
    torch.testing.assert_close(new.pool, torch.tensor([[0.95, 0.05], [0.05, 0.95], [0.0, 3.0], [7.0, 7.0]]))


def test_bad_temperature_is_a_config_error(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="tau"):
        digits_cfg("algorithm.name=fpl", "algorithm.tau=0")
