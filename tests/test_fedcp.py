"""FedCP: the MMD, the context, the (Gumbel-)softmax masks by hand, and the upload of the
global head as the mean of the two heads."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.fedcp import context_of, FedCP, FedCPHyper, masks, mmd_rbf
from protofl.models.base import FLModel

from method_checks import assert_bad_value_exits_2, assert_dp_sgd_refused
from conftest import record_run


def test_mmd_by_hand():
    a = torch.tensor([[0.0], [0.0]])
    assert float(mmd_rbf(a, a)) == 0.0
    # one point each at distance 1: K_aa = K_bb = 1 per bandwidth, K_ab = exp(-1 / (2 s))
    expected = sum(2 - 2 * math.exp(-0.5 / s) for s in (10, 15, 20, 50))
    assert math.isclose(float(mmd_rbf(torch.tensor([[0.0]]), torch.tensor([[1.0]]))), expected, rel_tol=1e-6)


def test_context_is_the_normalized_column_sum_of_the_personal_head():
    W = torch.tensor([[1.0, 0.0], [2.0, 4.0]])  # (C=2, d=2): sum of rows (3, 4)
    assert torch.allclose(context_of(W), torch.tensor([0.6, 0.8]))


def test_masks_with_and_without_gumbel_noise():
    algo = FedCP(FedCPHyper(tau=0.5), info=None)
    model = algo.adapt_model(FLModel(nn.Flatten(), nn.Linear(2, 2), feature_dim=2, num_classes=2))
    with torch.no_grad():
        for p in model.cpn.parameters():
            p.zero_()  # CPN output 0: both logits of every pair equal
    z, c = torch.ones(1, 2), torch.ones(2)
    assert torch.allclose(masks(model, z, c, 0.5), torch.full((1, 2), 0.5))
    g = torch.tensor([[[1.0, 0.0], [0.0, 0.5]]])  # (B, 2, d): noise of the personal / global logit
    s = masks(model, z, c, 0.5, g)  # softmax over the pair of (0 + g) / tau
    expected = torch.tensor([[1 / (1 + math.exp(-(1.0 - 0.0) / 0.5)), 1 / (1 + math.exp(-(0.0 - 0.5) / 0.5))]])
    assert torch.allclose(s, expected)


def test_personal_head_stays_and_the_global_head_uploaded_is_the_mean_of_both(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=fedcp", "rounds=2", "training.epochs=1")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    shared = {k for k in init if not k.startswith(("head.", "gbody."))}
    for _, _, msg, reply, state in seen:
        assert set(msg.weights) == set(reply.weights) == shared
        assert set(state.weights) == {"head.weight", "head.bias"}
        for k in ("weight", "bias"):  # h_g is frozen in training: its upload is (h_i + h_g) / 2
            assert torch.allclose(reply.weights[f"ghead.{k}"],
                                  0.5 * state.weights[f"head.{k}"] + 0.5 * msg.weights[f"ghead.{k}"])
    assert "gm" not in res.rows[-1] and 0.0 <= res.rows[-1]["pa"] <= 1.0


@pytest.mark.parametrize("key,value", [("lam", -1), ("tau", 0)])
def test_bad_hyper_parameters_exit_2_with_one_line(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("fedcp", key, value, tmp_path, capsys)


def test_dp_sgd_is_refused_in_one_line(tmp_path, capsys):
    """the MMD compares the batch's features as a set: per-sample gradients would change it."""
    assert_dp_sgd_refused("fedcp", tmp_path, capsys)
