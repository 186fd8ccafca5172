"""pFedMe (Dinh, Tran & Nguyen, NeurIPS 2020, "Personalized Federated Learning with Moreau
Envelopes"), Algorithm 1.

Each client's objective is the Moreau envelope of its loss f_i:

    F_i(w) = min_theta { f_i(theta) + (lam / 2) ||theta - w||^2 },
    theta_i(w) = its minimizer (the personalized model),  grad F_i(w) = lam (w - theta_i(w))

    server: send w_t to the clients (Algorithm 1: all N; here: the sampled S_t, below)
    client i: w_{i,0} = w_t; for r = 0 .. R-1 (R local steps, one minibatch D_i each):
        theta~ <- K steps of gradient descent with step ``personal_lr`` on
                  f_i(theta; D_i) + (lam / 2) ||theta - w_{i,r}||^2       (inner problem)
        w_{i,r+1} = w_{i,r} - eta lam (w_{i,r} - theta~)    (local update, Algorithm 1, line 8)
      reply w_{i,R}
    server: w_{t+1} = (1 - beta) w_t + beta sum_{i in S_t} a_i w_{i,R}   (global update)

How it runs on the engine: one ``ctx.fit`` of R steps (``training.epochs`` or
``training.steps``; the engine draws a fresh minibatch per step, as Algorithm 1 samples
D_i per local round) whose loss is the Moreau envelope itself. On its minibatch the loss
runs the K inner steps (``torch.func``, so both executors run them), then returns

    f_i(theta~; D_i) + (lam / 2) ||theta~ - w||^2    with theta~ held constant,

whose gradient is lam (w - theta~) (the envelope's gradient, the local update's direction):
the run's optimizer with step eta = ``training.lr`` takes the local update (exactly, for
plain SGD).
theta~ is warm-started: it lives in buffers ``theta.*`` of the model (``adapt_model``),
reset to w_t when the round starts and updated in place by each step's inner solve (as
BatchNorm updates its statistics), as in the authors' code. The personalized model
(PM, PA) is the last theta~, the paper's personalized model; the global model (GM, GA)
is w. (The authors' code evaluates w_{i,R} as its personalized model: the list it keeps
as theta~, ``persionalized_model_bar``, is the model's own parameter tensors returned by
``pFedMeOptimizer.step``, which ``update_parameters(self.local_model)`` at the end of
``train()`` overwrites with w_{i,R}; not copied.)

Defaults (the authors' MNIST settings, github.com/CharlieDinh/pFedMe README and
``main.py``): lam = 15, K = 5, personal_lr = 0.09, beta = 1 (beta = 2 is the paper's
accelerated variant). eta is the run's ``training.lr`` (0.005 there, plain SGD, with
batch 20 and R = 20 local steps: ``training.steps=20``). The local update (Algorithm 1,
line 8, as the authors call it in their issue tracker) contracts w towards theta~
by the factor 1 - eta lam per step (eta lam / (1 - momentum) with momentum): keep it well
below 1 (0.075 in the authors' setting). personal_lr = 0.09 is set for the authors' MNIST
models: with cnn_fmnist on Fashion-MNIST it diverges, where PFLlib's default 0.01 trains
(measured; docs/methods/personalization.md).

Choices and deviations:
* The paper's text was not available while writing this module; the algorithm above
  follows its Algorithm 1 as the authors' code implements it and as others transcribe it
  (line numbers from the authors' answers in their issue tracker: the inner problem is
  their Eq. (7), the local update Algorithm 1, line 8).
* The authors' inner step adds mu theta (mu = 0.001, weight decay on theta) to the
  gradient; Algorithm 1 has no such term and it is left out.
* The outer step uses the run's optimizer (momentum, weight decay, clipping), plain SGD
  in the paper; with ``training.momentum=0`` it is the local update exactly.
* ``weighting``: ``uniform`` (a_i = 1/|S_t|, Algorithm 1) by default; the authors' code
  weights by n_i (``samples``).
* Algorithm 1 (and the authors' code: "do update for all users not only selected users")
  sends w_t to all N clients, trains all of them every round, then samples S_t and
  aggregates only theirs. Here only the sampled clients S_t train (the engine's partial
  participation, as in PFLlib): a client outside S_t does not train that round, and
  its theta~ is made only at its turns. With every client sampled each round
  (``participation.fraction=1``) the two agree.
* The reported train loss is f_i at the last inner iterate before theta~ plus the
  proximal term at theta~ (the inner solve's last forward pass, no extra one).
* The inner problem runs over every parameter of the model; BatchNorm statistics (models
  with BatchNorm) follow each inner forward pass, as in the authors' code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Literal, Mapping, Optional

import torch
from torch import nn

from ..errors import require
from ..messages import Record
from ..nn.inner import detached, loss_grad_and_value, parameters_of
from .base import average, ClientContext, ClientResult, register, ServerContext, WeightsState
from .serveropt import ServerOptHyper
from .fedper import FedPer

THETA = "theta."  # the buffers holding the inner iterate theta~, one per parameter


@dataclass
class PFedMeHyper(ServerOptHyper):
    lam: float = 15.0  # lambda, weight of the proximal term of the Moreau envelope
    K: int = 5  # inner gradient steps per minibatch
    personal_lr: float = 0.09  # step of the inner gradient descent
    beta: float = 1.0  # server mixing (global update); 1 = plain averaging
    weighting: Literal["uniform", "samples"] = "uniform"

    def validate(self, section: str) -> None:
        require(self.lam > 0, f"{section}.lam", self.lam, "must be > 0")
        require(self.K >= 1, f"{section}.K", self.K, "must be >= 1")
        require(self.personal_lr > 0, f"{section}.personal_lr", self.personal_lr, "must be > 0")
        require(self.beta > 0, f"{section}.beta", self.beta, "must be > 0")


def parameter_buffers(module: nn.Module) -> nn.Module:
    """Plain modules mirroring ``module``'s parameters as buffers of the same names (and
    nothing else): storage for an iterate of the parameters that no optimizer moves."""
    out = nn.Module()
    for name, p in module.named_parameters():
        *path, leaf = name.split(".")
        node = out
        for part in path:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = cast(nn.Module, node._modules[part])  # added just above, never None
        node.register_buffer(leaf, p.detach().clone())
    return out


def moreau_inner(model: nn.Module, theta: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor], x: torch.Tensor,
                 y: torch.Tensor, lam: float, lr: float, K: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """K steps of gradient descent on f(theta; x, y) + (lam / 2) ||theta - w||^2 from ``theta``
    (the inner problem, approximately solved); returns the iterate and f at the last step's start."""
    w = detached(w)
    theta = detached(theta)
    for _ in range(K):
        g, f = loss_grad_and_value(model, theta, x, y)
        theta = {k: t - lr * (g[k] + lam * (t - w[k])) for k, t in theta.items()}
    return theta, f


def envelope_value(f: torch.Tensor, theta: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor],
                   lam: float) -> torch.Tensor:
    """f + (lam / 2) ||theta - w||^2 with theta constant: its gradient in w is lam (w - theta)."""
    prox = sum(((w[k] - theta[k].detach()) ** 2).sum() for k in w)
    return f.detach() + 0.5 * lam * prox


@register
class PFedMe(FedPer[WeightsState]):
    name = "pfedme"
    Hyper = PFedMeHyper
    couples_samples = True  # the inner (Moreau) problem is solved over the whole minibatch
    has_global_model = True
    personal_prefixes = (THETA,)  # theta~ never leaves the client

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model.theta = parameter_buffers(model)
        return model

    # -- server ------------------------------------------------------------------------------
    def aggregate(self, state: WeightsState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> WeightsState:
        avg = average((r for _, r in replies), self.hp.weighting)
        if not avg:
            return state
        b = self.hp.beta
        new = {k: (v if b == 1.0 or not v.is_floating_point() else (1 - b) * state.weights[k] + b * v)
               for k, v in avg.items()}  # the global update; integer buffers take the maximum (as in FedAvg)
        return self.server_update(state, new, ctx)  # (the server optimizer, when one is set)

    # -- client ------------------------------------------------------------------------------
    def client_init(self, ctx: ClientContext) -> Optional[Record]:
        return None  # theta~ restarts from w_t every round: no state between rounds

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        w_t = msg.weights
        names = [k[len(THETA):] for k in ctx.architecture.state_dict() if k.startswith(THETA)]
        start = {**w_t, **{THETA + k: w_t[k] for k in names}}  # theta~ = w_t
        fitted = await ctx.fit(start, self.envelope_loss)  # R local updates
        w = fitted.weights
        personal = ctx.shared_model({**w, **{k: w[THETA + k] for k in names}})  # theta~ in place of w
        return ClientResult(Record(weights=self.shared_part(w)), personal=personal)

    def envelope_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      extras: Mapping[str, Any]) -> torch.Tensor:
        """F_i(w) on the minibatch: the inner solve from the warm start, then the
        envelope's value with the gradient lam (w - theta~)."""
        hp = self.hp
        w = parameters_of(model)  # body and head (theta~ holds buffers only)
        theta0 = {k: model.get_buffer(THETA + k) for k in w}
        theta, f = moreau_inner(model, theta0, w, x, y, hp.lam, hp.personal_lr, hp.K)
        with torch.no_grad():  # the warm start of the next step (a buffer, like BatchNorm's statistics)
            for k, t in theta.items():
                theta0[k].copy_(t)
        return envelope_value(f, theta, w, hp.lam)
