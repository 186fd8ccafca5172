"""FedBABU (Oh, Kim & Yun, ICLR 2022, "FedBABU: Toward Enhanced Representation for
Federated Image Classification"), Algorithm 1.

    all clients and the server share one head H_0, randomly initialized and never updated
    server: send the body theta_t to the sampled clients S_t
    client k: theta_k <- E epochs of SGD on CE((H_0 o theta)(x), y) over theta only
    server: theta_{t+1} = sum_k (n_k / n) theta_k   over the replies that arrived
    personalized model of client k: (theta_t, H_0) fine-tuned for ``finetune_epochs``
    epochs on the client's data, body *and* head (the paper's fine-tuning, §3.3)

Shared: ``model.body``, averaged as in FedAvg. The head is the run's initial head on
every client and on the server (all start from the same initialization stream); it is
never in a message, never in an optimizer during federated training, so it stays
bit-identical to its initialization (tested). Clients keep no state. Global model (GM,
GA): the averaged body with H_0.

The fine-tuning runs only for a client the engine evaluates, after the reply is fixed
(``base.fine_tuned``): it changes nothing that training reads, and costs nothing outside
evaluation rounds.

Defaults and deviations:
* ``finetune_epochs`` = 5, the fine-tuning length of the paper's main results and the
  FedNH paper's setting.
* Fine-tuning uses the run's optimizer settings (lr of the round, momentum, weight
  decay, batch size) for body and head alike; only full fine-tuning is offered.
* The paper fine-tunes the final global model once, after training; here each evaluated
  client fine-tunes the global model it received in that round.
* The head's initialization is the model's own (PyTorch's default for ``nn.Linear``),
  as in the FedNH paper's FedBABU.
* The server's mean is weighted by n_k / n as in the box above (``weighting: samples``,
  FedAvg's default); the authors' code (github.com/jhoon-oh/FedBABU, ``main_fed.py``)
  sums the sampled clients' bodies and divides by m, a uniform mean: ``weighting:
  uniform`` follows it.
* With ``training.steps`` set, fine-tuning also takes that many steps and
  ``finetune_epochs`` is ignored (the engine's ``steps`` overrides any number of epochs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import require
from ..messages import Record
from .base import ClientContext, ClientResult, fine_tune_fits, fine_tuned, register, weights_of, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer


@dataclass
class FedBABUHyper(FedAvgHyper):
    finetune_epochs: int = 5  # personalization: full fine-tuning of the received global model

    def validate(self, section: str) -> None:
        require(self.finetune_epochs >= 1, f"{section}.finetune_epochs", self.finetune_epochs, "must be >= 1")


@register
class FedBABU(FedPer[WeightsState]):
    name = "fedbabu"
    Hyper = FedBABUHyper
    has_global_model = True  # body + the fixed initial head

    def client_init(self, ctx: ClientContext) -> None:
        return None  # no personal state: the head is the same fixed H_0 everywhere

    def private_fits(self, evaluating: bool, final: bool = False) -> list[dict[str, Any]]:
        return fine_tune_fits(evaluating, self.hp.finetune_epochs)

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        head0 = self.personal_part(weights_of(ctx.shared_model()))  # H_0: the run's initial head
        w_t = {**head0, **msg.weights}
        fitted = await ctx.fit(w_t, trainable=("body.",))  # the head stays fixed
        reply = Record(weights=self.shared_part(fitted.weights))
        # personalized model: the received global model fine-tuned (body and head, paper §3.3)
        return ClientResult(reply, personal=await fine_tuned(ctx, w_t, self.hp.finetune_epochs))
