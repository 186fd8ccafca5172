"""FedAvg-FT: FedAvg whose personalized model is the global model fine-tuned on the
client's own data -- how the FedGELA paper (Fan et al., NeurIPS 2023, §5 "Metrics")
reports the personal accuracy (PA) of methods that train one global model: "we
fine-tune the best global model in 10 epochs and record the averaged accuracy on all
client test datasets".

    server / training: FedAvg (McMahan et al. 2017, Algorithm 1), unchanged
    personalized model of client k in round t:
        v_k = w_t fine-tuned for ``finetune_epochs`` epochs of SGD on CE over all
              parameters, on client k's training data (the run's optimizer settings)

The fine-tuning happens only when the personalized model is evaluated (the first time
the evaluator asks it for a prediction), after the reply and the client's state have
been fixed: nothing that training reads -- the reply, the global model, the random
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
from typing import Mapping, Optional

import torch
from torch import nn

from ..errors import require
from ..messages import Record
from .base import ClientResult
from .fedavg import FedAvg, FedAvgHyper


class FineTuned:
    """A predictor: ``model`` loaded with ``weights`` and fine-tuned on the client's data
    for ``epochs`` epochs (all parameters, CE) on its first call; predictions in eval mode.

    Lazy on purpose: the engine evaluates the personalized model right after
    ``client_update`` returns and only in evaluation rounds, so the extra epochs cost
    nothing in the other rounds. ``weights`` must not be modified by the caller.
    """

    def __init__(self, model: nn.Module, weights: Mapping[str, torch.Tensor], ctx, epochs: int) -> None:
        self.model, self.weights, self.ctx, self.epochs = model, weights, ctx, epochs
        self.ready = False

    def tune(self) -> None:
        # the evaluator runs under inference mode; training needs autograd back
        with torch.inference_mode(False), torch.enable_grad():
            self.model.load_state_dict(self.weights)
            self.ctx.train(self.model, epochs=self.epochs)
        self.model.eval()
        self.ready = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ready:
            self.tune()
        return self.model(x)


@dataclass
class FedAvgFTHyper(FedAvgHyper):
    finetune_epochs: int = 10  # FedGELA §5

    def validate(self, s: str) -> None:
        require(self.finetune_epochs >= 1, f"{s}.finetune_epochs", self.finetune_epochs, "must be >= 1")


class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    Hyper = FedAvgFTHyper

    def client_update(self, msg: Record, state: Optional[Record], ctx) -> ClientResult:
        result = super().client_update(msg, state, ctx)  # FedAvg; the reply is a copy
        result.personal = FineTuned(result.personal, msg.subarrays("w."), ctx, self.hp.finetune_epochs)
        return result
