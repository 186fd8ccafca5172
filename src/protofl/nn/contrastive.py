"""Supervised contrastive loss between sample embeddings and a pool of class prototypes.

MP-FedCL (Qiao et al., 2023) eq. (11): each local embedding z_i is pulled towards the
pool prototypes of its own class (the positives P(i)) and pushed from the prototypes of
the other classes; the denominator runs over the whole pool A:

    s_ia = <z_i / ||z_i||, u_a / ||u_a||> / tau                       (cosine / tau)
    L_i  = -1/|P(i)| * sum_{p in P(i)} log( exp(s_ip) / sum_{a in A} exp(s_ia) )

(``positives="mean_log"``, the supervised-contrastive form of Khosla et al., 2020). The
cosine departs from MP-FedCL's text, whose eq. (11) takes "the inner (dot) product" of
the raw vectors (mpfedcl.py says why). The
alternative ``positives="log_sum"`` puts the positives inside one log,
``L_i = -log( sum_{p in P(i)} exp(s_ip) / sum_{a in A} exp(s_ia) )`` (as in FPL, Huang et
al., 2023). The loss is the mean of L_i over the samples that have at least one
positive; samples whose class has no prototype in the pool contribute nothing.

Written without branching on tensor values (masks instead of boolean indexing), so that
``torch.func.vmap`` can run it for a stack of clients (the batched executor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prototype_supcon_loss(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor,
                          proto_labels: torch.Tensor, tau: float = 0.07,
                          positives: str = "mean_log") -> torch.Tensor:
    """z (B, d) embeddings, y (B,) labels, protos (P, d) pool, proto_labels (P,) -> scalar."""
    if positives not in ("mean_log", "log_sum"):
        raise ValueError(f"positives must be 'mean_log' or 'log_sum', got {positives!r}")
    if len(protos) == 0 or len(z) == 0:
        return z.sum() * 0.0  # keeps the graph; nothing to contrast with
    s = F.normalize(z, dim=1) @ F.normalize(protos.to(z.dtype), dim=1).T / tau  # (B, P)
    log_prob = s - torch.logsumexp(s, dim=1, keepdim=True)  # (B, P)
    pos = proto_labels.to(y.device).unsqueeze(0) == y.unsqueeze(1)  # (B, P)
    n_pos = pos.sum(1)  # (B,)
    has = n_pos > 0
    if positives == "mean_log":
        per_sample = -(log_prob * pos).sum(1) / n_pos.clamp(min=1)
    else:  # rows without a positive take zeros, not an all -inf row (whose gradient is nan)
        masked = torch.where(has.unsqueeze(1), log_prob.masked_fill(~pos, float("-inf")), torch.zeros_like(log_prob))
        per_sample = -torch.logsumexp(masked, dim=1)
    # the mean over the samples with a positive; 0 (with a zero gradient) when none has one
    return torch.where(has, per_sample, torch.zeros_like(per_sample)).sum() / has.sum().clamp(min=1)
