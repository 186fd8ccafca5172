"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary, 2019, "Federated Learning with
Personalization Layers", arXiv:1912.00818): FedAvg on the body, a personal head per client.

    server: send the body w_t^B to the sampled clients S_t
    client k: model = (w_t^B, own head w_k^H); E epochs of SGD on CE over both parts
              (the paper's "base + personalization layers" trained together);
              reply the body, keep the head
    server: w_{t+1}^B = sum_k (n_k / n) w_k^B   over the replies that arrived

Shared: ``model.body`` (every state-dict entry outside ``head.``), averaged as in
FedAvg (``weighting``, integer buffers take the maximum). Personal: ``model.head``,
kept in the client's state Record (so checkpoints, resume, worker processes and Flower
carry it with no special case); a client that was never sampled starts from the run's
initial head. The head never leaves the client. Personalized model (PM/PA): the
client's body + head right after local training.

No global model: the server has no head of its own, so GM is not reported and GA is the
mean accuracy of the personalized models on the global test set (how FedGELA, §5, and
FedRoD report GA for personalized methods).

Deviations:
* The paper personalizes the last K layers (K = 1 or 2 fully connected layers in its
  experiments); here exactly ``model.head`` (the last linear layer of every protofl
  model), as the FedNH paper (appendix, "FedPer") and its code do.
* The FedNH paper reports a GM for FedPer; its code (Yutong-Dai/FedNH, FedPerServer)
  evaluates the averaged body with the server's never-updated initial head. We report
  none rather than that.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from ..messages import Record
from .base import ClientContext, ClientResult, Fitted, Predictors, register, ServerContext, weights_of, WS
from .fedavg import FedAvg


@register
class FedPer(FedAvg[WS]):
    name = "fedper"
    family = "personalization"
    has_global_model = False
    # state-dict entries that stay on the client (never in a message); a class attribute, which
    # FedBN sets on the instance from the architecture
    personal_prefixes: tuple[str, ...] = ("head.",)

    # -- the split -------------------------------------------------------------------------
    def is_personal(self, key: str) -> bool:
        return key.startswith(self.personal_prefixes)

    def shared_part(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in weights.items() if not self.is_personal(k)}

    def personal_part(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in weights.items() if self.is_personal(k)}

    # -- server ------------------------------------------------------------------------------
    def configure(self, state: WS, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=self.shared_part(state.weights))

    # aggregate: FedAvg over the shared entries; the server's copy of the personal entries
    # (the initial ones), in no reply, is never updated

    def global_predictor(self, state: WS, ctx: ServerContext) -> Optional[Predictors]:
        return ctx.shared_model(state.weights) if self.has_global_model else None

    # -- client ------------------------------------------------------------------------------
    def client_init(self, ctx: ClientContext) -> Optional[Record]:
        return Record(weights=self.personal_part(weights_of(ctx.shared_model())))  # the initial head

    async def local_training(self, weights: dict[str, torch.Tensor], msg: Record, ctx: ClientContext) -> Fitted:
        """FedPer: body and head trained together on CE (the FedAvg local update)."""
        return await ctx.fit(weights)

    def personalized(self, model: nn.Module, msg: Record, ctx: ClientContext) -> Optional[Predictors]:
        return model

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it (the initial head)
        fitted = await self.local_training({**msg.weights, **state.weights}, msg, ctx)
        w = fitted.weights
        return ClientResult(Record(weights=self.shared_part(w)), state=Record(weights=self.personal_part(w)),
                            personal=self.personalized(ctx.shared_model(w), msg, ctx))
