"""APFL: the parameter mixture by hand, the three gradients of one minibatch loss, alpha kept
in [0, 1], and what never leaves the client."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.algorithms.apfl import APFL, APFLHyper, apfl_loss, mixed_logits
from protofl.models.base import FLModel

from method_checks import assert_bad_value_exits_2
from conftest import record_run


def tiny(alpha):
    """body h = b x (b scalar), head logits = H h (H (2, 1)); w = (b=1, H=(1, -1)), v = (3, (0, 2))."""
    model = FLModel(nn.Linear(1, 1, bias=False), nn.Linear(1, 2, bias=False), feature_dim=1, num_classes=2)
    model = APFL(APFLHyper(alpha=alpha), info=None).adapt_model(model)
    with torch.no_grad():
        model.body.weight.fill_(1.0)
        model.head.weight.copy_(torch.tensor([[1.0], [-1.0]]))
        model.v.body.weight.fill_(3.0)
        model.v.head.weight.copy_(torch.tensor([[0.0], [2.0]]))
    return model


def test_personalized_model_mixes_parameters():
    model = tiny(0.25)
    # v-bar: b = 0.25 * 3 + 0.75 * 1 = 1.5, H = 0.25 (0, 2) + 0.75 (1, -1) = (0.75, -0.25)
    x = torch.tensor([[2.0]])
    assert torch.allclose(mixed_logits(model, x), torch.tensor([[2.25, -0.75]]))
    assert torch.allclose(model(x), torch.tensor([[2.0, -2.0]]))  # the global model w


def test_one_loss_gives_the_three_updates_of_algorithm_1():
    model = tiny(0.25)
    x, y = torch.tensor([[2.0], [-1.0]]), torch.tensor([1, 0])
    apfl_loss(model, x, y, {}).backward()
    # the gradient of f at w and at v-bar, each computed on its own model
    def grad_at(b, H):
        m = FLModel(nn.Linear(1, 1, bias=False), nn.Linear(1, 2, bias=False), feature_dim=1, num_classes=2)
        with torch.no_grad():
            m.body.weight.fill_(b)
            m.head.weight.copy_(torch.tensor(H))
        F.cross_entropy(m(x), y).backward()
        return m.body.weight.grad, m.head.weight.grad
    gw = grad_at(1.0, [[1.0], [-1.0]])
    gbar = grad_at(1.5, [[0.75], [-0.25]])
    assert torch.allclose(model.body.weight.grad, gw[0]) and torch.allclose(model.head.weight.grad, gw[1])
    assert torch.allclose(model.v.body.weight.grad, 0.25 * gbar[0])  # alpha grad f(v-bar)
    assert torch.allclose(model.v.head.weight.grad, 0.25 * gbar[1])
    # <v - w, grad f(v-bar)>: (3 - 1) g_b + (0 - 1, 2 + 1) . g_H
    expected = 2.0 * gbar[0].sum() + (torch.tensor([[-1.0], [3.0]]) * gbar[1]).sum()
    assert torch.allclose(model.alpha.grad, expected)


def test_alpha_outside_0_1_mixes_at_the_bound_and_keeps_its_gradient():
    model = tiny(1.0)
    with torch.no_grad():
        model.alpha.fill_(1.3)
    x, y = torch.tensor([[2.0]]), torch.tensor([0])
    assert torch.allclose(mixed_logits(model, x), model.v(x))  # clip(1.3) = 1: v alone
    F.cross_entropy(mixed_logits(model, x), y).backward()
    assert model.alpha.grad is not None and float(model.alpha.grad) != 0.0  # straight through


@pytest.mark.parametrize("adaptive", [True, False])
def test_v_and_alpha_stay_on_the_client_and_alpha_stays_in_0_1(adaptive, digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=apfl", "rounds=2", "training.epochs=1", "algorithm.alpha=1.0",
                     f"algorithm.adaptive={str(adaptive).lower()}", "training.lr=0.5")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    for _, _, msg, reply, state in seen:
        assert not any(k.startswith(("v.", "alpha")) for k in (*msg.weights, *reply.weights))
        assert set(state.weights) == {k for k in sim.server.init_weights() if k.startswith(("v.", "alpha"))}
        a = float(state.weights["alpha"])
        assert 0.0 <= a <= 1.0
        assert (a == 1.0) if not adaptive else True
    if adaptive:  # alpha moves (from the upper bound, down)
        assert any(float(s.weights["alpha"]) < 1.0 for *_, s in seen)
    assert "gm" in res.rows[-1]


def test_bad_alpha_exits_2_with_one_line(tmp_path, capsys):
    assert_bad_value_exits_2("apfl", "alpha", "1.5", tmp_path, capsys)
