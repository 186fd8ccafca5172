"""The in-memory dataset every loader returns.

A dataset is held as whole tensors per split, in the source's own dtype (uint8 images
stay uint8: 4x less memory, and a client's slice is converted when it trains), plus the
normalization to apply on the fly. Nothing is re-read from disk after loading.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import InputError


class MissingDataError(InputError, FileNotFoundError):
    """Raised when a dataset's files are not where we looked; says what and where."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor  # (N, ...) uint8 / float32 images or int64 / uint8 tokens
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    # on-the-fly normalization: x -> (x / scale - mean[c]) / std[c]; None = leave as is
    scale: Optional[float] = None
    mean: Optional[Sequence[float]] = None
    std: Optional[Sequence[float]] = None
    # natural partition (LEAF): one index array per user into the train / test split
    users_train: Optional[list[np.ndarray]] = None
    users_test: Optional[list[np.ndarray]] = None
    user_names: Optional[list[str]] = None
    class_names: Optional[list[str]] = None
    kind: str = "image"  # "image" | "vector" | "tokens"
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.y_train.dtype != torch.int64 or self.y_test.dtype != torch.int64:
            raise TypeError("labels must be int64 tensors")
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("x and y of a split must have the same length")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def train_labels(self) -> np.ndarray:
        return self.y_train.numpy()

    @property
    def test_labels(self) -> np.ndarray:
        return self.y_test.numpy()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Raw slice -> model input (float32 for images/vectors, int64 for tokens)."""
        if self.kind == "tokens":  # tokens may be stored as uint8 (the full LEAF Shakespeare)
            return x if x.dtype == torch.int64 else x.long()
        out = x.to(torch.float32)
        if out is x:  # already float32: do not modify the caller's tensor
            out = x.clone()
        # in place from here on: one float copy of the slice, no temporaries
        if self.scale is not None and self.scale != 1:
            out.div_(self.scale)
        if self.mean is not None:
            shape = (1, -1) + (1,) * (out.dim() - 2)  # per channel
            out.sub_(torch.as_tensor(self.mean, dtype=torch.float32, device=out.device).view(shape))
            out.div_(torch.as_tensor(self.std, dtype=torch.float32, device=out.device).view(shape))
        return out

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, train={tuple(self.x_train.shape)} {self.x_train.dtype}, "
            f"test={tuple(self.x_test.shape)}, classes={self.num_classes})"
        )


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 (N, C, H, W) images, on the [0, 1] scale
    (measured on the training split at load time, so no constant can be stale)."""
    if not len(x):
        return (0.0,) * x.shape[1], (1.0,) * x.shape[1]
    c = x.shape[1]
    s1, s2 = np.zeros(c), np.zeros(c)
    for start in range(0, len(x), 4096):  # float64 sums over bounded chunks: exact enough, little memory
        chunk = x[start:start + 4096].astype(np.float64) / 255.0
        s1 += chunk.sum(axis=(0, 2, 3))
        s2 += (chunk * chunk).sum(axis=(0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    mean = s1 / n
    std = np.sqrt(np.maximum(s2 / n - mean * mean, 1e-12))
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)
