"""FedAwS, Federated Averaging with Spreadout (Yu, Rawat, Menon & Kumar, ICML 2020,
"Federated Learning with Only Positive Labels"), in the form the label-skew literature runs
it as a baseline.

    client k: FedAvg's, E epochs of SGD on the cross entropy from w_t
    server:   w_{t+1} = FedAvg's average (then ``algorithm.server_opt``, if any), and then
              ``spread_steps`` steps of SGD (lr ``spread_lr``, momentum ``spread_momentum``)
              on the classifier rows W = (w_1 .. w_C) (``head.weight``) alone:
                  reg_sp(W) = 1/C^2 sum_c sum_{c' != c} max(0, nu - d(w_c, w_c'))^2
                  d(u, v)   = (1 - cos(u, v)) / 2                  (in [0, 1]; nu = ``margin``)
    global model: w_{t+1} with the spread-out W

The paper's setting is one class per client, with no negatives: there its clients train on
a positive-only loss and only the server's spreadout keeps the class embeddings from
collapsing into one point. Under label skew a client has several classes, so negatives, and
the label-skew implementations run it as above, FedAvg's clients and the spreadout on the
server: the code of FedRS's authors (Li & Zhan, KDD 2021; FedRS also targets clients that
miss classes), and fluke's. The positive-only client loss is not offered.

What it rests on: the paper's abstract (the server "imposes a geometric regularizer after
each round to encourage classes to be spreadout in the embedding space"); its regularizer,
the squared hinge on the distances between class embeddings summed over the pairs of
classes, as quoted by later work; and two implementations read for this module, the FedRS
authors' (github.com/lxcnju/FedRepo) and fluke's (github.com/makgyver/fluke,
fluke/algorithms/fedaws.py). The paper's full text was not at hand, so no equation numbers
are cited. Defaults are fluke's: margin 0.5 on the halved cosine distance (pairs pushed to
cos <= 0), 100 steps, lr 0.1, momentum 0.9, a fresh optimizer every round (FedRepo fixes
the momentum, 0.9, and takes the others as arguments).

Choices and deviations:
* Mean over the C x C pairs (both implementations'), not the paper's sum: a factor C^2 the
  step size absorbs. The diagonal (c' = c), a constant in both implementations, is left
  out: the same gradient.
* W is spread after the average and the server optimizer (FedAvgM, FedAdam, ...); the
  bias, if any, is not touched; the rows are written back unnormalized (as both do). The
  regularizer's value after the last step is logged as ``spreadout`` (without the diagonal's
  constant margin^2 / C, so below the two implementations' loss values by that much).
* The paper's server takes one step of size lambda * eta; the label-skew implementations
  take ``spread_steps`` steps of their own optimizer; we follow them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from ..errors import require
from .base import register, ServerContext, WeightsState
from .fedavg import FedAvg, FedAvgHyper

W = "head.weight"  # the classifier rows (C, d) inside the model's state dict


@dataclass
class FedAwSHyper(FedAvgHyper):
    margin: float = 0.5  # nu, on d = (1 - cos) / 2
    spread_steps: int = 100
    spread_lr: float = 0.1
    spread_momentum: float = 0.9

    def validate(self, section: str) -> None:
        require(0 < self.margin <= 1, f"{section}.margin", self.margin, "must be in (0, 1] (d lies in [0, 1])")
        require(self.spread_steps >= 0, f"{section}.spread_steps", self.spread_steps, "must be >= 0")
        require(self.spread_lr > 0, f"{section}.spread_lr", self.spread_lr, "must be > 0")
        require(0 <= self.spread_momentum < 1, f"{section}.spread_momentum", self.spread_momentum, "must be in [0, 1)")


def spreadout(w: torch.Tensor, margin: float) -> torch.Tensor:
    """reg_sp(W): the mean over the C x C pairs (c, c'), c != c', of max(0, margin - d)^2 with
    d = (1 - cos(w_c, w_c')) / 2 the halved cosine distance of the rows of ``w`` (C, d)."""
    u = F.normalize(w, dim=1)
    d = 0.5 * (1.0 - u @ u.T)
    off = ~torch.eye(len(w), dtype=torch.bool, device=w.device)
    return (F.relu(margin - d)[off] ** 2).sum() / len(w) ** 2


def spread_out(w: torch.Tensor, margin: float, steps: int, lr: float, momentum: float) -> tuple[torch.Tensor, float]:
    """``steps`` steps of SGD with momentum on :func:`spreadout` from ``w`` (a fresh optimizer);
    returns the new rows and the regularizer's value at them."""
    p = torch.nn.Parameter(w.detach().clone().float())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(spreadout(p, margin))
        opt.step()
    with torch.no_grad():
        return p.detach().to(w.dtype), float(spreadout(p, margin))


@register
class FedAwS(FedAvg[WeightsState]):
    name = "fedaws"
    family = "fixed and calibrated heads"
    Hyper = FedAwSHyper

    def server_update(self, state: WeightsState, x_bar: Mapping[str, torch.Tensor],
                      ctx: ServerContext) -> WeightsState:
        state = super().server_update(state, x_bar, ctx)  # FedAvg's average, then the server optimizer
        hp = self.hp
        w, reg = spread_out(state.weights[W], hp.margin, hp.spread_steps, hp.spread_lr, hp.spread_momentum)
        ctx.log("spreadout", reg)
        return dataclasses.replace(state, weights={**state.weights, W: w})

    def class_vectors(self, state: WeightsState) -> Optional[torch.Tensor]:
        return state.weights[W]  # the classifier rows, for the geometry logs
