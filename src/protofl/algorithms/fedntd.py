"""FedNTD (Lee, Jeong, Shin, Bae & Yun, NeurIPS 2022, "Preservation of the Global Knowledge
by Not-True Distillation in Federated Learning"): FedAvg whose clients, while they fit
their own labels, keep the global model's view of the classes that are *not* the label.

    server: FedAvg (send w_t, average the replies)
    client k, minibatch (x, y), logits z = f_w(x) and z^g = f_{w_t}(x) (the received global
    model, frozen):
        not-true softmax over the C - 1 classes c != y (the true class left out):
            q~_c(z) = exp(z_c / tau) / sum_{c' != y} exp(z_c' / tau)
        L_NTD = tau^2 KL( q~(z^g) || q~(z) ) = tau^2 sum_{c != y} q~_c(z^g) log( q~_c(z^g) / q~_c(z) )
        minimize  CE(z, y) + beta * L_NTD          (averaged over the minibatch)

Leaving the true class out is the point: the label's own logit is fitted by the
cross-entropy alone, and the distillation keeps the global model's ranking of the other
classes, among them the classes this client never sees (the forgetting the paper measures
under label skew). Defaults beta = 1, tau = 1: the authors' configuration file for FedNTD
(config/fedntd.json: ``"params": {"tau": 1, "beta": 1}``).

The paper's full text was not at hand when this was written: equation numbers are not
given; the loss above is the one of the paper's abstract and figure (the true class left
out of the softmax) as the authors' released code computes it (github.com/Lee-Gihun/FedNTD,
algorithms/fedntd/criterion.py: cross-entropy plus beta times tau^2 times the batch-mean KL
divergence of the temperature-tau softmaxes over the not-true logits), read, not copied. The
tau^2 factor is the code's (Hinton et al.'s scaling, which keeps the distillation's gradient
the same size across temperatures); whether the paper writes it could not be checked. At the
default tau = 1 it is 1.

Choices and details:
* The frozen global model computes its logits in eval mode (BatchNorm running statistics,
  no dropout), without gradient. The authors' code never sets its copy's mode: it
  deep-copies the shared client model, which the previous client's evaluation left in eval
  mode, so in effect its teacher runs in eval mode as well (train mode only for the run's
  first client, which matters only with BatchNorm).
* The not-true logits are gathered with indices computed from y (no Python branch on the
  label), so the batched executor runs the loss for many clients at once.
* Personalized model (PM/PA metrics): the client's model after local training, as FedAvg's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import require
from ..messages import Record
from ..models.base import FLModel
from ..nn.modes import eval_mode
from .base import ClientContext, LossFn, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedNTDHyper(FedAvgHyper):
    beta: float = 1.0  # weight of the not-true distillation (authors' config: 1)
    tau: float = 1.0  # softmax temperature (authors' config: 1)

    def validate(self, section: str) -> None:
        require(self.beta >= 0, f"{section}.beta", self.beta, "must be >= 0")
        require(self.tau > 0, f"{section}.tau", self.tau, "must be > 0")


def not_true(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C) logits -> (B, C - 1): each row without its true class y, the others in order."""
    B, C = z.shape
    j = torch.arange(C - 1, device=z.device).expand(B, C - 1)
    return z.gather(1, j + (j >= y.unsqueeze(1)).long())  # skip column y


def not_true_distillation(z: torch.Tensor, z_g: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """L_NTD averaged over the batch: tau^2 KL(q~(z_g) || q~(z)) of the temperature-tau
    softmaxes over the not-true classes; z, z_g (B, C) local and global logits, y (B,) labels."""
    log_q = F.log_softmax(not_true(z, y) / tau, dim=1)
    log_q_g = F.log_softmax(not_true(z_g, y) / tau, dim=1)
    kl = (log_q_g.exp() * (log_q_g - log_q)).sum(1).mean()
    return kl if tau == 1 else tau ** 2 * kl


def frozen_logits(model: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """f_{w_t}(x): the model with the global weights, in eval mode, no gradient."""
    with eval_mode(model), torch.no_grad():
        return cast(torch.Tensor, functional_call(model, weights, (x,)))


@register
class FedNTD(FedAvg[WeightsState]):
    name = "fedntd"
    family = "calibrated softmax"
    Hyper = FedNTDHyper
    hp: FedNTDHyper

    def objective(self, msg: Record, ctx: ClientContext) -> tuple[LossFn, dict[str, Any]]:
        """CE + beta L_NTD against the received global model (its weights are the client's extras)."""
        return self.ntd_loss, {"glob": ctx.like_model(msg.weights)}

    def ntd_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                 extras: Mapping[str, Any]) -> torch.Tensor:
        z = model(x)
        value = F.cross_entropy(z, y)
        if self.hp.beta == 0:
            return value
        z_g = frozen_logits(model, extras["glob"], x)
        return value + self.hp.beta * not_true_distillation(z, z_g, y, self.hp.tau)
