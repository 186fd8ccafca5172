"""Batched evaluation of predictors; the metric formulas live in :mod:`protofl.metrics`."""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from ..algorithms.base import Predictor, Predictors
from .. import metrics as M


def as_named(predictors: Predictors) -> dict[str, Predictor]:
    """One predictor -> {"": it}; a mapping keeps its order (the first is primary)."""
    if isinstance(predictors, Mapping):
        return dict(predictors)
    return {"": predictors}


@torch.inference_mode()
def class_correct(predict: Predictor, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                  batch_size: int = 1024, channels_last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-class (correct, count) of argmax predictions over (x, y), in batches."""
    modules = [predict] if isinstance(predict, nn.Module) else []
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    correct = torch.zeros(num_classes, dtype=torch.int64, device=y.device)  # no host sync per batch
    try:
        for i in range(0, len(y), batch_size):
            xb = x[i:i + batch_size]
            if channels_last and xb.dim() == 4:
                xb = xb.contiguous(memory_format=torch.channels_last)
            pred = predict(xb).argmax(dim=1).to(y.device)
            yb = y[i:i + batch_size]
            correct += torch.bincount(yb[pred == yb], minlength=num_classes)
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    count = torch.bincount(y.cpu(), minlength=num_classes)
    return correct.cpu().numpy().astype(np.int64), count.numpy().astype(np.int64)


def personal_metrics(predictors: Predictors, *, test_x: torch.Tensor, test_y: torch.Tensor, local_x: torch.Tensor,
                     local_y: torch.Tensor, train_counts: np.ndarray, num_classes: int, batch_size: int,
                     channels_last: bool, full_test: bool = True) -> dict[str, float]:
    """A client's personalized-model metrics (see docs/metrics.md).

    acc: plain accuracy on the global test set; pm_v / pm_l: the same with per-class
    weights V (class present locally) / L (local label proportions); pa: accuracy on
    the client's local test set. Extra predictors get an ``@name`` suffix.
    """
    out: dict[str, float] = {}
    for name, predict in as_named(predictors).items():
        sfx = f"@{name}" if name and out else ""
        if full_test:
            correct, count = class_correct(predict, test_x, test_y, num_classes, batch_size, channels_last)
            out["acc" + sfx] = M.accuracy(correct, count)
            out["pm_v" + sfx] = M.weighted_accuracy(correct, count, M.weights_v(train_counts))
            out["pm_l" + sfx] = M.weighted_accuracy(correct, count, M.weights_l(train_counts))
        if len(local_y):
            lc, ln = class_correct(predict, local_x, local_y, num_classes, batch_size, channels_last)
            out["pa" + sfx] = M.accuracy(lc, ln)
    return out
