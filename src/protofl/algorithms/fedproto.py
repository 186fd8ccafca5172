"""FedProto (Tan et al., AAAI 2022, "FedProto: Federated Prototype Learning across
Heterogeneous Clients"), Algorithm 1.

Clients and server exchange only class prototypes; no model weights ever travel, so
every client keeps its own model and clients may differ in architecture as long as the
feature dimension d is shared (``model.per_client``, e.g. cnn_mnist with 18/20/22
channels).

    client i, given the global prototypes C_bar^(j) of the classes that have one:
        minimize  L_S(F_i(x), y) + lambda * L_R(f_i(x), C_bar^(y))           (local loss)
        L_R = 0 for samples whose class has no global prototype yet (round 1: all)
        C_i^(j) = 1/|D_ij| sum_{(x, y) in D_ij} f_i(x)                        (local prototypes)
    server:
        C_bar^(j) = sum_{i in N_j} |D_ij| / N_j * C_i^(j)                     (aggregation)
        (sum over the set of clients holding class j; N_j = sum_i |D_ij|, their samples of class j)
    inference: y_hat = argmin_j ||f_i(x) - C_bar^(j)||_2 over the classes with a global
        prototype (no knowledge of the client's label set), and the local classifier.

Choices and deviations (paper = the AAAI text, read for this module; code = the
authors' release, github.com/yuetan031/FedProto, exps/federated_main.py, lib/update.py
and lib/utils.py, also read):

* L_R (``distance``): the paper writes L_R = sum_j d(C_i^(j), C_bar_i^(j)) between the
  client's local and the global prototypes, "a regularization term that measures the
  distance (we use L2 distance)", and says d "can take a variety of forms, such as L1
  distance, L2 distance, and earth mover's distance", without fixing the scale. The code
  (and protofl) apply it per sample, between the embedding f(x) and the global prototype
  of its class. ``mse`` (default) is what the code computes, the
  loss its README's lambda values (--ld 1 for MNIST/FEMNIST, 0.1 for CIFAR-10) weight:
  the mean over the batch and the d dimensions of (f(x) - C_bar^(y))^2, i.e. the squared
  L2 distance divided by d, with samples without a global prototype counted as 0 in the
  batch mean (the code substitutes the sample's own embedding there). ``sq_l2`` drops
  the 1/d; ``l2`` is the Euclidean distance ||f(x) - C_bar^(y)||_2. The nearest-prototype
  rule is the same for all three.
* Local prototypes: as in the paper, the mean embedding per class over the client's
  whole training set *after* local training, in eval mode (``ctx.features``). The code
  averages the embeddings of the last local epoch in training mode (dropout on, the
  model changing during the epoch).
* Aggregation (``weighting``): ``counts`` (default) weights client i by |D_ij| / N_j as
  in the paper's equation. Its printed form has an extra 1/|N_j| in front of the sum;
  taken literally that would shrink every prototype by the number of clients holding
  the class, so the weights are read as summing to one. ``uniform`` is the plain mean
  over the clients holding the class (what the code does).
* A class that no arriving client holds this round keeps its previous global prototype
  (with full participation, as in the paper, this never happens).
* Inference: the primary predictor (``pa``) takes the argmin over all global prototypes,
  as the paper's inference rule (argmin_j ||f(phi; x) - C^(j)||_2) does. The authors'
  evaluation (test_inference_new_het_lt) restricts the argmin to the client's own
  classes (label knowledge); protofl offers that rule as the ``own`` predictor
  (``pa@own``). The code also accumulates its correct/total counters across users, so
  later users' accuracy mixes in earlier users' samples; that is not copied: the engine
  evaluates each client on its own.
* The nearest-prototype predictors of round r use the prototypes the client received
  (aggregated in round r - 1); in round 1 there are none and every score is -inf. So
  the final evaluation (round T) uses the prototypes aggregated in round T - 1, whereas
  the authors' final test uses those aggregated after the last round, from the same
  final models it tests (exps/federated_main.py: ``proto_aggregation`` after the last
  round, then ``test_inference_new_het_lt``): a difference from the authors'
  evaluation.

Messages (sparse: only the classes that have a prototype travel):
    server -> client: protos (m, d), classes (m,) int64, counts (m,) int64
    client -> server: protos (m_i, d), classes (m_i,), counts (m_i,)
Client state: its model's weights. Server state: :class:`ProtoState`.

Under ``privacy.mode: sample`` the local model trains by DP-SGD and the local prototypes
and counts are released privately (:func:`protofl.nn.privacy.release_class_means`:
clipped features, noisy sums and counts of every class; one release a round): FedProto's
whole message is then private at the record level (docs/privacy.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, ClassVar, Literal, Mapping, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require
from ..messages import Arrays, Record, expect_arrays, expect_indices, expect_shapes
from ..models.base import FLModel
from ..nn.privacy import release_class_means
from ..nn.prototypes import NearestPrototype, aggregate_prototypes
from .base import (Algorithm, ClientContext, ClientResult, cross_entropy, Diagnostics, LossFn, register,
                   ServerContext, weights_of)


@dataclass
class FedProtoHyper:
    lam: float = 1.0  # lambda: weight of L_R (paper: 1 for MNIST/FEMNIST, 0.1 for CIFAR-10)
    distance: Literal["mse", "sq_l2", "l2"] = "mse"
    weighting: Literal["counts", "uniform"] = "counts"

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")


@dataclass
class ProtoState:
    protos: torch.Tensor  # (C, d) global prototypes C_bar; zero rows where counts == 0
    counts: torch.Tensor  # (C,) int64 samples behind each prototype; 0 = no prototype yet


# FedProto's server state: its own ProtoState; the methods built on it keep theirs (FedTGP a
# ProtoState with more fields, FedPCL and FedGH states of their own, with their own server half)
PS = TypeVar("PS")


# ---------------------------------------------------------------------------------------
# shared math
# ---------------------------------------------------------------------------------------
def prototype_distance(z: torch.Tensor, c: torch.Tensor, distance: str) -> torch.Tensor:
    """(B,) per-sample distance between embeddings z (B, d) and targets c (B, d)."""
    diff = z - c
    if distance == "mse":
        return (diff ** 2).mean(1)
    if distance == "sq_l2":
        return (diff ** 2).sum(1)
    if distance == "l2":
        return cast(torch.Tensor, torch.linalg.vector_norm(diff, dim=1))
    raise ValueError(f"unknown distance {distance!r}")


def sparse(protos: torch.Tensor, counts: torch.Tensor) -> Arrays:
    """(C, d) prototypes + (C,) counts -> the message arrays of the classes with count > 0."""
    classes = torch.nonzero(counts > 0).flatten()
    return {"protos": protos[classes].contiguous(), "classes": classes,
            "counts": counts[classes].to(torch.int64)}


def dense(rec: Record, num_classes: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`sparse`: (C, d) prototypes with zero rows, (C,) counts."""
    protos = torch.zeros(num_classes, dim, dtype=torch.float32)
    counts = torch.zeros(num_classes, dtype=torch.int64)
    cls = rec.array("classes").cpu()
    protos[cls] = rec.array("protos").detach().cpu().float()
    counts[cls] = rec.array("counts").cpu()
    return protos, counts


# ---------------------------------------------------------------------------------------
# the method
# ---------------------------------------------------------------------------------------
@register
class FedProto(Algorithm[PS], Diagnostics[PS]):
    name = "fedproto"
    family = "prototype exchange"
    Hyper: ClassVar[type] = FedProtoHyper
    has_global_model = False
    heterogeneous_models = True
    reply_arrays = ("protos", "classes", "counts")

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> PS:
        C, d = self.info.num_classes, self.info.feature_dim
        return cast(PS, ProtoState(torch.zeros(C, d), torch.zeros(C, dtype=torch.int64)))

    def configure(self, state: PS, rnd: int, ctx: ServerContext) -> Record:
        own = cast(ProtoState, state)  # FedProto's own (a method with another state overrides this)
        return Record(arrays=sparse(own.protos, own.counts))

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        # every reply carries all three arrays (a client without data: m_i = 0 rows of each);
        # classes and counts are int64 (they index and fill dense()'s tables)
        missing = expect_arrays(reply, "protos", "classes", "counts")
        if missing:
            return missing
        classes, counts = reply.array("classes"), reply.array("counts")
        if classes.dtype != torch.int64 or counts.dtype != torch.int64:
            return "arrays 'classes' and 'counts' must be int64"
        if classes.dim() != 1:
            return f"array 'classes' has shape {tuple(classes.shape)}, expected (m,)"
        n = len(classes)
        return (expect_shapes(reply, protos=(n, self.info.feature_dim), counts=(n,))
                or expect_indices(reply, "classes", self.info.num_classes, unique=True))

    def aggregate(self, state: PS, rnd: int, replies: list[tuple[int, Record]], ctx: ServerContext) -> PS:
        if not replies:
            return state
        previous = cast(ProtoState, state)  # FedProto's own (a method with another state overrides this)
        C, d = self.info.num_classes, self.info.feature_dim
        local = [dense(r, C, d) for _, r in replies]
        glob, n = aggregate_prototypes([p for p, _ in local], [c for _, c in local], self.hp.weighting)
        fresh = n > 0
        # classes nobody held this round keep their previous prototype
        protos = torch.where(fresh.unsqueeze(1), glob, previous.protos)
        counts = torch.where(fresh, n, previous.counts)
        return cast(PS, ProtoState(protos, counts))

    def class_vectors(self, state: PS) -> Optional[torch.Tensor]:
        return cast(ProtoState, state).protos  # the global prototypes C_bar (C, d); zero rows: none yet

    def prototype_releases(self, privacy: Any) -> int:
        return 1  # the local prototypes and counts, once per round

    # -- client ------------------------------------------------------------------------------
    def client_init(self, ctx: ClientContext) -> Record:
        return Record(weights=weights_of(ctx.shared_model()))

    def local_objective(self, c_bar: torch.Tensor, has: torch.Tensor) -> tuple[LossFn, dict[str, torch.Tensor]]:
        """(loss, extras): L_S + lambda * L_R with the global prototypes c_bar (C, d) where has
        (C,) is true; L_S alone while no class has a global prototype (round 1) or lambda = 0."""
        if not bool(has.any()) or self.hp.lam == 0:
            return cross_entropy, {}
        return self.prototype_loss, {"c_bar": c_bar, "has": has}

    def prototype_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                       extras: Mapping[str, Any]) -> torch.Tensor:
        c_bar, has = extras["c_bar"], extras["has"]
        z: torch.Tensor = model.body(x)  # (B, d)
        l_s = F.cross_entropy(model.head(z), y)
        m = has[y]  # (B,) samples whose class has a global prototype
        target = torch.where(m.unsqueeze(1), c_bar[y], z.detach())  # own embedding: distance 0
        l_r = torch.where(m, prototype_distance(z, target, self.hp.distance), torch.zeros_like(l_s)).mean()
        return cast(torch.Tensor, l_s + self.hp.lam * l_r)

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        c_bar, n_bar = dense(msg, C, self.info.feature_dim)
        c_bar, has = c_bar.to(y.device), (n_bar > 0).to(y.device)
        loss, extras = self.local_objective(c_bar, has)
        assert state is not None  # client_init made it
        fitted = await ctx.fit(state.weights, loss, extras=extras)  # from the client's own model

        # local prototypes: class means of the embeddings after training (eval mode)
        # (N, d) embeddings ((0, d) for a client without data)
        z = await ctx.features(fitted.weights)
        protos, counts = release_class_means(ctx, z, y, C)  # private under privacy.mode: sample
        reply = Record(arrays=sparse(protos.detach().cpu(), counts.cpu()))
        model = ctx.shared_model(fitted.weights)
        present = torch.nonzero(has).flatten()
        # "own": the paper's evaluation rule, the argmin restricted to the client's own classes
        own = torch.nonzero(has & (ctx.class_counts.to(has.device) > 0)).flatten()
        body = cast(nn.Module, model.body)
        personal = {"proto": NearestPrototype(body, c_bar[present], present, C),
                    "own": NearestPrototype(body, c_bar[own], own, C), "logits": model}
        return ClientResult(reply, state=Record(weights=fitted.weights), personal=personal)
