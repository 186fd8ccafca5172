"""BSM-FedAvg: FedAvg whose clients train with the balanced softmax (Ren et al., "Balanced
Meta-Softmax for Long-Tailed Visual Recognition", NeurIPS 2020), the baseline of ReBaFL
(Xu et al., "Stabilizing and Improving Federated Learning with Non-IID Data and Client
Dropout", 2023; its eq. 9 with eps = 0).

    client k: minimize  -log [ pi_ky exp(z_y) / sum_j pi_kj exp(z_j) ],  pi_kc = n_kc / n_k
    server:   FedAvg (weighted by n_k)

The prior is the client's own label distribution (``ctx.class_counts``). Classes the
client does not hold get pi = 0, i.e. they leave the local softmax entirely
(``nn.losses``); the authors' code adds 1e-9 to pi instead, which differs by ~1e-9.
A client with a single class therefore has zero loss and zero gradient: without weight
decay it returns the global model unchanged (with ``training.weight_decay`` > 0 its
weights only decay toward 0; BatchNorm running statistics, in a model that has them,
still move). ReBaFL's eps > 0 is the fix, see ``rebafl.py``.

Personalized model (PA, PM): the local model after local training (ReBaFL's protocol),
scored with the balanced logits z + log pi_k (key ``local``, primary). This is the
balanced softmax's own reading: training with z + log pi makes the plain logits z those
of a balanced label distribution, and adding log pi adapts them back to the prior pi,
here the client's own label distribution, which its local test set follows. The plain logits (the balanced
prediction) are reported as ``@logits``.
"""
from __future__ import annotations

import torch

from ..nn.losses import balanced_logits, relaxed_prior
from .base import ClientContext, register, WeightsState
from .fedavg import FedAvg


@register
class BSMFedAvg(FedAvg[WeightsState]):
    name = "bsmfedavg"
    family = "calibrated softmax"

    def logit_adjustment(self, ctx: ClientContext) -> torch.Tensor:
        return relaxed_prior(ctx.class_counts, 0.0).to(ctx.data[1].device)  # (C,) pi_kc = n_kc / n_k

    def adjust_logits(self, z: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        return balanced_logits(z, prior)  # the balanced softmax
