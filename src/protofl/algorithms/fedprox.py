"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

FedAvg whose local objective adds a proximal term to the global weights w_t (eq. 2):

    h_k(w; w_t) = F_k(w) + (mu / 2) * ||w - w_t||^2

The proximal term runs over all trainable parameters. Everything else is FedAvg.

``mu`` = 0.01 is protofl's choice, not a value the paper prescribes: the paper tunes mu
per dataset over a small grid ({0.001, 0.01, 0.1, 1}; its text was not at hand when this
note was written). The ReBaFL authors' baseline uses mu = 0.001.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import require
from ..messages import Record
from ..models.base import FLModel
from ..nn.losses import proximal
from .base import ClientContext, LossFn, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedProxHyper(FedAvgHyper):
    mu: float = 0.01

    def validate(self, section: str) -> None:
        require(self.mu >= 0, f"{section}.mu", self.mu, "must be >= 0")


@register
class FedProx(FedAvg[WeightsState]):
    name = "fedprox"
    family = "baselines"
    Hyper = FedProxHyper
    hp: FedProxHyper

    def objective(self, msg: Record, ctx: ClientContext) -> tuple[LossFn, dict[str, Any]]:
        """Eq. (2); the anchor w_t is the client's own tensors (its trainable parameters)."""
        return self.proximal_loss, {"anchor": ctx.trainable(ctx.like_model(msg.weights))}

    def proximal_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                      extras: Mapping[str, Any]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y) + 0.5 * self.hp.mu * proximal(model, extras["anchor"])
