"""Fixed classifier heads: maximally separated unit prototypes (FedNH), the simplex ETF
(FedGELA, FedETF) and orthonormal class vectors (SphereFed), plus the head module that holds them.

Shapes: C classes, d feature dimensions. Prototypes are returned as (C, d) rows (one per
class, as in ``nn.Linear.weight``); the ETF as the paper's (d, C) matrix M (one column
per class).

* :func:`simplex_etf` -- FedGELA's M = sqrt(C/(C-1)) U (I_C - 1 1^T / C), U^T U = I_C.
  Every column has unit norm and any two columns have inner product -1/(C-1).
* :func:`max_separated_prototypes` -- FedNH's problem (1):

      max_{w_1..w_C}  min_{i != j} ||w_i - w_j||   s.t. ||w_c|| = 1.

  For d >= C-1 the optimum is the regular simplex (the ETF's columns), with minimum
  distance sqrt(2C/(C-1)). For C > d+1 there is in general no closed form (Tammes' problem); we
  solve it numerically with projected gradient descent on a smooth surrogate of the
  largest pairwise cosine, with many random restarts, and keep the best restart.
* :func:`orthonormal_prototypes` -- SphereFed's C mutually orthogonal unit rows (d >= C).
* :class:`FixedHead` -- logits = s * W f / ||f|| with W a *buffer* (never trained by SGD,
  but part of the state dict so it travels with the weights) and s a learnable parameter
  or a fixed buffer.

Everything is computed in float64 on the CPU from a seeded generator, so every process
(server, clients, pool workers) builds the identical head for the same (C, d, seed).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import cast, TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..models.base import FLModel

# numerical solver settings (C > d+1): restarts run as one batch; their number shrinks
# with the problem size (the work per step grows like C^2 d) within these bounds
SOLVER_MAX_RESTARTS = 64
SOLVER_MIN_RESTARTS = 8
SOLVER_WORK = 200_000  # restarts * C^2 * d budget per step
SOLVER_STEPS = 1500
_SEED_TAG_ETF = 0xE7F
_SEED_TAG_SOLVER = 0x7A3E5
_SEED_TAG_ORTHO = 0x0A7


def _generator(seed: int, tag: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + tag) % (2 ** 63))
    return g


def _orthonormal_columns(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(n, k) with orthonormal columns (k <= n), uniformly random via QR of a Gaussian."""
    A = torch.randn(n, k, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(A)
    sign = torch.sign(torch.diagonal(R))
    sign[sign == 0] = 1.0
    return Q * sign  # sign fix: Q is then Haar-distributed, not biased by the QR convention


def simplex_etf(C: int, d: int, seed: int = 0) -> torch.Tensor:
    """The (d, C) simplex equiangular tight frame M with M^T M = C/(C-1) (I - 1 1^T / C).

    d >= C: the paper's construction M = sqrt(C/(C-1)) U (I - 1 1^T/C) with a random
    U (d, C), U^T U = I_C. d = C-1: U cannot have C orthonormal columns, but the centered
    simplex lies in the (C-1)-dim subspace 1^perp, so M = sqrt(C/(C-1)) V B^T with B (C, C-1)
    an orthonormal basis of 1^perp and V (d, C-1) random orthonormal gives the same Gram
    matrix. d < C-1: no simplex ETF exists (C equiangular vectors with inner product
    -1/(C-1) span C-1 dimensions); raises ValueError.
    """
    C, d = int(C), int(d)
    if C < 2:
        raise ValueError(f"simplex ETF needs at least 2 classes, got C={C}")
    if d < C - 1:
        raise ValueError(f"a simplex ETF of C={C} classes needs feature dimension d >= C-1 = {C - 1}; "
                         f"got d={d}")
    gen = _generator(seed, _SEED_TAG_ETF)
    centering = torch.eye(C, dtype=torch.float64) - 1.0 / C  # (C, C) = I - 1 1^T / C
    if d >= C:
        U = _orthonormal_columns(d, C, gen)  # (d, C)
        M = U @ centering
    else:  # d == C-1
        B, _ = torch.linalg.qr(centering[:, : C - 1])  # (C, C-1), spans 1^perp
        V = _orthonormal_columns(d, C - 1, gen)  # (d, C-1) square orthogonal here
        M = V @ B.T
    return math.sqrt(C / (C - 1)) * M  # (d, C)


def orthonormal_prototypes(C: int, d: int, seed: int = 0) -> torch.Tensor:
    """(C, d) float32 orthonormal rows: C mutually orthogonal unit class vectors in R^d
    (SphereFed's fixed classifier), a uniformly random frame seeded like the ETF (the same
    in every process). Needs d >= C; raises ValueError otherwise."""
    C, d = int(C), int(d)
    if C < 1 or d < C:
        raise ValueError(f"{C} orthonormal class vectors need feature dimension d >= C = {C}; got d={d}")
    return _orthonormal_columns(d, C, _generator(seed, _SEED_TAG_ORTHO)).T.to(torch.float32).contiguous()


def min_pairwise_distance(W: torch.Tensor) -> float:
    """min_{i != j} ||w_i - w_j|| over the rows of W (C, d); inf for C < 2."""
    if W.shape[0] < 2:
        return float("inf")
    D = torch.cdist(W.to(torch.float64), W.to(torch.float64))
    D.fill_diagonal_(float("inf"))
    return float(D.min())


def _solve_tammes(C: int, d: int, seed: int, restarts: int, steps: int) -> torch.Tensor:
    """Numerical solution of problem (1) for C > d+1: the best of ``restarts`` runs.

    Each run starts from random unit vectors and minimizes the smooth maximum of the
    pairwise cosines, L_tau(W) = (1/tau) log sum_{i != j} exp(tau <w_i, w_j>), which tends
    to max_{i != j} <w_i, w_j> as tau grows (and ||w_i - w_j||^2 = 2 - 2 <w_i, w_j> on the
    sphere, so minimizing the largest cosine maximizes the smallest distance). Projected
    gradient: step on dL/dW = (P + P^T) W with P the softmax weights of the pairs, then
    renormalize the rows. tau is annealed geometrically from 5 to 10^4 so early steps
    spread all points and late steps polish the closest pairs.
    """
    gen = _generator(seed, _SEED_TAG_SOLVER)
    W = torch.nn.functional.normalize(torch.randn(restarts, C, d, generator=gen, dtype=torch.float64), dim=2)
    eye = torch.eye(C, dtype=torch.bool)
    tau0, tau1 = 5.0, 1e4
    for t in range(steps):
        tau = tau0 * (tau1 / tau0) ** (t / max(1, steps - 1))
        G = W @ W.transpose(1, 2)  # (R, C, C) cosines
        logits = (tau * G).masked_fill(eye, float("-inf")).flatten(1)
        P = torch.softmax(logits, dim=1).view(restarts, C, C)  # pair weights, sum 1
        grad = (P + P.transpose(1, 2)) @ W  # (R, C, d)
        # step ~ C / tau: P spreads over ~C pairs per row early on, and late steps must
        # be fine enough to resolve cosine differences of order 1/tau
        lr = 0.5 * C / tau
        W = torch.nn.functional.normalize(W - lr * grad, dim=2)
    G = W @ W.transpose(1, 2)
    worst = G.masked_fill(eye, float("-inf")).flatten(1).max(dim=1).values  # (R,) largest cosine
    return W[int(torch.argmin(worst))]


@lru_cache(maxsize=64)
def _max_separated_cached(C: int, d: int, seed: int) -> torch.Tensor:
    if C == 1:
        return torch.nn.functional.normalize(torch.randn(1, d, generator=_generator(seed, _SEED_TAG_ETF),
                                                         dtype=torch.float64), dim=1)
    if d >= C - 1:
        return simplex_etf(C, d, seed).T.contiguous()  # (C, d): the regular simplex
    restarts = min(SOLVER_MAX_RESTARTS, max(SOLVER_MIN_RESTARTS, SOLVER_WORK // (C * C * d)))
    # thousands of steps on tiny tensors: intra-op threads only add synchronization (10-50x
    # slower on a busy machine), so the solver runs on one thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _solve_tammes(C, d, seed, restarts, SOLVER_STEPS)
    finally:
        torch.set_num_threads(threads)


def max_separated_prototypes(C: int, d: int, seed: int = 0) -> torch.Tensor:
    """(C, d) float32 unit rows solving FedNH's problem (1); cached per (C, d, seed).

    Closed-form regular simplex for d >= C-1 (minimum distance sqrt(2C/(C-1))); the
    numerical solver with restarts for C > d+1.
    """
    C, d = int(C), int(d)
    if C < 1 or d < 1:
        raise ValueError(f"need C >= 1 classes and d >= 1 dimensions, got C={C}, d={d}")
    return _max_separated_cached(C, d, int(seed)).to(torch.float32).clone()  # callers may not alter the cache


class FixedHead(nn.Module):
    """logits = s * W f / ||f||: a fixed (C, d) head on L2-normalized features.

    ``weight`` is a buffer: it is in the state dict (so messages carry it and a server can
    set it), but it is not a parameter, so no optimizer ever moves it. ``scale`` is a
    learnable parameter when ``learn_scale`` is true, else a buffer.
    """

    weight: torch.Tensor  # (C, d), a buffer
    scale: torch.Tensor  # a parameter or a buffer

    def __init__(self, weight: torch.Tensor, scale: float = 1.0, learn_scale: bool = False) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.float32).clone())  # (C, d)
        s = torch.tensor(float(scale))
        if learn_scale:
            self.scale = nn.Parameter(s)
        else:
            self.register_buffer("scale", s)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        f = nn.functional.normalize(h, dim=1)  # (B, d), ||f|| = 1 (a zero feature stays 0)
        return self.scale * (f @ self.weight.T)  # (B, C)


def add_projection(model: nn.Module) -> nn.Module:
    """Append a linear projection (d -> d, with bias) to ``model.body``.

    The FedGELA authors' models end their backbone in one FC "projection layer" whose
    output (signed, not passed through a ReLU) is normalized and fed to the ETF. Our
    bodies end in a ReLU, so every feature lies in the non-negative orthant: its cosine
    with a head direction w is at most ||w^+|| / ||w|| (w^+ the positive part), so it
    cannot point at directions with negative entries; the projection makes the features
    signed again. The normalization is the fixed head's
    own (:class:`FixedHead` normalizes its input). ``model.body`` becomes
    ``Sequential(old_body, Linear)``: state-dict keys gain a ``body.0.`` / ``body.1.``
    prefix. Called inside the run's seeded init, so the projection is the same everywhere.
    """
    flm = cast("FLModel", model)  # a protofl model: a body and a head
    d = flm.feature_dim
    flm.body = nn.Sequential(flm.body, nn.Linear(d, d))
    return model
