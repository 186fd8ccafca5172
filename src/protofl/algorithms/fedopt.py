"""FedAvgM, FedAdam, FedYogi and FedAdagrad: FedAvg with a server optimizer.

FedAvgM: Hsu, Qi & Brown, 2019, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification" (arXiv:1909.06335). FedAdagrad, FedYogi, FedAdam:
Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar & McMahan, ICLR 2021, "Adaptive
Federated Optimization", Algorithm 2.

    server: send x_t to the sampled clients S_t
    client i: K local SGD steps from x_t (FedAvg's client, unchanged); reply x_i
    server: Delta_t = sum_i p_i (x_i - x_t)   (p_i = n_i / n, or 1/|S_t| with weighting: uniform)
            x_{t+1} = ServerOpt(x_t, Delta_t)

Each is an entry of the registry for ``algorithm.name=fedavg algorithm.server_opt=<opt>``;
the optimizer itself (the update rules, where each default comes from, the choices where
the papers are silent and the deviations from the authors' code) is written once, in
:mod:`protofl.algorithms.serveropt`, and applies to every method with one global model
(``algorithm.server_opt`` on FedProx, FedNH, SCAFFOLD, ...). Their hyper-parameters are
FedAvg's ``weighting`` and the server optimizer's ``server_lr``, ``server_momentum``,
``server_beta2`` and ``server_tau``; ``server_opt`` is the method's own and cannot change.

Algorithm 2 prints the uniform mean 1/|S_t| sum_i Delta_i^t; the default here weights by
n_i, as FedAvg and the authors' TensorFlow Federated code (weighted by the number of
examples) do; ``weighting: uniform`` gives the printed mean.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TYPE_CHECKING

from ..errors import require
from .base import register, WeightsState
from .fedavg import FedAvg, FedAvgHyper
from .serveropt import ServerOpt


class FixedServerOpt:
    """The check of a named method's Hyper: its server optimizer stays the one its name
    says (the default of its ``server_opt``)."""

    if TYPE_CHECKING:  # the Hyper dataclass it is mixed into has them
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
        server_opt: ServerOpt

    def validate(self, section: str) -> None:
        own = type(self).__dataclass_fields__["server_opt"].default
        require(self.server_opt == own, f"{section}.server_opt", self.server_opt,
                f"this method is FedAvg with server_opt {own}; for another optimizer use "
                f"algorithm.name=fedavg algorithm.server_opt={self.server_opt}")


@dataclass(kw_only=True)
class FedAvgMHyper(FixedServerOpt, FedAvgHyper):
    server_opt: ServerOpt = "avgm"


@dataclass(kw_only=True)
class FedAdamHyper(FixedServerOpt, FedAvgHyper):
    server_opt: ServerOpt = "adam"


@dataclass(kw_only=True)
class FedYogiHyper(FixedServerOpt, FedAvgHyper):
    server_opt: ServerOpt = "yogi"


@dataclass(kw_only=True)
class FedAdagradHyper(FixedServerOpt, FedAvgHyper):
    server_opt: ServerOpt = "adagrad"


@register
class FedAvgM(FedAvg[WeightsState]):
    """FedAvg with server momentum: m_t = beta m_{t-1} + Delta_t, x_{t+1} = x_t + eta m_t."""

    name = "fedavgm"
    family = "server optimizers"
    Hyper = FedAvgMHyper


@register
class FedAdam(FedAvg[WeightsState]):
    """FedAvg with the server's Adam step (Algorithm 2, v_t = beta_2 v_{t-1} + (1 - beta_2) Delta_t^2)."""

    name = "fedadam"
    family = "server optimizers"
    Hyper = FedAdamHyper


@register
class FedYogi(FedAvg[WeightsState]):
    """FedAvg with the server's Yogi step (Algorithm 2, v_t = v_{t-1} - (1 - beta_2) Delta_t^2
    sign(v_{t-1} - Delta_t^2))."""

    name = "fedyogi"
    family = "server optimizers"
    Hyper = FedYogiHyper


@register
class FedAdagrad(FedAvg[WeightsState]):
    """FedAvg with the server's Adagrad step (Algorithm 2, v_t = v_{t-1} + Delta_t^2)."""

    name = "fedadagrad"
    family = "server optimizers"
    Hyper = FedAdagradHyper
