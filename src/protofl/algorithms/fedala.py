"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, AAAI 2023, "FedALA: Adaptive Local
Aggregation for Personalized Federated Learning"), Algorithm 1.

Before local training, client i mixes the received global model Theta into its old local
model Theta_i element by element, with weights W_i it learns (adaptive local aggregation,
ALA):

    Theta^_i = Theta_i + (Theta - Theta_i) (.) W_i   on the top p layers
    Theta^_i = Theta                                  on the lower layers
    W_i <- clip(W_i - eta grad_{W_i} L(Theta^_i; D_i^s), 0, 1),     (weight learning)
            grad_{W_i} L = grad_{Theta^_i} L (.) (Theta - Theta_i)
    on D_i^s, a random s% of the local data; W_i starts at all ones. The first time ALA
    runs, W_i is trained epoch after epoch until the standard deviation of the last
    ``num_pre_loss`` epoch losses is below ``threshold``; afterwards one epoch per round.

    server: send Theta_t to the sampled clients S_t
    client i: Theta^_i by ALA; Theta_i <- E epochs of SGD on CE from Theta^_i; reply Theta_i,
              keep Theta_i and W_i
    server: Theta_{t+1} = sum_i (n_i / n) Theta_i   over the replies

How it runs on the engine: each ALA epoch is one ``ctx.fit`` in which the model's top-p
parameter slots hold W_i (they have its shapes; the lower layers hold Theta and are
frozen) and the loss builds Theta^_i from them. The loss computes g = grad_W L with
``torch.func`` and hands the optimizer the direction (W - clip(W - eta g, 0, 1)) / eta
(``nn.inner.projected_direction``); the call runs plain SGD with step eta (no momentum,
weight decay or clipping), so each step is the projected step exactly. The fit takes
ceil(int(s% n_i) / B) steps of the engine's full minibatches of B (its permutation of the
epoch): about s% of the data, up to B - 1 samples more, and all of it for a client with
n_i <= B (the authors' code: exactly int(s% n_i) samples, a last batch shorter). The ALA
loss is the plain cross-entropy.

State: Theta_i (all weights) and W_i (an array group ``W``) in the client's state Record.
Personalized model (PM, PA): Theta_i after local training; global model (GM, GA): Theta.

Defaults (paper and the authors' code, github.com/TsingZ0/FedALA): eta = 1.0, s = 80,
``layer_idx`` = 2 parameter tensors counted from the top (the head's weight and bias:
the code's p, finer than the paper's layers), threshold = 0.01 (the paper's, per the
authors' README; the code's default is 0.1), num_pre_loss = 10.

Choices and deviations:
* ALA runs at a client's turn only (before its local training); the authors'
  ``send_models`` (``serverALA.py``) runs it on every client every round, sampled or not,
  so a client's Theta_i and W_i also move in the rounds it does not train.
* A client's first participation skips ALA (Theta_i = Theta, nothing to mix), also when it
  is first sampled after round 1; the authors' code then mixes Theta into the run's
  *initial* model. The start phase (training W to convergence) is its next participation.
* The start phase stops after at most ``max_init_epochs`` epochs (not in the paper or the
  code, which can loop for ever: the authors' README warns about this).
* Each ALA epoch draws its own random s% of the data; the code uses one contiguous random
  window of the data for all epochs of a round. The convergence test uses each epoch's
  mean loss (the code: its last batch's loss).
* BatchNorm statistics of Theta^_i (models with BatchNorm) are Theta's (the code: Theta_i's
  own, as its ALA touches ``parameters()`` only).
* The personalized model is evaluated after local training; the authors' code evaluates
  it at the start of a round, after ALA and before local training.
* The paper's text was not available while writing this module (hence no equation
  numbers); ALA above is lines 6-16 of its Algorithm 1 as the authors' code implements it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch import nn

from ..errors import require
from ..messages import Record
from ..nn.inner import loss_grad_and_value, projected_direction, with_gradient
from .base import ClientContext, ClientResult, register, trainable_names, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedALAHyper(FedAvgHyper):
    eta: float = 1.0  # step of the weight learning
    rand_percent: float = 80.0  # s: the share of the local data ALA learns on, in percent
    layer_idx: int = 2  # p: ALA on this many parameter tensors counted from the top
    threshold: float = 0.01  # start phase: stop when std(last losses) < threshold
    num_pre_loss: int = 10  # ... over this many epoch losses
    max_init_epochs: int = 50  # start phase: at most this many epochs (protofl's cap)

    def validate(self, section: str) -> None:
        require(self.eta > 0, f"{section}.eta", self.eta, "must be > 0")
        require(0 < self.rand_percent <= 100, f"{section}.rand_percent", self.rand_percent, "must be in (0, 100]")
        require(self.layer_idx >= 1, f"{section}.layer_idx", self.layer_idx, "must be >= 1")
        require(self.threshold > 0, f"{section}.threshold", self.threshold, "must be > 0")
        require(self.num_pre_loss >= 2, f"{section}.num_pre_loss", self.num_pre_loss, "must be >= 2")
        require(self.max_init_epochs >= 1, f"{section}.max_init_epochs", self.max_init_epochs, "must be >= 1")


def local_aggregation(local: Mapping[str, torch.Tensor], glob: Mapping[str, torch.Tensor],
                      W: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Theta_i + (Theta - Theta_i) (.) W_i, entry by entry."""
    return {k: local[k] + (glob[k] - local[k]) * W[k] for k in W}


@register
class FedALA(FedAvg[WeightsState]):
    name = "fedala"
    family = "personalization"
    Hyper = FedALAHyper
    # ALA's step is a projected direction, nonlinear in the batch's gradient: per-sample
    # clipping and averaging would change it, and noise would push W_i out of [0, 1]
    couples_samples = True

    def ala_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
        """L(Theta^_i) with the gradient that makes one plain SGD step of size eta the
        projected step of the weight learning; the model's top parameter slots hold W_i."""
        local, glob = extras["local"], extras["global"]
        W = {k: p for k, p in model.named_parameters() if k in local}

        g, value = loss_grad_and_value(model, W, x, y, lambda w: local_aggregation(local, glob, w))
        return with_gradient(value, W, projected_direction(W, g, self.hp.eta))

    async def adaptive_local_aggregation(self, theta: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor],
                                         W: Mapping[str, torch.Tensor], started: bool,
                                         ctx: ClientContext) -> dict[str, torch.Tensor]:
        """Learn W_i (one epoch, or the start phase) and return it."""
        hp = self.hp
        top = list(W)
        B = ctx.training_settings().batch_size
        steps = max(1, math.ceil(int(hp.rand_percent / 100 * ctx.num_samples) / B))  # one pass over s% of D_i
        extras = {"local": {k: local[k] for k in top}, "global": {k: theta[k] for k in top}}
        weights, losses = {**theta, **W}, []
        for _ in range(1 if started else hp.max_init_epochs):
            fitted = await ctx.fit(weights, self.ala_loss, extras=extras, trainable=tuple(top), steps=steps,
                                   lr=hp.eta, momentum=0.0, weight_decay=0.0, clip_grad=None, optimizer="sgd",
                                   report=False)
            weights = fitted.weights
            losses.append(fitted.stats.loss)
            if len(losses) > hp.num_pre_loss and np.std(losses[-hp.num_pre_loss:]) < hp.threshold:
                break
        return {k: weights[k] for k in top}

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        theta = msg.weights
        top = trainable_names(ctx.architecture)[-self.hp.layer_idx:]
        if state is None:  # first participation: Theta_i = Theta, W_i = 1, no ALA yet
            start, W, started = theta, {k: torch.ones_like(theta[k]) for k in top}, False
        else:
            local, W = state.weights, state.group("W")  # a group it stored itself
            W = await self.adaptive_local_aggregation(theta, local, W, bool(state.config["started"]), ctx)
            start, started = {**theta, **local_aggregation(local, theta, W)}, True
        fitted = await ctx.fit(start)  # E epochs of SGD on CE from Theta^_i
        state = Record(weights=fitted.weights, arrays={"W": W}, config={"started": started})
        return ClientResult(Record(weights=fitted.weights), state=state, personal=ctx.shared_model(fitted.weights))
