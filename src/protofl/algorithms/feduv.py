"""FedUV (Son, Kim, Chung, Huang & Liu, CVPR 2024, "FedUV: Uniformity and Variance for
Heterogeneous Federated Learning", arXiv:2402.18372): FedAvg whose clients add two
regularizers that make a local model behave as if its data were IID, whatever its label
distribution:

    server: FedAvg (send w_t, average the replies by sample counts)
    client k, minibatch of N samples, representations z_i = body(x_i) (the classifier's
    input, (N, d)), probabilities p_i = softmax(head(z_i)) (C classes):
        variance (classifier):  L_V = 1/C sum_c max(0, gamma - std_i(p_ic)),  gamma = 1/sqrt(C)
        uniformity (encoder):   L_U = 1/P sum_{i<j} exp(-||z_i - z_j||^2 / sigma),
                                sigma = median of the nonzero ||z_i - z_j||^2,  P = N(N-1)/2
        minimize  CE + lam * L_V + mu * L_U

The variance term is a hinge on the standard deviation over the batch of each class's
probability (the "dimension-wise probability distribution of the classifier"): under
label skew a biased classifier gives the classes it does not see a near-constant small
probability, while C confident predictions, one per class, have std(p_c) = gamma (a
larger balanced batch of confident predictions spreads a little less: 0.301 for N = 128
at C = 10 against gamma = 0.316, so the hinge never quite switches off, as in the code). The
uniformity term is a Gaussian potential over all pairs of the batch's representations
(Wang & Isola's uniformity), which spreads them apart.

Sources. The paper's method section could not be obtained (no arXiv HTML, CVF page or
full-text copy was found); what is stated here comes from its abstract and from the
authors' released code (github.com/sonhamin/FedUV: algs/feduv.py ``UVReg``, train_fl.py),
read, not copied. So no equation numbers are given. Defaults lam = 2.5, mu = 0.5: the
code's ``--std_coeff`` ("the lambda parameter") and ``--unif_coeff`` ("the mu parameter").
Neither PFLlib, FL-bench nor fluke implements FedUV.

Where this follows the code, and where the paper's words and the code may differ:
* gamma = 1/sqrt(C) is the code's: the (unbiased) standard deviation of a column of the
  C x C identity, i.e. of C one-hot predictions, one per class. std over the batch is
  the unbiased one, as in the code.
* The uniformity term is applied to the raw representations (the code's, after the last
  ReLU), not to unit-normalized ones, although the paper calls it hyperspherical; the
  median bandwidth makes it invariant to the scale of z. As in the code: there is no log
  (Wang & Isola take log E exp(-t ||u - v||^2)); the kernel divides by the median squared
  distance itself (no factor 2); sigma is not detached (its gradient reaches the median
  pair); and pairs of equal representations count in the mean but not in the median.
* With a batch of one (no pairs, no spread) both terms are 0; the code would give NaN.
  With no nonzero distance the median is undefined; sigma = 1 then (every pair is at
  distance 0, the term is 1 with zero gradient whatever sigma). The code would give NaN.
* The median is taken with ``nanmedian`` over the distances with the zeros masked (the
  lower of the two middle values for an even count, as the code's ``torch.median``), so the
  loss has no value-dependent shapes and batches across clients.
* The training settings of the code (SGD, momentum 0.9, weight decay 1e-5, lr 0.01,
  B = 128, E = 10) are the run's (``training.*``), not the method's; so is the batching (the
  code's loaders drop an epoch's last partial batch, and a client with fewer than B samples
  never trains there).
* Personalized model (PM/PA metrics): the client's model after local training, as FedAvg's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import Record
from ..models.base import FLModel
from .base import ClientContext, LossFn, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedUVHyper(FedAvgHyper):
    lam: float = 2.5  # weight of the classifier-variance term L_V (authors' --std_coeff)
    mu: float = 0.5  # weight of the representation-uniformity term L_U (authors' --unif_coeff)

    def validate(self, section: str) -> None:
        require(self.lam >= 0 and math.isfinite(self.lam), f"{section}.lam", self.lam, "must be a finite number >= 0")
        require(self.mu >= 0 and math.isfinite(self.mu), f"{section}.mu", self.mu, "must be a finite number >= 0")


def classifier_variance(logits: torch.Tensor) -> torch.Tensor:
    """L_V of (N, C) logits: the mean over classes of max(0, 1/sqrt(C) - std over the batch
    of the class's softmax probability); 0 for a batch of one."""
    N, C = logits.shape
    if N < 2:  # a shape, not a value: the batched executor groups clients by batch size
        return logits.new_zeros(())
    p = F.softmax(logits, dim=1)
    return F.relu(1 / math.sqrt(C) - p.std(dim=0)).mean()  # unbiased std, per class


def pairwise_sq_distances(z: torch.Tensor) -> torch.Tensor:
    """||z_i - z_j||^2 for i < j, (N(N-1)/2,), in ``torch.pdist``'s order; exactly 0 for equal rows."""
    i, j = torch.triu_indices(len(z), len(z), 1, device=z.device)
    return ((z[i] - z[j]) ** 2).sum(1)


def uniformity(z: torch.Tensor) -> torch.Tensor:
    """L_U of (N, d) representations: the mean over pairs of exp(-||z_i - z_j||^2 / sigma),
    sigma the median of the nonzero squared distances (1 if there is none); 0 for N < 2."""
    if len(z) < 2:
        return z.new_zeros(())
    d2 = pairwise_sq_distances(z)
    sigma = torch.nanmedian(torch.where(d2 > 0, d2, torch.full_like(d2, math.nan)))
    sigma = torch.where(torch.isnan(sigma), torch.ones_like(sigma), sigma)
    return torch.exp(-d2 / sigma).mean()


@register
class FedUV(FedAvg[WeightsState]):
    name = "feduv"
    family = "calibrated softmax"
    couples_samples = True  # both terms are statistics of the whole batch: no per-sample DP-SGD
    Hyper = FedUVHyper

    def objective(self, msg: Record, ctx: ClientContext) -> tuple[LossFn, dict[str, Any]]:
        """The local objective and the client's own tensors it reads (none)."""
        return self.uv_loss, {}

    def uv_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                extras: Mapping[str, Any]) -> torch.Tensor:
        z: torch.Tensor = model.body(x)  # (N, d): the classifier's input
        logits: torch.Tensor = model.head(z)
        value = F.cross_entropy(logits, y)
        if self.hp.lam:
            value = value + self.hp.lam * classifier_variance(logits)
        if self.hp.mu:
            value = value + self.hp.mu * uniformity(z)
        return value
