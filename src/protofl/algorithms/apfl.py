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
        alpha_i <- alpha_i - eta grad_alpha f_i(v-bar_i; xi) = <v_i - w_i, grad f_i(v-bar_i)>
      reply w_i; keep v_i, alpha_i
    server: w_{t+1} = sum_i (n_i / n) w_i   over the replies

One minibatch loss gives all three updates at once: CE(w(x)) + CE(v-bar(x)) with w held
constant inside v-bar (``apfl_loss``): w gets the gradient of its own loss only, v and
alpha those of the mixture's, by the chain rule exactly as above. The model carries v as
``model.v`` (a copy of the network, same initialization as w: v_i^0 = w^0) and alpha as
``model.alpha``, both personal (the client's state Record; never sent). The global model
(GM, GA) is w; the personalized model (PM, PA) is v-bar with the client's alpha.

Choices and deviations:
* alpha in [0, 1]: the forward pass mixes with clip(alpha, 0, 1) and lets the gradient
  through as if unclipped (a straight-through projection), and alpha is clipped to
  [0, 1] after every local update; the authors' code clips after each of its alpha steps.
* alpha, v and w all step with the run's optimizer (momentum, weight decay included;
  Algorithm 1 writes plain SGD with one step size eta). Weight decay pulls alpha towards
  0; the authors' code adds 0.02 alpha to alpha's gradient to the same effect.
* The authors' code (github.com/MLOPTPSU/FedTorch, ``apfl.py``) mixes the two models'
  *outputs*, alpha v(x) + (1 - alpha) w(x), updates alpha once per round and computes its
  gradient from the parameters' gradients; here the paper's parameter mixture and one alpha
  step per local step. PFLlib's APFL trains v on its own loss instead of the mixture's;
  not followed.
* ``alpha`` (initial alpha_i) = 0.5 as in the authors' README example; ``adaptive: false``
  keeps it fixed (the paper's fixed-alpha runs).
* The paper's text was not available while writing this module; the updates above are
  those of its Algorithm 1 (arXiv v3) as recalled and as the authors' code computes them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ..errors import require
from ..messages import Record
from .base import register
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
    alpha = model.alpha
    a = alpha + (alpha.clamp(0.0, 1.0) - alpha).detach()
    shared = {k: p for k, p in model.named_parameters() if not k.startswith((V, ALPHA))}
    mixed = {k: a * p + (1 - a) * shared[k].detach() for k, p in model.v.named_parameters()}
    return functional_call(model.v, mixed, (x,))


def apfl_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras) -> torch.Tensor:
    """f_i(w) + f_i(v-bar): w by its own loss, v and alpha by the mixture's."""
    return F.cross_entropy(model(x), y) + F.cross_entropy(mixed_logits(model, x), y)


class Mixture(nn.Module):
    """APFL's personalized predictor: the model with parameters v-bar."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixed_logits(self.model, x)


@register
class APFL(FedPer):
    name = "apfl"
    Hyper = APFLHyper
    has_global_model = True
    personal_prefixes = (V, ALPHA)

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model.v = copy.deepcopy(model)  # v^0 = w^0
        model.alpha = nn.Parameter(torch.tensor(float(self.hp.alpha)))
        return model

    async def local_training(self, weights, msg: Record, ctx):
        moving = None if self.hp.adaptive else ("body.", "head.", V)  # alpha fixed: out of the optimizer
        fitted = await ctx.fit(weights, apfl_loss, trainable=moving)
        fitted.weights[ALPHA].clamp_(0.0, 1.0)  # alpha_i stays in [0, 1]
        return fitted

    def personalized(self, model, msg: Record, ctx) -> nn.Module:
        return Mixture(model)
