"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020, "Personalized Federated Learning
with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach"), Algorithm 1.

The clients minimize the MAML objective F(w) = 1/n sum_i f_i(w - alpha grad f_i(w)): the
loss after one step of adaptation.

    server: send w_t to the sampled clients S_t
    client i: w <- w_t; at every local step, on independent minibatches D, D', D'':
        w~ = w - alpha grad f_i(w; D)                                  (adaptation)
        FO: w <- w - beta grad f_i(w~; D')                             (first order)
        HF: w <- w - beta (I - alpha H~) grad f_i(w~; D'),             (Hessian-free)
            H~ u = [grad f_i(w + delta u; D'') - grad f_i(w - delta u; D'')] / (2 delta),
            u = grad f_i(w~; D')        (a finite-difference Hessian-vector product)
      reply w
    server: w_{t+1} = sum_i (n_i / n) w_i   over the replies
    personalized model of client i: w_t - alpha grad f_i(w_t; D) on one minibatch of its
    own data (one step of SGD with step alpha from the model it received)

How it runs on the engine: one ``ctx.fit`` whose minibatch holds 2 (FO) or 3 (HF) times
``training.batch_size`` samples, cut into the independent batches D, D' (, D'') by the
loss (``nn.inner.split_batch``; a short last batch is cut in proportion). The loss
computes the adaptation with ``torch.func`` (so both executors run it): for FO it returns
f_i(w~; D') with the gradient step held constant, whose gradient is the FO direction; for
HF it returns f_i(w~; D') with the HF direction as its gradient (``nn.inner.with_gradient``).
The run's optimizer takes the outer step with beta = ``training.lr``.

Defaults and deviations:
* ``alpha`` (the adaptation step) defaults to the round's learning rate, and beta (the
  outer step) is ``training.lr`` too, so by default alpha = beta. In PFLlib and the pFedMe
  authors' Per-FedAvg the learning rate is alpha and beta is a separate, smaller value
  (their README: ``--learning_rate 0.005 --beta 0.001``; ``userperavg.py`` takes the outer
  step with ``optimizer.step(beta=self.beta)``): ``algorithm.alpha=0.005
  training.lr=0.001`` reproduces that setting.
* ``variant = fo``: protofl's choice, the variant the pFedMe authors' code and PFLlib
  implement (the only one they have). ``delta = 0.001``: protofl's choice (the paper's
  value was not read).
* The paper's text was not available while writing this module; the updates above are its
  Algorithm 1 (FO and HF variants) as recalled.
* The outer step uses the run's optimizer (momentum, weight decay included); plain SGD in
  the paper.
* ``weighting``: FedAvg's n_i-weighted mean by default; ``uniform`` is the plain mean of
  the replies of Algorithm 1's server step.
* An epoch covers the data once in minibatches of 2 or 3 x ``training.batch_size``
  (PFLlib's convention), not once per batch D.
* The personalized model adapts from the model received this round, on a minibatch of the
  client's training data, one step of size alpha; it is computed only when the engine
  evaluates the client. The pFedMe authors' code (``train_one_step``) takes it from the
  test data and takes a second step, of size beta on another batch, after the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Sequence

import torch
from torch import nn

from ..errors import require
from ..messages import Record
from ..nn.inner import cross_entropy_at, detached, loss_grad, parameters_of, split_batch, with_gradient
from .base import ClientContext, ClientResult, register, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class PerFedAvgHyper(FedAvgHyper):
    variant: Literal["fo", "hf"] = "fo"  # first order, or Hessian-free
    alpha: Optional[float] = None  # adaptation step (None: the round's learning rate)
    delta: float = 0.001  # HF: finite-difference step

    def validate(self, section: str) -> None:
        require(self.alpha is None or self.alpha > 0, f"{section}.alpha", self.alpha,
                "must be > 0 (or null: the round's learning rate)")
        require(self.delta > 0, f"{section}.delta", self.delta, "must be > 0")


def adapted(model: nn.Module, w: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
            alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """w~ = w - alpha grad f(w; x, y), the gradient held constant (d w~ / d w = I)."""
    g = loss_grad(model, w, x, y)
    return {k: v - alpha * g[k] for k, v in w.items()}


def fo_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
    """f(w~; D'): its gradient in w is grad f(w~; D'), the FO step's direction."""
    (x1, y1), (x2, y2) = split_batch(x, y, 2)
    w = parameters_of(model)
    return cross_entropy_at(model, adapted(model, w, x1, y1, extras["alpha"]), x2, y2)


def hf_direction(model: nn.Module, w: dict[str, torch.Tensor], batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 alpha: torch.Tensor, delta: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(I - alpha H~(w; D'')) grad f(w~; D') and f(w~; D'), with H~ the finite-difference Hessian."""
    (x1, y1), (x2, y2), (x3, y3) = batches
    w = detached(w)
    w_tilde = adapted(model, w, x1, y1, alpha)
    u = loss_grad(model, w_tilde, x2, y2)
    value = cross_entropy_at(model, w_tilde, x2, y2)
    plus = loss_grad(model, {k: v + delta * u[k] for k, v in w.items()}, x3, y3)
    minus = loss_grad(model, {k: v - delta * u[k] for k, v in w.items()}, x3, y3)
    return {k: u[k] - alpha * (plus[k] - minus[k]) / (2 * delta) for k in w}, value


@register
class PerFedAvg(FedAvg[WeightsState]):
    name = "perfedavg"
    family = "personalization"
    Hyper = PerFedAvgHyper
    couples_samples = True  # the minibatch is split into the inner step's D and the outer D'

    def hf_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
        w = parameters_of(model)
        d, value = hf_direction(model, w, split_batch(x, y, 3), extras["alpha"], self.hp.delta)
        return with_gradient(value, w, d)

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        alpha = self.hp.alpha if self.hp.alpha is not None else ctx.lr
        extras = {"alpha": torch.tensor(float(alpha), device=ctx.data[1].device)}
        parts = 2 if self.hp.variant == "fo" else 3
        loss = fo_loss if self.hp.variant == "fo" else self.hf_loss
        fitted = await ctx.fit(msg.weights, loss, extras=extras,
                               batch_size=parts * ctx.training_settings().batch_size)
        personal = None
        if ctx.evaluating:  # one step of plain SGD with step alpha from w_t on one minibatch
            step = await ctx.fit(msg.weights, steps=1, lr=float(alpha), momentum=0.0, weight_decay=0.0,
                                 clip_grad=None, optimizer="sgd", report=False)
            personal = ctx.shared_model(step.weights)
        return ClientResult(Record(weights=fitted.weights), personal=personal)
