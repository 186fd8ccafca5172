"""FedPAC: the simplex QP, the feature statistics (V_i, h_i), the combination weights,
the aligned loss and the server's classifier collaboration."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo
from protofl.algorithms.fedpac import FedPAC, FedPACHyper, combination_weights, feature_statistics
from protofl.messages import Record
from protofl.models.base import FLModel
from protofl.nn.qp import simplex_qp


def test_simplex_qp_known_solutions():
    # diagonal Q: alpha_j proportional to 1 / Q_jj
    np.testing.assert_allclose(simplex_qp(np.diag([1.0, 2.0, 4.0])), [4 / 7, 2 / 7, 1 / 7], atol=1e-12)
    # f(b) = (1-b)^2 + 4 (1-b) b + 10 b^2 = 1 + 2b + 7b^2 on b in [0, 1]: the bound b = 0 is active
    np.testing.assert_allclose(simplex_qp(np.array([[1.0, 2.0], [2.0, 10.0]])), [1.0, 0.0], atol=1e-9)
    assert simplex_qp(np.array([[3.0]])).tolist() == [1.0]
    # the floor drops small weights and renormalizes: 1/Q_jj = 1, 1, 1/2000 -> the third drops
    np.testing.assert_allclose(simplex_qp(np.diag([1.0, 1.0, 2000.0]), floor=1e-3), [0.5, 0.5, 0.0], atol=1e-12)
    for bad in (np.zeros((2, 3)), np.zeros((0, 0)), np.array([[np.nan]])):
        with pytest.raises(ValueError):
            simplex_qp(bad)


def test_feature_statistics_by_hand():
    z = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 0, 1])
    v, h = feature_statistics(z, y, 3)
    # p = (2/3, 1/3, 0), mu_0 = (2, 0), mu_1 = (0, 2): h = p mu
    torch.testing.assert_close(h, torch.tensor([[4 / 3, 0.0], [0.0, 2 / 3], [0.0, 0.0]]))
    # V = 1/n sum_k (p_k E_k||z||^2 - ||h_k||^2) = (2/3 * 5 + 1/3 * 4 - 16/9 - 4/9) / 3
    assert float(v) == pytest.approx(22 / 27)


def test_combination_weights_by_hand():
    H = torch.zeros(2, 2, 2)
    H[1, 0, 0] = 2.0  # ||h_0 - h_1||_F^2 = 4
    # client 0: Q = diag(V) + [[0, 0], [0, 4]] = diag(1, 5) -> alpha = (5/6, 1/6)
    np.testing.assert_allclose(combination_weights(torch.tensor([1.0, 1.0]), H, 0), [5 / 6, 1 / 6], atol=1e-12)
    # identical statistics: the bias term vanishes and alpha_j is proportional to 1 / V_j
    np.testing.assert_allclose(combination_weights(torch.tensor([1.0, 3.0]), torch.zeros(2, 2, 2), 1),
                               [3 / 4, 1 / 4], atol=1e-12)


def info(C=2, N=3):
    return TaskInfo(num_classes=C, num_clients=N, feature_dim=2, input_shape=(2,), seed=0, rounds=2)


def test_aligned_loss_by_hand():
    algo = FedPAC(FedPACHyper(lam=2.0), info())
    head = nn.Linear(2, 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = FLModel(nn.Identity(), head, 2, 2)
    x, y = torch.tensor([[1.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1])
    target = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    got = algo.aligned_loss(model, x, y, {"target": target})
    # CE of zero logits + lam * mean over the batch and the d dims of (z - c_y)^2 = (1 + 4) / 4
    assert float(got.detach()) == pytest.approx(math.log(2) + 2.0 * 5 / 4)


def test_server_combines_the_round_classifiers_and_sends_each_client_its_own():
    algo = FedPAC(FedPACHyper(), info())
    init = {"body.w": torch.zeros(1), "head.weight": torch.zeros(2, 2), "head.bias": torch.zeros(2)}

    logged = {}
    ctx = SimpleNamespace(device=torch.device("cpu"), log=logged.__setitem__,
                          init_weights=lambda: {k: v.clone() for k, v in init.items()})
    state = algo.server_init(ctx)
    assert algo.configure_client(state, 1, 0, ctx) is None  # nothing combined yet: the client's own head

    def reply(n, v, phi, proto):
        r = Record(weights={"body.w": torch.full((1,), float(n))},
                   arrays={"proto": torch.tensor(proto), "counts": torch.tensor([n, 0]), "v": torch.tensor([v]),
                           "h": torch.zeros(2, 2),  # identical h: alpha_j proportional to 1 / V_j
                           "head": {"head.weight": torch.full((2, 2), phi), "head.bias": torch.full((2,), phi)}})
        r.num_samples = n
        return r

    replies = [(0, reply(10, 1.0, 1.0, [[1.0, 0.0], [0.0, 0.0]])), (2, reply(30, 3.0, 5.0, [[0.0, 1.0], [0.0, 0.0]]))]
    assert all(algo.check_reply(r, Record()) is None for _, r in replies)
    new = algo.aggregate(state, 1, replies, ctx)
    torch.testing.assert_close(new.weights["body.w"], torch.tensor([25.0]))  # (10 * 10 + 30 * 30) / 40
    torch.testing.assert_close(new.protos[0], torch.tensor([0.25, 0.75]))  # count-weighted c_0
    assert new.counts.tolist() == [40, 0]
    # alpha = (3/4, 1/4) for both: phi = 3/4 * 1 + 1/4 * 5 = 2
    for cid in (0, 2):
        msg = algo.configure_client(new, 2, cid, ctx)
        torch.testing.assert_close(msg.weights["head.weight"], torch.full((2, 2), 2.0))
    assert algo.configure_client(new, 2, 1, ctx) is None  # client 1 was not in the round
    assert logged["pac_self_weight"] == pytest.approx(0.5)  # (3/4 + 1/4) / 2
    assert "body.w" in algo.configure(new, 2, ctx).weights and "head.weight" not in algo.configure(new, 2, ctx).weights
    bad = reply(10, 1.0, 1.0, [[1.0, 0.0], [0.0, 0.0]])
    bad.arrays["head"] = {"body.w": torch.zeros(1)}
    assert "head" in algo.check_reply(bad, Record())


def test_bad_hyper_parameter_is_a_config_error(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="head_epochs"):
        digits_cfg("algorithm.name=fedpac", "algorithm.head_epochs=0")


def test_a_reply_missing_an_array_or_with_a_misshapen_classifier_is_refused():
    algo = FedPAC(FedPACHyper(), info())
    C, d = 2, 2
    head = {"head.weight": torch.zeros(C, d), "head.bias": torch.zeros(C)}

    def reply(**change):
        arrays = {"proto": torch.zeros(C, d), "counts": torch.tensor([3, 0]), "v": torch.zeros(1),
                  "h": torch.zeros(C, d), "head": dict(head)}
        arrays.update(change)
        return Record(weights={"body.w": torch.zeros(1)}, arrays={k: v for k, v in arrays.items() if v is not None},
                      num_samples=3)

    assert algo.check_reply(reply(), Record()) is None  # a class the client lacks: zero rows, still sent
    assert algo.check_reply(reply(head={"head.weight": torch.zeros(C, d)}), Record()) is None  # a head without bias
    for k in ("proto", "counts", "v", "h"):  # the aggregate reads every one of them
        assert "must carry" in algo.check_reply(reply(**{k: None}), Record())
    assert "head" in algo.check_reply(reply(head=None), Record())
    assert "expected" in algo.check_reply(reply(head={"head.bias": torch.zeros(C)}), Record())  # no weight
    assert "shape" in algo.check_reply(reply(head={**head, "head.weight": torch.zeros(C, d + 1)}), Record())
    assert "shape" in algo.check_reply(reply(head={**head, "head.bias": torch.zeros(C + 1)}), Record())
    # a combined classifier was sent: the reply's classifier has exactly its entries
    sent = Record(weights={"head.weight": torch.zeros(C, d), "head.bias": torch.zeros(C)})
    assert algo.check_reply(reply(), sent) is None
    assert "expected" in algo.check_reply(reply(head={"head.weight": torch.zeros(C, d)}), sent)


def test_the_aggregate_leaves_out_a_classifier_whose_entries_are_not_the_models():
    algo = FedPAC(FedPACHyper(), info())
    init = {"body.w": torch.zeros(1), "head.weight": torch.zeros(2, 2), "head.bias": torch.zeros(2)}
    ctx = SimpleNamespace(device=torch.device("cpu"), log=lambda *a: None,
                          init_weights=lambda: {k: v.clone() for k, v in init.items()})
    state = algo.server_init(ctx)

    def reply(n, head):
        return Record(weights={"body.w": torch.full((1,), float(n))},
                      arrays={"proto": torch.ones(2, 2), "counts": torch.tensor([n, 0]), "v": torch.ones(1),
                              "h": torch.zeros(2, 2), "head": head}, num_samples=n)

    good = reply(10, {"head.weight": torch.ones(2, 2), "head.bias": torch.ones(2)})
    no_bias = reply(30, {"head.weight": torch.ones(2, 2)})  # passes check_reply: a linear head
    assert algo.check_reply(no_bias, Record()) is None
    new = algo.aggregate(state, 1, [(0, good), (1, no_bias)], ctx)
    torch.testing.assert_close(new.weights["body.w"], torch.tensor([10.0]))  # client 1 left out
    assert new.combined.tolist() == [True, False, False] and new.counts.tolist() == [10, 0]
    assert algo.aggregate(state, 1, [(1, no_bias)], ctx) is state
