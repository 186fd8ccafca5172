"""FedNova (Wang, Liu, Liang, Joshi & Poor, NeurIPS 2020, "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization"): the paper's generalized
update rule x_{t+1} - x_t = -tau_eff sum_i w_i eta d_i with FedNova's choice w_i = p_i
(section 4), for the local solver SGD with momentum. The paper's full text was not at hand
when this was written: equation numbers are therefore not given; the formulas below are the
paper's as its abstract, section structure and the authors' released code
(github.com/JYWa/FedNova, distoptim/FedNova.py, read, not copied) state them.

Clients that take different numbers of local steps tau_i pull FedAvg's average toward the
objectives of the clients that took more steps (the objective inconsistency). FedNova
averages each client's update normalized by how much its local solver accumulated:

    server: send x_t to the sampled clients S_t
    client i: tau_i local steps of SGD (momentum rho, learning rate eta) from x_t to y_i;
        x_t - y_i = eta G_i a_i  (G_i: its stochastic gradients, a_i: their weights)
        vanilla SGD:   a_i = [1, ..., 1],                         ||a_i||_1 = tau_i
        momentum rho:  a_i,k = (1 - rho^(tau_i - k + 1)) / (1 - rho),
                       ||a_i||_1 = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)
        reply  d_i = (x_t - y_i) / ||a_i||_1   (eta times its normalized gradient G_i a_i / ||a_i||_1)
               and ||a_i||_1 (and tau_i)
    server: p_i = n_i / sum_{j in S_t} n_j
            tau_eff = sum_i p_i ||a_i||_1
            x_{t+1} = x_t - tau_eff sum_i p_i d_i

When every client takes the same steps, d_i = (x_t - y_i)/||a||_1 and tau_eff = ||a||_1:
FedNova is FedAvg. ``algorithm.server_opt`` then applies to x_{t+1} like to any method with
one global model (the authors' server momentum ``gmf`` is ``server_opt: avgm`` at a constant
learning rate: their buffer holds gradients divided by the learning rate, so their step
decay of the learning rate also rescales the old momentum).

Choices where the paper is silent, and details:
* tau_i is the number of optimizer steps the engine took (``training.epochs`` over the
  client's batches, or ``training.steps``); eta is the round's learning rate, constant
  within the round, and cancels: d_i carries it and tau_eff does not.
* Weight decay lambda adds lambda y to the gradient and stays part of G_i (as in the
  authors' code); so does clipping (``training.clip``, which the authors' code does not
  have). a_i is defined for SGD: ``training.optimizer`` adam or adamw has no such weights,
  and FedNova refuses to run with them.
* d_i covers the trainable parameters; the other entries of y_i (BatchNorm statistics,
  integer counters) travel as they are (``rest``) and are averaged as FedAvg does
  (integer counters take the maximum).
* ``weighting``: "samples" is the paper's p_i = n_i / n over the arrivals; "uniform" gives 1/|S_t|.
* The server trusts a client's ||a_i||_1 as the paper does; a reply without it, or with a
  negative one, is rejected.

Deviations from the authors' code (github.com/JYWa/FedNova, distoptim/FedNova.py): none in
the update for plain SGD and SGD with momentum. Their code also offers a proximal local
solver (FedProx + FedNova), whose tau_eff is sum_i p_i tau_i; it is not offered here.
fluke's FedNova adds tau_i up over the rounds (a_i grows every round) and updates the
average in place while it sums the clients; neither is followed.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import cast, Literal, Optional

import torch

from ..errors import ConfigError
from ..messages import Arrays, Record
from .base import (average, ClientContext, ClientResult, GlobalModel, register, reply_weight, ServerContext,
                   WeightsState)
from .serveropt import ServerOptHyper

log = logging.getLogger(__name__)


@dataclass
class FedNovaHyper(ServerOptHyper):
    weighting: Literal["samples", "uniform"] = "samples"  # p_i (paper: n_i / n)


def a_norm(tau: int, rho: float) -> float:
    """||a_i||_1 of tau steps of SGD with momentum rho (torch's heavy ball, dampening 0):
    tau for rho = 0, else [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)."""
    if rho == 0:
        return float(tau)
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


def normalized_average(x: dict[str, torch.Tensor], d: list[dict[str, torch.Tensor]], a: list[float],
                       p: list[float]) -> dict[str, torch.Tensor]:
    """x - tau_eff sum_i p_i d_i with tau_eff = sum_i p_i a_i, for the entries of the d_i
    (p: the clients' weights, summing to 1)."""
    tau_eff = sum(pi * ai for pi, ai in zip(p, a))
    out = {}
    for k in d[0]:
        step = cast(torch.Tensor, sum(pi * di[k] for pi, di in zip(p, d)))  # d is not empty
        out[k] = x[k] - tau_eff * step.to(x[k].dtype)
    return out


@register
class FedNova(GlobalModel[WeightsState]):
    name = "fednova"
    family = "global-model baselines"
    Hyper = FedNovaHyper
    reply_arrays = ("d", "rest")  # d_i by parameter name; the other entries of y_i
    update_group = "d"

    # -- server ------------------------------------------------------------------------------
    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        a = reply.metrics.get("a")
        if a is None or a < 0:
            return "no ||a_i||_1 >= 0 (metric 'a')"
        d, rest = reply.arrays.get("d"), reply.arrays.get("rest", {})
        if not isinstance(d, dict) or not d:
            return "no normalized update d"
        if not isinstance(rest, dict):
            return "rest is one array, not a group of the model's other weights"
        for group, part in (("d", d), ("rest", rest)):
            for k, t in part.items():
                ref = sent.weights.get(k)
                if ref is None or tuple(t.shape) != tuple(ref.shape):
                    return f"{group}[{k!r}] is not shaped like a model weight"
        # every weight exactly once: in d (the trainable parameters) or in rest (the others)
        if set(d) & set(rest) or set(d) | set(rest) != set(sent.weights):
            return "d and rest do not split the model's weights between them"
        return None

    def aggregate(self, state: WeightsState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> WeightsState:
        arrived = [r for _, r in replies if reply_weight(r, self.hp.weighting) > 0]
        if not arrived:
            return state  # nobody arrived: keep x_t
        # check_reply let through only replies that hold every weight once, in d or in rest;
        # every client puts its trainable parameters in d, so the d's agree unless a client
        # misbehaves: one whose d differs from the most common one is left out (the sum over
        # the clients would otherwise lack a term)
        names = Counter(frozenset(r.arrays["d"]) for r in arrived).most_common(1)[0][0]
        if any(frozenset(r.arrays["d"]) != names for r in arrived):
            log.warning("FedNova: left out %d replies whose d holds other weights than the others'",
                        sum(frozenset(r.arrays["d"]) != names for r in arrived))
            arrived = [r for r in arrived if frozenset(r.arrays["d"]) == names]
        weights = [reply_weight(r, self.hp.weighting) for r in arrived]
        p = [w / sum(weights) for w in weights]
        # check_reply let through only replies whose d and rest are groups (dicts of tensors)
        x_bar = normalized_average(state.weights, [r.group("d") for r in arrived],
                                   [float(r.metrics["a"]) for r in arrived], p)
        x_bar.update(average(arrived, self.hp.weighting,
                             part=lambda r: cast(dict[str, torch.Tensor], r.arrays.get("rest", {}))))
        return self.server_update(state, x_bar, ctx)

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        settings = ctx.training_settings()
        if settings.optimizer != "sgd":
            raise ConfigError("training.optimizer", settings.optimizer,
                              "FedNova normalizes SGD's local updates (a_i is defined for SGD with momentum); "
                              "use training.optimizer=sgd")
        x = ctx.like_model(msg.weights)
        fitted = await ctx.fit(x)  # tau_i steps of SGD with momentum rho from x_t
        y, tau = fitted.weights, fitted.stats.steps
        a = a_norm(tau, settings.momentum)
        params = ctx.trainable(x)
        d = {k: (x[k] - y[k]) / a if a > 0 else torch.zeros_like(x[k]) for k in params}
        arrays: Arrays = {"d": d}
        rest = {k: v for k, v in y.items() if k not in params}
        if rest:
            arrays["rest"] = rest
        reply = Record(arrays=arrays, metrics={"a": a, "tau": tau})
        return ClientResult(reply, personal=ctx.shared_model(y))
