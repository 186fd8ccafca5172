"""Local training: every client trains only on its own data, never communicating.

A client trains whenever it would have been sampled (same sampler and participation
as the federated methods, so compute budgets match), continuing from its own model.
All clients start from the same initial weights. There is no global model: GA is the
mean of the local models' accuracy on the global test set.
"""
from __future__ import annotations

from typing import Optional

from ..messages import Record
from .base import Algorithm, ClientContext, ClientResult, register, ServerContext, weights_of


@register
class Local(Algorithm[None]):
    name = "local"
    family = "baselines"
    has_global_model = False
    heterogeneous_models = True
    reply_arrays = ()  # nothing but the sample count travels

    def server_init(self, ctx: ServerContext) -> None:
        return None

    def configure(self, state: None, rnd: int, ctx: ServerContext) -> Record:
        return Record()

    def client_init(self, ctx: ClientContext) -> Record:
        return Record(weights=weights_of(ctx.shared_model()))

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it
        fitted = await ctx.fit(state.weights)  # continues from the client's own model
        return ClientResult(Record(), state=Record(weights=fitted.weights), personal=ctx.shared_model(fitted.weights))

    def aggregate(self, state: None, rnd: int, replies: list[tuple[int, Record]], ctx: ServerContext) -> None:
        return None
