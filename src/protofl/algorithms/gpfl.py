"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao & Guan, ICCV 2023, "GPFL: Simultaneously
Learning Global and Personalized Feature Information for Personalized Federated
Learning"): a shared feature extractor whose output a conditional valve (CoV) turns into a
global and a personalized feature, the global one guided by global category embeddings
(GCE).

    modules: feature extractor f (shared), GCE: class embeddings E in R^{C x d} (shared),
             CoV: gamma(.), beta(.) -- each Linear(d, d) + ReLU + LayerNorm (shared),
             personal head h_i (stays on the client)
    conditional inputs (from the received E): g = (1/C) sum_c E_c (global),
             p_i = sum_c pi_ic E_c, pi_ic = n_ic / n_i (personalized)
    CoV(z, c) = ReLU( z (.) (gamma(c) + 1) + beta(c) )
    client i, per minibatch, z = f(x), z_G = CoV(z, g), z_P = CoV(z, p_i):
        L = CE(h_i(z_P), y)                                       personalized loss
          + CE(cos(z_G, E), y)                                    angle-level guidance
          + lam ||z_G - E0_y||_2                                  magnitude-level guidance
          + (mu / 2) (||GCE||^2 + ||CoV||^2)                      regularization
        E0 = the received E, held fixed (the "frozen" GCE); cos(z_G, E) the (B, C) cosine
        similarities used as logits; ||.||_2 over the whole batch (not squared, not averaged)
    server: (f, GCE, CoV)_{t+1} = sum_i (n_i / n) (f, GCE, CoV)_i   over the replies
    personalized model (PM, PA): h_i(CoV(f(x), p_i)); no global model (GA is the mean of the
    personalized models on the global test set)

On the engine: ``adapt_model`` adds ``model.gce`` (the embedding table) and ``model.cov``;
the split is FedPer's (the head personal, everything else averaged). One ``ctx.fit`` per
round with the loss above; g, p_i and E0 are the client's extras.

Defaults (the authors' ``run_me.sh``, github.com/TsingZ0/GPFL, for the 4-layer CNN and
3-layer MLP): lam = 0.01, mu = 0.1.

Choices and deviations:
* mu is an L2 term in the loss on the GCE and CoV parameters (the code: SGD weight decay
  mu on their own optimizers; identical gradients).
* The magnitude term is one L2 norm over the whole batch, ``torch.norm(feat_G - emb, 2)``
  as in the authors' code; the poster's eq. (4) writes it for one sample,
  ||f^G_i - GCE(y_i; C^)||_2 (C^ the frozen GCE). For samples at similar distances the
  batch's norm is sqrt(B) times their mean, so lam weighs about sqrt(B) times more than
  in a per-sample mean. protofl follows the code, departing from eq. (4). The norm couples
  the batch's samples, so DP-SGD (``privacy.mode: sample``) refuses GPFL.
* The conditional inputs are computed from the GCE the client receives at its turn. The
  authors' code uses zero vectors in round 1 (``clientgp.py``, before any ``set_GCE``);
  afterwards the server's ``set_GCE`` runs on every client every round, computing them
  from the client's own GCE *before* overwriting it with the new global one: the GCE it
  trained in the previous round if it trained then, else the previous round's global
  GCE (one aggregation older than the one it receives).
* All parts step with the run's optimizer (the code: three plain SGD optimizers at one
  learning rate).
* The personalized model is evaluated after local training; the authors' code evaluates
  it at the start of a round, before local training.
* The paper's text was not available while writing this module; the method is stated from
  the authors' code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Mapping, Optional, TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import require
from ..messages import Record
from .base import ClientContext, ClientResult, register, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer

if TYPE_CHECKING:
    from ..models.base import FLModel


@dataclass
class GPFLHyper(FedAvgHyper):
    lam: float = 0.01  # magnitude-level guidance
    mu: float = 0.1  # L2 regularization of GCE and CoV

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")
        require(self.mu >= 0, f"{section}.mu", self.mu, "must be >= 0")


def _valve_net(d: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm(d))


class CoV(nn.Module):
    """The conditional valve: ReLU(z (.) (gamma(c) + 1) + beta(c)) for a condition c (d,)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma, self.beta = _valve_net(d), _valve_net(d)

    def forward(self, z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.relu(z * (self.gamma(c) + 1) + self.beta(c))


def conditional_inputs(E: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, p): the mean class embedding and the client's label-weighted one."""
    pi = counts.to(E.dtype) / counts.sum().clamp(min=1)
    return E.mean(0), pi @ E


def angle_loss(z_G: torch.Tensor, E: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """CE over the cosine similarities of the global features to the class embeddings."""
    return F.cross_entropy(F.normalize(z_G, dim=1) @ F.normalize(E, dim=1).T, y)


class Valved(nn.Module):
    """GPFL's personalized predictor: h_i(CoV(f(x), p_i))."""

    def __init__(self, model: nn.Module, p: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("p", p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = cast("GPFLModel", self.model)
        return cast(torch.Tensor, model.head(model.cov(model.body(x), self.p)))


if TYPE_CHECKING:
    class GPFLModel(FLModel):
        """A protofl model after :meth:`GPFL.adapt_model`."""

        gce: nn.Embedding
        cov: CoV


@register
class GPFL(FedPer[WeightsState]):
    name = "gpfl"
    Hyper = GPFLHyper
    hp: GPFLHyper
    couples_samples = True  # the magnitude term is one norm over the whole batch

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model = cast("GPFLModel", model)  # a protofl model; gce and cov added here
        model.gce = nn.Embedding(model.num_classes, model.feature_dim)
        model.cov = CoV(model.feature_dim)
        return model

    def gpfl_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                  extras: Mapping[str, Any]) -> torch.Tensor:
        hp = self.hp
        model = cast("GPFLModel", model)  # adapt_model's
        z = model.body(x)
        z_G, z_P = model.cov(z, extras["g"]), model.cov(z, extras["p"])
        E = model.gce.weight
        loss: torch.Tensor = F.cross_entropy(model.head(z_P), y) + angle_loss(z_G, E, y)
        loss = loss + hp.lam * torch.linalg.vector_norm(z_G - extras["E0"][y])
        l2 = sum((p ** 2).sum() for p in [*model.gce.parameters(), *model.cov.parameters()])
        return loss + 0.5 * hp.mu * l2

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it (the initial head)
        E0 = msg.weights["gce.weight"]
        g, p = conditional_inputs(E0, ctx.class_counts.to(E0.device))
        fitted = await ctx.fit({**msg.weights, **state.weights}, self.gpfl_loss, extras={"g": g, "p": p, "E0": E0})
        w = fitted.weights
        return ClientResult(Record(weights=self.shared_part(w)), state=Record(weights=self.personal_part(w)),
                            personal=Valved(ctx.shared_model(w), p))
