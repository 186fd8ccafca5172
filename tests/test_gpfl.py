"""GPFL: the conditional inputs, the conditional valve, the angle-level and magnitude-level
guidance by hand, and what stays on the client."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.gpfl import angle_loss, conditional_inputs, CoV, GPFL, GPFLHyper
from protofl.models.base import FLModel

from method_checks import assert_bad_value_exits_2, assert_round_2_is_the_weighted_mean, assert_dp_sgd_refused
from conftest import record_run


def test_conditional_inputs_by_hand():
    E = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    g, p = conditional_inputs(E, torch.tensor([2, 0, 2]))
    assert torch.allclose(g, torch.tensor([2 / 3, 2 / 3]))
    assert torch.allclose(p, torch.tensor([1.0, 0.5]))  # 0.5 E_0 + 0.5 E_2


def test_valve_with_zero_nets_is_relu():
    cov = CoV(2)
    with torch.no_grad():
        for p in cov.parameters():
            p.zero_()  # gamma(c) = beta(c) = LayerNorm(0) with zero affine = 0
    z = torch.tensor([[1.0, -2.0]])
    assert torch.equal(cov(z, torch.tensor([5.0, 5.0])), torch.tensor([[1.0, 0.0]]))


def test_angle_loss_by_hand():
    z_G = torch.tensor([[2.0, 0.0]])
    E = torch.tensor([[1.0, 0.0], [0.0, 3.0]])  # cosines (1, 0)
    assert math.isclose(float(angle_loss(z_G, E, torch.tensor([0]))), math.log(1 + math.exp(-1)), rel_tol=1e-6)


def test_gpfl_loss_terms_by_hand():
    algo = GPFL(GPFLHyper(lam=0.5, mu=0.0), info=None)
    model = algo.adapt_model(FLModel(nn.Flatten(), nn.Linear(2, 2), feature_dim=2, num_classes=2))
    with torch.no_grad():
        for p in [*model.cov.parameters(), *model.head.parameters()]:
            p.zero_()
        model.gce.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    x, y = torch.tensor([[3.0, 4.0]]), torch.tensor([1])
    E0 = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    extras = {"g": torch.zeros(2), "p": torch.zeros(2), "E0": E0}
    loss = algo.gpfl_loss(model, x, y, extras)
    # zero head: CE log 2; z_G = relu(x) = (3, 4): cosines (0.6, 0.8), CE to class 1;
    # magnitude: lam ||(3, 4) - (0, 1)|| = 0.5 sqrt(18)
    angle = -math.log(math.exp(0.8) / (math.exp(0.6) + math.exp(0.8)))
    expected = math.log(2) + angle + 0.5 * math.sqrt(18)
    assert math.isclose(float(loss.detach()), expected, rel_tol=1e-6)


def test_head_stays_on_the_client_and_gce_cov_are_averaged(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=gpfl", "rounds=2", "training.epochs=1")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    init = sim.server.init_weights()
    assert {"gce.weight"} < set(init) and any(k.startswith("cov.") for k in init)
    for _, _, msg, reply, state in seen:
        assert set(msg.weights) == set(reply.weights) == {k for k in init if not k.startswith("head.")}
        assert set(state.weights) == {"head.weight", "head.bias"}
    assert_round_2_is_the_weighted_mean(seen, [k for k in init if not k.startswith("head.")])
    assert "gm" not in res.rows[-1]


@pytest.mark.parametrize("key,value", [("lam", -1), ("mu", -0.1)])
def test_bad_hyper_parameters_exit_2_with_one_line(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("gpfl", key, value, tmp_path, capsys)


def test_dp_sgd_is_refused_in_one_line(tmp_path, capsys):
    """the magnitude term is one norm over the whole batch: per-sample gradients would change it."""
    assert_dp_sgd_refused("gpfl", tmp_path, capsys)
