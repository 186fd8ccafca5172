"""APFL: the parameter mixture by hand, the three gradients of one minibatch loss, alpha kept
in [0, 1], and what never leaves the client."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.algorithms.apfl import APFL, APFLHyper, apfl_loss, mixed_logits, projected_alpha
from protofl.algorithms.base import trainable_names
from protofl.engine.train import fit, TrainSettings
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


@pytest.mark.parametrize("lr_times", [4.0, -4.0, 0.5])
def test_every_local_step_projects_alpha_onto_0_1(lr_times):
    """One step of the engine's loop: alpha lands on clip(alpha - eta g, 0, 1) (the authors'
    alpha_update clips after each step), v and w take their plain SGD steps."""
    x, y = torch.tensor([[2.0], [-1.0]]), torch.tensor([1, 0])
    probe = tiny(0.25)
    apfl_loss(probe, x, y, {}).backward()
    g = float(probe.alpha.grad)
    eta = abs(lr_times / g)  # alpha - eta g = 0.25 - lr_times sign(g): below 0, above 1, inside
    expected = min(max(0.25 - eta * g, 0.0), 1.0)
    assert (expected in (0.0, 1.0)) == (abs(lr_times) > 1)
    model = tiny(0.25)
    stats = fit(model, x, y, loss=apfl_loss, extras={"lr": torch.tensor(eta)}, names=trainable_names(model),
                settings=TrainSettings(lr=eta, batch_size=2, steps=1), generator=torch.Generator().manual_seed(0),
                grad=projected_alpha)
    assert stats.steps == 1
    assert float(model.alpha.detach()) == pytest.approx(expected, abs=1e-6)
    assert torch.allclose(model.v.body.weight, probe.v.body.weight - eta * probe.v.body.weight.grad)
    assert torch.allclose(model.body.weight, probe.body.weight - eta * probe.body.weight.grad)


def test_projected_alpha_leaves_the_other_gradients_and_a_fixed_alpha_alone():
    g = {"alpha": torch.tensor(2.0), "body.weight": torch.tensor([3.0])}
    out = projected_alpha(g, {"lr": torch.tensor(0.5)}, {"alpha": torch.tensor(0.25), "body.weight": torch.tensor([1.0])})
    assert float(out["alpha"]) == 0.5 and torch.equal(out["body.weight"], g["body.weight"])  # (0.25 - 0) / 0.5
    fixed = {"body.weight": torch.tensor([3.0])}
    assert projected_alpha(fixed, {"lr": torch.tensor(0.5)}, {"body.weight": torch.tensor([1.0])}) == fixed


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
