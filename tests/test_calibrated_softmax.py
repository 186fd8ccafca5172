"""The calibrated-softmax losses (nn/losses.py) and the methods built on them: BSM-FedAvg,
FedRS, FedLC. Hand-computed values on tiny tensors."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import TaskInfo
from protofl.config import ConfigError, check_dataclass
from protofl.nn.losses import (
    balanced_logits,
    balanced_softmax_loss,
    calibrated_logits,
    label_counts,
    relaxed_prior,
    restricted_logits,
)

INFO = TaskInfo(num_classes=3, num_clients=2, feature_dim=2, input_shape=(3,), seed=0, rounds=1)


# ---------------------------------------------------------------------------------------
# priors
# ---------------------------------------------------------------------------------------
def test_relaxed_prior_formula_and_missing_classes():
    counts = torch.tensor([3, 1, 0, 0])
    pi = relaxed_prior(counts, 0.2)
    # (1 - 0.2) * [3/4, 1/4, 0, 0] + 0.2 / 4
    assert torch.allclose(pi, torch.tensor([0.65, 0.25, 0.05, 0.05]))
    assert math.isclose(float(pi.sum()), 1.0, rel_tol=1e-6)
    assert torch.allclose(relaxed_prior(counts, 0.01)[2:], torch.full((2,), 0.01 / 4))  # eps / C


def test_prior_with_eps_zero_is_the_label_distribution():
    assert torch.allclose(relaxed_prior(torch.tensor([2, 6, 0]), 0.0), torch.tensor([0.25, 0.75, 0.0]))
    assert torch.allclose(relaxed_prior(torch.zeros(4, dtype=torch.int64), 0.0), torch.full((4,), 0.25))
    with pytest.raises(ValueError):
        relaxed_prior(torch.tensor([1, 1]), 1.5)


def test_label_counts():
    assert label_counts(torch.tensor([2, 0, 2, 2]), 4).tolist() == [1, 0, 3, 0]


# ---------------------------------------------------------------------------------------
# balanced softmax
# ---------------------------------------------------------------------------------------
def test_balanced_softmax_with_uniform_prior_is_cross_entropy():
    torch.manual_seed(0)
    z, y = torch.randn(6, 5), torch.tensor([0, 4, 2, 2, 1, 3])
    assert torch.allclose(balanced_softmax_loss(z, y, torch.full((5,), 0.2)), F.cross_entropy(z, y), atol=1e-6)


def test_balanced_softmax_hand_example():
    # pi = [0.75, 0.25], exp(z) = [1, 2]: p(0) = 0.75 / (0.75 + 0.5) = 0.6
    z, pi = torch.tensor([[0.0, math.log(2.0)]]), torch.tensor([0.75, 0.25])
    assert math.isclose(float(balanced_softmax_loss(z, torch.tensor([0]), pi)), -math.log(0.6), rel_tol=1e-6)
    assert torch.allclose(torch.softmax(balanced_logits(z, pi), 1), torch.tensor([[0.6, 0.4]]))


def test_single_class_balanced_softmax_has_no_gradient_but_relaxed_prior_has():
    z = torch.tensor([[0.3, -1.0, 2.0], [1.0, 0.5, 0.0]], requires_grad=True)
    y = torch.tensor([1, 1])
    counts = torch.tensor([0, 2, 0])
    loss = balanced_softmax_loss(z, y, relaxed_prior(counts, 0.0))  # one-hot prior
    loss.backward()
    assert loss.item() == 0.0 and torch.all(z.grad == 0)
    z.grad = None
    loss = balanced_softmax_loss(z, y, relaxed_prior(counts, 0.01))
    loss.backward()
    assert loss.item() > 0 and torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0


def test_absent_class_with_eps_zero_keeps_loss_and_gradient_finite():
    z = torch.tensor([[5.0, 0.0, 1.0]], requires_grad=True)
    pi = relaxed_prior(torch.tensor([1, 1, 0]), 0.0)
    loss = balanced_softmax_loss(z, torch.tensor([1]), pi)
    loss.backward()
    # class 2 is out of the softmax: -log(e^0 / (e^5 + e^0))
    assert math.isclose(loss.item(), math.log(1 + math.exp(5.0)), rel_tol=1e-6)
    assert torch.isfinite(z.grad).all() and float(z.grad[0, 2]) == 0.0


# ---------------------------------------------------------------------------------------
# FedRS and FedLC logits
# ---------------------------------------------------------------------------------------
def test_restricted_logits_hand_example():
    z = torch.tensor([[1.0, 2.0, 3.0], [-2.0, 4.0, 1.0]])
    out = restricted_logits(z, torch.tensor([5, 0, 2]), alpha=0.5)
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 3.0], [-2.0, 2.0, 1.0]]))
    assert torch.equal(restricted_logits(z, torch.tensor([0, 0, 1]), alpha=1.0), z)  # alpha = 1: FedAvg


def test_calibrated_logits_hand_example():
    z = torch.zeros(1, 3)
    out = calibrated_logits(z, torch.tensor([16, 1, 0]), tau=1.0)  # margins 16^-1/4 = 0.5, 1, inf
    assert out[0, :2].tolist() == [-0.5, -1.0] and out[0, 2] == -math.inf
    loss = F.cross_entropy(out, torch.tensor([0]))
    assert math.isclose(float(loss), -math.log(math.exp(-0.5) / (math.exp(-0.5) + math.exp(-1.0))), rel_tol=1e-6)
    shifted = calibrated_logits(z + 1, torch.tensor([16, 1, 0]), tau=2.0)  # 1 - 2 * [0.5, 1]
    assert torch.allclose(shifted[0, :2], torch.tensor([0.0, -1.0]))
    assert torch.equal(calibrated_logits(z, torch.tensor([16, 1, 0]), tau=0.0), z)  # tau = 0: plain CE


# ---------------------------------------------------------------------------------------
# the methods wire the client's counts into the loss
# ---------------------------------------------------------------------------------------
class FixedLogits(nn.Module):
    """A 'model' whose logits are a trainable (B, C) table, so losses are hand-checkable."""

    def __init__(self, z):
        super().__init__()
        self.z = nn.Parameter(z.clone())

    def forward(self, x):
        return self.z[x]


def fake_ctx(counts):
    counts = torch.tensor(counts)
    return SimpleNamespace(class_counts=counts, data=(None, torch.zeros(1, dtype=torch.int64)))


def method(name, **params):
    cls = ALGORITHMS.get(name)
    return cls(check_dataclass(cls.Hyper, params, "algorithm"), INFO)


Z = torch.tensor([[0.0, math.log(2.0), 1.0], [1.0, 0.0, -1.0]])
X, Y = torch.tensor([0, 1]), torch.tensor([1, 0])


@pytest.mark.parametrize("name,params,counts,expected", [
    ("bsmfedavg", {}, [3, 1, 0], lambda z: F.cross_entropy(z + torch.log(torch.tensor([0.75, 0.25, 0.0])), Y)),
    ("fedrs", {"alpha": 0.25}, [3, 1, 0], lambda z: F.cross_entropy(z * torch.tensor([1.0, 1.0, 0.25]), Y)),
    ("fedlc", {"tau": 0.5}, [16, 1, 0],
     lambda z: F.cross_entropy(z - 0.5 * torch.tensor([0.5, 1.0, math.inf]), Y)),
])
def test_method_local_loss_uses_the_client_counts(name, params, counts, expected):
    algo = method(name, **params)
    model = FixedLogits(Z)
    loss_fn, extras = algo.objective(None, fake_ctx(counts))
    loss = loss_fn(model, X, Y, extras)
    assert math.isclose(loss.item(), float(expected(Z)), rel_tol=1e-6)
    assert loss.item() != pytest.approx(float(F.cross_entropy(Z, Y)))  # not plain FedAvg


@pytest.mark.parametrize("name,params", [("fedrs", {"alpha": 1.0}), ("fedlc", {"tau": 0.0})])
def test_neutral_settings_reduce_to_fedavg(name, params):
    model = FixedLogits(Z)
    loss_fn, extras = method(name, **params).objective(None, fake_ctx([3, 1, 0]))
    loss = loss_fn(model, X, Y, extras)
    assert math.isclose(loss.item(), float(F.cross_entropy(Z, Y)), rel_tol=1e-6)


@pytest.mark.parametrize("name,key,value", [("fedrs", "alpha", 1.5), ("fedrs", "alpha", -0.1),
                                            ("fedlc", "tau", -1.0)])
def test_hyper_parameters_are_validated(name, key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        check_dataclass(ALGORITHMS.get(name).Hyper, {key: value}, "algorithm")


def test_bsmfedavg_single_class_client_returns_the_global_model(tmp_path):
    """eps = 0 and one class per client: zero loss and zero gradient, so the weights do
    not move (no weight decay)."""
    from protofl.config import from_dict
    from protofl.engine.simulation import Simulation

    cfg = from_dict({"rounds": 1, "data": {"name": "digits"},
                     "partition": {"name": "pathological", "num_clients": 10, "classes_per_client": 1},
                     "model": {"name": "mlp", "hidden": [16], "feature_dim": 8},
                     "training": {"lr": 0.1, "momentum": 0.9, "batch_size": 32},
                     "algorithm": {"name": "bsmfedavg"}, "eval": {"personal": False},
                     "execution": {"threads": 1, "workers": 0}, "output": {"progress": False}})
    sim = Simulation(cfg, run_dir=tmp_path / "r")
    w0 = sim.algorithm.server_init(sim.server).weights
    res = sim.run()
    assert res.rows[0]["arrived"] == 10 and res.rows[0]["train_loss"] == 0.0
    for k, v in res.server_state.weights.items():  # equal up to the float error of averaging
        assert torch.allclose(v, w0[k], rtol=0, atol=1e-6), k
