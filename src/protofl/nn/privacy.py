"""Differential privacy's mechanisms on plain tensors (docs/privacy.md).

Every function here takes its clip bound C, its noise multiplier sigma and a
:class:`NoiseStream`: draws from SHAKE-256 (a cryptographic extendable-output function,
FIPS 202) of a party's 32-byte secret key and the stream's label (round, client,
purpose; engine/privacy.py). The noise is the same in every executor and after a resume
from the checkpoint that holds the key, and without the key it can be neither replayed
nor searched for: a ``torch.Generator`` would not do, its Mersenne Twister takes 32 bits
of its seed (2^32 streams, a search an attacker can afford). The noise is drawn on the
CPU (the same numbers on any device).

* :func:`clip_rows`: rows scaled to L2 norm at most C (Opacus' factor
  min(1, C / (||v|| + 1e-6)));
* :func:`private_gradient`: DP-SGD's step (Abadi et al., CCS 2016, Algorithm 1): the
  per-sample gradients clipped to C, summed, Gaussian noise of std sigma C added, divided
  by the expected batch size;
* :func:`private_class_means`: class means a client may send under record-level DP: its
  features clipped to C, the per-class sums and counts released by one Gaussian
  mechanism (one record changes one class's sum by at most C and its count by 1, so the
  pair (sum, C * count) moves by at most sqrt(2) C: noise of std sqrt(2) sigma C on each
  sum coordinate and sqrt(2) sigma on each count), the means their ratio (post-processing);
* :func:`private_kmeans`: the same mechanism per Lloyd step (DP-Lloyd, Su et al., "Differentially
  Private k-Means Clustering", CODASPY 2016): centers of each class's features, every
  step's cluster sums and counts released with noise; the start is the private class
  mean split by data-independent offsets;
* :func:`release_class_means` / :func:`release_class_kmeans`: what a method calls: the
  plain computation without ``privacy.mode: sample``, the private one with it.

Why the release's sensitivity is sqrt(2) C although the features come from a model
trained on the same records: under ``sample`` that model is itself the output of DP-SGD
(every ``ctx.fit`` is), and the release is composed with it in the client's ledger
(adaptive composition): given the model, one record changes one class's clipped sum by
at most C and its count by 1, whatever the model is. Features of a model trained
*without* privacy break this (one record moves every feature through the model), which
is why the earlier ``privacy.mode: prototype`` is refused.

Why the mean is not noised directly: its sensitivity, 2C / (n_c + 1), depends on the
class count n_c, which is itself private; noising the sum and the count keeps the noise
data-independent, and every class (held or not) is released the same way.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .prototypes import class_means

# Opacus' guard against a zero norm in the clip factor (opacus/optimizers/optimizer.py)
CLIP_EPS = 1e-6


class NoiseStream:
    """Uniform and Gaussian draws from SHAKE-256(key | label | block), block 0, 1, ...: each
    call reads the next block, so calls in the same order give the same draws. Uniforms
    take 53 bits each; normals are Box-Muller pairs of them (float64, then the dtype asked).
    Cryptographically secure given a secret ``key``; with a key derived from a public seed
    (``privacy.noise: seeded``) it replays, by design."""

    def __init__(self, key: bytes, label: Sequence[object]) -> None:
        self.prefix = bytes(key) + b"|" + repr(tuple(label)).encode() + b"|"
        self.block = 0

    def _uniform53(self, n: int) -> np.ndarray:
        """n integers in [0, 2^53)."""
        data = hashlib.shake_256(self.prefix + self.block.to_bytes(8, "little")).digest(8 * n)
        self.block += 1
        return np.frombuffer(data, dtype="<u8") >> np.uint64(11)

    def uniform(self, shape: Sequence[int]) -> torch.Tensor:
        """U[0, 1) of ``shape`` (float64)."""
        n = int(np.prod(shape)) if len(shape) else 1
        return torch.from_numpy(self._uniform53(n).astype(np.float64) * 2.0 ** -53).reshape(tuple(shape))

    def normal(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """N(0, 1) of ``shape``: Box-Muller on pairs of uniforms, u1 in (0, 1]."""
        n = int(np.prod(shape)) if len(shape) else 1
        m = (n + 1) // 2
        u = self._uniform53(2 * m).astype(np.float64)
        r = np.sqrt(-2.0 * np.log((u[:m] + 1.0) * 2.0 ** -53))
        t = 2.0 * math.pi * u[m:] * 2.0 ** -53
        z = np.concatenate([r * np.cos(t), r * np.sin(t)])[:n]
        return torch.from_numpy(z).to(dtype).reshape(tuple(shape))


def clip_factor(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / (||v|| + 1e-6)) for every norm; exactly 1 without a bound (C = inf)."""
    if math.isinf(clip):
        return torch.ones_like(norms)
    return torch.clamp(clip / (norms + CLIP_EPS), max=1.0)


def clip_rows(v: torch.Tensor, clip: float) -> torch.Tensor:
    """The rows of ``v`` (N, ...) scaled to L2 norm at most ``clip``; a row within the
    bound keeps its value (times 1.0: the same bits)."""
    norms = torch.linalg.vector_norm(v.reshape(len(v), -1), dim=1)
    return v * clip_factor(norms, clip).view(-1, *([1] * (v.dim() - 1))).to(v.dtype)


def gaussian(shape: Sequence[int], std: float, generator: NoiseStream,
             like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """N(0, std^2) of ``shape``, drawn on the CPU from ``generator``, then moved to ``like``'s
    device and dtype (float32 by default)."""
    z = generator.normal(tuple(shape))
    z = z * std
    return z if like is None else z.to(device=like.device, dtype=like.dtype)


# ---------------------------------------------------------------------------------------
# DP-SGD
# ---------------------------------------------------------------------------------------
def private_gradient(per_sample: Sequence[torch.Tensor], clip: float, sigma: float,
                     noise: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                     batch: Optional[float] = None) -> list[torch.Tensor]:
    """DP-SGD's gradient of one step for S clients at once.

    ``per_sample[i]``: (S, b, ...) the gradients of parameter i of each of the b samples
    of each client's batch. Each sample's gradient (all parameters together) is clipped
    to ``clip``; per client the clipped gradients are summed, ``sigma * clip * noise`` is
    added (``noise``: (S, n) standard normal draws, n the parameters' total size, split
    in the order of ``per_sample``) and the sum is divided by ``batch`` (the expected batch
    size of Poisson sampling; default b). ``mask`` (S, b): which rows are samples (a
    padded row counts as nothing). A sample whose gradient is not finite counts as a zero
    gradient, so that one sample still moves the sum by at most ``clip``. Returns (S, ...)
    per parameter. As Opacus' DPOptimizer with ``loss_reduction="mean"`` and the batch
    size as its expected batch size.
    """
    S, b = per_sample[0].shape[:2]
    sq = [g.reshape(S, b, -1).float().pow(2).sum(2) for g in per_sample]  # (S, b) each
    norms = torch.stack(sq, dim=0).sum(0).sqrt()  # (S, b): each sample's norm over all parameters
    finite = torch.isfinite(norms)
    keep = finite if mask is None else finite & mask
    coef = torch.where(keep, clip_factor(norms, clip), torch.zeros_like(norms))  # (S, b)
    out, at = [], 0
    for g in per_sample:
        g = torch.where(keep.view(S, b, *([1] * (g.dim() - 2))), g, torch.zeros((), dtype=g.dtype, device=g.device))
        summed = torch.einsum("sb,sb...->s...", coef.to(g.dtype), g)  # (S, ...)
        if noise is not None and sigma > 0:
            n = summed[0].numel()
            summed = summed + (sigma * clip) * noise[:, at:at + n].reshape(summed.shape).to(g.dtype)
            at += n
        out.append(summed / (b if batch is None else batch))
    return out


# ---------------------------------------------------------------------------------------
# prototypes
# ---------------------------------------------------------------------------------------
def private_sums(z: torch.Tensor, groups: torch.Tensor, num_groups: int, clip: float, sigma: float,
                 generator: NoiseStream) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian mechanism on per-group sums and counts of the features ``z`` (N, d)
    (already clipped to ``clip``): (G, d) noisy sums and (G,) noisy counts (float). One
    record moves (sum, clip * count) by at most sqrt(2) clip in L2: std sqrt(2) sigma clip
    on each sum coordinate, sqrt(2) sigma on each count."""
    d = z.shape[1]
    sums = torch.zeros(num_groups, d, dtype=z.dtype, device=z.device)
    sums.index_add_(0, groups, z)
    counts = torch.bincount(groups, minlength=num_groups).to(z.dtype)
    if sigma > 0:
        std = math.sqrt(2.0) * sigma
        sums = sums + gaussian((num_groups, d), std * clip, generator, like=sums)
        counts = counts + gaussian((num_groups,), std, generator, like=counts)
    return sums, counts


def released_counts(counts: torch.Tensor) -> torch.Tensor:
    """Noisy counts as the int64 counts a message carries: rounded, at least 0."""
    return torch.clamp(torch.round(counts), min=0).to(torch.int64)


def private_class_means(z: torch.Tensor, y: torch.Tensor, num_classes: int, clip: float, sigma: float,
                        generator: NoiseStream) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, d) class means and (C,) int64 counts of the features ``z`` (N, d), private at the
    record level: every class (held or not) gets a noisy sum and count (one Gaussian
    mechanism, :func:`private_sums`), its mean is sum / max(count, 1). With sigma = 0 and
    no bound this is :func:`~protofl.nn.prototypes.class_means` bit for bit."""
    z = clip_rows(z, clip)
    sums, counts = private_sums(z, y, num_classes, clip, sigma, generator)
    return sums / counts.clamp(min=1).unsqueeze(1), released_counts(counts)


def private_kmeans(z: torch.Tensor, y: torch.Tensor, num_classes: int, k: int, steps: int, clip: float,
                   sigma: float, generator: NoiseStream) -> tuple[torch.Tensor, torch.Tensor]:
    """k centers per class of the features ``z`` (N, d), private at the record level:
    (C, k, d) centers and (C, k) int64 counts, after 1 + ``steps`` Gaussian mechanisms.

    Start: the private class mean (:func:`private_sums`), its k copies moved apart by
    data-independent random directions of a tenth of the mean's norm. Each Lloyd step
    assigns every feature to the nearest center of its class and releases the noisy sums
    and counts of the C k clusters; a center is its sum / max(count, 1), a cluster whose
    noisy count is below 1 keeps its previous center. A record sits in one cluster of one
    class, so each step is one mechanism of sensitivity sqrt(2) C, whatever C and k are.
    """
    z = clip_rows(z, clip)
    d = z.shape[1]
    sums, counts = private_sums(z, y, num_classes, clip, sigma, generator)
    mean = sums / counts.clamp(min=1).unsqueeze(1)  # (C, d)
    offsets = generator.normal((num_classes, k, d)).to(z)  # data-independent
    offsets = offsets / offsets.norm(dim=2, keepdim=True).clamp(min=1e-12)
    scale = 0.1 * mean.norm(dim=1).clamp(min=1e-6).view(-1, 1, 1)
    centers = mean.unsqueeze(1) + (scale * offsets if k > 1 else 0.0)  # (C, k, d)
    n = counts.unsqueeze(1).expand(num_classes, k) / k  # (C, k) before any step: the mean's count, shared
    for _ in range(steps):
        dist = torch.cdist(z.unsqueeze(1), centers[y]).squeeze(1)  # (N, k): to the centers of its class
        groups = y * k + dist.argmin(1)
        s, n = private_sums(z, groups, num_classes * k, clip, sigma, generator)
        fresh = (s / n.clamp(min=1).unsqueeze(1)).view(num_classes, k, d)
        n = n.view(num_classes, k)
        centers = torch.where((n >= 1).unsqueeze(2), fresh, centers)
    return centers, released_counts(n)


# ---------------------------------------------------------------------------------------
# what methods call
# ---------------------------------------------------------------------------------------
def prototype_privacy(ctx: Any) -> Optional[Any]:
    """The client's privacy settings when its prototypes must be private (``privacy.mode:
    sample``), else None. ``ctx.privacy`` has ``feature_clip``, ``sigma``, ``kmeans_steps``,
    ``generator(purpose)`` and ``spend(releases)``."""
    p = getattr(ctx, "privacy", None)
    return p if p is not None and p.mode == "sample" else None


def release_class_means(ctx: Any, z: torch.Tensor, y: torch.Tensor,
                        num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (C, d) class means and (C,) counts a client sends: plain
    :func:`~protofl.nn.prototypes.class_means`, or :func:`private_class_means` under
    ``privacy.mode: sample`` (one release of the client's records)."""
    p = prototype_privacy(ctx)
    if p is None:
        return class_means(z, y, num_classes)
    p.spend(1)
    return private_class_means(z, y, num_classes, p.feature_clip, p.sigma, p.generator("class_means"))


def release_class_kmeans(ctx: Any, z: torch.Tensor, y: torch.Tensor, num_classes: int,
                         k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Under ``privacy.mode: sample``: every class's k private centers that carry a
    (noisy) count of at least 1, as (m, d) prototypes and (m,) int64 labels
    (:func:`private_kmeans`, 1 + ``privacy.kmeans_steps`` releases)."""
    p = prototype_privacy(ctx)
    if p is None:
        raise ValueError("release_class_kmeans is the private k-means; without privacy.mode: sample, "
                         "use protofl.nn.clustering.kmeans")
    p.spend(1 + p.kmeans_steps)
    centers, counts = private_kmeans(z, y, num_classes, k, p.kmeans_steps, p.feature_clip, p.sigma,
                                     p.generator("kmeans"))
    keep = counts >= 1  # (C, k)
    labels = torch.arange(num_classes, device=z.device).unsqueeze(1).expand(num_classes, k)
    return centers[keep], labels[keep]
