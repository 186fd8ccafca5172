"""Prototype inversion: the input whose features match a sent prototype, a probe of what a
class mean leaks (docs/privacy.md, "What a prototype leaks").

A server that knows the feature map f a client used (FedNH, MP-FedCL and ReBaFL send their
weights beside their prototypes) and receives that client's class prototype p (the mean of f
over the client's samples of the class) can look for

    x^ = argmin_x  ||f(x) - p||^2 / ||p||^2  +  lambda * TV(x),   x within the inputs' range,

the feature-matching inversion of Mahendran & Vedaldi (CVPR 2015, "Understanding Deep Image
Representations by Inverting Them": their normalized loss, and their total-variation
regularizer with beta = 2, here the mean squared difference of neighbouring pixels). Behind
a prototype of one or a few samples, x^ resembles those samples; differential privacy on
the prototype (``privacy.mode: sample``: DP-SGD and a private release) bounds how much it can.

Plain tensors only: :func:`total_variation` and :func:`invert_features`; the experiment that
measures the leak is benchmarks/privacy/inversion.py.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """(B,) mean squared difference of vertically and horizontally neighbouring entries of
    each image in x (B, C, H, W): the TV prior with beta = 2, averaged over the differences."""
    dv = (x[:, :, 1:, :] - x[:, :, :-1, :]) ** 2
    dh = (x[:, :, :, 1:] - x[:, :, :, :-1]) ** 2
    return (dv.flatten(1).sum(1) + dh.flatten(1).sum(1)) / (dv[0].numel() + dh[0].numel())


def invert_features(f: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor, start: torch.Tensor,
                    steps: int = 300, lr: float = 0.05, tv: float = 0.0, low: Optional[float] = None,
                    high: Optional[float] = None, modules: tuple[nn.Module, ...] = ()) -> torch.Tensor:
    """(B, ...) inputs x^ whose features f(x^) approach ``targets`` (B, d), by Adam on
    ||f(x) - target||^2 / ||target||^2 + ``tv`` * TV(x) summed over the batch (a zero target
    is taken as norm 1), from ``start`` (B, ...), each step followed by clamping x to
    [``low``, ``high``] (the inputs' range). Only x is trained: ``modules`` (the parameters behind f) are frozen during the search and left as
    they were (values, requires_grad and train/eval mode)."""
    if steps < 0 or lr <= 0 or tv < 0:
        raise ValueError(f"invert_features: steps={steps}, lr={lr}, tv={tv}: need steps >= 0, lr > 0, tv >= 0")
    if targets.shape[0] != start.shape[0]:
        raise ValueError(f"invert_features: {targets.shape[0]} targets for {start.shape[0]} starts")
    params = [p for m in modules for p in m.parameters()]
    grads = [p.requires_grad for p in params]
    modes = [m.training for m in modules]
    for p in params:
        p.requires_grad_(False)
    for m in modules:
        m.eval()
    try:
        x = start.detach().clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr)
        scale = (targets ** 2).sum(1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = ((f(x) - targets) ** 2).sum(1) / scale
            if tv and x.dim() == 4:
                loss = loss + tv * total_variation(x)
            loss.sum().backward()
            opt.step()
            if low is not None or high is not None:
                with torch.no_grad():
                    x.clamp_(low, high)
        return x.detach()
    finally:
        for p, g in zip(params, grads):
            p.requires_grad_(g)
        for m, mode in zip(modules, modes):
            m.train(mode)
