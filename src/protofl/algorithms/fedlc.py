"""FedLC (Zhang et al., ICML 2022, "Federated Learning with Label Distribution Skew via
Logits Calibration"): FedAvg whose clients train with the calibrated cross-entropy

    L_cal = -log [ exp(z_y - tau n_ky^(-1/4)) / sum_j exp(z_j - tau n_kj^(-1/4)) ]

i.e. a pairwise label margin tau (n_kj^(-1/4) - n_ky^(-1/4)) that favours the client's
rare classes (the paper's calibrated loss, Sec. 4). n_kc are the client's label counts.
Server: FedAvg.

Deviations / choices:
* The paper prints the denominator as a sum over j != y. That "loss" is unbounded below
  and training with it collapses (reported in FL-bench issue #5); like every public
  implementation (FL-bench, the ReBaFL authors' baseline) the sum here runs over all j.
* A class the client does not hold has n = 0 and margin +inf: it drops out of the local
  softmax (logit -inf). Released code uses n + 1e-9 (the ReBaFL authors' baseline), a
  margin of (1e-9)^(-1/4) tau ~ 178 tau, or n + 1e-8, a margin of 100 tau; either has the
  same effect (a held class has a margin of at most tau). ``tau = 0`` is plain cross-entropy over all classes.

Personalized model (PA, PM): the FedLC paper evaluates only the global model; the FedGELA
and ReBaFL papers use FedLC as a generic-FL baseline. For such baselines FedGELA's PA
fine-tunes the best global model for 10 epochs on each client and scores it with nothing
masked (its Sec. 5, "Metrics"); ReBaFL reports the global model only. protofl's personal
model is the local model after the round's local training, scored with the calibrated
logits z_c - tau n_kc^(-1/4) it was trained with (key ``local``, primary; classes the
client lacks are excluded); the plain logits are reported as ``@logits``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import require
from ..nn.losses import calibrated_logits
from .base import ClientContext, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedLCHyper(FedAvgHyper):
    tau: float = 1.0  # calibration strength (the ReBaFL authors' baseline and FL-bench use 1.0)

    def validate(self, section: str) -> None:
        require(self.tau >= 0.0, f"{section}.tau", self.tau, "must be >= 0")


@register
class FedLC(FedAvg[WeightsState]):
    name = "fedlc"
    family = "calibrated softmax"
    Hyper = FedLCHyper

    def logit_adjustment(self, ctx: ClientContext) -> torch.Tensor:
        return ctx.class_counts.to(ctx.data[1].device)  # (C,) n_kc

    def adjust_logits(self, z: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return calibrated_logits(z, counts, tau=self.hp.tau)  # the calibrated softmax
