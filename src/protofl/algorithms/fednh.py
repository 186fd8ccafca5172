"""FedNH (Dai et al., AAAI 2023, "Tackling Data Heterogeneity in Federated Learning with
Class Prototypes"), Algorithm 1, and FedUH (the uniform head, never updated): implemented in
the authors' code (src/flbase/strategies/FedUH.py: FedAvg with the fixed head and a
learnable scale, the base class of their FedNHClient and FedNHServer), not reported in the
paper: the paper uses the uniform head (UH) only in its spiral figures, and its Table 1 has
no FedUH row.

    model: body f(theta; x) in R^d, L2-normalized; head W (C x d) of unit class prototypes;
           logits = s * W f(theta; x) / ||f(theta; x)||, s learnable (or fixed)
    init (problem 1): W = argmax_{||w_c|| = 1} min_{i != j} ||w_i - w_j||
           d >= C-1: the regular simplex; C > d+1: numerical (see protofl.nn.heads)
    server: send (theta_t, s_t, W_t) to the sampled clients S_t
    client k: E epochs of SGD on theta and s only on eq. (2), the local objective
           (cross-entropy of s W f / ||f||; W is fixed during local training), then
           eq. (3): mu_{k,c} = (1/n_{k,c}) sum_{i: y_i = c} f(theta_k; x_i) / ||f(theta_k; x_i)||
           for every class c it owns; reply theta_k, s_k, mu_k (C x d) and n_k (C,)
    server: Algorithm 1, line 9: theta_{t+1}, s_{t+1} = 1/|S_t| sum_k (theta_k, s_k)  (uniform)
           eq. (4): W_c <- rho W_c + (1 - rho) sum_{k in S_t} alpha_k mu_{k,c}, then
           (Algorithm 1, line 8) W_c <- W_c / ||W_c||; classes nobody reported keep W_c
    personalized model: the client's body after local training with the head it received
    FedUH: rho = 1 (W stays at its initialization; clients send no prototypes)

Implementation: ``adapt_model`` replaces ``model.head`` by a :class:`~protofl.nn.heads.FixedHead`
whose W is a *buffer*: it travels with the weights in every message but no optimizer moves
it, and the server sets it by eq. (4) instead of averaging it. Replies leave W out (the
client never changes it).

Hyper-parameters:
* ``rho`` (0.9): eq. (4) smoothing.
* ``weighting`` (body aggregation): ``uniform`` (default) is Algorithm 1 line 9,
  1/|S_t| sum_k theta_k, and the authors' code; ``samples`` weights by n_k as FedAvg does
  (the two compared: benchmarks/history.md, section 4).
* ``proto_weighting`` (alpha in eq. 4: "some positive scalars" in Section 3, set in
  Appendix A.2: "The aggregation weight is set as alpha_k^t = 1/|S^t|", beside "we use
  rho=0.9 for all tests"): ``uniform`` (default) is that choice, alpha_k = 1/|S_t|, so a
  class held by few of the sampled clients moves less than one held by all; ``counts``
  alpha_{k,c} = n_{k,c} / sum_j n_{j,c} applied to the plain eq. (3) means; ``official``
  the authors' server (FedNH/src/flbase/strategies/FedNH.py): each client's class mean is
  renormalized, mu_{k,c} / ||mu_{k,c}||, weighted by n_{k,c} / sum_j n_{j,c}, the weighted
  average is renormalized, and only then enters the moving average (normalized again).
* ``scale`` (initial value of s, or its value when ``learn_scale`` is false; the paper
  suggests s = 30 for a fixed scale), ``learn_scale`` (true).
* ``projection`` (false): an optional linear layer + L2 normalization in front of the
  head (see ``protofl.nn.heads.ProjectionHead`` and FedGELA); off for FedNH because its
  head already normalizes the features and the paper's body has none.

Choices where the paper is silent: the initial s is 1.0 (Appendix A.2 only makes s
trainable). The authors' code starts s at 1.0 in Conv2CifarNH (their CIFAR model) but at
20.0 in ResNetModNH (src/flbase/models/CNN.py, their TinyImageNet ResNet-18), and their
MLPNH (the spiral's MLP) has no scale parameter (s = 1); with ``resnet18_gn``
``algorithm.scale=20`` follows them. A client's mu_{k,c} is the plain mean of normalized
features (eq. 3), not renormalized (``official`` renormalizes it).

Deviations from the authors' released code (github.com/Yutong-Dai/FedNH):
* init: their code substitutes ``torch.nn.init.orthogonal_`` for problem (1) (their issue
  #1: the orthonormal basis "has the notion of uniformity but lacks the notion of maximum
  separation"); this holds for every C: for C <= d the rows are orthonormal, all at
  distance sqrt(2) = 1.414 where the simplex's are sqrt(2C/(C-1)) (1.491 at C = 10), and for
  C > d orthogonal_ makes the columns orthonormal, so the rows are not even unit vectors.
  We solve problem (1).
* eq. (4): the default alpha is the paper's literal 1/|S_t|; ``proto_weighting: official``
  is their aggregation (above). ``counts`` alone does NOT reproduce it: it weights by the
  same class counts but averages the un-normalized means and skips the intermediate
  renormalization.
* eq. (3): our means are over the client's un-augmented training inputs (as the paper
  writes them); theirs are over their training loader, augmented (random crop and flip) on
  CIFAR and TinyImageNet; this differs only under ``data.augment``.
* their optional "adversarial" prototype aggregation (confidence-weighted) is not implemented.

Under ``privacy.mode: sample`` theta and s train by DP-SGD and eq. (3)'s means and counts
are released privately (:func:`protofl.nn.privacy.release_class_means`; the normalized
features already have norm 1; one release a round): weights and prototypes are private
together (docs/privacy.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, ClassVar, Literal, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import require
from ..messages import Arrays, Record, expect_arrays, expect_shapes
from ..models.base import FLModel
from ..nn.heads import FixedHead, add_projection, max_separated_prototypes, min_pairwise_distance
from ..nn.privacy import release_class_means
from .base import ClientContext, ClientResult, GlobalModel, register, ServerContext, WeightsState
from .serveropt import ServerOptHyper

HEAD_W = "head.weight"  # the prototypes W (C, d) inside the model's state dict


@dataclass
class FedUHHyper(ServerOptHyper):
    scale: float = 1.0  # s: initial value (learn_scale) or fixed value
    learn_scale: bool = True
    weighting: Literal["samples", "uniform"] = "uniform"  # body aggregation (Algorithm 1, line 9)
    projection: bool = False  # linear projection + L2 normalization before the head

    def validate(self, section: str) -> None:
        require(self.scale > 0, f"{section}.scale", self.scale, "must be > 0")


@dataclass
class FedNHHyper(FedUHHyper):
    rho: float = 0.9  # eq. (4) smoothing
    proto_weighting: Literal["uniform", "counts", "official"] = "uniform"  # alpha_k in eq. (4)

    def validate(self, section: str) -> None:
        super().validate(section)
        require(0.0 <= self.rho <= 1.0, f"{section}.rho", self.rho, "must be in [0, 1]")


@dataclass
class FedNHState(WeightsState):
    """``weights``: theta, s and W (under "head.weight")."""


def prototype_update(W: torch.Tensor, mu: torch.Tensor, counts: torch.Tensor, rho: float,
                     weighting: str = "uniform") -> torch.Tensor:
    """Eq. (4) for all classes at once.

    W (C, d) current unit prototypes; mu (K, C, d) the K replies' class means (eq. 3, zero
    rows for classes a client lacks); counts (K, C) their class counts. Returns the new
    (C, d) W: rho W_c + (1 - rho) sum_k alpha_k mu_{k,c}, row-normalized; a class no client
    reported (or whose update cancels to zero) keeps W_c.

    ``weighting``: "uniform" alpha_k = 1/|S_t|; "counts" alpha_{k,c} = n_{k,c} / sum_j n_{j,c};
    "official" (the authors' code) the same count weights on the renormalized means
    mu_{k,c} / ||mu_{k,c}||, and the weighted average renormalized before the moving average.
    """
    K = mu.shape[0]
    has = (counts > 0).to(mu.dtype)  # (K, C)
    if weighting == "uniform":
        alpha = has / K  # alpha_k = 1/|S_t|; a client without class c adds nothing to it
    elif weighting in ("counts", "official"):
        alpha = counts.to(mu.dtype) / counts.sum(0).clamp(min=1).to(mu.dtype)  # (K, C)
    else:
        raise ValueError(f"weighting must be 'uniform', 'counts' or 'official', got {weighting!r}")
    if weighting == "official":
        mu = F.normalize(mu, dim=2)  # each client's class mean renormalized (zero rows stay 0)
    avg = (alpha.unsqueeze(2) * mu).sum(0)  # (C, d)
    if weighting == "official":
        avg = F.normalize(avg, dim=1)
    new = rho * W + (1.0 - rho) * avg
    norm = new.norm(dim=1, keepdim=True)  # (C, 1)
    keep = (has.sum(0) == 0) | (norm.squeeze(1) < 1e-12)
    return torch.where(keep.unsqueeze(1), W, new / norm.clamp(min=1e-12))


@register
class FedNH(GlobalModel[FedNHState]):
    name = "fednh"
    family = "fixed and calibrated heads"
    reply_arrays = ("proto", "counts")  # besides theta and s
    Hyper: ClassVar[type] = FedNHHyper

    @property
    def rho(self) -> float:
        return cast(float, self.hp.rho)

    @property
    def updates_head(self) -> bool:
        return self.rho < 1.0

    # -- model: fixed prototype head, problem (1) ---------------------------------------------
    def adapt_model(self, model: nn.Module) -> nn.Module:
        base = cast(FLModel, model)  # the zoo's models
        W = max_separated_prototypes(base.num_classes, base.feature_dim, self.info.seed)  # (C, d)
        if self.hp.projection:
            model = add_projection(model)
        model.head = FixedHead(W, scale=self.hp.scale, learn_scale=self.hp.learn_scale)
        return model

    # -- server -------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedNHState:
        return FedNHState(ctx.init_weights())

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        C, d = self.info.num_classes, self.info.feature_dim
        # with a moving head, aggregate reads both arrays: asked for, not only shaped
        return ((expect_arrays(reply, "proto", "counts") if self.updates_head else None)
                or expect_shapes(reply, proto=(C, d), counts=(C,)))

    # -- client -------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        fitted = await ctx.fit(msg.weights)  # theta and s move; W is a buffer and stays fixed
        arrays: Arrays = {}
        if self.updates_head:  # eq. (3): class means of the normalized features after training
            f = F.normalize(await ctx.features(fitted.weights, "body"), dim=1)  # (n_k, d)
            # (C, d), (C,); private under privacy.mode: sample
            arrays["proto"], arrays["counts"] = release_class_means(ctx, f, ctx.data[1], ctx.num_classes)
        reply = Record(weights={k: v for k, v in fitted.weights.items() if k != HEAD_W}, arrays=arrays)
        return ClientResult(reply, personal=ctx.shared_model(fitted.weights))

    # -- server -------------------------------------------------------------------------------
    def aggregate(self, state: FedNHState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedNHState:
        new = super().aggregate(state, rnd, replies, ctx)  # theta, s: line 9 (W is not in replies)
        if new is state or not self.updates_head:
            return new  # nobody arrived: keep theta_t, s_t, W_t
        W = state.weights[HEAD_W]
        # "proto" and "counts": tensors, as the clients send them (check_reply checks their shapes)
        mu = torch.stack([r.array("proto") for _, r in replies]).to(W)  # (K, C, d)
        counts = torch.stack([r.array("counts") for _, r in replies]).to(W.device)  # (K, C)
        new.weights[HEAD_W] = prototype_update(W, mu, counts, self.rho, self.hp.proto_weighting)  # eq. (4)
        ctx.log("head_min_dist", min_pairwise_distance(new.weights[HEAD_W]))
        return new

    def class_vectors(self, state: FedNHState) -> Optional[torch.Tensor]:
        return state.weights[HEAD_W]  # the prototypes W (C, d)

    def prototype_releases(self, privacy: Any) -> int:
        return 1 if self.updates_head else 0  # eq. (3)'s means and counts, once per round


@register
class FedUH(FedNH):
    """FedNH with rho = 1: the uniform (maximally separated) head is never updated."""

    name = "feduh"
    Hyper = FedUHHyper

    @property
    def rho(self) -> float:
        return 1.0
