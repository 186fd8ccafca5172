"""FedDecorr: the decorrelation term by hand, its relation to the authors' scaling, its
hyper-parameter, and beta = 0 being FedAvg bit for bit. The first test is the one
docs/adding_a_method.md prints (tests/test_docs.py checks that it is this one)."""
import pytest
import torch

from protofl.algorithms.feddecorr import decorrelation


def test_decorrelation_of_perfectly_correlated_and_of_independent_dimensions():
    z = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])  # dimension 2 = 2 x dimension 1
    assert torch.isclose(decorrelation(z), torch.tensor(1.0), atol=1e-4)  # K = all ones
    z = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])  # uncorrelated
    assert torch.isclose(decorrelation(z), torch.tensor(0.5), atol=1e-4)  # K = identity


def test_decorrelation_of_anticorrelated_dimensions_and_a_constant_one():
    # z2 = -z1, z3 constant: K = [[1, -1, 0], [-1, 1, 0], [0, 0, 0]], ||K||^2 = 4, d^2 = 9
    z = torch.tensor([[1.0, -1.0, 3.0], [2.0, -2.0, 3.0], [3.0, -3.0, 3.0]])
    assert torch.isclose(decorrelation(z), torch.tensor(4 / 9), atol=1e-4)
    assert float(decorrelation(torch.tensor([[1.0, 2.0, 3.0]]))) == 0.0  # one sample: no correlation


def test_the_authors_scaling_is_a_batch_dependent_multiple_of_the_papers_term():
    """The docstring's conversion: the code's off-diagonal mean of (z^T z)^2 / N (unbiased
    variance) has (N-1)^2 / N * d / (d-1) times the gradient of ||K||_F^2 / d^2."""
    g = torch.Generator().manual_seed(0)
    N, d = 16, 5
    z = torch.randn(N, d, generator=g)
    z[:, 1] = 2 * z[:, 0] + 0.3 * torch.randn(N, generator=g)  # some correlation to remove
    z.requires_grad_(True)
    ours, = torch.autograd.grad(decorrelation(z), z)
    x = (z - z.mean(0)) / torch.sqrt(z.var(0) + 1e-8)
    off = ~torch.eye(d, dtype=torch.bool)
    theirs, = torch.autograd.grad(((x.T @ x)[off] ** 2).mean() / N, z)
    assert torch.allclose(theirs, ours * (N - 1) ** 2 / N * d / (d - 1), rtol=1e-3, atol=1e-6)


def test_beta_must_be_non_negative(digits_cfg):
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="beta"):
        digits_cfg("algorithm.name=feddecorr", "algorithm.beta=-0.1")


def test_beta_zero_is_fedavg_bit_for_bit(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    got = {}
    for name, extra in (("fedavg", []), ("feddecorr", ["algorithm.beta=0"])):
        cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "eval.personal=false", *extra)
        got[name] = Simulation(cfg, run_dir=tmp_path / name).run().server_state.weights
    assert all(torch.equal(got["fedavg"][k], got["feddecorr"][k]) for k in got["fedavg"])
