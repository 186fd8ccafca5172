"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, ICML 2020, "SCAFFOLD:
Stochastic Controlled Averaging for Federated Learning"), Algorithm 1 with option II.

    server: send x and the server control variate c to the sampled clients S
    client i (control variate c_i, 0 at first):
        y <- x;  K times:  y <- y - eta_l (g_i(y) - c_i + c)
        c_i+ = c_i - c + (x - y) / (K eta_l)                 option II
        reply  Delta y_i = y - x,  Delta c_i = c_i+ - c_i;  keep c_i <- c_i+
    server: x <- x + eta_g * (1/|S|) sum_{i in S} Delta y_i
            c <- c + (1/N) sum_{i in S} Delta c_i      (N = all clients)
    identical to FedAvg when every client has the same objective (then c = c_i)

The corrected step is the engine's training loop with a gradient transform (``grad`` of
``ctx.fit``): each minibatch gradient g becomes g - c_i + c before the optimizer step, so
plain SGD (momentum 0, weight decay 0) takes exactly y <- y - eta_l (g(y) - c_i + c), and
the reported training loss is the task loss alone. With the engine's other settings:
* momentum beta: the correction enters the momentum buffer with the gradient, so a
  constant correction is amplified like the gradient (by 1/(1 - beta) in steady state).
  Option II therefore divides by the steady-state step of heavy-ball SGD,
  eta_l / (1 - beta), instead of eta_l: (x - y) / K is about eta_l / (1 - beta) times the
  mean corrected gradient, and c_i must estimate the gradient, not the momentum step.
  With eta_l alone c_i comes out 1/(1 - beta) times too large (10x at beta = 0.9), the
  correction then out-weighs the gradient and training diverges (benchmarks/history.md,
  section 7). At beta = 0 this is the paper's formula exactly.
* weight decay lambda: PyTorch adds lambda y to the gradient, so c_i estimates the
  gradient of the regularized local objective F_i + lambda/2 ||y||^2; the server's c is the
  mean of those.
* clip_grad: the correction is clipped together with the gradient.
eta_l is the round's learning rate (``training.lr`` with ``lr_decay``); K the number of
steps taken (``training.epochs`` or ``training.steps``); option II's step size is
``ctx.step_size`` = eta_l / (1 - beta).

Choices where the paper is silent, and details:
* Control variates cover the trainable parameters; float buffers (BatchNorm statistics)
  travel in Delta y and get the server step like the weights; integer buffers take the
  maximum. Both are counted in the bytes metric: messages carry x and c down, Delta y and
  Delta c up (twice FedAvg's payload each way).
* ``weighting``: "uniform" is the paper's 1/|S| mean of Delta y; "samples" weights by n_i.
* Clients that drop out (reply lost) keep their old c_i; the server update uses the
  arrivals only (the 1/N of the c-update stays N, as in the paper).
* Option I (c_i+ = the gradient of F_i at x, one extra pass over the data) is not offered.
* ``server_opt`` (serveropt.py, none by default): with a server optimizer, eta_g is that
  optimizer's learning rate, applied to x_bar = x + mean Delta y (with ``none``, the step
  above; ``avgm`` with momentum 0 is the same step). ``server_lr`` defaults to 1.0 here
  (the paper's eta_g = 1), not to null, so it overrides the server optimizer's own default
  learning rate: with ``server_opt: adam`` (or yogi, adagrad) eta is 1.0, not 1e-2; set
  ``server_lr`` for those.

Deviations from the paper: none in the algorithm. There is no official code release by the
authors; widely used re-implementations (e.g. NIID-Bench) apply the correction after the
optimizer step, outside momentum, and weight Delta y by samples -- here the correction is
part of the gradient (see above) and the weighting is the paper's by default. The ReBaFL
authors' implementation (github.com/JianXu95/ReBaFL, ``methods/scaffold.py`` and
``running.py``), whose numbers ReBaFL's Table 1 reports, differs more: it subtracts
eta_l (c - c_i) after each step of SGD with momentum 0.5, outside momentum, yet divides by
K eta_l in option II, so c_i comes out about 1/(1 - 0.5) = 2 times the gradient; its server
adds the plain mean of the arrivals' Delta c_i to c (no |S|/N), averages Delta y uniformly,
and clips gradients at norm 10 (``max_grad_norm``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import torch

from ..errors import require
from ..messages import Record
from .base import (average, ClientContext, ClientResult, cross_entropy, GlobalModel, register, ServerContext,
                   trainable_names, WeightsState)
from .serveropt import ServerOptHyper


@dataclass
class ScaffoldHyper(ServerOptHyper):
    server_lr: float = 1.0  # eta_g, the global step size
    weighting: Literal["uniform", "samples"] = "uniform"  # mean of Delta y (paper: uniform)

    def validate(self, section: str) -> None:
        require(self.server_lr > 0, f"{section}.server_lr", self.server_lr, "must be > 0")


@dataclass
class ScaffoldState(WeightsState):  # weights: x
    control: dict[str, torch.Tensor]  # c, one tensor per trainable parameter


def option_ii(c_i: dict[str, torch.Tensor], c: dict[str, torch.Tensor], x: dict[str, torch.Tensor],
              y: dict[str, torch.Tensor], steps: int, lr: float) -> dict[str, torch.Tensor]:
    """c_i+ = c_i - c + (x - y) / (K eta_l)  (Algorithm 1, option II; ``lr`` = the step size)."""
    if steps == 0:
        return {k: v.clone() for k, v in c_i.items()}
    return {k: c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr) for k in c_i}


@register
class Scaffold(GlobalModel[ScaffoldState]):
    name = "scaffold"
    family = "global-model baselines"
    reply_arrays = ("dy", "dc")  # Delta y_i, Delta c_i (groups by parameter name)
    update_group = "dy"
    Hyper = ScaffoldHyper

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> ScaffoldState:
        w = ctx.init_weights()
        return ScaffoldState(w, {k: torch.zeros_like(w[k]) for k in trainable_names(ctx.shared_model())})

    def configure(self, state: ScaffoldState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights, arrays={"c": state.control})

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        """aggregate reads Delta y_i for every entry of x and Delta c_i for every entry of c:
        two groups shaped as what was sent (x's weights, the control variate c)."""
        for name, ref in (("dy", sent.weights), ("dc", sent.arrays.get("c"))):
            got = reply.arrays.get(name)
            if not isinstance(got, dict) or not isinstance(ref, dict) or set(got) != set(ref) \
                    or any(tuple(t.shape) != tuple(ref[k].shape) for k, t in got.items()):
                return f"group {name!r} must hold one entry per entry the client received, of the same shape"
        return None

    def aggregate(self, state: ScaffoldState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> ScaffoldState:
        if not replies:  # nobody arrived: keep x and c
            return state
        dy = average((r for _, r in replies), self.hp.weighting, part=lambda r: r.group("dy"))
        N = self.info.num_clients
        c = {k: v.clone() for k, v in state.control.items()}
        for _, r in replies:
            for k, d in r.group("dc").items():
                c[k].add_(d, alpha=1.0 / N)
        if self.hp.server_opt == "none":  # x <- x + eta_g mean Delta y
            x = {k: (v + self.hp.server_lr * dy[k].to(v.dtype) if v.is_floating_point() else dy[k])
                 for k, v in state.weights.items()}
            return dataclasses.replace(state, weights=x, control=c)
        # a server optimizer takes the step from x_bar = x + mean Delta y, with eta_g as its eta
        x_bar = {k: (v + dy[k].to(v.dtype) if v.is_floating_point() else dy[k]) for k, v in state.weights.items()}
        return dataclasses.replace(self.server_update(state, x_bar, ctx), control=c)

    # -- client ------------------------------------------------------------------------------
    task_loss = staticmethod(cross_entropy)  # F_i, the client's own objective

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        x = ctx.like_model(msg.weights)
        c = msg.group("c")
        c_i = state.group("c") if state is not None else {k: torch.zeros_like(v) for k, v in c.items()}
        # K local steps y <- y - eta_l (g(y) - c_i + c) on the trainable parameters
        fitted = await ctx.fit(x, self.task_loss, trainable=tuple(c), grad=corrected, extras={"c": c, "c_i": c_i})
        y = fitted.weights
        c_new = option_ii(c_i, c, x, y, fitted.stats.steps, ctx.step_size)
        dy = {k: (y[k] - x[k] if v.is_floating_point() else y[k]) for k, v in x.items()}
        reply = Record(arrays={"dy": dy, "dc": {k: c_new[k] - c_i[k] for k in c}})
        return ClientResult(reply, state=Record(arrays={"c": c_new}), personal=ctx.shared_model(y))


def corrected(grads: dict[str, torch.Tensor], extras: Mapping[str, Any],
              params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The SCAFFOLD step direction: g - c_i + c for every trainable parameter."""
    c, c_i = extras["c"], extras["c_i"]
    return {k: g + (c[k] - c_i[k]) for k, g in grads.items()}
