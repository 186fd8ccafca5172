"""FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data"), Algorithm 1.

    server: send w_t to the sampled clients S_t
    client k: w_k <- E epochs of minibatch SGD on its data, starting from w_t
    server: w_{t+1} = sum_k (n_k / n) w_k   over the replies that arrived

``weighting: uniform`` replaces n_k / n by 1 / |S_t|. BatchNorm statistics are averaged
like weights; integer buffers take the maximum. Personalized model (for PM/PA
metrics): the client's model right after local training, as in the FedNH paper.

Subclasses whose clients train with adjusted logits (FedRS, FedLC, BSM-FedAvg) define
``logit_adjustment_parts``: the local loss is the cross-entropy of the adjusted logits, and the
personalized model predicts with the same adjusted logits (the client's local softmax,
named ``local``), next to the plain logits (``@logits``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..messages import Record, prefixed
from .base import Algorithm, BatchPlan, ClientResult, cross_entropy_loss, weighted_mean, weights_of


@dataclass
class FedAvgHyper:
    weighting: Literal["samples", "uniform"] = "samples"


@dataclass
class WeightsState:
    weights: dict[str, torch.Tensor]


class AdjustedLogits(nn.Module):
    """A personalized predictor: ``adjust(model(x))``, the softmax the client trained with."""

    def __init__(self, model: nn.Module, adjust: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.adjust = model, adjust

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adjust(self.model(x))


def _functional_ce(forward, params, x, y, extras):
    return F.cross_entropy(forward(x), y)  # = cross_entropy_loss


class _AdjustedCE:
    """``local_loss`` with a logit adjustment, as a pure function of the client's tensor."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, forward, params, x, y, extras):
        return F.cross_entropy(self.fn(forward(x), extras["adjust"]), y)


class FedAvg(Algorithm):
    name = "fedavg"
    Hyper = FedAvgHyper
    reply_arrays = ("w.*",)

    def server_init(self, ctx) -> WeightsState:
        return WeightsState(ctx.init_weights())

    def configure(self, state: WeightsState, rnd, cid, ctx) -> Record:
        return Record(arrays=prefixed("w.", state.weights))

    # -- client ------------------------------------------------------------------------------
    def logit_adjustment_parts(self, ctx) -> Optional[tuple[Callable, torch.Tensor]]:
        """``(fn, t)``: the client's logits are ``fn(z, t)`` with its own (C,) tensor ``t`` (e.g.
        its label counts) and ``fn`` the same for every client; None = plain softmax. Subclasses
        define this; the batched executor stacks ``t`` over clients."""
        return None

    def logit_adjustment(self, ctx) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """(B, C) logits -> the logits of the client's local softmax; None = plain softmax."""
        parts = self.logit_adjustment_parts(ctx)
        if parts is None:
            return None
        fn, t = parts
        return lambda z: fn(z, t)

    def local_loss(self, model, msg: Record, ctx):
        """The local objective; FedProx and others override this hook only."""
        adjust = self.logit_adjustment(ctx)
        if adjust is None:
            return cross_entropy_loss

        def loss(model, x, y):
            return F.cross_entropy(adjust(model(x)), y)

        return loss

    def client_update(self, msg: Record, state: Optional[Record], ctx) -> ClientResult:
        model = ctx.model(msg.subarrays("w."))
        ctx.train(model, loss=self.local_loss(model, msg, ctx))
        return self.batch_result(msg, ctx, model)

    # -- batched execution: the same update for many clients at once (engine/batched.py) --
    batch_hooks = ("client_update", "client_init", "local_loss", "logit_adjustment")

    def batch_plan(self, msg: Record, ctx) -> Optional[BatchPlan]:
        """``local_loss`` as a pure function: the cross-entropy of the (adjusted) logits from w_t."""
        parts = self.logit_adjustment_parts(ctx)
        if parts is None:
            return BatchPlan(msg.subarrays("w."), _functional_ce, {})
        fn, t = parts
        return BatchPlan(msg.subarrays("w."), _AdjustedCE(fn), {"adjust": t})

    def batch_result(self, msg: Record, ctx, model) -> ClientResult:
        reply = Record(arrays=prefixed("w.", weights_of(model)), metrics={"num_samples": ctx.num_samples})
        adjust = self.logit_adjustment(ctx)
        personal = model if adjust is None else {"local": AdjustedLogits(model, adjust), "logits": model}
        return ClientResult(reply, personal=personal)

    # -- server ------------------------------------------------------------------------------
    def aggregation_weight(self, reply: Record) -> float:
        return reply.metrics["num_samples"] if self.hp.weighting == "samples" else 1.0

    def aggregate(self, state: WeightsState, rnd, replies, ctx) -> WeightsState:
        avg = weighted_mean((self.aggregation_weight(r), r.subarrays("w.")) for _, r in replies
                            if self.aggregation_weight(r) > 0)
        return WeightsState(avg) if avg else state  # nobody arrived: keep w_t

    def global_predictor(self, state: WeightsState, ctx):
        return ctx.model(state.weights)
