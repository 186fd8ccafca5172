"""The one local training loop.

Every method trains through :func:`local_train`; methods change *what* is minimized
(the ``loss`` callable) and *which* parameters move (``params``), never the loop.
Batches are slices of a per-epoch permutation of the client's in-memory tensors.
``precision="bf16"`` runs the loss (the forward pass) under bfloat16 autocast, backward
and the SGD step on the float32 weights (:mod:`protofl.engine.precision`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .precision import autocast

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteLossError(FloatingPointError):
    """Local training produced a NaN/inf loss; carries the round and client."""

    def __init__(self, rnd: int, cid: int, value: float) -> None:
        self.rnd, self.cid, self.value = rnd, cid, value
        super().__init__(f"non-finite training loss ({value}) in round {rnd} on client {cid}")

    def __reduce__(self):  # survives the trip back from a worker process
        return (type(self), (self.rnd, self.cid, self.value))


@dataclass
class TrainStats:
    loss: float  # sample-weighted mean of the minibatch losses
    steps: int
    samples: int  # samples processed (epochs x client size, or steps x batch)


def local_train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss: LossFn,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    momentum: float,
    weight_decay: float,
    batch_size: int,
    epochs: int,
    steps: Optional[int],
    clip_grad: Optional[float],
    generator: torch.Generator,
    channels_last: bool = False,
    precision: str = "fp32",
) -> TrainStats:
    params = [p for p in params if p.requires_grad]
    n = len(y)
    if n == 0 or not params:
        return TrainStats(loss=0.0, steps=0, samples=0)
    model.train()
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    total_steps = steps if steps is not None else epochs * math.ceil(n / batch_size)
    loss_sum = torch.zeros((), dtype=torch.float64, device=y.device)  # no host sync per step
    device_type = x.device.type
    seen = step = 0
    while step < total_steps:
        perm = torch.randperm(n, generator=generator).to(y.device)  # CPU stream: same order on any device
        xp, yp = x[perm], y[perm]  # one gather per epoch; batches below are views
        if channels_last and xp.dim() == 4:
            xp = xp.contiguous(memory_format=torch.channels_last)
        for i in range(0, n, batch_size):
            if step == total_steps:
                break
            xb, yb = xp[i:i + batch_size], yp[i:i + batch_size]
            with autocast(precision, device_type):
                value = loss(model, xb, yb)
            opt.zero_grad(set_to_none=True)
            value.backward()
            if clip_grad is not None:
                nn.utils.clip_grad_norm_(params, clip_grad)
            opt.step()
            loss_sum += value.detach() * len(yb)
            seen += len(yb)
            step += 1
    return TrainStats(loss=float(loss_sum) / seen, steps=step, samples=seen)
