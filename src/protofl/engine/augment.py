"""Per-epoch data augmentation (``data.augment``): random crop with padding and horizontal
flip, the standard CIFAR recipe of the papers (FedNH, FedGELA, ReBaFL train with it).

It runs inside the one training step, on the device, per sample, in both executors:

* the random draws of a client's ``ctx.fit`` -- for every step and sample, a crop offset
  (dy, dx) in [0, 2p] and a flip -- are made up front on the CPU from the client's own
  stream (seed, "augment", round, client), like its data order (:func:`augment_plan`);
  the sequential driver and the batched executor's stacks use the same plan, so both see
  the same images and a resume repeats them;
* :func:`apply` crops and flips a batch with indexing only (the values are copied, never
  interpolated), so an augmented batch is bit-identical wherever it is made;
* the padding is the image value 0 (black) as it looks after normalization, as
  ``torchvision.transforms.RandomCrop(padding=p)`` pads the raw image before ``Normalize``.

Evaluation and the features of ``ctx.features`` (prototypes) never see augmentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

@dataclass(frozen=True)
class Augment:
    crop: int = 0  # p: pad by p, then crop a random window of the original size
    flip: bool = False

    @classmethod
    def of(cls, spec: Optional[Mapping[str, Any]]) -> "Augment":
        """``data.augment`` (``{crop: 4, flip: true}``; {} or null: none)."""
        return cls(**(spec or {}))

    @property
    def active(self) -> bool:
        return self.crop > 0 or self.flip


def augment_plan(aug: Augment, steps: int, batch: int, generator: torch.Generator) -> dict[str, np.ndarray]:
    """The draws of ``steps`` minibatches of at most ``batch`` samples: crop offsets
    ``offsets`` (steps, batch, 2) in [0, 2 crop] and ``flips`` (steps, batch) bool, from
    ``generator`` in that order (a step of fewer samples uses its first rows)."""
    offsets = torch.randint(0, 2 * aug.crop + 1, (steps, batch, 2), generator=generator) if aug.crop \
        else torch.zeros(steps, batch, 2, dtype=torch.int64)
    flips = torch.rand(steps, batch, generator=generator) < 0.5 if aug.flip else torch.zeros(steps, batch, dtype=torch.bool)
    return {"offsets": offsets.numpy(), "flips": flips.numpy()}


def pad_value(normalize: Callable[[torch.Tensor], torch.Tensor], channels: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """(1, C, 1, 1): the raw image value 0 after the dataset's normalization."""
    return normalize(torch.zeros(1, channels, 1, 1, dtype=dtype, device=device))


def apply(aug: Augment, x: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """The augmented batch: x (B, C, H, W) normalized images, offsets (B, 2) (dy, dx) in
    [0, 2 crop], flips (B,) bool, pad (1, C, 1, 1) the padding value. Indexing only: every
    output value is one of the inputs or the padding (no host sync: on a GPU it queues)."""
    B, C, H, W = x.shape
    crop = aug.crop
    if crop:
        padded = pad.to(x.dtype).expand(B, C, H + 2 * crop, W + 2 * crop).clone()
        padded[:, :, crop:crop + H, crop:crop + W] = x
        rows = offsets[:, 0, None] + torch.arange(H, device=x.device)  # (B, H)
        cols = offsets[:, 1, None] + torch.arange(W, device=x.device)  # (B, W)
        b = torch.arange(B, device=x.device)[:, None, None, None]
        c = torch.arange(C, device=x.device)[None, :, None, None]
        x = padded[b, c, rows[:, None, :, None], cols[:, None, None, :]]  # (B, C, H, W)
    if aug.flip:
        x = torch.where(flips[:, None, None, None], x.flip(-1), x)
    return x
