"""Calibrated softmax losses for label-skewed clients: the shared math of BSM-FedAvg,
ReBaFL, FedRS and FedLC.

All four change the local softmax by the client's own label counts ``n`` (C,); each is
written here as a transformation of the logits z (B, C) followed by the ordinary
cross-entropy, so a method's objective is ``F.cross_entropy(transform(z), y)``.

* balanced softmax (Ren et al., NeurIPS 2020; ReBaFL eq. 9):
  p(y|x) = pi_y exp(z_y) / sum_j pi_j exp(z_j)  ==  softmax(z + log pi)
* relaxed prior (ReBaFL eq. 10): pi_c = (1 - eps) n_c / n + eps / C. eps = 0 gives the
  plain label prior (BSM); a class missing on the client gets eps / C instead of 0.
* restricted softmax (FedRS, Li & Zhan, KDD 2021): z_c -> alpha_c z_c with alpha_c = 1
  for classes the client holds and alpha (0 <= alpha <= 1) for the missing ones.
* logit calibration (FedLC, Zhang et al., ICML 2022): z_c -> z_c - tau n_c^(-1/4).

Absent classes make ``log pi_c`` (BSM, eps = 0) or ``-tau n_c^(-1/4)`` (FedLC) equal to
-inf: those classes drop out of the local softmax exactly (zero probability, zero
gradient), instead of the ``+1e-9`` fudge of most released code, which has the same
effect up to ~1e-9. The cross-entropy stays finite because the target class is always
one the client holds.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F


def label_counts(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C,) int64 counts of the labels ``y`` (B,) (a comparison table, not ``bincount``: it
    also runs under vmap)."""
    return (y.unsqueeze(1) == torch.arange(num_classes, device=y.device)).sum(0)


def relaxed_prior(counts: torch.Tensor, epsilon: float) -> torch.Tensor:
    """ReBaFL eq. 10: pi_c = (1 - eps) n_c / n + eps / C, a (C,) float32 distribution.

    ``epsilon = 0`` is the empirical label prior of balanced softmax. With no samples at
    all (n = 0) the prior is uniform.
    """
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    n = counts.to(torch.float32)
    C = n.numel()
    total = n.sum()
    # a select, not an if on the total, so that it runs under vmap (the batched executor)
    return torch.where(total > 0, (1.0 - epsilon) * n / total + epsilon / C, torch.full_like(n, 1.0 / C))


def balanced_logits(logits: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """Balanced softmax as logits: z + log pi, (B, C). softmax of it = pi*exp(z) / sum."""
    return logits + torch.log(prior.to(logits.dtype)).unsqueeze(0)


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """Mean of -log [pi_y exp(z_y) / sum_j pi_j exp(z_j)] over the batch (ReBaFL eq. 9)."""
    return F.cross_entropy(balanced_logits(logits, prior), y)


def restricted_logits(logits: torch.Tensor, counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """FedRS restricted softmax as logits: alpha_c z_c, alpha_c = 1 if n_c > 0 else alpha."""
    scale = torch.where(counts > 0, 1.0, float(alpha)).to(logits.dtype)  # (C,)
    return logits * scale.unsqueeze(0)


def calibrated_logits(logits: torch.Tensor, counts: torch.Tensor, tau: float) -> torch.Tensor:
    """FedLC logit calibration: z_c - tau n_c^(-1/4); n_c = 0 gives -inf (class excluded)."""
    if tau == 0:  # plain cross-entropy over all classes (and no 0 * inf = nan)
        return logits
    n = counts.to(logits.dtype)
    margin = torch.where(n > 0, n.clamp(min=1.0) ** -0.25, torch.full_like(n, float("inf")))  # (C,)
    return logits - float(tau) * margin.unsqueeze(0)


def proximal(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum_k ||w_k - a_k||^2 over the parameters named in ``anchor`` (FedProx's eq. 2 and
    Ditto's eq. 2 without their factor mu/2, lam/2): the squared distance of the model's
    current parameters to the anchor."""
    params = dict(model.named_parameters())
    # cast: an empty anchor would give the int 0
    return cast(torch.Tensor, sum(torch.sum((params[k] - a) ** 2) for k, a in anchor.items()))
