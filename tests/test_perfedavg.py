"""Per-FedAvg: the minibatch cut, the first-order step by hand, the Hessian-free direction
against the exact MAML gradient, the one-step personalization."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from protofl.algorithms.perfedavg import fo_loss, hf_direction
from protofl.engine.client import ClientContext, drive
from protofl.engine.simulation import Simulation
from protofl.models.base import FLModel
from protofl.nn.inner import split_batch, with_gradient

from method_checks import assert_bad_value_exits_2
from conftest import recorded_update


def test_split_batch_cuts_by_size_only():
    x = torch.arange(7.0)
    assert [len(p) for p, _ in split_batch(x, x, 2)] == [3, 4]
    assert [len(p) for p, _ in split_batch(torch.arange(9.0), torch.arange(9), 3)] == [3, 3, 3]
    assert [len(p) for p, _ in split_batch(x[:1], x[:1], 3)] == [1, 1, 1]  # too small: used whole
    parts = split_batch(x, x, 2)
    assert torch.equal(torch.cat([p for p, _ in parts]), x)  # disjoint, in order


def test_with_gradient_has_the_value_and_the_given_gradient():
    p = {"a": torch.tensor([1.0, 2.0], requires_grad=True)}
    out = with_gradient(torch.tensor(0.7), p, {"a": torch.tensor([3.0, -1.0])})
    out.backward()
    assert math.isclose(float(out.detach()), 0.7, rel_tol=1e-7)
    assert torch.equal(p["a"].grad, torch.tensor([3.0, -1.0]))


def tiny(dtype=torch.float32):
    model = FLModel(nn.Flatten(), nn.Linear(1, 2, bias=False), feature_dim=1, num_classes=2).to(dtype)
    with torch.no_grad():
        model.head.weight.zero_()
    return model


def test_first_order_step_by_hand():
    model = tiny()
    x, y = torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1])  # D = (1, 0), D' = (2, 1)
    loss = fo_loss(model, x, y, {"alpha": torch.tensor(0.1)})
    loss.backward()
    # w~ = 0 - 0.1 (p - e_0) 1 = (0.05, -0.05); on D': logits (0.1, -0.1), p = sigmoid(+-0.2)
    p0 = 1 / (1 + math.exp(-0.2))
    assert math.isclose(float(loss.detach()), -math.log(1 - p0), rel_tol=1e-6)
    assert torch.allclose(model.head.weight.grad, torch.tensor([[2 * p0], [2 * (1 - p0) - 2]]), atol=1e-6)


def test_hessian_free_direction_matches_the_exact_maml_gradient():
    torch.manual_seed(0)
    model = FLModel(nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Linear(4, 3), feature_dim=4,
                    num_classes=3).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 2, 1, 0])
    D, D2 = (x[:3], y[:3]), (x[3:], y[3:])
    w = {k: p.detach().clone().requires_grad_(True) for k, p in model.named_parameters()}
    alpha = 0.3
    # exact: d/dw f(w - alpha grad f(w; D); D') = (I - alpha H(w; D)) grad f(w~; D')
    g = torch.autograd.grad(F.cross_entropy(functional_call(model, w, (D[0],)), D[1]), list(w.values()),
                            create_graph=True)
    w_tilde = {k: v - alpha * gk for (k, v), gk in zip(w.items(), g)}
    exact = torch.autograd.grad(F.cross_entropy(functional_call(model, w_tilde, (D2[0],)), D2[1]), list(w.values()))
    # HF with D'' = D: the finite-difference Hessian-vector product
    d, value = hf_direction(model, w, [D, D2, D], torch.tensor(alpha, dtype=torch.float64), delta=1e-5)
    for (k, _), e in zip(w.items(), exact):
        assert torch.allclose(d[k], e, atol=1e-7), k
    f_tilde = F.cross_entropy(functional_call(model, w_tilde, (D2[0],)), D2[1])
    assert math.isclose(float(value), float(f_tilde.detach()), rel_tol=1e-9)


def test_personalized_model_is_one_sgd_step_of_size_alpha_from_w_t(digits_cfg, tmp_path):
    sim = Simulation(digits_cfg("algorithm.name=perfedavg", "algorithm.alpha=0.2"), run_dir=tmp_path / "r")
    algo = sim.algorithm
    msg = algo.configure(algo.server_init(sim.server), 1, sim.server)
    result, fits = recorded_update(sim, 0, 1, msg, None, evaluating=True)
    (train, _), (adapt, step) = fits
    assert train.settings == {"batch_size": 2 * 32}  # D and D' from one minibatch of 2 B
    assert adapt.weights is msg.weights and step.stats.steps == 1
    assert adapt.settings["lr"] == 0.2 and adapt.settings["momentum"] == 0.0
    assert result.personal is not None
    no_eval = drive(algo.client_update(msg, None, ClientContext(sim.runtime, 0, 1, evaluating=False)),
                    ClientContext(sim.runtime, 0, 1).execute)
    assert no_eval.personal is None


@pytest.mark.parametrize("key,value", [("variant", "so"), ("alpha", 0), ("delta", -1)])
def test_bad_hyper_parameters_exit_2_with_one_line(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("perfedavg", key, value, tmp_path, capsys)
