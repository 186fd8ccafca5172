"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, ICLR 2021, "Federated
Learning Based on Dynamic Regularization"), Algorithm 1.

    server: send theta^{t-1} to the active clients P_t
    client k (state: the gradient of its local loss at its last model, grad_k = 0 at first):
        theta_k^t = argmin_theta  L_k(theta) - <grad_k, theta> + alpha/2 ||theta - theta^{t-1}||^2
        grad_k   <- grad_k - alpha (theta_k^t - theta^{t-1})   (first-order condition)
    server: h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})   (m = all clients)
            theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - h^t / alpha

The argmin is E epochs of the engine's local SGD on the objective above (as in the paper's
experiments). Its linear term is written <grad_k, theta - theta^{t-1}>, which differs from
the paper's by a constant: same gradients, and the reported training loss starts at the
task loss. The gradient of the regularizer with respect to theta is
-grad_k + alpha (theta - theta^{t-1}).

Choices where the paper is silent, and details:
* grad_k and h cover the trainable parameters; float buffers (BatchNorm statistics) are
  averaged like FedAvg and get no h-correction; integer buffers take the maximum.
* ``weighting``: "uniform" is the paper's 1/|P_t| mean; "samples" weights by n_k (the
  h-update stays the paper's 1/m sum).
* A client whose reply is lost keeps its grad_k; a round with no arrival keeps theta and h.
* The global model evaluated (GM) is theta^t, the model sent to the clients (the
  authors' code evaluates another model, below).
* ``alpha`` = 0.01 is the value of the authors' example script (``example_cifar_10.py``,
  ``alpha_coef = 1e-2``), within the paper's grid.
* ``server_opt`` (serveropt.py, none by default) takes theta^t as its x_bar; h is FedDyn's as above.

Deviations from the authors' code (github.com/alpemreacar/FedDyn): the code divides alpha
by each client's relative data size (alpha_k = alpha / (n_k / mean n)) and adds the
optimizer's weight decay on top; here alpha is the same for every client as in the paper,
and ``training.weight_decay`` is whatever the run configures. The code keeps the server's
correction as the mean over all clients of their accumulated updates, which equals -h/alpha.
The accuracy the code reports each round is that of ``avg_model``, the plain mean of the
active clients' models, not of ``cld_model`` (theta^t = mean - h/alpha, the model it
sends); here GM is theta^t. The code's local solver is plain SGD (no momentum) with
gradients clipped at norm 10; here the run's ``training.*`` settings apply. When no client
is active in a round the code redraws the participants until one is; here a round without
arrivals keeps theta and h.
The ReBaFL authors' FedDyn (github.com/JianXu95/ReBaFL, ``methods/feddyn.py``), whose
numbers ReBaFL's Table 1 reports, uses alpha = 0.0001.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import torch
from torch import nn

from ..errors import require
from ..messages import Record
from .base import (average, ClientContext, ClientResult, cross_entropy, GlobalModel, register, ServerContext,
                   trainable_names, WeightsState)
from .serveropt import ServerOptHyper


@dataclass
class FedDynHyper(ServerOptHyper):
    alpha: float = 0.01  # weight of the dynamic regularizer (the paper's grid: 0.1, 0.01, 0.001)
    weighting: Literal["uniform", "samples"] = "uniform"

    def validate(self, section: str) -> None:
        require(self.alpha > 0, f"{section}.alpha", self.alpha, "must be > 0")


@dataclass
class FedDynState(WeightsState):  # weights: theta^t
    h: dict[str, torch.Tensor]  # one tensor per trainable parameter


def dynamic_regularizer(params: dict[str, torch.Tensor], grad_k: dict[str, torch.Tensor],
                        anchor: dict[str, torch.Tensor], alpha: float) -> torch.Tensor:
    """-<grad_k, theta - theta^{t-1}> + alpha/2 ||theta - theta^{t-1}||^2."""
    terms = [-torch.sum(grad_k[k] * (p - anchor[k])) + 0.5 * alpha * torch.sum((p - anchor[k]) ** 2)
             for k, p in params.items()]
    return torch.stack(terms).sum()


def server_update(theta_prev: dict[str, torch.Tensor], h: dict[str, torch.Tensor],
                  local: list[dict[str, torch.Tensor]], mean: dict[str, torch.Tensor], alpha: float,
                  num_clients: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """h^t and theta^t from the arrivals' theta_k^t and their mean (Algorithm 1, server)."""
    h_new = {k: v.clone() for k, v in h.items()}
    for w in local:
        for k in h_new:
            h_new[k].sub_(w[k] - theta_prev[k], alpha=alpha / num_clients)
    theta = {k: (v - h_new[k] / alpha if k in h_new else v) for k, v in mean.items()}
    return theta, h_new


@register
class FedDyn(GlobalModel[FedDynState]):
    name = "feddyn"
    family = "global-model baselines"
    reply_arrays = ()  # theta_k only
    Hyper = FedDynHyper

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedDynState:
        w = ctx.init_weights()
        return FedDynState(w, {k: torch.zeros_like(w[k]) for k in trainable_names(ctx.shared_model())})

    def aggregate(self, state: FedDynState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedDynState:
        if not replies:
            return state
        mean = average((r for _, r in replies), self.hp.weighting)
        theta, h = server_update(state.weights, state.h, [r.weights for _, r in replies], mean,
                                 self.hp.alpha, self.info.num_clients)
        return dataclasses.replace(self.server_update(state, theta, ctx), h=h)  # server_opt: none -> theta

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        anchor = ctx.like_model(msg.weights)  # theta^{t-1}
        keys = list(ctx.trainable(anchor))
        grad_k = state.group("grad") if state is not None else {k: torch.zeros_like(anchor[k]) for k in keys}
        fitted = await ctx.fit(anchor, self.regularized_loss, trainable=tuple(keys),
                               extras={"grad_k": grad_k, "anchor": {k: anchor[k] for k in keys}})
        theta = fitted.weights
        new_grad = {k: grad_k[k] - self.hp.alpha * (theta[k] - anchor[k]) for k in keys}
        return ClientResult(Record(weights=theta), state=Record(arrays={"grad": new_grad}),
                            personal=ctx.shared_model(theta))

    task_loss = staticmethod(cross_entropy)  # L_k, the client's own objective

    def regularized_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         extras: Mapping[str, Any]) -> torch.Tensor:
        """L_k(theta) - <grad_k, theta - theta^{t-1}> + alpha/2 ||theta - theta^{t-1}||^2."""
        task = self.task_loss(model, x, y, extras)  # first: the order of the terms is the order the
        params = dict(model.named_parameters())  # gradient contributions are summed in
        return task + dynamic_regularizer({k: params[k] for k in extras["grad_k"]}, extras["grad_k"],
                                          extras["anchor"], self.hp.alpha)
