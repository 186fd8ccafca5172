"""FedDecorr (Shi, Liang, Zhang, Tan & Bai, ICLR 2023, "Towards Understanding and Mitigating
Dimensional Collapse in Heterogeneous Federated Learning"): FedAvg whose clients add a
decorrelation term on the representations z = f(x) of each minibatch (Section 4):

    L = CE(h(z), y) + beta * L_FedDecorr,   L_FedDecorr = ||K||_F^2 / d^2

with K the (d, d) correlation matrix of the batch: each dimension of z z-scored over the
N samples of the batch, K = z^T z / N. The server is FedAvg's.

beta = 0.1: the authors' default (their CIFAR-10 and TinyImageNet scripts; CIFAR-100 uses
0.05). Choices where the paper is silent: the standard deviation is the biased one, plus
1e-5 against a constant dimension; a batch of one sample has no correlation, its term is 0.

Deviation of the authors' code (github.com/bytedance/FedDecorr, loss.py) from the paper,
not followed here: it averages (z^T z)_ij^2 / N over the off-diagonal entries only, with
the unbiased variance, which is (N-1)^2 / N * d / (d-1) times the gradient of the term
above (the diagonal of K is constant). Its beta = 0.1 at batch size 64 is beta = 6.2 here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from protofl.algorithms.base import ClientContext, LossFn, register, WeightsState
from protofl.algorithms.fedavg import FedAvg, FedAvgHyper
from protofl.errors import require
from protofl.messages import Record
from protofl.models.base import FLModel


@dataclass
class FedDecorrHyper(FedAvgHyper):
    beta: float = 0.1  # weight of the decorrelation term

    def validate(self, section: str) -> None:
        require(self.beta >= 0, f"{section}.beta", self.beta, "must be >= 0")


def decorrelation(z: torch.Tensor) -> torch.Tensor:
    """||K||_F^2 / d^2 of the (N, d) representations z."""
    z = (z - z.mean(0)) / (z.std(0, unbiased=False) + 1e-5)  # each dimension standardized
    K = z.T @ z / len(z)  # (d, d) correlation matrix
    return (K ** 2).sum() / z.shape[1] ** 2


@register
class FedDecorr(FedAvg[WeightsState]):  # FedAvg's server state: the global weights
    name = "feddecorr"
    family = "global-model baselines"
    couples_samples = True  # ||K||_F^2 of the batch's features: no per-sample DP-SGD
    Hyper = FedDecorrHyper
    hp: FedDecorrHyper

    def objective(self, msg: Record, ctx: ClientContext) -> tuple[LossFn, dict[str, Any]]:
        """The local objective and the client's own tensors it reads (none here)."""
        return self.decorrelated_loss, {}

    def decorrelated_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                          extras: Mapping[str, Any]) -> torch.Tensor:
        z = model.body(x)  # (N, d)
        return F.cross_entropy(model.head(z), y) + self.hp.beta * decorrelation(z)
