"""FedDBE (Zhang, Hua, Cao, Wang, Song, Xue, Ma & Guan, NeurIPS 2023, "Eliminating Domain
Bias for Federated Learning in Representation Space"): FedAvg with the domain bias
eliminator DBE -- a personalized representation bias and a mean regularization.

    client i: representation z = f(x) (the body), personalized representation bias
              (PRBM) z-bar_i^p in R^d, a trainable vector that never leaves the client;
              the head sees z + z-bar_i^p
    mean regularization (MR): z-bar_i, the running mean of the local representations over
              the round's minibatches, z-bar_i <- (1 - mu) z-bar_i + mu mean_batch(z)
              (from 0 at the start of the round), is pulled to the global mean z-bar^g:
        L_i = CE(h(z + z-bar_i^p), y) + kappa * mean_d [ (z-bar_i - z-bar^g)^2 / 2 ]
    initialization period: the clients train plain FedAvg (CE(h(z), y)) and report
              z-bar_i; the server fixes z-bar^g = sum_i (n_i / n) z-bar_i once
    server: (f, h)_{t+1} = sum_i (n_i / n) (f, h)_i   over the replies
    personalized model (PM, PA): h(f(x) + z-bar_i^p); global model (GM, GA): h(f(x)),
    body and head without a bias (protofl's choice: the authors never evaluate a global
    model)

On the engine: ``adapt_model`` adds ``model.dbe`` with the parameter ``bias`` (the PRBM,
zeros at first) and the buffer ``running_mean`` (z-bar_i); both are personal (FedPer's
split, kept in the client's state Record). The running mean is reset to 0 when a round's
training starts and updated in place by the loss at every step (as BatchNorm updates its
statistics); its gradient flows through the current batch's mean only, as in the
authors' code. The initialization period is round 1 (the first round in which replies
arrive): its clients train without DBE and send z-bar_i (array ``mean``); z-bar^g stays
fixed from then on and is part of every later broadcast.

Defaults (the authors' Fashion-MNIST command, github.com/TsingZ0/DBE ``run_me.sh``):
kappa = 50, mu = 1 (z-bar_i = the current batch's mean). The code's defaults are kappa = 0
(no MR) and mu = 0.1.

Choices and deviations:
* The authors' initialization period is a separate pass in which *every* client trains
  once before round 1, and its trained weights are then discarded: nothing is aggregated,
  and ``send_models`` overwrites every client's model with the initial global model
  (``serverDBE.py``). Here round 1 is that period, a normal FedAvg round whose average is
  kept, and z-bar^g is the mean over the clients that arrived in it.
* A reply of the initialization period without z-bar_i (array ``mean``) is rejected, as
  is one that sends it later.
* The PRBM steps with the run's optimizer (the code: its own plain SGD at the same
  learning rate).
* The personalized model is evaluated after local training; the authors' code evaluates
  it at the start of a round, before local training.
* The paper's text was not available while writing this module; the method is stated from
  the authors' code and the paper's abstract.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast, Mapping, Optional, TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import require
from ..messages import Arrays, expect_shapes, Record
from .base import average, ClientContext, ClientResult, register, ServerContext, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer

if TYPE_CHECKING:
    from ..models.base import FLModel

DBE = "dbe."


@dataclass
class FedDBEHyper(FedAvgHyper):
    kappa: float = 50.0  # weight of the mean regularization
    momentum: float = 1.0  # mu of the running mean z-bar_i (1: the batch mean)

    def validate(self, section: str) -> None:
        require(self.kappa >= 0, f"{section}.kappa", self.kappa, "must be >= 0")
        require(0 < self.momentum <= 1, f"{section}.momentum", self.momentum, "must be in (0, 1]")


@dataclass
class FedDBEState(WeightsState):
    global_mean: Optional[torch.Tensor] = None  # z-bar^g (d,), fixed after the initialization period


class DomainBias(nn.Module):
    """The PRBM z-bar_i^p (a parameter) and the running mean z-bar_i (a buffer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))
        self.register_buffer("running_mean", torch.zeros(d))

    if TYPE_CHECKING:
        running_mean: torch.Tensor  # the buffer registered above


if TYPE_CHECKING:
    class DBEModel(FLModel):
        """The model :meth:`FedDBE.adapt_model` makes: the FLModel with the module ``dbe``."""

        dbe: DomainBias


class BiasedHead(nn.Module):
    """FedDBE's personalized predictor: h(f(x) + z-bar_i^p)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = cast("DBEModel", self.model)
        out: torch.Tensor = model.head(model.body(x) + model.dbe.bias)
        return out


def tracked_mean(model: nn.Module, z: torch.Tensor, mu: float) -> torch.Tensor:
    """z-bar_i <- (1 - mu) z-bar_i + mu mean(z): stored in the buffer, returned with the
    gradient of the batch's part."""
    dbe = cast("DBEModel", model).dbe
    rm = (1 - mu) * dbe.running_mean + mu * z.mean(0)
    with torch.no_grad():
        dbe.running_mean.copy_(rm.detach())
    return rm


@register
class FedDBE(FedPer[FedDBEState]):
    name = "feddbe"
    Hyper = FedDBEHyper
    has_global_model = True
    personal_prefixes = (DBE,)
    reply_arrays = ("mean",)  # z-bar_i, in the initialization period only
    couples_samples = True  # z-bar_i tracks the batch's mean feature, and the loss regularizes it

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model.dbe = DomainBias(cast("FLModel", model).feature_dim)
        return model

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedDBEState:
        return FedDBEState(ctx.init_weights())

    def configure(self, state: FedDBEState, rnd: int, ctx: ServerContext) -> Record:
        arrays: Arrays = {} if state.global_mean is None else {"global_mean": state.global_mean}
        return Record(weights=self.shared_part(state.weights), arrays=arrays)

    def aggregate(self, state: FedDBEState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedDBEState:
        new = super().aggregate(state, rnd, replies, ctx)
        if state.global_mean is None and replies:  # the initialization period: fix z-bar^g
            g = average((r for _, r in replies), self.hp.weighting,
                        part=lambda r: {"m": r.array("mean")})
            if g:
                new = dataclasses.replace(new, global_mean=g["m"])
        return new

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        if "global_mean" in sent.arrays:
            return "z-bar_i sent after the initialization period" if "mean" in reply.arrays else None
        if not isinstance(reply.arrays.get("mean"), torch.Tensor):  # aggregate fixes z-bar^g from it
            return "z-bar_i (array 'mean') missing from a reply of the initialization period"
        return expect_shapes(reply, mean=(self.info.feature_dim,))

    # -- client ------------------------------------------------------------------------------
    def init_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                  extras: Mapping[str, Any]) -> torch.Tensor:
        """The initialization period: plain CE, z-bar_i tracked."""
        net = cast("DBEModel", model)
        z: torch.Tensor = net.body(x)
        tracked_mean(model, z, self.hp.momentum)
        return F.cross_entropy(net.head(z), y)

    def dbe_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                 extras: Mapping[str, Any]) -> torch.Tensor:
        """CE(h(z + z-bar_i^p), y) + kappa mean_d (z-bar_i - z-bar^g)^2 / 2."""
        net = cast("DBEModel", model)
        z: torch.Tensor = net.body(x)
        rm = tracked_mean(model, z, self.hp.momentum)
        reg = (0.5 * (rm - extras["global_mean"]) ** 2).mean()
        return cast(torch.Tensor, F.cross_entropy(net.head(z + net.dbe.bias), y) + self.hp.kappa * reg)

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it (the initial personal entries)
        personal = dict(state.weights)
        personal[DBE + "running_mean"] = torch.zeros_like(personal[DBE + "running_mean"])  # reset per round
        weights = {**msg.weights, **personal}
        g = msg.arrays.get("global_mean")
        if g is None:
            fitted = await ctx.fit(weights, self.init_loss, trainable=("body.", "head."))
            arrays: Arrays = {"mean": fitted.weights[DBE + "running_mean"]}
        else:
            fitted = await ctx.fit(weights, self.dbe_loss, extras={"global_mean": g})
            arrays = {}
        w = fitted.weights
        reply = Record(weights=self.shared_part(w), arrays=arrays)
        return ClientResult(reply, state=Record(weights=self.personal_part(w)),
                            personal=BiasedHead(ctx.shared_model(w)))
