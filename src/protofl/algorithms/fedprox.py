"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

FedAvg whose local objective adds a proximal term to the global weights w_t (eq. 2):

    h_k(w; w_t) = F_k(w) + (mu / 2) * ||w - w_t||^2

The proximal term runs over all trainable parameters. Everything else is FedAvg.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import require
from .base import BatchPlan, cross_entropy_loss
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedProxHyper(FedAvgHyper):
    mu: float = 0.01

    def validate(self, s: str) -> None:
        require(self.mu >= 0, f"{s}.mu", self.mu, "must be >= 0")


class FedProx(FedAvg):
    name = "fedprox"
    Hyper = FedProxHyper

    def local_loss(self, model, msg, ctx):
        anchor = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]  # w_t
        mu = self.hp.mu

        def loss(model, x, y):
            prox = sum(torch.sum((p - p0) ** 2) for p, p0 in anchor)
            return cross_entropy_loss(model, x, y) + 0.5 * mu * prox

        return loss

    batch_hooks = ("client_update", "client_init", "local_loss", "logit_adjustment", "logit_adjustment_parts")

    def batch_plan(self, msg, ctx):
        """``local_loss`` as a pure function; the anchor w_t is the client's own extra."""
        w = msg.subarrays("w.")
        return BatchPlan(w, _prox_loss(self.hp.mu), {k: v.detach().clone() for k, v in w.items()})


def _prox_loss(mu: float):
    def loss(forward, params, x, y, anchor):
        prox = sum(torch.sum((p - anchor[k]) ** 2) for k, p in params.items())
        return torch.nn.functional.cross_entropy(forward(x), y) + 0.5 * mu * prox

    return loss
