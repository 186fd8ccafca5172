"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, ICML 2021, "Exploiting Shared
Representations for Personalized Federated Learning"), Algorithm 1.

    server: send the representation (body) phi_t to the sampled clients S_t
    client k, own head h_k:
      1. h_k   <- ``head_epochs`` epochs of SGD on CE(h(phi_t(x)), y) over h only,
                  the body frozen at phi_t                                (head update)
      2. phi_k <- ``body_epochs`` epochs of SGD on CE(h_k(phi(x)), y) over phi only,
                  the new head frozen                              (representation update)
      reply phi_k, keep h_k
    server: phi_{t+1} = sum_k (n_k / n) phi_k   over the replies that arrived

Shared: ``model.body`` (averaged as in FedAvg); personal: ``model.head``, kept in the
client's state Record, the run's initial head for a client that was never sampled.
Personalized model: phi_k + h_k after the two phases. As FedPer, no global model (GA =
mean of the personalized models on the global test set).

Each phase is one ``ctx.fit`` with ``trainable=`` set to its own
parameters, so an optimizer never holds the other part (no weight decay or momentum on
it either). BatchNorm running statistics of the body (models with BatchNorm only) are
buffers, not parameters: they follow the batches in both phases, as in the authors'
code, which keeps the whole model in train mode. With ``training.steps`` set, each phase
runs that many steps. The reported train loss is that of phase 2.

Defaults and deviations:
* ``head_epochs`` = 10 as in the paper's experiments.
* ``body_epochs`` defaults to the run's ``training.epochs``: protofl's choice, following
  the FedNH paper's FedRep (appendix: 10 head + 5 body epochs, which
  ``training.epochs=5`` reproduces). In the authors' code (github.com/lgcollins/FedRep) a
  client runs ``--local_ep`` epochs of which the last ``--local_rep_ep`` (default 1) train
  the representation; their scripts always run 10 head epochs, with 1 body epoch for
  CIFAR-10 with 2 shards per client (``--local_ep 11 --local_rep_ep 1``) and 5 in the
  others (``--local_ep 15 --local_rep_ep 5``). Set ``body_epochs`` to follow them.
* The FedNH paper reports a GM for FedRep (the averaged body with the server's initial
  head); we report none (see ``fedper.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import require
from ..messages import Record
from .base import ClientContext, Fitted, register, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer


@dataclass
class FedRepHyper(FedAvgHyper):
    head_epochs: int = 10  # phase 1: the personal head, body frozen
    body_epochs: Optional[int] = None  # phase 2: the body, head frozen (None: training.epochs)

    def validate(self, section: str) -> None:
        require(self.head_epochs >= 1, f"{section}.head_epochs", self.head_epochs, "must be >= 1")
        require(self.body_epochs is None or self.body_epochs >= 1, f"{section}.body_epochs", self.body_epochs,
                "must be >= 1 (or null: training.epochs)")


@register
class FedRep(FedPer[WeightsState]):
    name = "fedrep"
    Hyper = FedRepHyper

    def private_fits(self, evaluating: bool, final: bool = False) -> list[dict[str, Any]]:
        """The head's epochs, then the body's."""
        return [{"epochs": self.hp.head_epochs}, {} if self.hp.body_epochs is None else {"epochs": self.hp.body_epochs}]

    async def local_training(self, weights: dict[str, torch.Tensor], msg: Record, ctx: ClientContext) -> Fitted:
        # phase 1: only the head's parameters move, the body frozen at phi_t
        head = await ctx.fit(weights, trainable=("head.",), epochs=self.hp.head_epochs)
        # phase 2: only the body's parameters move, the new head frozen
        overrides = {} if self.hp.body_epochs is None else {"epochs": self.hp.body_epochs}
        return await ctx.fit(head.weights, trainable=("body.",), **overrides)
