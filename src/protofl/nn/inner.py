"""Inner steps inside a local objective: the shared math of pFedMe, Per-FedAvg and FedALA.

Some methods take gradient steps *inside* one step of local training: pFedMe solves its
Moreau-envelope problem by K steps of gradient descent on the minibatch, Per-FedAvg
evaluates the loss after a one-step adaptation, FedALA learns its aggregation weights by
projected gradient descent. Written as functions of a model's parameters, those steps
run inside ``loss(model, x, y, extras)`` (``algorithms/base.py``) with ``torch.func``,
so both executors run them: the sequential one on the live model, the batched one under
``vmap`` on every client's slice of the stack (``torch.func`` transforms nest).

* :func:`parameters_of`: the parameters the loss sees, by name (in the batched executor,
  the slot's own);
* :func:`loss_grad_and_value`, :func:`loss_grad`: the gradient of the cross-entropy at given
  parameters (or at a function of them), as constants;
* :func:`with_gradient`: a scalar with a given value whose gradient is a given direction
  (an update rule that is not the gradient of the reported loss);
* :func:`projected_direction`: the direction that turns one plain SGD step into projected
  gradient descent onto a box;
* :func:`split_batch`: one minibatch cut into independent parts (Per-FedAvg's D, D', D'').
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

Params = dict[str, torch.Tensor]


def parameters_of(model: nn.Module, prefixes: Optional[Sequence[str]] = None) -> Params:
    """The model's parameters by name (those under one of ``prefixes``, when given). Inside a
    loss these are the tensors training differentiates: the live parameters, or a slot's."""
    keep = None if prefixes is None else tuple(prefixes)
    return {k: p for k, p in model.named_parameters() if keep is None or k.startswith(keep)}


def detached(params: Mapping[str, torch.Tensor]) -> Params:
    return {k: v.detach() for k, v in params.items()}


def cross_entropy_at(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
    """CE of the model with ``params`` in place of its own parameters of those names."""
    return F.cross_entropy(functional_call(model, dict(params), (x,)), y)


def loss_grad_and_value(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                        transform: Optional[Callable[[Params], Params]] = None) -> tuple[Params, torch.Tensor]:
    """(grad_theta L, L) at theta = ``params``, as constants (no graph back to ``params``), for
    L(theta) = CE(model_{transform(theta)}(x), y) (``transform``: None = the identity): one
    forward and one backward pass. The model's buffers enter as inputs of the transformed
    function, so BatchNorm's running statistics follow this forward pass as they would any
    other (``torch.func`` refuses to mutate a tensor the function did not receive)."""
    def f(p: Params, buffers: Params) -> torch.Tensor:
        q = p if transform is None else transform(p)
        return F.cross_entropy(functional_call(model, {**q, **buffers}, (x,)), y)

    return grad_and_value(f)(detached(params), dict(model.named_buffers()))


def loss_grad(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
              y: torch.Tensor) -> Params:
    """grad_theta CE(model_theta(x), y) at theta = ``params``, as constants."""
    return loss_grad_and_value(model, params, x, y)[0]


def with_gradient(value: torch.Tensor, params: Mapping[str, torch.Tensor],
                  direction: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A scalar equal to ``value`` whose gradient with respect to ``params`` is ``direction``
    (and nothing else): ``sg(value) + sum_k <p_k - sg(p_k), sg(d_k)>``. The optimizer then
    steps along ``direction`` while the reported loss is ``value``."""
    out = value.detach()
    for k, p in params.items():
        out = out + ((p - p.detach()) * direction[k].detach()).sum()
    return out


def projected_direction(W: Mapping[str, torch.Tensor], g: Mapping[str, torch.Tensor], lr: float,
                        lo: float = 0.0, hi: float = 1.0) -> Params:
    """(W - clip(W - lr g, lo, hi)) / lr: plain SGD with step ``lr`` along it lands on
    clip(W - lr g, lo, hi), one step of projected gradient descent onto [lo, hi]."""
    return {k: (W[k].detach() - torch.clamp(W[k].detach() - lr * g[k], lo, hi)) / lr for k in W}


def split_batch(x: torch.Tensor, y: torch.Tensor, parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A minibatch of b samples as ``parts`` disjoint pieces of b // parts samples (the last
    takes the remainder); a batch smaller than ``parts`` is used whole by every piece. The
    cut depends on the batch's size only, never on its values."""
    b = len(y)
    n = b // parts
    if n == 0:
        return [(x, y)] * parts
    cuts = [i * n for i in range(parts)] + [b]
    return [(x[cuts[i]:cuts[i + 1]], y[cuts[i]:cuts[i + 1]]) for i in range(parts)]
