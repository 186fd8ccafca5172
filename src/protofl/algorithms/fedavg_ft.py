"""FedAvg-FT: FedAvg whose personalized model is the global model fine-tuned on the
client's own data -- how the FedGELA paper (Fan et al., NeurIPS 2023, §5 "Metrics")
reports the personal accuracy (PA) of methods that train one global model: "we
fine-tune the best global model in 10 epochs and record the averaged accuracy on all
client test datasets".

    server / training: FedAvg (McMahan et al. 2017, Algorithm 1), unchanged
    personalized model of client k in round t:
        v_k = w_t fine-tuned for ``finetune_epochs`` epochs of SGD on CE over all
              parameters, on client k's training data (the run's optimizer settings)

The fine-tuning happens only when the personalized model is evaluated
(``base.fine_tuned``), after the reply and the client's state have been fixed: nothing that training reads -- the reply, the global model, the random
streams of later rounds -- depends on it, so turning personalized evaluation on or off
leaves the training run bit-identical (tested).

Deviations:
* FedGELA fine-tunes the *best* global model once, after training; protofl evaluates
  clients during training, so each evaluated client fine-tunes the global model it
  received in that round (w_t, before its own local update). In the final round this is
  the last global model, not the best one.
* protofl's plain ``fedavg`` already reports as personalized model the client's model
  after its E local epochs started from w_t (the FedNH paper's convention): FedAvg-FT
  with ``finetune_epochs`` = ``training.epochs`` is that same estimator with different
  mini-batches. The default, 10, follows FedGELA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import require
from ..messages import Record
from .base import ClientContext, ClientResult, fine_tune_fits, fine_tuned, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedAvgFTHyper(FedAvgHyper):
    finetune_epochs: int = 10  # FedGELA §5

    def validate(self, section: str) -> None:
        require(self.finetune_epochs >= 1, f"{section}.finetune_epochs", self.finetune_epochs, "must be >= 1")


@register
class FedAvgFT(FedAvg[WeightsState]):
    name = "fedavg_ft"
    family = "personalization"
    Hyper = FedAvgFTHyper

    def private_fits(self, evaluating: bool, final: bool = False) -> list[dict[str, Any]]:
        return fine_tune_fits(evaluating, self.hp.finetune_epochs)

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        fitted = await ctx.fit(msg.weights)  # FedAvg's local update
        result = self.result(fitted, ctx)
        result.personal = await fine_tuned(ctx, msg.weights, self.hp.finetune_epochs)  # v_k from w_t
        return result
