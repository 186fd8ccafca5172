"""FedRS (Li & Zhan, KDD 2021, "FedRS: Federated Learning with Restricted Softmax for
Label Distribution Non-IID Data"): FedAvg whose clients train with the restricted softmax

    p(y = c | x) = exp(alpha_c z_c) / sum_j exp(alpha_j z_j),
    alpha_c = 1 if client k holds class c, else alpha  (0 <= alpha <= 1)

(the paper's restricted softmax, Sec. 4: the logits of the classes missing on the client
are scaled down, which limits how much the missing classes' classifier weights are pushed
away during local training). Server: FedAvg.

Deviations / choices:
* z_c is the head's full output (w_c . h + b_c): the paper writes the bias-free w_c . h,
  and the authors' code (github.com/lxcnju/FedRepo, ``algorithms/fedrs.py``:
  ``hs.mm(ws.transpose(0, 1))``) drops the classifier's bias too; with a bias in the head
  (``cnn_fmnist``) the bias is scaled together with the weights here.
* alpha_c is the paper's hard 0/1 presence rule (as in ReBaFL's re-implementation, which
  uses alpha = 0.5). The FedRS authors' released code uses a soft variant,
  alpha_c = alpha + (1 - alpha) n_c / max_j n_j; not implemented here.

Personalized model (PA, PM): the FedRS paper evaluates only the global model; the FedGELA
and ReBaFL papers use FedRS as a generic-FL baseline. For such baselines FedGELA's PA
fine-tunes the best global model for 10 epochs on each client and scores it with nothing
masked (its Sec. 5, "Metrics"); ReBaFL reports the global model only. protofl's personal
model is the local model after the round's local training, scored with the softmax it was
trained with, the restricted logits alpha_c z_c (key ``local``, primary); the plain
logits over all classes are reported as ``@logits``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import require
from ..nn.losses import restricted_logits
from .base import ClientContext, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedRSHyper(FedAvgHyper):
    alpha: float = 0.5  # scale of the missing classes' logits; 1 = FedAvg

    def validate(self, section: str) -> None:
        require(0.0 <= self.alpha <= 1.0, f"{section}.alpha", self.alpha, "must be in [0, 1]")


@register
class FedRS(FedAvg[WeightsState]):
    name = "fedrs"
    family = "calibrated softmax"
    Hyper = FedRSHyper

    def logit_adjustment(self, ctx: ClientContext) -> torch.Tensor:
        return ctx.class_counts.to(ctx.data[1].device)  # (C,) n_kc

    def adjust_logits(self, z: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return restricted_logits(z, counts, alpha=self.hp.alpha)  # the restricted softmax
