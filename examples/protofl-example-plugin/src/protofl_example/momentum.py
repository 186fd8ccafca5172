"""FedAvg with server momentum, written as a third-party plugin method (``fedavgm_plugin``).

protofl has server momentum built in (``algorithm.name=fedavgm``, or ``server_opt: avgm`` on
any method with one global model); this package writes it again from the outside, with
its own hyper-parameters, server state and aggregation, to show what a plugin method
needs. Hsu, Qi and Brown, 2019, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification":

    Δ_t   = w_t - Σ_k (n_k / n) w_k          (the averaged update, as a pseudo-gradient)
    v_t   = β v_{t-1} + Δ_t                   (v_0 = 0)
    w_t+1 = w_t - η_s v_t

β = 0, η_s = 1 is FedAvg. Clients are FedAvg's unchanged: the method overrides only
the server's ``server_init`` and ``aggregate`` hooks. Integer buffers (BatchNorm's
counters) are taken from the average, as in FedAvg; float buffers get the momentum step
(the built-in ``fedavgm`` takes them from the average: on a model without BatchNorm the
two give the same model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from protofl.algorithms.base import average, WeightsState
from protofl.algorithms.fedavg import FedAvg
from protofl.errors import require


@dataclass
class MomentumHyper:  # its own settings only (not FedAvg's, which bring the built-in server optimizer's)
    beta: float = 0.9  # server momentum β
    server_lr: float = 1.0  # η_s
    weighting: Literal["samples", "uniform"] = "samples"

    def validate(self, section: str) -> None:
        require(0 <= self.beta < 1, f"{section}.beta", self.beta, "must be in [0, 1)")
        require(self.server_lr > 0, f"{section}.server_lr", self.server_lr, "must be > 0")


@dataclass
class MomentumState(WeightsState):
    velocity: Optional[dict[str, torch.Tensor]] = None


class ServerMomentum(FedAvg):
    name = "fedavgm_plugin"
    family = "server optimizers"
    Hyper = MomentumHyper

    def server_init(self, ctx) -> MomentumState:
        return MomentumState(ctx.init_weights())

    def aggregate(self, state: MomentumState, rnd, replies, ctx) -> MomentumState:
        avg = average((r for _, r in replies), self.hp.weighting)  # Σ_k (n_k / n) w_k
        if not avg:  # nobody arrived: keep w_t and v_{t-1}
            return state
        w, hp = state.weights, self.hp
        velocity, new = {}, {}
        for k, a in avg.items():
            if not a.is_floating_point():
                new[k] = a
                continue
            delta = w[k] - a
            v = delta if state.velocity is None else hp.beta * state.velocity[k] + delta
            velocity[k] = v
            new[k] = w[k] - hp.server_lr * v
        return MomentumState(new, velocity)
