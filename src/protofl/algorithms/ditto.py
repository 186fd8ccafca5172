"""Ditto (Li, Hu, Beirami & Smith, ICML 2021, "Ditto: Fair and Robust Federated Learning
Through Personalization"), Algorithm 1 with FedAvg as the global solver.

    server: send w_t to the sampled clients S_t
    client k:
      w_k <- E epochs of SGD on F_k(w), starting from w_t              (global, = FedAvg)
      v_k <- ``personal_epochs`` epochs of SGD on
                 h_k(v; w_t) = F_k(v) + (lam / 2) ||v - w_t||^2                 (eq. 2)
             i.e. v <- v - eta (grad F_k(v) + lam (v - w_t)), from the client's own v_k
      reply w_k; keep v_k
    server: w_{t+1} = sum_k (n_k / n) w_k   over the replies that arrived

Shared: the whole model w (FedAvg). Personal: v_k, a full model in the client's state
Record, starting from the run's initial weights w_0 (Algorithm 1 initializes v_k^0 = w^0)
for a client that was never sampled. The proximal term anchors v to the *received*
global model w_t (not to w_k after the local update) and runs over all trainable
parameters; buffers (BatchNorm statistics) follow v's own batches. Global model (GM,
GA): w. Personalized model (PM, PA): v_k after its update. The reported train loss is
that of the personal objective h_k.

Defaults and deviations:
* ``lam`` defaults to 0.1; the paper tunes it per dataset from {0.01, 0.1, 1, 2}; the
  FedNH paper uses 0.75 (its configs: "follows the setting of FedRep") with its own Ditto
  (github.com/Yutong-Dai/FedNH, ``strategies/Ditto.py``), which anchors v to the client's
  locally trained w_k rather than to the received w_t and steps with plain SGD (no
  momentum or weight decay, gradients clipped at norm 10), so 0.75 there is not the same
  regularization strength as 0.75 here.
* ``personal_epochs`` defaults to the run's ``training.epochs`` (the paper's s local
  iterations on v are as many as those on w).
* The optimizer for v is the run's (momentum and weight decay included); Algorithm 1
  writes plain SGD steps on h_k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch.nn import functional as F

from ..errors import require
from ..messages import Record
from ..models.base import FLModel
from ..nn.losses import proximal
from .base import ClientContext, ClientResult, register, weights_of, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class DittoHyper(FedAvgHyper):
    lam: float = 0.1  # weight of the proximal term toward w_t
    personal_epochs: Optional[int] = None  # epochs on v (None: training.epochs)

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")
        require(self.personal_epochs is None or self.personal_epochs >= 1, f"{section}.personal_epochs",
                self.personal_epochs, "must be >= 1 (or null: training.epochs)")


@register
class Ditto(FedAvg[WeightsState]):
    name = "ditto"
    family = "personalization"
    Hyper = DittoHyper
    hp: DittoHyper

    def client_init(self, ctx: ClientContext) -> Record:
        return Record(weights=weights_of(ctx.shared_model()))  # v_k^0 = w^0

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it (v_k^0)
        w_t = msg.weights
        w_k = await ctx.fit(w_t)  # the global solver's local update (FedAvg)
        reply = Record(weights=w_k.weights)
        epochs = {} if self.hp.personal_epochs is None else {"epochs": self.hp.personal_epochs}
        anchor = {k: w_t[k] for k in ctx.trainable(w_t)}
        v_k = await ctx.fit(state.weights, self.personal_loss, extras={"w_t": anchor}, **epochs)  # eq. 2, from v_k
        return ClientResult(reply, state=Record(weights=v_k.weights), personal=ctx.shared_model(v_k.weights))

    def private_fits(self, evaluating: bool, final: bool = False) -> list[dict[str, Any]]:
        """The global solver's update and the personal model's (eq. 2), every turn."""
        return [{}, {} if self.hp.personal_epochs is None else {"epochs": self.hp.personal_epochs}]

    def personal_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                      extras: Mapping[str, Any]) -> torch.Tensor:
        """h_k(v; w_t) = CE + (lam / 2) sum ||v - w_t||^2 over the trainable parameters (eq. 2)."""
        return F.cross_entropy(model(x), y) + 0.5 * self.hp.lam * proximal(model, extras["w_t"])
