"""FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data"), Algorithm 1.

    server: send w_t to the sampled clients S_t
    client k: w_k <- E epochs of minibatch SGD on its data, starting from w_t
    server: w_{t+1} = sum_k (n_k / n) w_k   over the replies that arrived

``weighting: uniform`` replaces n_k / n by 1 / |S_t|. BatchNorm statistics are averaged
like weights; integer buffers take the maximum. Personalized model (for PM/PA
metrics): the client's model right after local training, as in the FedNH paper.

The server half is :class:`~protofl.algorithms.base.GlobalModel`'s. Subclasses change the
local objective through :meth:`FedAvg.objective` (FedProx's proximal term, ReBaFL's
balanced softmax, ...). Those whose clients train with adjusted
logits (FedRS, FedLC, BSM-FedAvg) define ``adjust_logits(z, t)`` and the client's own
(C,) tensor ``t`` (``logit_adjustment``): the local loss is the cross-entropy of the
adjusted logits, and the personalized model predicts with the same adjusted logits (the
client's local softmax, named ``local``), next to the plain logits (``@logits``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Mapping, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..messages import Record
from .base import ClientContext, ClientResult, cross_entropy, Fitted, GlobalModel, LossFn, register, WS
from .serveropt import ServerOptHyper


@dataclass
class FedAvgHyper(ServerOptHyper):
    weighting: Literal["samples", "uniform"] = "samples"


class AdjustedLogits(nn.Module):
    """A personalized predictor: ``adjust(model(x))``, the softmax the client trained with."""

    def __init__(self, model: nn.Module, adjust: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.adjust = model, adjust

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adjust(self.model(x))


@register
class FedAvg(GlobalModel[WS]):
    # generic in its server state WS for the subclasses with fields of their own
    # (``class FedX(FedAvg[FedXState])``); FedAvg itself keeps a WeightsState
    name = "fedavg"
    family = "baselines"
    Hyper: ClassVar[type] = FedAvgHyper
    reply_arrays: ClassVar[Optional[tuple[str, ...]]] = ()  # the trained weights only

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        loss, extras = self.objective(msg, ctx)
        fitted = await ctx.fit(msg.weights, loss, extras=extras)  # E epochs of SGD from w_t
        return self.result(fitted, ctx)

    def objective(self, msg: Record, ctx: ClientContext) -> tuple[LossFn, dict[str, Any]]:
        """The local objective and the client's own tensors it reads: plain cross-entropy, or
        the cross-entropy of the adjusted logits. FedProx and others override this hook only."""
        t = self.logit_adjustment(ctx)
        return (cross_entropy, {}) if t is None else (self.adjusted_cross_entropy, {"adjust": t})

    def result(self, fitted: Fitted, ctx: ClientContext) -> ClientResult:
        """The reply (the trained weights) and the personalized model (the trained model)."""
        reply = Record(weights=fitted.weights)
        model = ctx.shared_model(fitted.weights)
        t = self.logit_adjustment(ctx)
        personal = model if t is None else {"local": AdjustedLogits(model, lambda z: self.adjust_logits(z, t)),
                                            "logits": model}
        return ClientResult(reply, personal=personal)

    # -- adjusted logits (FedRS, FedLC, BSM-FedAvg) -------------------------------------------
    def logit_adjustment(self, ctx: ClientContext) -> Optional[torch.Tensor]:
        """The client's own (C,) tensor ``t`` of its adjusted logits (e.g. its label counts);
        None (FedAvg) = plain softmax."""
        return None

    def adjust_logits(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(B, C) logits -> the logits of the client's local softmax, given its ``t``."""
        return z

    def adjusted_cross_entropy(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                               extras: Mapping[str, Any]) -> torch.Tensor:
        return F.cross_entropy(self.adjust_logits(model(x), extras["adjust"]), y)
