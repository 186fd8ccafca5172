"""pFedMe: the Moreau envelope's inner solve and gradient by hand, one outer step, the
warm start, the server's beta mixing, and what never leaves the client."""
import math

import pytest
import torch
from torch import nn

from protofl.algorithms.base import TaskInfo, WeightsState
from protofl.algorithms.pfedme import (envelope_value, moreau_inner, parameter_buffers, PFedMe, PFedMeHyper,
                                        THETA)
from protofl.messages import Record
from protofl.models.base import FLModel

from method_checks import assert_bad_value_exits_2
from conftest import DIGITS, record_run


def tiny():
    """logits = W x for x in R^1, W (2, 1): CE gradients by hand."""
    model = FLModel(nn.Flatten(), nn.Linear(1, 2, bias=False), feature_dim=1, num_classes=2)
    with torch.no_grad():
        model.head.weight.zero_()
    return model


def sigmoid(t):
    return 1 / (1 + math.exp(-t))


def test_inner_solve_is_k_gradient_steps_on_f_plus_the_proximal_term():
    model = tiny()
    w = {"head.weight": torch.zeros(2, 1)}
    x, y = torch.tensor([[1.0]]), torch.tensor([0])
    theta, f = moreau_inner(model, dict(w), w, x, y, lam=15.0, lr=0.1, K=2)
    # step 1 from theta = w = 0: logits (0, 0), grad = (p - e_0) x = (-0.5, 0.5), prox 0
    # -> theta_1 = (0.05, -0.05); step 2: logits (0.05, -0.05), p_0 = sigmoid(0.1)
    t1 = 0.05
    g = sigmoid(0.1) - 1.0
    t2 = t1 - 0.1 * (g + 15.0 * t1)
    assert torch.allclose(theta["head.weight"], torch.tensor([[t2], [-t2]]), atol=1e-6)
    assert math.isclose(t2, 0.022502, abs_tol=1e-6)
    assert math.isclose(float(f), math.log(1 + math.exp(-0.1)), rel_tol=1e-6)  # f at theta_1


def test_envelope_value_and_its_gradient_lambda_times_w_minus_theta():
    w = {"a": torch.tensor([1.0, -2.0], requires_grad=True)}
    theta = {"a": torch.tensor([0.5, 1.0])}
    value = envelope_value(torch.tensor(0.3), theta, w, lam=4.0)
    assert math.isclose(float(value.detach()), 0.3 + 2.0 * (0.25 + 9.0), rel_tol=1e-6)
    value.backward()
    assert torch.allclose(w["a"].grad, 4.0 * torch.tensor([0.5, -3.0]))


def test_one_outer_step_of_plain_sgd_is_algorithm_1_line_8_and_warm_starts_theta():
    algo = PFedMe(PFedMeHyper(lam=15.0, K=2, personal_lr=0.1), info=None)
    model = algo.adapt_model(tiny())
    assert set(model.state_dict()) == {"head.weight", THETA + "head.weight"}
    assert [k for k, _ in model.named_parameters()] == ["head.weight"]  # theta~ is buffers only
    x, y = torch.tensor([[1.0]]), torch.tensor([0])
    loss = algo.envelope_loss(model, x, y, {})
    loss.backward()
    t2 = 0.05 - 0.1 * (sigmoid(0.1) - 1.0 + 15.0 * 0.05)
    theta = torch.tensor([[t2], [-t2]])
    assert torch.allclose(model.head.weight.grad, 15.0 * (0 - theta), atol=1e-6)  # lam (w - theta~)
    assert torch.allclose(model.get_buffer(THETA + "head.weight"), theta, atol=1e-6)  # the warm start
    eta = 0.005
    with torch.no_grad():
        model.head.weight -= eta * model.head.weight.grad  # w <- w - eta lam (w - theta~)
    assert torch.allclose(model.head.weight, eta * 15.0 * theta, atol=1e-7)


def test_parameter_buffers_copies_parameters_as_buffers_only():
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    copy = parameter_buffers(net)
    assert not list(copy.parameters())
    assert set(dict(copy.named_buffers())) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert torch.equal(copy.get_buffer("0.weight"), net[0].weight)


@pytest.mark.parametrize("beta,expected", [(1.0, [2.5]), (0.5, [1.75]), (2.0, [4.0])])
def test_server_mixes_the_uniform_mean_with_beta(beta, expected):
    info = TaskInfo(num_classes=2, num_clients=2, feature_dim=1, input_shape=(1,), seed=0, rounds=1)
    algo = PFedMe(PFedMeHyper(beta=beta), info)
    state = WeightsState({"a": torch.tensor([1.0]), THETA + "a": torch.tensor([9.0])})
    replies = [(0, Record(weights={"a": torch.tensor([2.0])}, num_samples=1)),
               (1, Record(weights={"a": torch.tensor([3.0])}, num_samples=3))]
    new = algo.aggregate(state, 1, replies, None)  # (1 - beta) * 1 + beta * (2 + 3) / 2
    assert torch.allclose(new.weights["a"], torch.tensor(expected))
    assert torch.equal(new.weights[THETA + "a"], torch.tensor([9.0]))  # never aggregated
    assert algo.aggregate(state, 1, [], None) is state


def test_theta_never_leaves_the_client_and_the_personalized_model_is_theta(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=pfedme", "rounds=2", "training.epochs=1")
    sim, res, seen = record_run(cfg, tmp_path / "r")
    for _, _, msg, reply, state in seen:
        assert state is None
        assert not any(k.startswith(THETA) for k in (*msg.weights, *reply.weights))
    assert "gm" in res.rows[-1] and 0.0 <= res.rows[-1]["pa"] <= 1.0


@pytest.mark.parametrize("key,value", [("K", 0), ("lam", 0), ("personal_lr", -1), ("beta", 0)])
def test_bad_hyper_parameters_exit_2_with_one_line(key, value, tmp_path, capsys):
    assert_bad_value_exits_2("pfedme", key, value, tmp_path, capsys)


@pytest.mark.parametrize("name,extra", [("pfedme", ["algorithm.K=1"]), ("perfedavg", []), ("fedala", [])])
def test_inner_steps_on_a_batchnorm_model_batched_equals_sequential(name, extra, tmp_path):
    """The gradient steps inside these losses (nn.inner) run BatchNorm in training mode: its
    statistics must follow them on both executors (torch.func refuses a mutated capture).
    K = 1: with several inner steps on a ReLU/max-pool network, a rounding difference that
    flips one max-pool choice moves theta~ by ~1e-4 (a kink, not an error), so the two
    executors agree only to that precision."""
    from protofl.config import load_config
    from protofl.engine.simulation import Simulation
    from conftest import shared_data

    root = shared_data()
    if not (root / "mnist").exists():
        pytest.skip("MNIST not present (set PROTOFL_TEST_DATA)")
    cfg = load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1",
                               f"algorithm.name={name}", *extra, "data.name=mnist", f"data.root={root}",
                               "data.train_size=240", "model.name=lenet5", "partition.num_clients=3",
                               "participation.fraction=1.0", "rounds=2", "training.epochs=1", "training.lr=0.01",
                               "training.momentum=0", "eval.final_all_clients=false", "eval.personal=false",
                               "eval.every=2"])
    out = {}
    for ex in ("sequential", "batched"):
        res = Simulation(cfg.replace(**{"execution.executor": ex}), run_dir=tmp_path / ex).run()
        out[ex] = res.server_state.weights
    a, b = out["sequential"], out["batched"]
    assert any(k.endswith("running_mean") for k in a)
    for k in a:
        if a[k].is_floating_point():
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k
        else:
            assert torch.equal(a[k], b[k]), k
