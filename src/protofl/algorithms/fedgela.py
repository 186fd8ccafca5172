"""FedGELA (Fan et al., NeurIPS 2023, "Federated Learning with Bilateral Curation for
Partially Class-Disjoint Data"), and its ablation FedGE (global ETF, no local adaptation).

    global head: a random simplex ETF, W = sqrt(E_W) M with
           M = sqrt(C/(C-1)) U (I_C - 1 1^T / C), U^T U = I_C (d x C; every column has norm
           sqrt(E_W), any two columns have cosine -1/(C-1)); fixed for the whole run
    features: h = f(theta; x) / ||f(theta; x)||  (E_H = 1)
    local adaptation, eq. (4): W_k = Phi_k W = Phi_k sqrt(E_W) M with
           Phi_k = diag(Phi_{k,1}, ..., Phi_{k,C}), Phi_{k,c} = n_{k,c} / (n_k gamma),
           scaling the ETF column of class c; gamma = 1/C by default, so that
           sum_k (n_k / n) Phi_k = I when the global data is balanced
    client k, eq. (5): E epochs of SGD on the backbone theta only, minimizing
           -log [ exp(Phi_{k,y} W_y^T h) / sum_{c in C_k} exp(Phi_{k,c} W_c^T h) ]
           where C_k = {c : n_{k,c} > 0} are the client's existing classes
    server: theta_{t+1} = sum_k (n_k / n) theta_k (the head is never aggregated)
    inference: GA (generic) = global backbone + plain ETF, logits W^T h;
           PA (personal) = the client's backbone after local training + its adapted ETF,
           logits Phi_k W^T h
    FedGE: the same global ETF without local adaptation (Phi_k = I, softmax over all C classes,
           personal model = the client's backbone + plain ETF)

Hyper-parameters:
* ``E_W`` (squared norm of each ETF column, W = sqrt(E_W) M, Algorithm 1): the paper tunes
  it with unit features (E_H = 1, section 5.1); its text says "As shown in Figure 4, from a
  large range from 10e3 to 10e6 of E_W, our method achieves bilateral improvement" (Fig. 4's
  x axis is log E_W). Read literally, 10e3 .. 10e6 is 10^4 .. 10^7; we read it as
  10^3 .. 10^6, taking 10eN for 10^N (the figure itself is not in the text copy we read).
  Default 10^3, the low end of that range. The logits then lie in
  [-sqrt(E_W), sqrt(E_W)] = [-31.6, 31.6] (times Phi).
* ``clip_grad`` (20): local gradient-norm clip, the authors' ``clip_grad_norm_(max_norm=20)``;
  null = the engine's ``training.clip_grad``. Logits of scale sqrt(E_W) give large
  gradients early in training; the clip keeps E_W = 10^3 stable at lr 0.01.
* ``projection`` (false): a linear layer d -> d appended to the backbone, whose signed
  output the head normalizes (h = f / ||f||) before the ETF: the paper's models feed the
  ETF "one layer of FC as the projection layer" (Appendix C: 84-d for SVHN and CIFAR-10,
  512-d for CIFAR-100); the authors' code has a Linear-ReLU-Linear encoder instead
  (model.py, model_cifar; out_dim 512 for CIFAR-10). Our bodies end in a ReLU, so every
  feature lies in the non-negative orthant: a non-negative unit feature reaches cosine at
  most ||W_c^+|| / ||W_c|| with an ETF direction W_c (W_c^+ its positive part; about 0.7
  for the randomly rotated ETF in 128 dimensions), so no feature can point at its class's
  direction; the projection makes the features signed. Off by default:
  the ETF sits directly on the (normalized) ReLU features.
* ``gamma`` (null = 1/C), ``weighting`` (backbone aggregation: "samples" as in the paper,
  or "uniform").

Why these defaults (E_W, the clip, the projection), measured: benchmarks/history.md,
section 4.

Feature dimension: a simplex ETF of C vectors needs d >= C-1. For d >= C we use the paper's
construction; for d = C-1 (where U^T U = I_C is impossible) the same Gram matrix
M^T M = C/(C-1) (I - 1 1^T / C) is built in the (C-1)-dim subspace 1^perp
(:func:`protofl.nn.heads.simplex_etf`); for d < C-1 the method refuses to start with a
configuration error naming the model's feature_dim.

Choices where the paper is silent: a class the client lacks has Phi_{k,c} = 0, so the
personal model gives it logit 0 (it stays in the argmax; the authors' code does the same).

Deviations from the authors' released code (github.com/MediaBrain-SJTU/FedGELA), which does
not run as released (undefined names; an ETF width hard-coded per dataset, 84 for CIFAR-10,
that mismatches the feature width of its default model):
* their "E_W" is a temperature dividing the logits (the code's default 0.2; their README
  runs ``--temperature=0.00001``, i.e. logits x 10^5); the logits are an ETF of unit
  columns times ``out_g``, the third output of model_cifar, ``self.proxy(x)`` on the
  encoder's output x. For ``--proxy etf`` (FedGELA.py's default, and their README's)
  model.py's ``proxies`` makes that a BatchNorm1d, so the features are un-normalized
  BatchNorm outputs; this is inferred from the source, not run: model.py also star-imports
  a ``get_proxy`` module the repository lacks. We follow the paper: unit features and an
  ETF of column norm sqrt(E_W).
* their local loss takes the softmax over all C classes (absent classes with logit 0); we
  follow eq. (5), the softmax over the client's classes C_k.
* their ETF is drawn from numpy's global RNG after ``set_seed`` seeded it with the run's
  ``init_seed`` (and after the partitioning's draws); ours comes from a generator of its
  own, seeded from the run's seed, the same in every process. Both are fixed by the seed,
  with different draws.
* their aggregation weights are the number of local batches; ours the number of samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast, ClassVar, Literal, Mapping, Optional, TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError, require
from ..messages import Record
from ..nn.heads import FixedHead, add_projection, simplex_etf
from .base import ClientContext, ClientResult, GlobalModel, register, ServerContext, TaskInfo, WeightsState
from .serveropt import ServerOptHyper

if TYPE_CHECKING:
    from ..models.base import FLModel


E_W_DEFAULT = 1000.0  # the low end of the paper's sweep (read as 10^3 .. 10^6); see the docstring
PROJECTION_DEFAULT = False  # off: see the docstring and benchmarks/history.md, section 4
CLIP_DEFAULT: Optional[float] = 20.0  # the authors' clip_grad_norm_(max_norm=20)


@dataclass
class FedGEHyper(ServerOptHyper):
    E_W: float = E_W_DEFAULT  # squared column norm of the ETF: logits lie in [-sqrt(E_W), sqrt(E_W)]
    weighting: Literal["samples", "uniform"] = "samples"
    projection: bool = PROJECTION_DEFAULT  # linear projection before the (normalizing) ETF head
    clip_grad: Optional[float] = CLIP_DEFAULT  # local gradient-norm clip; null = training.clip_grad

    def validate(self, section: str) -> None:
        require(self.E_W > 0, f"{section}.E_W", self.E_W, "must be > 0")
        require(self.clip_grad is None or self.clip_grad > 0, f"{section}.clip_grad", self.clip_grad, "must be > 0 or null")


@dataclass
class FedGELAHyper(FedGEHyper):
    gamma: Optional[float] = None  # Phi_{k,c} = n_{k,c} / (n_k gamma); null = 1/C

    def validate(self, section: str) -> None:
        super().validate(section)
        require(self.gamma is None or self.gamma > 0, f"{section}.gamma", self.gamma, "must be > 0 or null")


@dataclass
class FedGELAState(WeightsState):
    """``weights``: backbone theta and the fixed ETF head (buffers)."""


def local_adaptation(counts: torch.Tensor, gamma: Optional[float] = None) -> torch.Tensor:
    """(C,) Phi_k: Phi_{k,c} = n_{k,c} / (n_k gamma), gamma = 1/C by default."""
    n = counts.to(torch.float32)
    C = n.numel()
    g = 1.0 / C if gamma is None else float(gamma)
    return n / (n.sum().clamp(min=1.0) * g)


def gela_loss(logits: torch.Tensor, y: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Eq. (5): cross-entropy of the logits Phi_{k,c} W_c^T h over the existing classes only.

    ``logits`` (B, C) = W^T h with the plain ETF; ``phi`` (C,) the client's Phi_k, zero
    exactly for the classes it lacks (they leave the softmax).
    """
    z = (logits * phi).masked_fill(phi <= 0, float("-inf"))  # (B, C)
    return F.cross_entropy(z, y)


class AdaptedETF(nn.Module):
    """The personal predictor: the client's backbone with its adapted ETF, logits Phi_k W^T h."""

    def __init__(self, model: nn.Module, phi: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("phi", phi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.model(x) * self.phi)  # (B, C)


@register
class FedGELA(GlobalModel[FedGELAState]):
    name = "fedgela"
    family = "fixed and calibrated heads"
    reply_arrays = ()  # the backbone theta only
    Hyper: ClassVar[type[FedGEHyper]] = FedGELAHyper  # FedGE: FedGEHyper
    adapt_locally = True  # False: FedGE

    def __init__(self, hp: Any, info: TaskInfo) -> None:
        super().__init__(hp, info)
        C, d = info.num_classes, info.feature_dim
        if d < C - 1:
            raise ConfigError("algorithm.name", self.name,
                              f"its simplex ETF of {C} classes needs feature_dim >= num_classes - 1 = {C - 1}, "
                              f"but the model's features have {d} dimensions; choose a model with wider "
                              f"features (a simplex ETF does not exist in fewer dimensions)")

    # -- model: the fixed ETF head ------------------------------------------------------------
    def adapt_model(self, model: nn.Module) -> nn.Module:
        flm = cast("FLModel", model)  # a protofl model
        M = simplex_etf(flm.num_classes, flm.feature_dim, self.info.seed)  # (d, C)
        if self.hp.projection:
            model = add_projection(model)  # signed features (the authors' projection layer)
        W = math.sqrt(self.hp.E_W) * M  # (d, C), columns of norm sqrt(E_W)
        model.head = FixedHead(W.T, scale=1.0, learn_scale=False)  # logits = W^T h, h unit
        return model

    # -- server -------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedGELAState:
        return FedGELAState(ctx.init_weights())  # theta_0 and the ETF; aggregate: the backbone only

    # -- client -------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        clip = self.train_overrides()
        if self.adapt_locally:
            phi = local_adaptation(ctx.class_counts, self.hp.gamma).to(ctx.data[1].device)  # (C,) Phi_k
            # eq. (5); the head has no parameters: only theta moves
            fitted = await ctx.fit(msg.weights, self.adapted_loss, extras={"phi": phi}, **clip)
        else:  # FedGE: plain cross-entropy over all classes
            fitted = await ctx.fit(msg.weights, **clip)
        model = ctx.shared_model(fitted.weights)
        reply = Record(weights={k: v for k, v in fitted.weights.items() if not k.startswith("head.")})
        return ClientResult(reply, personal=AdaptedETF(model, phi) if self.adapt_locally else model)

    @staticmethod
    def adapted_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
        return gela_loss(model(x), y, extras["phi"])  # eq. (5)

    def train_overrides(self) -> dict[str, Any]:
        return {} if self.hp.clip_grad is None else {"clip_grad": self.hp.clip_grad}

    # the server: GlobalModel's average of the backbones (the ETF head, in no reply, is kept as
    # is); GA: the global backbone with the plain ETF

    def class_vectors(self, state: FedGELAState) -> Optional[torch.Tensor]:
        return state.weights["head.weight"]  # the ETF's columns, one row per class (C, d)


@register
class FedGE(FedGELA):
    """FedGELA without local adaptation: a global ETF head, plain cross-entropy."""

    name = "fedge"
    Hyper = FedGEHyper
    adapt_locally = False
