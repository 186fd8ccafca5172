"""FPL (Huang, Ye, Shi, Li & Du, CVPR 2023, "Rethinking Federated Learning with Domain Shift: A
Prototype View"): FedAvg whose clients are pulled towards *cluster* prototypes (several
per class, robust to a dominant domain) and an *unbiased* prototype per class.

    client i, given the cluster prototypes P^k of every class k and the unbiased ones U^k
    (Algorithm 1, LocalUpdating):
        z = f(x);  s(z, c) = cos(z, c) / tau                                          (7)
        L_CPCL = -log [ sum_{c in P^y} exp(s(z, c))
                        / (sum_{c in P^y} exp(s(z, c)) + sum_{c in N^y} exp(s(z, c))) ]   (8)
                 N^y = P - P^y: the other classes' cluster prototypes
        L_UPCR = 1/d ||z - U^y||_2^2                      (1/d of eq. (10), as in the code)
        minimize L = L_CPCL + L_UPCR + CE(g(z), y)                                   (12)
        reply w_i and its class means c_i^k of f(x) over D_i after training          (2)
    server (Algorithm 1):
        w = sum_i |D_i| / |D| w_i                                  (sample-weighted FedAvg)
        for every class k: FINCH (cosine similarity: each prototype's first neighbour,
            eq. (4)) of the clients' class-k means; a cluster prototype is the mean of the
            prototypes of one cluster                                       -> P^k   (5)
        U^k = 1/|P^k| sum_{c in P^k} c                                 (unbiased prototype, 6)
    predictor: the global model

What it rests on: the paper's text (CVPR 2023; equation numbers above are its) and the
authors' release (github.com/WenkeHuang/RethinkFL, models/fpl.py), both read for this
module. Defaults: tau = 0.02 (Section 4.2: "we choose tau = 0.02 by default"; also the
code's ``infoNCET``), sample-weighted FedAvg (Algorithm 1; the code's ``averaging:
weight``), the three terms weighted 1 (eq. (12), as in the code).

Where the two differ, and what protofl does:
* L_UPCR: eq. (10) is the sum over the d feature dimensions, sum_v (z_v - U^y_v)^2; the
  code takes ``nn.MSELoss``, 1/d of it, and so does protofl.
* s(z, c): eq. (7) as printed divides z.c by (||z|| ||c|| / tau), which is tau cos(z, c);
  evidently a typo for cos(z, c) / tau, what the code computes and protofl uses (a
  temperature of 0.02 multiplying the similarity would flatten the softmax).
* Local prototypes: as in the paper (Algorithm 1 and eq. (2): class means over the whole
  of D_i after the local epochs), in eval mode; the code averages the last local epoch's
  training-mode features.

Other choices:
* FINCH (:func:`protofl.nn.clustering.finch`, written from its paper): the paper does not
  say which partition of FINCH's hierarchy gives P^k; the code keeps the last partition of the hierarchy (the coarsest one that has more than one cluster;
  one cluster when the first partition already has one); so does this module. A class
  with one client prototype is its own cluster.
* The loss is averaged over the minibatch; a sample whose class has no prototype yet adds
  0 to both terms (the code's sum over such samples divided by the batch size). Round 1
  (no prototypes): cross-entropy alone, as in the code.
* A class that no arriving client holds keeps its previous cluster prototypes (with the
  code's full participation this never happens; the code would drop them).
* ``cpcl`` / ``upcr`` switch a term off (the paper's ablations).

Messages: down ``w.*`` and the group ``pool`` (``protos`` (P, d), ``labels`` (P,)); up
``w.*`` and FedProto's sparse class means (``protos``, ``classes``, ``counts``).

Under ``privacy.mode: sample`` the model trains by DP-SGD and the uploaded class means and
counts are released privately (:func:`protofl.nn.privacy.release_class_means`, one release
a round): weights and prototypes are private together (docs/privacy.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import Record
from ..models.base import FLModel
from ..nn.clustering import finch
from ..nn.contrastive import prototype_supcon_loss
from ..nn.privacy import release_class_means
from ..nn.prototypes import class_means
from .base import ClientContext, ClientResult, cross_entropy, LossFn, register, ServerContext
from .fedavg import FedAvg, FedAvgHyper
from .fedproto import FedProto, sparse
from .mpfedcl import PoolState


@dataclass
class FPLHyper(FedAvgHyper):  # weighting: FedAvg's weights of the models; server_opt
    tau: float = 0.02  # temperature of L_CPCL (the code's infoNCET)
    cpcl: bool = True  # cluster prototypes contrastive learning
    upcr: bool = True  # unbiased prototypes consistent regularization

    def validate(self, section: str) -> None:
        require(self.tau > 0, f"{section}.tau", self.tau, "must be > 0")


def cluster_prototypes(protos: torch.Tensor) -> torch.Tensor:
    """(m, d) client prototypes of one class -> (k, d) cluster prototypes: the means of the
    clusters of FINCH's last partition (cosine distance), in cluster-label order."""
    labels = torch.from_numpy(finch(protos, "cosine")[-1])
    return torch.stack([protos[labels == c].mean(0) for c in range(int(labels.max()) + 1)])


def unbiased_prototypes(pool: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u^k = the mean of class k's cluster prototypes: (C, d), and (C,) whether k has any."""
    u, n = class_means(pool, labels, num_classes)
    return u, n > 0


@register
class FPL(FedAvg[PoolState]):
    name = "fpl"
    family = "prototype exchange"
    reply_arrays = ("protos", "classes", "counts")  # besides w_i
    Hyper = FPLHyper

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> PoolState:
        return PoolState(ctx.init_weights(), torch.zeros(0, self.info.feature_dim), torch.zeros(0, dtype=torch.int64))

    def configure(self, state: PoolState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights, arrays={"pool": {"protos": state.pool, "labels": state.labels}})

    check_reply = FedProto.check_reply  # the replies' class means are FedProto's sparse arrays

    def aggregate(self, state: PoolState, rnd: int, replies: list[tuple[int, Record]], ctx: ServerContext) -> PoolState:
        if not replies:
            return state
        new = super().aggregate(state, rnd, replies, ctx)  # FedAvg (and the server optimizer's moments)
        groups: dict[int, list[torch.Tensor]] = {}
        for _, r in replies:  # client-id order
            protos = r.array("protos").detach().cpu().float()
            classes = r.array("classes").cpu()
            for row, k in zip(protos, classes.tolist()):
                groups.setdefault(int(k), []).append(row)
        pool_parts, label_parts = [torch.zeros(0, self.info.feature_dim)], [torch.zeros(0, dtype=torch.int64)]
        for k in sorted(groups):
            c = cluster_prototypes(torch.stack(groups[k]))
            pool_parts.append(c)
            label_parts.append(torch.full((len(c),), k, dtype=torch.int64))
        pool, labels = torch.cat(pool_parts), torch.cat(label_parts)
        keep = ~torch.isin(state.labels, labels)  # classes nobody held this round keep theirs
        pool, labels = torch.cat([pool, state.pool[keep]]), torch.cat([labels, state.labels[keep]])
        ctx.log("cluster_prototypes", float(len(pool)))
        return dataclasses.replace(new, pool=pool, labels=labels)

    def class_vectors(self, state: PoolState) -> Optional[torch.Tensor]:
        return unbiased_prototypes(state.pool, state.labels, self.info.num_classes)[0]  # u^k; zero rows: none

    def prototype_releases(self, privacy: Any) -> int:
        return 1  # the uploaded class means and counts

    # -- client ------------------------------------------------------------------------------
    def local_objective(self, pool: torch.Tensor, labels: torch.Tensor) -> tuple[LossFn, dict[str, torch.Tensor]]:
        """(loss, extras): CE + L_CPCL + L_UPCR against the received prototypes; CE alone
        before any prototype exists (round 1) or with both terms switched off."""
        if len(pool) == 0 or not (self.hp.cpcl or self.hp.upcr):
            return cross_entropy, {}
        u, has = unbiased_prototypes(pool, labels, self.info.num_classes)
        return self.prototype_loss, {"pool": pool, "labels": labels, "u": u, "has": has}

    def prototype_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,  # body f, head g
                       extras: Mapping[str, Any]) -> torch.Tensor:
        z = model.body(x)  # (B, d)
        value = F.cross_entropy(model.head(z), y)
        has = extras["has"][y]  # (B,) samples whose class has prototypes
        frac = has.sum() / len(y)  # the per-sample terms summed over those samples, / B
        if self.hp.cpcl:  # -log(sum_pos exp / sum_all exp) of cosines / tau, mean over samples with a positive
            value = value + frac * prototype_supcon_loss(z, y, extras["pool"], extras["labels"], self.hp.tau,
                                                         "log_sum")
        if self.hp.upcr:
            mse = ((z - extras["u"][y]) ** 2).mean(1)  # (B,) 1/d ||z - u^y||^2
            value = value + torch.where(has, mse, torch.zeros_like(mse)).sum() / len(y)
        return value

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        _, y = ctx.data
        pool = msg.group("pool")  # the group: protos (P, d), labels (P,)
        loss, extras = self.local_objective(pool["protos"].to(y.device), pool["labels"].to(y.device))
        fitted = await ctx.fit(msg.weights, loss, extras=extras)
        z = await ctx.features(fitted.weights)
        protos, counts = release_class_means(ctx, z, y, self.info.num_classes)  # private under privacy.*
        reply = Record(weights=fitted.weights, arrays=sparse(protos.detach().cpu(), counts.cpu()))
        return ClientResult(reply, personal=ctx.shared_model(fitted.weights))
