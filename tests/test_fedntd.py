"""FedNTD: the not-true distillation by hand on tiny logits (the true class left out, the
temperature), its gradient never reaching the true logit, and bad settings."""
import math

import pytest
import torch

from protofl.algorithms.fedntd import FedNTDHyper, not_true, not_true_distillation
from protofl.config import check_dataclass
from protofl.errors import ConfigError


def test_not_true_drops_each_rows_own_label():
    z = torch.tensor([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0], [30.0, 31.0, 32.0]])
    assert torch.equal(not_true(z, torch.tensor([0, 1, 2])), torch.tensor([[11.0, 12.0], [20.0, 22.0], [30.0, 31.0]]))


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_not_true_distillation_by_hand():
    # C = 3, label 2: local not-true logits [1, 2], global [0, 0] -> q~ = [1/(1+e), e/(1+e)], q~^g = [1/2, 1/2]
    z, z_g = torch.tensor([[1.0, 2.0, 3.0]]), torch.zeros(1, 3)
    q = [1 / (1 + math.e), math.e / (1 + math.e)]
    got = not_true_distillation(z, z_g, torch.tensor([2]), tau=1.0)
    assert float(got) == pytest.approx(kl([0.5, 0.5], q), rel=1e-6)  # = 0.1201
    # tau = 2 halves the logits: [0.5, 1]; the KL is scaled by tau^2 = 4 (the authors' code's factor)
    q2 = [1 / (1 + math.exp(0.5)), math.exp(0.5) / (1 + math.exp(0.5))]
    assert float(not_true_distillation(z, z_g, torch.tensor([2]), tau=2.0)) == pytest.approx(4 * kl([0.5, 0.5], q2),
                                                                                              rel=1e-6)
    # the batch mean: a second row whose local and global not-true softmaxes agree adds 0
    z2, zg2 = torch.tensor([[1.0, 2.0, 3.0], [5.0, 1.0, 1.0]]), torch.tensor([[0.0, 0.0, 0.0], [0.0, 4.0, 4.0]])
    both = not_true_distillation(z2, zg2, torch.tensor([2, 0]), tau=1.0)
    assert float(both) == pytest.approx(kl([0.5, 0.5], q) / 2, rel=1e-6)


def test_the_true_logit_gets_no_gradient_from_the_distillation():
    z = torch.tensor([[1.0, 2.0, 3.0, -1.0]], requires_grad=True)
    not_true_distillation(z, torch.tensor([[0.5, 0.0, 2.0, 1.0]]), torch.tensor([1]), tau=1.0).backward()
    assert z.grad[0, 1] == 0 and z.grad.abs().sum() > 0
    z = torch.tensor([[0.3, 9.0, -2.0]], requires_grad=True)  # local = global on the not-true classes: 0
    loss = not_true_distillation(z, torch.tensor([[1.3, -5.0, -1.0]]), torch.tensor([1]), tau=1.0)
    assert float(loss) == pytest.approx(0.0, abs=1e-7)  # a shift of the not-true logits changes nothing


@pytest.mark.parametrize("key,value", [("beta", -0.1), ("tau", 0.0)])
def test_bad_settings_are_one_line_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        check_dataclass(FedNTDHyper, {key: value}, "algorithm")
