"""FedPCL (Tan, Long, Ma, Liu, Zhou & Jiang, NeurIPS 2022, "Federated Learning from
Pre-Trained Models: A Contrastive Learning Approach").

In the paper every client holds the same m *fixed* pre-trained backbones; their outputs
are concatenated and fused by a small client-specific projection network g_i, the only
part that trains. Only class prototypes travel (no weights), so each client fuses the
backbones in its own (personalized) way:

    z = g_i([b_1(x); ...; b_m(x)]) / ||.||                  (projection: Linear, ReLU, L2 norm)
    local prototypes  C_i^k = mean of z over client i's samples of class k
    global prototypes C^k   = the mean of the C_i^k over the clients i holding class k
    server -> every client: the global prototypes and every client's local prototypes
                            (a class a client lacks is filled with the global prototype)
    client i minimizes L_g + L_p over g_i, with s(z, c) = <z / ||z||, c> / tau (c as it is:
    a mean of unit vectors, ||c|| <= 1):
        L_g = -log [ exp(s(z, C^y)) / sum_k exp(s(z, C^k)) ]                       (global)
        L_p = 1/K sum_j -log [ exp(s(z, C_j^y)) / sum_k exp(s(z, C_j^k)) ]   (local, K clients)
    then uploads its new C_i^k
    inference: the nearest own local prototype

**Narrowed in protofl**: protofl builds one model per client, so the "backbone" is the
configured model's body (one backbone, m = 1), optionally with pretrained weights
(``model.pretrained``) and frozen (``backbone: frozen``, the paper's setting: only the
projection trains). ``backbone: trained`` (the default, for runs without pretrained
weights, and what PFLlib's FedPCL does) trains the body too. ``adapt_model`` appends the
projection (d -> d) to ``model.body``; ``model.head`` is never used nor trained. Several
distinct pretrained backbones per client are not supported.

What it rests on: the paper's text was not at hand (only its abstract: fixed pre-trained
backbones, a lightweight fusion, prototype-wise contrastive learning with global and
local prototypes, only prototypes shared); the form of the losses above is PFLlib's
(github.com/TsingZ0/PFLlib, clientpcl.py), the rest the authors' release
(github.com/yuetan031/FedPCL, lib/update.py, lib/losses.py, lib/models/models.py,
exps/federated_main.py), both read for this module; no equation numbers are cited.
tau = 0.07 is the code's. The similarity takes the prototype as it is, not normalized:
both codes do (PFLlib's ``matmul(F.normalize(rep), proto.T) / tau``; the authors'
``ConLoss`` uses the raw prototype as anchor); whether the paper means a cosine could
not be checked.

Deviations from the authors' code:
* Their contrastive loss is supervised-contrastive with the *prototype* of a sample's
  class as anchor and the batch's features (two augmented views) as contrast set, and
  only the local-prototype term (sum over clients) enters their loss (no CE, no separate
  global term); here the sample-to-prototype softmax above (PFLlib's). No augmentation.
* Their projection network also has a decision layer whose loss is never used; here the
  model's head stays unused.
* A frozen backbone's parameters never move, but BatchNorm running statistics in it (for
  bodies that have BatchNorm) follow the client's batches, as the engine trains in train
  mode.
* Round 1 (no prototypes yet): the loss is 0, as in the code (``0 * loss``: only
  ``training.weight_decay`` moves the weights); PFLlib skips training then.
* Prototypes are the class means of the projection's output over the whole training
  set after training, in eval mode; the authors' code takes them after training in eval
  mode too, but over a loader that drops the last partial batch (``drop_last=True``) and
  on the first augmented view of each image. The server keeps each client's latest
  prototypes; the global prototypes are the plain mean over the stored prototypes of
  the clients holding the class (the code's mean, with all clients participating); L_p
  runs over the clients that have uploaded so far (PFLlib fills the others with the
  global prototypes).
* Inference: ``local`` (primary) the nearest own local prototype in L2, over the
  client's own classes (the code's rule, its MSE has the same ranking); ``global`` the
  nearest received global prototype over every class that has one.

Under ``privacy.mode: sample`` the backbone trains by DP-SGD and the uploaded prototypes
and counts are released privately (:func:`protofl.nn.privacy.release_class_means`, one
release a round): FedPCL's whole upload is then private at the record level; the client's
own ``local`` predictor keeps its exact prototypes, which never leave it and no loss reads
(docs/privacy.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require
from ..messages import Record
from ..models.base import FLModel
from ..nn.privacy import prototype_privacy, release_class_means
from ..nn.prototypes import class_means, NearestPrototype
from .base import ClientContext, ClientResult, register, ServerContext
from .fedproto import dense, FedProto, sparse


@dataclass
class FedPCLHyper:
    tau: float = 0.07  # temperature of the prototype-wise contrastive losses (the code's)
    backbone: Literal["trained", "frozen"] = "trained"  # frozen: only the projection trains

    def validate(self, section: str) -> None:
        require(self.tau > 0, f"{section}.tau", self.tau, "must be > 0")


@dataclass
class PCLState:
    tables: torch.Tensor  # (N, C, d) each client's latest local prototypes (zero rows: none)
    held: torch.Tensor  # (N, C) bool: the client's latest upload holds the class


class L2Normalize(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(h, dim=1)


def projection(d: int) -> nn.Module:
    """The lightweight projection network: Linear(d, d), ReLU, L2 normalization (the code's
    ProjandDeci without its decision layer)."""
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), L2Normalize())


def prototype_softmax(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, has: torch.Tensor,
                      tau: float) -> torch.Tensor:
    """(K,) losses -log softmax_k(<z / ||z||, P_j^k> / tau)[y] of K prototype tables P (K, C, d)
    with their classes has (K, C), each the mean over the samples whose class the table has
    (0 for none); z (B, d), y (B,). Classes a table lacks are left out of its softmax. The
    prototypes enter as they are (not normalized), as in the authors' and PFLlib's code."""
    s = torch.einsum("bd,kcd->kbc", F.normalize(z, dim=1), protos.to(z.dtype)) / tau
    s = s.masked_fill(~has.unsqueeze(1), -1e9)  # finite: a row never turns all -inf (nan gradients)
    logp = s.log_softmax(2).gather(2, y.view(1, -1, 1).expand(len(protos), -1, 1)).squeeze(2)  # (K, B)
    own = has[:, y]  # (K, B)
    return -torch.where(own, logp, torch.zeros_like(logp)).sum(1) / own.sum(1).clamp(min=1)


@register
class FedPCL(FedProto[PCLState]):
    name = "fedpcl"
    Hyper = FedPCLHyper

    def adapt_model(self, model: nn.Module) -> nn.Module:
        fl = cast(FLModel, model)  # the zoo's models
        model.body = nn.Sequential(fl.body, projection(fl.feature_dim))  # backbone: body.0, g_i: body.1
        return model

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> PCLState:
        N, C, d = self.info.num_clients, self.info.num_classes, self.info.feature_dim
        return PCLState(torch.zeros(N, C, d), torch.zeros(N, C, dtype=torch.bool))

    @staticmethod
    def global_prototypes(state: PCLState) -> tuple[torch.Tensor, torch.Tensor]:
        """C^k: the plain mean of the stored local prototypes of class k, (C, d); (C,) has."""
        w = state.held.to(state.tables.dtype).unsqueeze(2)  # (N, C, 1)
        n = w.sum(0)  # (C, 1)
        return (w * state.tables).sum(0) / n.clamp(min=1), n.squeeze(1) > 0

    def configure(self, state: PCLState, rnd: int, ctx: ServerContext) -> Record:
        G, has = self.global_prototypes(state)
        uploaded = state.held.any(1)  # (N,) the clients whose prototypes L_p runs over
        held = state.held[uploaded]
        tables = torch.where(held.unsqueeze(2), state.tables[uploaded], G)  # missing classes: global
        return Record(arrays={"global": G, "has": has, "locals": tables, "locals_has": held | has})

    def aggregate(self, state: PCLState, rnd: int, replies: list[tuple[int, Record]], ctx: ServerContext) -> PCLState:
        if not replies:
            return state
        tables, held = state.tables.clone(), state.held.clone()
        for cid, r in replies:
            tables[cid], counts = dense(r, self.info.num_classes, self.info.feature_dim)
            held[cid] = counts > 0
        return PCLState(tables, held)

    def class_vectors(self, state: PCLState) -> Optional[torch.Tensor]:
        return self.global_prototypes(state)[0]

    # -- client ------------------------------------------------------------------------------
    def zero_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
        z: torch.Tensor = model.body(x)
        return z.sum() * 0.0  # the code's 0 * loss: only weight decay moves the weights

    def contrastive_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                         extras: Mapping[str, Any]) -> torch.Tensor:
        z = model.body(x)  # (B, d), unit length
        l_g = prototype_softmax(z, y, extras["global"].unsqueeze(0), extras["has"].unsqueeze(0), self.hp.tau)[0]
        return l_g + prototype_softmax(z, y, extras["locals"], extras["locals_has"], self.hp.tau).mean()

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        a = {k: cast(torch.Tensor, v).to(y.device) for k, v in msg.arrays.items()}
        # no prototype yet (round 1): nothing to contrast with, the loss is 0 (as in the code)
        loss, extras = (self.contrastive_loss, a) if bool(a["has"].any()) else (self.zero_loss, {})
        trainable = ("body.1.",) if self.hp.backbone == "frozen" else ("body.",)  # never the unused head
        assert state is not None  # client_init made it (the client's own model)
        weights = (await ctx.fit(state.weights, loss, extras=extras, trainable=trainable)).weights
        z = await ctx.features(weights)
        protos, counts = class_means(z, y, C)  # C_i^k after training (the local predictor's, exact)
        sent = release_class_means(ctx, z, y, C) if prototype_privacy(ctx) else (protos, counts)  # what leaves
        body = cast(FLModel, ctx.shared_model(weights)).body
        own, present = torch.nonzero(counts > 0).flatten(), torch.nonzero(a["has"]).flatten()
        personal = {"local": NearestPrototype(body, protos[own], own, C),
                    "global": NearestPrototype(body, a["global"][present], present, C)}
        return ClientResult(Record(arrays=sparse(sent[0].detach().cpu(), sent[1].cpu())),
                            state=Record(weights=weights), personal=personal)
