"""FedUV: the classifier-variance hinge and the representation uniformity by hand on tiny
tensors, both against the authors' formulas (algs/feduv.py, written out here as the
reference), the cases where the code gives NaN, batching under vmap, the loss, bad
settings, and lam = mu = 0 being FedAvg bit for bit."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.algorithms.feduv import FedUVHyper, classifier_variance, pairwise_sq_distances, uniformity
from protofl.config import check_dataclass
from protofl.errors import ConfigError


# -- L_V: max(0, 1/sqrt(C) - std over the batch of each class's probability), mean over classes ----
def test_constant_predictions_pay_the_whole_margin():
    # equal logits: p = 1/4 for every sample, std 0; gamma = 1/sqrt(4)
    assert float(classifier_variance(torch.zeros(3, 4))) == 0.5


def test_balanced_confident_predictions_pay_nothing():
    # one confident prediction per class: each column is one-hot, unbiased std = 1/sqrt(C) = gamma
    assert float(classifier_variance(100 * torch.eye(4))) == 0.0


def test_variance_hinge_by_hand():
    # C = 2, N = 2, logits [[ln 3, 0], [0, ln 3]]: p = [[3/4, 1/4], [1/4, 3/4]]; each column has
    # mean 1/2 and unbiased variance 2 (1/4)^2 = 1/8, std = sqrt(2)/4; gamma - std = sqrt(2)/2 - sqrt(2)/4
    a = math.log(3)
    got = classifier_variance(torch.tensor([[a, 0.0], [0.0, a]]))
    assert float(got) == pytest.approx(math.sqrt(2) / 4, abs=1e-6)  # 0.35355
    # the mean over classes: a third class with constant probability adds its full margin 1/sqrt(3)
    p = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])  # column stds sqrt(2)/8, sqrt(2)/8, 0
    want = (2 * (1 / math.sqrt(3) - math.sqrt(2) / 8) + 1 / math.sqrt(3)) / 3
    assert float(classifier_variance(p.log())) == pytest.approx(want, abs=1e-6)
    assert float(classifier_variance(torch.tensor([[5.0, -1.0]]))) == 0.0  # one sample: no spread, no term


def authors_variance(logits):
    """UVReg's std term: relu(eye(C).std(0).mean() - softmax(X).std(0)).mean()."""
    gamma = torch.eye(logits.shape[1]).std(dim=0).mean()
    return F.relu(gamma - F.softmax(logits, dim=1).std(dim=0)).mean()


def test_variance_matches_the_authors_term_and_has_a_finite_gradient_on_a_constant_class():
    logits = torch.randn(16, 10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert classifier_variance(logits).item() == pytest.approx(authors_variance(logits).item(), rel=1e-6)
    ours, = torch.autograd.grad(classifier_variance(logits), logits)
    theirs, = torch.autograd.grad(authors_variance(logits), logits)
    assert torch.allclose(ours, theirs, atol=1e-7)
    assert torch.eye(7).std(dim=0).mean().item() == pytest.approx(1 / math.sqrt(7))  # the code's gamma
    # a class whose logit lags by 200: its probability is exactly 0 in float32 for every sample,
    # its std 0 and its hinge active; torch's std gives that column a zero gradient, not NaN
    z = torch.tensor([[0.0, 1.0, -200.0], [1.0, 0.0, -200.0]], requires_grad=True)
    g, = torch.autograd.grad(classifier_variance(z), z)
    assert torch.isfinite(g).all() and torch.equal(g[:, 2], torch.zeros(2))


# -- L_U: mean over pairs of exp(-||z_i - z_j||^2 / sigma), sigma = median nonzero distance -------
def test_pairwise_distances_in_pdist_order():
    z = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    assert torch.equal(pairwise_sq_distances(z), torch.tensor([25.0, 1.0, 18.0]))
    assert torch.allclose(pairwise_sq_distances(z), torch.pdist(z) ** 2)


def test_uniformity_by_hand():
    # points 0, 1, 3 on a line: squared distances 1, 9, 4, median 4
    got = uniformity(torch.tensor([[0.0], [1.0], [3.0]]))
    assert float(got) == pytest.approx((math.exp(-1 / 4) + math.exp(-9 / 4) + math.exp(-1)) / 3, rel=1e-6)
    # 0, 1, 3, 7: 1, 9, 49, 4, 36, 16 -> an even count; the lower middle value 9, as torch.median
    d2 = [1, 9, 49, 4, 36, 16]
    got = uniformity(torch.tensor([[0.0], [1.0], [3.0], [7.0]]))
    assert float(got) == pytest.approx(sum(math.exp(-d / 9) for d in d2) / 6, rel=1e-6)
    # equal representations: their pair (distance 0, kernel 1) counts in the mean, not in the median
    got = uniformity(torch.tensor([[0.0], [0.0], [2.0]]))  # 0, 4, 4 -> sigma = 4
    assert float(got) == pytest.approx((1 + 2 * math.exp(-1)) / 3, rel=1e-6)


def test_uniformity_is_scale_invariant_and_defined_everywhere():
    z = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    assert float(uniformity(5 * z)) == pytest.approx(float(uniformity(z)), rel=1e-5)
    assert float(uniformity(z[:1])) == 0.0  # one sample: no pairs
    collapsed = torch.zeros(4, 3, requires_grad=True)  # no nonzero distance: sigma = 1, value 1, gradient 0
    value = uniformity(collapsed)
    g, = torch.autograd.grad(value, collapsed)
    assert value.item() == 1.0 and torch.equal(g, torch.zeros(4, 3))


def authors_uniformity(z):
    """UVReg's uniformity term: pdist^2, sigma = median of the nonzero ones, mean exp(-d^2 / sigma)."""
    d2 = torch.pdist(z, p=2).pow(2)
    return d2.mul(-1 / torch.median(d2[d2 != 0])).exp().mean()


def test_uniformity_matches_the_authors_term_in_value_and_gradient():
    z = torch.randn(9, 4, generator=torch.Generator().manual_seed(2))
    z[3] = z[5]  # a repeated representation (the code's mask of zero distances)
    z.requires_grad_(True)
    ours, = torch.autograd.grad(uniformity(z), z)
    theirs, = torch.autograd.grad(authors_uniformity(z), z)
    assert uniformity(z).item() == pytest.approx(authors_uniformity(z).item(), rel=1e-6)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_both_terms_batch_under_vmap():
    """Per-client values inside torch.func.vmap equal the one-by-one ones (the batched executor)."""
    from torch.func import grad, vmap

    g = torch.Generator().manual_seed(3)
    z, logits = torch.randn(3, 6, 4, generator=g), torch.randn(3, 6, 5, generator=g)
    z[1, 2] = z[1, 4]
    assert torch.allclose(vmap(grad(uniformity))(z), torch.stack([grad(uniformity)(a) for a in z]), atol=1e-6)
    assert torch.allclose(vmap(grad(classifier_variance))(logits),
                          torch.stack([grad(classifier_variance)(a) for a in logits]), atol=1e-6)


# -- the loss and the method's settings ---------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_the_local_loss_is_ce_plus_lam_lv_plus_mu_lu():
    from protofl.algorithms.feduv import FedUV

    torch.manual_seed(0)
    model, x, y = Tiny(), torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    method = FedUV(FedUVHyper(lam=2.5, mu=0.5), None)  # the loss reads only self.hp
    z = model.body(x)
    want = F.cross_entropy(model.head(z), y) + 2.5 * classifier_variance(model.head(z)) + 0.5 * uniformity(z)
    assert method.uv_loss(model, x, y, {}).item() == pytest.approx(want.item(), rel=1e-6)


def test_client_level_dp_covers_it_and_dp_sgd_refuses_it():
    """Its replies are the weights alone (client-level DP applies); its loss is a statistic of
    the whole batch, which per-sample gradients would take apart (DP-SGD refuses it)."""
    from protofl.algorithms.feduv import FedUV
    from protofl.config import from_dict
    from protofl.engine.privacy import check_privacy

    method = FedUV(FedUVHyper(), None)
    check_privacy(from_dict({"privacy": {"mode": "client"}}), method, None)
    with pytest.raises(ConfigError, match="couples the samples of a batch"):
        check_privacy(from_dict({"privacy": {"mode": "sample"}}), method, None)


def test_defaults_are_the_authors():
    hp = FedUVHyper()
    assert (hp.lam, hp.mu) == (2.5, 0.5)  # train_fl.py: --std_coeff 2.5, --unif_coeff 0.5


@pytest.mark.parametrize("key,value", [("lam", -0.1), ("mu", -1.0), ("lam", math.inf), ("mu", math.nan)])
def test_bad_settings_are_one_line_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        check_dataclass(FedUVHyper, {key: value}, "algorithm")


def test_lam_and_mu_zero_is_fedavg_bit_for_bit(digits_cfg, tmp_path):
    from protofl.engine.simulation import Simulation

    got = {}
    for name, extra in (("fedavg", []), ("feduv", ["algorithm.lam=0", "algorithm.mu=0"])):
        cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "eval.personal=false", *extra)
        got[name] = Simulation(cfg, run_dir=tmp_path / name).run().server_state.weights
    assert all(torch.equal(got["fedavg"][k], got["feduv"][k]) for k in got["fedavg"])
