"""APFL (Deng, Kamani & Mahdavi, 2020, "Adaptive Personalized Federated Learning",
arXiv:2003.13461), Algorithm 1 with the adaptive mixing parameter.

Each client i keeps a local model v_i and a mixing weight alpha_i in [0, 1]; its
personalized model is the mixture of parameters

    v-bar_i = alpha_i v_i + (1 - alpha_i) w_i

    server: send w_t to the sampled clients S_t
    client i: w_i <- w_t; at every local step, on one minibatch xi and all at the
              iterates of the previous step:
        w_i     <- w_i     - eta grad f_i(w_i; xi)                       (local copy of w)
        v_i     <- v_i     - eta grad_v f_i(v-bar_i; xi)  = alpha_i grad f_i(v-bar_i)
        alpha_i <- clip(alpha_i - eta grad_alpha f_i(v-bar_i; xi), 0, 1),
                   grad_alpha f_i(v-bar_i; xi) = <v_i - w_i, grad f_i(v-bar_i)>
      reply w_i; keep v_i, alpha_i
    server: w_{t+1} = sum_i (n_i / n) w_i   over the replies

One minibatch loss gives all three updates at once: CE(w(x)) + CE(v-bar(x)) with w held
constant inside v-bar (``apfl_loss``): w gets the gradient of its own loss only, v and
alpha those of the mixture's, by the chain rule exactly as above. alpha's gradient g is
then replaced by the projected direction (alpha - clip(alpha - eta g, 0, 1)) / eta
(``projected_alpha``, the fit's gradient transform, after DP-SGD's noise where there is
one): the optimizer's plain SGD step along it lands on clip(alpha - eta g, 0, 1).
The model carries v as ``model.v`` (a copy of the network, same initialization as w:
v_i^0 = w^0) and alpha as ``model.alpha``, both personal (the client's state Record; never
sent). The global model (GM, GA) is w; the personalized model (PM, PA) is v-bar with the
client's alpha.

Choices and deviations:
* alpha in [0, 1]: alpha is projected onto [0, 1] after every local step, as the authors'
  ``alpha_update`` clips after each of its alpha steps. The projection is exact for the
  default plain SGD (``training.momentum=0``, ``weight_decay=0``, ``optimizer: sgd``;
  ``clip_grad`` keeps it inside [0, 1]); with momentum, weight decay or Adam the step
  along the projected direction can leave [0, 1], so the forward pass mixes with
  clip(alpha, 0, 1) (gradient straight through) and alpha is clipped once more after the
  round. (Until this was changed, alpha was clipped only after the round and could leave
  [0, 1] within it: once below 0, v's gradient clip(alpha) grad f was zero.)
* alpha, v and w all step with the run's optimizer (momentum, weight decay included;
  Algorithm 1 writes plain SGD with one step size eta). Weight decay pulls alpha towards
  0; the authors' code adds 0.02 alpha to alpha's gradient to the same effect.
* The authors' code (github.com/MLOPTPSU/FedTorch, ``apfl.py``) mixes the two models'
  *outputs*, alpha v(x) + (1 - alpha) w(x), updates alpha once per round and computes its
  gradient from the parameters' gradients; here the paper's parameter mixture and one alpha
  step per local step. PFLlib's APFL trains v on its own loss instead of the mixture's;
  not followed.
* ``alpha`` (initial alpha_i) = 0.5 as in the authors' README example; alpha is adaptive
  by default (``adaptive: true``), whereas that example runs a fixed alpha (the code's
  ``fed_adaptive_alpha`` defaults to False); ``adaptive: false`` keeps it fixed (the
  paper's fixed-alpha runs and the authors' example).
* ``weighting``: FedAvg's n_i-weighted mean (the box above) by default; the authors'
  centered ``fedavg_aggregation`` averages with 1/num_online_clients (their distributed
  one by the clients' sample shares): ``weighting: uniform`` is the centered code's.
* The paper's text was not available while writing this module; the updates above are
  those of its Algorithm 1 (arXiv v3) as recalled and as the authors' code computes them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast, Mapping

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ..errors import require
from ..messages import Record
from ..nn.inner import projected_direction
from .base import ClientContext, Fitted, register, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer

V, ALPHA = "v.", "alpha"


@dataclass
class APFLHyper(FedAvgHyper):
    alpha: float = 0.5  # alpha_i at the start
    adaptive: bool = True  # learn alpha_i (else it stays at ``alpha``)

    def validate(self, section: str) -> None:
        require(0.0 <= self.alpha <= 1.0, f"{section}.alpha", self.alpha, "must be in [0, 1]")


def mixed_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """v-bar(x) with v-bar = a v + (1 - a) sg(w), a = clip(alpha, 0, 1) with a straight-through
    gradient: the personalized model's logits."""
    alpha = cast(torch.Tensor, model.alpha)
    a = alpha + (alpha.clamp(0.0, 1.0) - alpha).detach()
    shared = {k: p for k, p in model.named_parameters() if not k.startswith((V, ALPHA))}
    v = cast(nn.Module, model.v)
    mixed = {k: a * p + (1 - a) * shared[k].detach() for k, p in v.named_parameters()}
    return cast(torch.Tensor, functional_call(v, mixed, (x,)))


def apfl_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
    """f_i(w) + f_i(v-bar): w by its own loss, v and alpha by the mixture's."""
    return F.cross_entropy(model(x), y) + F.cross_entropy(mixed_logits(model, x), y)


def projected_alpha(grads: dict[str, torch.Tensor], extras: Mapping[str, Any],
                    params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fit's gradient transform: alpha's gradient g becomes (alpha - clip(alpha - eta g,
    0, 1)) / eta (eta = ``extras["lr"]``), so that a plain SGD step projects alpha onto
    [0, 1]; the other gradients pass unchanged."""
    if ALPHA not in grads:  # alpha fixed (adaptive: false)
        return grads
    d = projected_direction({ALPHA: params[ALPHA]}, {ALPHA: grads[ALPHA]}, extras["lr"])
    return {**grads, **d}


class Mixture(nn.Module):
    """APFL's personalized predictor: the model with parameters v-bar."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixed_logits(self.model, x)


@register
class APFL(FedPer[WeightsState]):
    name = "apfl"
    Hyper = APFLHyper
    has_global_model = True
    personal_prefixes = (V, ALPHA)

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model.v = copy.deepcopy(model)  # v^0 = w^0
        model.alpha = nn.Parameter(torch.tensor(float(self.hp.alpha)))
        return model

    async def local_training(self, weights: dict[str, torch.Tensor], msg: Record, ctx: ClientContext) -> Fitted:
        moving = None if self.hp.adaptive else ("body.", "head.", V)  # alpha fixed: out of the optimizer
        lr = torch.tensor(float(ctx.lr), device=ctx.data[1].device)
        fitted = await ctx.fit(weights, apfl_loss, trainable=moving, grad=projected_alpha, extras={"lr": lr})
        fitted.weights[ALPHA].clamp_(0.0, 1.0)  # (a no-op for plain SGD: the steps projected alpha already)
        return fitted

    def personalized(self, model: nn.Module, msg: Record, ctx: ClientContext) -> nn.Module:
        return Mixture(model)
