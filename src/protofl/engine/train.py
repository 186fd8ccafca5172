"""The one local training loop (of the sequential executor).

Every method trains through :func:`local_train`; methods change *what* is minimized
(the ``loss`` callable), *which* parameters move (``params``) and, optionally, the
gradient before the step (``grad``), never the loop. Batches are slices of a per-epoch
permutation of the client's in-memory tensors; :func:`batch_sizes` is the schedule of
their sizes, which the batched executor (``engine/batched.py``) follows too.
``precision="bf16"`` runs the loss (the forward pass) under bfloat16 autocast, backward
and the SGD step on the float32 weights (:mod:`protofl.engine.precision`).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..algorithms.base import TrainStats
from .precision import autocast

# the imperative form ``ctx.train`` takes: loss(model, x, y); the step's index is passed
# to a ``StepLoss`` (loss(model, x, y, step)), which ``ctx.fit`` uses
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
StepLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]


class NonFiniteLossError(FloatingPointError):
    """Local training produced a NaN/inf loss; carries the round and client."""

    def __init__(self, rnd: int, cid: int, value: float) -> None:
        self.rnd, self.cid, self.value = rnd, cid, value
        super().__init__(f"non-finite training loss ({value}) in round {rnd} on client {cid}")

    def __reduce__(self):  # survives the trip back from a worker process
        return (type(self), (self.rnd, self.cid, self.value))


def total_steps(n: int, batch_size: int, epochs: int, steps: Optional[int]) -> int:
    """SGD steps of a client with n samples: ``steps``, or ``epochs * ceil(n / batch_size)``."""
    if n == 0:
        return 0
    return steps if steps is not None else epochs * math.ceil(n / batch_size)


def batch_sizes(n: int, batch_size: int, total: int) -> list[int]:
    """The minibatch size of each of ``total`` steps: epochs cut into batches, the last of
    an epoch smaller when ``batch_size`` does not divide ``n``."""
    per_epoch = [min(batch_size, n - i) for i in range(0, n, batch_size)]
    return [per_epoch[s % len(per_epoch)] for s in range(total)] if n else []


def local_train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss: LossFn | StepLoss,
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
    grad: Optional[Callable[[list[torch.Tensor]], list[torch.Tensor]]] = None,
    step_loss: bool = False,
) -> TrainStats:
    """``epochs`` (or ``steps``) of SGD on ``loss`` over ``params``, in place.

    ``grad``: the minibatch gradients of ``params`` (in their order; zeros for a parameter
    the loss does not reach) -> the gradients the step uses, before clipping. With
    ``step_loss``, ``loss`` also receives the step's index (0, 1, ...).
    """
    params = [p for p in params if p.requires_grad]
    n = len(y)
    if n == 0 or not params:
        return TrainStats(loss=0.0, steps=0, samples=0)
    model.train()
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    total = total_steps(n, batch_size, epochs, steps)
    loss_sum = torch.zeros((), dtype=torch.float64, device=y.device)  # no host sync per step
    device_type = x.device.type
    seen = step = 0
    while step < total:
        perm = torch.randperm(n, generator=generator).to(y.device)  # CPU stream: same order on any device
        xp, yp = x[perm], y[perm]  # one gather per epoch; batches below are views
        if channels_last and xp.dim() == 4:
            xp = xp.contiguous(memory_format=torch.channels_last)
        for i in range(0, n, batch_size):
            if step == total:
                break
            xb, yb = xp[i:i + batch_size], yp[i:i + batch_size]
            with autocast(precision, device_type):
                value = loss(model, xb, yb, step) if step_loss else loss(model, xb, yb)
            opt.zero_grad(set_to_none=True)
            value.backward()
            if grad is not None:
                new = grad([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
                for p, g in zip(params, new):
                    p.grad = g
            if clip_grad is not None:
                nn.utils.clip_grad_norm_(params, clip_grad)
            opt.step()
            loss_sum += value.detach() * len(yb)
            seen += len(yb)
            step += 1
    return TrainStats(loss=float(loss_sum) / seen, steps=step, samples=seen)
