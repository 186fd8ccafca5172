"""MP-FedCL (Qiao et al., IEEE Internet of Things Journal 2023, "MP-FedCL: Multiprototype
Federated Contrastive Learning for Edge Intelligence"), Algorithms 1 and 2, with its
single-prototype (SP-FedCL) and DBSCAN (DP-FedCL) variants.

    server, round t: send the global weights w_t and the global prototype pool U
    client i (Algorithm 1):
        w_i <- local SGD on  L_S(F(x), y) + lambda * L_R(f(x), y; U)        eq. (12), L_R eq. (11)
        for every class j it holds: k-means of its embeddings {f(x): y = j} into K
        centroids -> its prototypes of class j                                    (multi-prototype)
        reply w_i, its prototypes, its sample count
    server:
        w_{t+1} = sum_i n_i / n * w_i                           (FedAvg, Algorithm 1 line 9)
        U_j = all clients' prototypes of class j (eq. 8), each arriving client's group padded
              to K with the pool average U_bar_j (eq. 9); a client without class j
              gets K copies of U_bar_j                                             eq. (10)
    inference (Algorithm 2): y_hat = argmin_j min_{u in U_j} ||f(x) - u||_2          eq. (13)

No official code exists; every choice is listed here. Re-checked against the paper's text
(section IV-A/B/C, Algorithms 1-2, Table IV), the points it leaves open or states
ambiguously, and where protofl departs from it:

* Eq. (12) is the plain sum L_S + L_R; ``lam`` = 1 reproduces it (an extension).
* Eq. (11) as printed: -1/(KN) sum_i sum_k 1/|P(y)| sum_{p in P(y)} log [exp(v_i . u_p^k / tau)
  / sum_{a in [C]} exp(v_i . u_a^k / tau)], with "P(y) the set of labels distinct from y"
  and "the size of one [global prototype] set is K". Taken literally the positives would
  be the *other* classes, which contradicts the stated aim (align a representation with
  its class's prototypes, push the others away) and supervised contrastive learning
  [65]; we read P(y) as the prototypes of class y. The printed denominator pairs the k-th
  prototype of every class; the pool holds a variable number of prototypes per class
  (all clients' K each), so ours runs over all pool prototypes. tau = 0.07 (Table IV).
* Eq. (11)'s similarity: "the • symbol denotes the inner (dot) product" of the raw
  embedding and prototype. protofl departs from this: it uses the cosine (the dot
  product of the L2-normalized vectors) divided by tau, the supervised-contrastive form
  of [65] (whose temperatures, 0.07 among them, are set for unit vectors); with a raw
  dot product the scale of the logits would follow the feature norms, which nothing
  bounds.
* Eq. (10) conditions on the count |u_{i,j}| < K and says "replacing u_{i,j}^k with the
  averaged prototype" for each k; read literally, a client with fewer than K prototypes
  of class j would send K copies of U_bar_j and lose its own. We read it as padding, as
  the text around it says ("ensures that each client has K prototypes for each class"):
  the client's own prototypes stay and only the missing slots take U_bar_j. A client
  without class j has |u_{i,j}| = 0 < K and gets K copies of U_bar_j, as eq. (10) and
  its text state: "some clients' classes may be missing ... the global prototype pool can
  be utilized to fill in the missing classes", "each client is guaranteed to have a
  consistent and balanced set of prototypes for all classes, regardless of their
  respective data distribution". (protofl used to leave such clients out of U_j; the
  copies change the pool whenever a class is missing somewhere: they weight U_bar_j in
  L_R's positives and denominator, and U_bar_j can be nearer than every sent prototype
  in eq. 13.) A class that no arriving client holds has no U_bar_j and keeps its
  previous pool prototypes.
* Eq. (9) averages "the N_i instances belonging to U_j": the mean over the pool set of
  class j before padding, i.e. over all prototypes of class j that arrived this round.
* SP-FedCL (single prototype) and DP-FedCL (DBSCAN, section V-D) are described in one
  paragraph each; DBSCAN's eps and min_samples are not given (ours below).

* L_R (eq. 11) is the supervised contrastive loss of :mod:`protofl.nn.contrastive`:
  embeddings and prototypes are compared by the dot product of their L2-normalized
  vectors divided by the temperature tau = 0.07; the positives of a sample are the pool
  prototypes of its class, the denominator runs over the prototypes of all classes, and
  the loss averages the log-probabilities of the positives (``positives="mean_log"``;
  ``"log_sum"`` puts them inside one log). Samples whose class has no pool prototype
  contribute no L_R. ``lam`` (default 1, the plain sum of the paper) weights it.
  Before the first pool exists (round 1) L_R = 0.
* Prototypes are computed after local training from the embeddings of the client's whole
  training set in eval mode (``ctx.features``), in the raw (unnormalized) feature space;
  inference eq. (13) uses the raw L2 distance to them.
* k-means (eq. 7's "Clustering"): section IV-A says "we also randomly select the k
  centroids in the first iteration ... and repeat this process until the centroid does
  not change or changes only slightly" (random initial centroids, one run). protofl
  departs from this: scikit-learn's Lloyd with greedy k-means++ seeding and ``n_init``
  = 5 restarts (lowest inertia wins), at most ``max_iter`` = 100 iterations each, on one
  thread, seeded from the (round, client, class) stream ``ctx.rng("kmeans", j)``
  (:func:`protofl.nn.clustering.kmeans`). Why: a single random start can land in a poor
  local optimum (two centroids in one cluster), which makes the prototypes depend on
  the draw more than on the data; k-means++ with restarts gives the clustering the
  paper's "converge to at least a local optimum" aims at more reliably. ``n_init: 1``
  comes closest to the paper's single run (still k-means++ seeded). A class with fewer
  than K distinct samples yields its distinct embeddings (fewer than K prototypes).
* Padding eq. (10): U_bar_j is the mean of all prototypes of class j in the round's
  replies; every arriving client's group of class j is padded with it to K rows (k-means
  and SP-FedCL; for DP-FedCL, which has no K, to the largest group of that class), a
  client without class j from an empty group, i.e. K copies of U_bar_j (DP-FedCL: as
  many as the class's largest group).
* The pool is rebuilt each round from the replies that arrived; a class that no
  arriving client holds keeps its previous pool prototypes.
* Predictors: personalized = the client's model after local training with the pool it
  received (eq. 13), plus its classifier head as ``@logits``; global = the global model
  with the new pool (eq. 13), plus the global model's head as ``gm@logits``. A class
  with no pool prototype scores -inf (round 1's personalized predictor: every class).
* SP-FedCL: K = 1, the class mean instead of k-means. DP-FedCL: scikit-learn's DBSCAN on
  the L2-normalized embeddings of each class (``eps`` is then scale-free); a prototype is
  the mean of a cluster's raw embeddings; noise points are dropped; a class whose points
  are all noise gets its mean as its only prototype; at most ``max_clusters`` (the
  largest) clusters per class. The DBSCAN defaults are our choice, not the paper's (it
  gives none); why eps = 0.3: benchmarks/history.md, section 5.
* Training settings (SGD lr 0.01, momentum 0.5, decay 0.95 per round, batch 32, one local
  epoch) are engine config (``training.*``, see configs/mpfedcl_mnist.yaml).

Messages:
    server -> client: weights w_t; the pool: group ``pool`` of ``protos`` (P, d), ``labels`` (P,) int64
    client -> server: weights w_i; ``protos`` (m_i, d), ``labels`` (m_i,) int64

Under ``privacy.mode: sample`` the model trains by DP-SGD and the prototypes of every class
are private at the record level: MP-FedCL's k centers by the private k-means (DP-Lloyd,
:func:`protofl.nn.privacy.release_class_kmeans`: 1 + ``privacy.kmeans_steps`` releases a
round), SP-FedCL's class means by one release; DP-FedCL (DBSCAN) is refused. Weights and
prototypes are then private together (docs/privacy.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast, ClassVar, Literal, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require, require_size
from ..messages import Record, expect_arrays, expect_indices, expect_shapes
from ..models.base import FLModel
from ..nn.clustering import dbscan_centroids, kmeans, pad_groups
from ..nn.contrastive import prototype_supcon_loss
from ..nn.privacy import prototype_privacy, release_class_kmeans, release_class_means
from ..nn.prototypes import NearestPrototype
from .base import (ClientContext, ClientResult, cross_entropy, LossFn, Predictors, register, ServerContext,
                   WeightsState)
from .fedavg import FedAvg
from .serveropt import ServerOptHyper


@dataclass
class FedCLHyper(ServerOptHyper):
    tau: float = 0.07  # temperature of eq. (11)
    lam: float = 1.0  # weight of L_R
    positives: Literal["mean_log", "log_sum"] = "mean_log"
    weighting: Literal["samples", "uniform"] = "samples"  # FedAvg weights of the models

    def validate(self, section: str) -> None:
        require(self.tau > 0, f"{section}.tau", self.tau, "must be > 0")
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")


@dataclass
class MPFedCLHyper(FedCLHyper):
    k: int = 2  # K prototypes per class (paper: 2 MNIST, 4 Digit-5/Office-10, 3 DomainNet)
    n_init: int = 5  # k-means restarts
    max_iter: int = 100  # Lloyd iterations per restart

    def validate(self, section: str) -> None:
        super().validate(section)
        require_size(self, section, "k")
        require(self.n_init >= 1, f"{section}.n_init", self.n_init, "must be >= 1")
        require(self.max_iter >= 1, f"{section}.max_iter", self.max_iter, "must be >= 1")


@dataclass
class DPFedCLHyper(FedCLHyper):
    eps: float = 0.3  # DBSCAN radius on L2-normalized embeddings (chord length, 0..2)
    min_samples: int = 5
    max_clusters: int = 10  # per class and client (bounds the message)

    def validate(self, section: str) -> None:
        super().validate(section)
        require(self.eps > 0, f"{section}.eps", self.eps, "must be > 0")
        require(self.min_samples >= 1, f"{section}.min_samples", self.min_samples, "must be >= 1")
        require_size(self, section, "max_clusters")


@dataclass
class PoolState(WeightsState):
    pool: torch.Tensor  # (P, d) the global prototype pool U (all classes)
    labels: torch.Tensor  # (P,) int64 class of each pool prototype


def build_pool(groups: dict[int, list[torch.Tensor]], size: Optional[int],
               dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (10): {class j: [client i's (n_ij, d) prototypes, ...]} -> pool (P, d), labels (P,).

    Each class's groups are padded to ``size`` rows (None: to the class's largest group)
    with the class's pool average."""
    protos: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    for j in sorted(groups):
        gs = groups[j]
        padded = pad_groups(gs, size if size is not None else max(len(g) for g in gs))  # (n_j, K, d)
        flat = padded.reshape(-1, padded.shape[-1])
        protos.append(flat)
        labels.append(torch.full((len(flat),), j, dtype=torch.int64))
    if not protos:
        return torch.zeros(0, dim), torch.zeros(0, dtype=torch.int64)
    return torch.cat(protos), torch.cat(labels)


@register
class MPFedCL(FedAvg[PoolState]):
    name = "mpfedcl"
    family = "prototype exchange"
    reply_arrays = ("protos", "labels")  # besides w_i
    Hyper: ClassVar[type] = MPFedCLHyper

    # -- what distinguishes MP / SP / DP: the prototypes of one class -------------------------
    def class_prototypes(self, z: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """(n, d) embeddings of one class -> (m, d) prototypes."""
        return kmeans(z, self.hp.k, rng, n_init=self.hp.n_init, max_iter=self.hp.max_iter).centroids

    def pad_size(self) -> Optional[int]:
        return cast(int, self.hp.k)

    def local_prototypes(self, ctx: ClientContext, z: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, d) prototypes and (m,) labels of every class the client holds."""
        protos = [torch.zeros(0, self.info.feature_dim)]  # a client without data has none to send
        labels = [torch.zeros(0, dtype=torch.int64)]
        for j in torch.unique(y).tolist():
            p = self.class_prototypes(z[y == j], ctx.rng("kmeans", j))
            protos.append(p.detach().cpu())
            labels.append(torch.full((len(p),), j, dtype=torch.int64))
        return torch.cat(protos), torch.cat(labels)

    def private_prototypes(self, ctx: ClientContext, z: torch.Tensor,
                           y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under ``privacy.mode: sample``: (m, d) prototypes and (m,) labels of every class,
        by the private k-means (protofl.nn.privacy.private_kmeans)."""
        return release_class_kmeans(ctx, z, y, self.info.num_classes, self.hp.k)

    def prototype_releases(self, privacy: Any) -> int:
        return cast(int, 1 + privacy.kmeans_steps)  # the private class means that start k-means, then each Lloyd step

    # -- server ------------------------------------------------------------------------------
    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        # every reply carries both arrays (a client without data: 0 rows of each); aggregate reads them
        missing = expect_arrays(reply, "protos", "labels")
        if missing:
            return missing
        labels = reply.array("labels")
        if labels.dim() != 1:
            return f"array 'labels' has shape {tuple(labels.shape)}, expected (m,)"
        n = len(labels)
        return (expect_shapes(reply, protos=(n, self.info.feature_dim))
                or expect_indices(reply, "labels", self.info.num_classes))

    def server_init(self, ctx: ServerContext) -> PoolState:
        d = self.info.feature_dim
        return PoolState(ctx.init_weights(), torch.zeros(0, d), torch.zeros(0, dtype=torch.int64))

    def configure(self, state: PoolState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights, arrays={"pool": {"protos": state.pool, "labels": state.labels}})

    def aggregate(self, state: PoolState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> PoolState:
        if not replies:
            return state
        new = super().aggregate(state, rnd, replies, ctx)  # FedAvg, Algorithm 1 line 9
        # eq. (10): every arriving client has a group of every class that some arriving client
        # holds; a client without class j contributes an empty group, which pad_groups fills
        # with U_bar_j (K copies; DP-FedCL: as many as the class's largest group)
        held = torch.unique(torch.cat([r.array("labels").cpu()
                                       for _, r in replies])).tolist()
        groups: dict[int, list[torch.Tensor]] = {j: [] for j in held}
        for _, r in replies:  # client-id order
            protos = r.array("protos").detach().cpu().float()
            labels = r.array("labels").cpu()
            for j in held:
                groups[j].append(protos[labels == j])
        pool, labels = build_pool(groups, self.pad_size(), self.info.feature_dim)
        # classes nobody held this round keep their previous pool prototypes
        keep = ~torch.isin(state.labels, labels)
        pool, labels = torch.cat([pool, state.pool[keep]]), torch.cat([labels, state.labels[keep]])
        return dataclasses.replace(new, pool=pool, labels=labels)

    def class_vectors(self, state: PoolState) -> torch.Tensor:
        """One vector per class for the geometry logs: the mean of the class's unit-length
        pool prototypes (the pool holds several per class)."""
        V = torch.zeros(self.info.num_classes, self.info.feature_dim)
        if len(state.pool):
            P = F.normalize(state.pool.float().cpu(), dim=1)
            V.index_add_(0, state.labels.cpu(), P)
        return V

    def global_predictor(self, state: PoolState, ctx: ServerContext) -> Predictors:
        model = ctx.shared_model(state.weights)
        return {"proto": NearestPrototype(cast(nn.Module, model.body), state.pool, state.labels, self.info.num_classes),
                "logits": model}

    # -- client ------------------------------------------------------------------------------
    def local_objective(self, pool: torch.Tensor, labels: torch.Tensor) -> tuple[LossFn, dict[str, torch.Tensor]]:
        """(loss, extras): eq. (12), L_S + lambda * L_R against the pool; L_S alone while the
        pool is empty (round 1) or lambda = 0."""
        if len(pool) == 0 or self.hp.lam == 0:
            return cross_entropy, {}
        return self.contrastive_loss, {"pool": pool, "labels": labels}

    def contrastive_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                         extras: Mapping[str, Any]) -> torch.Tensor:
        z: torch.Tensor = model.body(x)  # (B, d)
        l_ce = F.cross_entropy(model.head(z), y)
        return cast(torch.Tensor, l_ce + self.hp.lam * prototype_supcon_loss(z, y, extras["pool"], extras["labels"],
                                                                             self.hp.tau, self.hp.positives))

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        received = msg.group("pool")
        pool, labels = received["protos"].to(y.device), received["labels"].to(y.device)
        loss, extras = self.local_objective(pool, labels)
        fitted = await ctx.fit(msg.weights, loss, extras=extras)

        z = await ctx.features(fitted.weights)  # (N, d) embeddings after training
        if prototype_privacy(ctx) is not None:  # every class, private (a class held or not looks alike)
            protos, proto_labels = self.private_prototypes(ctx, z, y)
        else:
            protos, proto_labels = self.local_prototypes(ctx, z, y)
        reply = Record(weights=fitted.weights, arrays={"protos": protos.detach().cpu(), "labels": proto_labels.cpu()})
        model = ctx.shared_model(fitted.weights)
        personal = {"proto": NearestPrototype(cast(nn.Module, model.body), pool, labels, C), "logits": model}
        return ClientResult(reply, personal=personal)


@register
class SPFedCL(MPFedCL):
    """SP-FedCL: one prototype per class, the class mean (K = 1)."""

    name = "spfedcl"
    Hyper = FedCLHyper

    def class_prototypes(self, z: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        return z.mean(0, keepdim=True)

    def pad_size(self) -> Optional[int]:
        return 1

    def private_prototypes(self, ctx: ClientContext, z: torch.Tensor,
                           y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        means, counts = release_class_means(ctx, z, y, self.info.num_classes)  # (C, d), (C,)
        keep = counts >= 1
        return means[keep], torch.nonzero(keep).flatten()

    def prototype_releases(self, privacy: Any) -> int:
        return 1  # the class means


@register
class DPFedCL(MPFedCL):
    """DP-FedCL: DBSCAN chooses the number of prototypes of each class."""

    name = "dpfedcl"
    Hyper = DPFedCLHyper

    def class_prototypes(self, z: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        return dbscan_centroids(z, self.hp.eps, self.hp.min_samples, self.hp.max_clusters)

    def pad_size(self) -> Optional[int]:
        return None  # the largest group of each class

    def prototype_releases(self, privacy: Any) -> int:
        return 0  # DBSCAN has no private counterpart here
