"""Class prototypes: per-class means of features, their aggregation across clients, and
the nearest-prototype predictor.

Shapes: features (N, d), labels (N,), prototypes (C, d), counts (C,). A class with no
samples has count 0 and a zero row; consumers mask by ``counts > 0``.
"""
from __future__ import annotations

import torch
from torch import nn


def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, d) per-class mean of ``features`` and (C,) int64 counts; absent classes -> zeros."""
    d = features.shape[1]
    sums = torch.zeros(num_classes, d, dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, features)
    counts = torch.bincount(labels, minlength=num_classes)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(features.dtype)
    return means, counts


def aggregate_prototypes(protos: list[torch.Tensor], counts: list[torch.Tensor],
                         weighting: str = "counts") -> tuple[torch.Tensor, torch.Tensor]:
    """Combine clients' (C, d) prototypes into global ones, class by class.

    weighting="counts": p_c = sum_k n_kc p_kc / sum_k n_kc (each client weighted by how many
    samples of class c it holds); weighting="uniform": the plain mean over the clients
    that hold class c. Returns the (C, d) global prototypes and the (C,) total counts;
    classes nobody holds get a zero row and count 0.
    """
    if not protos:
        raise ValueError("no prototypes to aggregate")
    if weighting not in ("counts", "uniform"):
        raise ValueError(f"weighting must be 'counts' or 'uniform', got {weighting!r}")
    P = torch.stack(protos).to(torch.float32)  # (K, C, d)
    N = torch.stack(counts).to(torch.float32)  # (K, C)
    W = N if weighting == "counts" else (N > 0).to(torch.float32)
    den = W.sum(0)  # (C,)
    glob = (W.unsqueeze(2) * P).sum(0) / den.clamp(min=1e-12).unsqueeze(1)
    glob[den == 0] = 0.0
    return glob, N.sum(0).to(torch.int64)


class NearestPrototype(nn.Module):
    """Scores (B, C): minus the smallest L2 distance from body(x) to a prototype of each
    class; a class without any prototype scores -inf. With one prototype per class this
    is FedProto's rule; with several it is MP-FedCL's eq. (13).

    A module (not a closure) so that the evaluator switches the body to eval mode.
    """

    protos: torch.Tensor  # (P, d), a buffer
    labels: torch.Tensor  # (P,), a buffer

    def __init__(self, body: nn.Module, protos: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
        super().__init__()
        self.body = body
        self.register_buffer("protos", protos.detach().clone())  # (P, d)
        self.register_buffer("labels", labels.detach().to(torch.int64).clone())  # (P,)
        self.num_classes = int(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.body(x)  # (B, d)
        scores = z.new_full((len(z), self.num_classes), float("-inf"))  # (B, C)
        if len(self.protos) == 0:
            return scores
        # exact distances (the matmul shortcut can mis-rank near ties)
        dist = torch.cdist(z.float(), self.protos.to(z.device).float(),
                           compute_mode="donot_use_mm_for_euclid_dist")  # (B, P)
        idx = self.labels.to(z.device).unsqueeze(0).expand_as(dist)
        return scores.scatter_reduce(1, idx, -dist.to(scores.dtype), reduce="amax", include_self=True)


def prototype_rows(protos: list[torch.Tensor], counts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Several clients' (C, d) prototype tables as one set of labelled rows: (n, d) the rows
    whose count is > 0, table after table in class order, and (n,) their classes (the
    training data of FedTGP's and FedGH's server steps)."""
    rows = [p[c > 0] for p, c in zip(protos, counts)]
    classes = [torch.nonzero(c > 0).flatten() for c in counts]
    return torch.cat(rows), torch.cat(classes)
