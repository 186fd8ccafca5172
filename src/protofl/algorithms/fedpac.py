"""FedPAC (Xu, Tong & Huang, ICLR 2023, "Personalized Federated Learning with Feature
Alignment and Classifier Collaboration").

A shared feature extractor f (``model.body``, FedAvg) and a personal linear classifier
phi_i (``model.head``) per client; the extractor is aligned to global class prototypes
and each client's classifier is replaced by a combination of the round's classifiers
whose weights the server chooses by a small quadratic program:

    server -> client i: f_t, the global prototypes c_k, (its combined classifier phi_i)
    client i, with the received f_t (features of its training set, eval mode):
        p_ik = n_ik / n_i,  mu_ik = class-k mean of f_t(x)
        h_ik = p_ik mu_ik,  V_i = 1/n_i sum_k ( p_ik E_k||f_t(x)||^2 - ||h_ik||^2 )   (statistics)
        1. ``head_epochs`` epochs on CE over phi_i only (f frozen)
        2. E epochs on CE + lambda * 1/d ||f(x) - c_y||^2 over f only (phi_i frozen)   (alignment;
           c_y = mu_iy for a class without a global prototype; CE alone before any exists)
        reply f_i, phi_i, its prototypes (class means of f_i(x) after training), n_ik, V_i, h_i
    server:
        f_{t+1} = sum_i n_i / n * f_i;   c_k = sum_i n_ik mu'_ik / sum_i n_ik               (FedAvg)
                                         (c_k of a class no arriving client holds: kept)
        for each client i of the round, over the round's K clients j:
            alpha_i = argmin_{alpha >= 0, sum alpha = 1}  sum_j alpha_j^2 V_j + || sum_j alpha_j (h_i - h_j) ||_F^2
                    = alpha^T (diag(V) + D) alpha,  D_jl = sum_k <h_ik - h_jk, h_ik - h_lk>
            phi_i <- sum_j alpha_ij phi_j                             (classifier collaboration)

Family: personalization (its output is a personalized model per client; the prototypes
only regularize the shared extractor).

What it rests on: the paper's text was not at hand (only its abstract); the steps above
are those of the authors' release (github.com/JianXu95/FedPAC, methods/fedpac.py,
tools.py, running.py, read for this module), so no equation numbers are cited.
lambda = 1 is the code's default (``--lam``).

Choices and deviations:
* The QP is solved with scipy (SLSQP, then polished exactly on its support:
  :func:`protofl.nn.qp.simplex_qp`) instead of cvxpy; weights below ``floor`` = 1e-3 are
  dropped and the rest renormalized, as in the code. If the solver fails the client
  keeps its own classifier (the code's fallback when its matrix is not PSD; diag(V) + D is
  PSD by construction, so the code's eigenvalue repair is not needed).
* The statistics use the received extractor before local training, in eval mode (the
  code's order); the global prototypes are count-weighted (the code's).
* ``head_lr`` (None: the run's lr) is the classifier phase's learning rate: the code uses
  0.1 there and 0.01 for the extractor. Both phases are separate optimizer runs (momentum
  and weight decay from ``training.*``; the code: 0.5 and 5e-4).
* The combined classifier is stored on the server and sent with the client's next
  message (the code writes it into the client object at once); a client never combined
  uses its own. The personalized model is the client's model after local training,
  before the server combines classifiers: protofl's convention, and also what the code
  reports (``acc2`` of ``local_training``).
* A class that no arriving client holds keeps its previous global prototype. The code
  replaces the whole prototype table every round (``protos_aggregation``), and would
  fail on such a class (``update_global_protos`` indexes ``global_protos[i]`` for every
  class); with its full participation and every class present this never happens.
* With ``training.steps`` set, both phases run that many steps (``head_epochs`` is then
  not used; FedRep's head phase likewise), since the engine's step count takes
  ``steps`` before epochs.
* Prototypes and statistics are over the client's whole training set.
* A reply without one of its arrays, or whose classifier is not the model's (other
  entries or shapes), is refused (``check_reply``) or left out of the round (``aggregate``).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, cast, Mapping, Optional

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import Record, expect_arrays, expect_shapes
from ..models.base import FLModel
from ..nn.prototypes import aggregate_prototypes, class_means
from ..nn.qp import simplex_qp
from .base import ClientContext, ClientResult, cross_entropy, register, reply_weight, ServerContext, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer


@dataclass
class FedPACHyper(FedAvgHyper):
    lam: float = 1.0  # weight of the feature alignment term (the code's --lam)
    head_epochs: int = 1  # classifier phase (the code: 1 epoch)
    head_lr: Optional[float] = None  # classifier phase lr (None: the run's; the code: 0.1)
    floor: float = 1e-3  # combination weights below it are dropped (the code's eps)

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")
        require(self.head_epochs >= 1, f"{section}.head_epochs", self.head_epochs, "must be >= 1")
        require(self.head_lr is None or self.head_lr > 0, f"{section}.head_lr", self.head_lr,
                "must be > 0 (or null: training.lr)")
        require(0 <= self.floor < 1, f"{section}.floor", self.floor, "must be in [0, 1)")


@dataclass
class FedPACState(WeightsState):  # weights: the extractor f (and the initial classifier)
    protos: torch.Tensor  # (C, d) global prototypes c_k
    counts: torch.Tensor  # (C,) samples behind c_k; 0 = none yet
    heads: dict[str, torch.Tensor]  # head entry -> (N, ...) each client's combined classifier
    combined: torch.Tensor  # (N,) bool: the client has one


def feature_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V_i, h_i) of features z (n, d) with labels y (n,): h_ik = p_ik mu_ik (C, d) and the
    scalar V_i = 1/n sum_k (p_ik E_k||z||^2 - ||h_ik||^2), the variance of the estimate of h_i."""
    n = max(len(y), 1)
    mu, counts = class_means(z, y, num_classes)
    sq, _ = class_means((z ** 2).sum(1, keepdim=True), y, num_classes)  # (C, 1) E_k ||z||^2
    p = counts.to(z.dtype) / n
    h = p.unsqueeze(1) * mu
    return ((p * sq.squeeze(1)).sum() - (h ** 2).sum()) / n, h


def combination_weights(V: torch.Tensor, H: torch.Tensor, i: int, floor: float = 1e-3) -> npt.NDArray[np.float64]:
    """alpha_i (K,): argmin over the simplex of alpha^T (diag(V) + D) alpha, D_jl = sum_k <h_ik - h_jk,
    h_ik - h_lk>, for the K clients' V (K,) and h (K, C, d); one-hot at i if the solver fails."""
    A = (H[i] - H).reshape(len(H), -1).double()  # (K, C d) rows h_i - h_j
    Q = torch.diag(V.double()) + A @ A.T
    alpha = simplex_qp(Q.cpu().numpy(), floor)
    if alpha is None:
        alpha = np.eye(len(H))[i]
    return alpha


def head_problem(algo: FedPer[Any], reply: Record, sent: Record) -> Optional[str]:
    """Why the reply's group 'head' is not a linear classifier d -> C of the model (None: it is).
    Against the sent classifier when one was sent, else any linear one, with or without a bias."""
    C, d = algo.info.num_classes, algo.info.feature_dim
    head = reply.arrays.get("head")
    if not isinstance(head, dict) or not head or not all(algo.is_personal(k) for k in head):
        return "group 'head' must hold the classifier's entries (head.*)"
    sent_head = algo.personal_part(sent.weights)  # the combined classifier, when it was sent
    # the classifier is linear, d -> C (every protofl model's head), with or without a bias
    ref = {k: tuple(v.shape) for k, v in sent_head.items()} or {"head.weight": (C, d), "head.bias": (C,)}
    keys_ok = set(head) == set(ref) if sent_head else ("head.weight" in head and set(head) <= set(ref))
    if not keys_ok:
        return f"group 'head' holds {sorted(head)}, expected the classifier's entries {sorted(ref)}"
    for k, t in head.items():
        if tuple(t.shape) != ref[k]:
            return f"head entry {k!r} has shape {tuple(t.shape)}, expected {ref[k]}"
    return None


def model_heads_only(replies: list[tuple[int, Record]], heads: Mapping[str, torch.Tensor],
                     method: str) -> list[tuple[int, Record]]:
    """The replies whose classifier has the model's entries (check_reply let through any linear
    one; a bias the model lacks, or no bias where it has one, cannot enter a combination).
    The warning names ``method`` and goes to its module's logger (``protofl.algorithms.<method>``)."""
    shapes = {k: v.shape[1:] for k, v in heads.items()}
    odd = [cid for cid, r in replies
           if {k: t.shape for k, t in r.group("head").items()} != shapes]
    if odd:
        logging.getLogger(f"{__package__}.{method.lower()}").warning(
            "%s: left out the replies of clients %s, whose classifier entries are not the model's", method, odd)
    return [(cid, r) for cid, r in replies if cid not in odd]


@register
class FedPAC(FedPer[FedPACState]):
    name = "fedpac"
    Hyper = FedPACHyper
    reply_arrays = ("proto", "counts", "v", "h", "head")  # besides f_i

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedPACState:
        w = ctx.init_weights()
        C, d, N = self.info.num_classes, self.info.feature_dim, self.info.num_clients
        heads = {k: torch.zeros(N, *v.shape, dtype=v.dtype) for k, v in self.personal_part(w).items()}
        return FedPACState(w, torch.zeros(C, d), torch.zeros(C, dtype=torch.int64), heads,
                           torch.zeros(N, dtype=torch.bool))

    def configure(self, state: FedPACState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=self.shared_part(state.weights),
                      arrays={"protos": state.protos, "proto_counts": state.counts})

    def configure_client(self, state: FedPACState, rnd: int, cid: int, ctx: ServerContext) -> Optional[Record]:
        if not bool(state.combined[cid]):
            return None
        return Record(weights={k: v[cid] for k, v in state.heads.items()})

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        C, d = self.info.num_classes, self.info.feature_dim
        # every reply carries all five (class_means gives zero rows for the classes a client lacks)
        missing = expect_arrays(reply, "proto", "counts", "v", "h")
        if missing:
            return missing
        return head_problem(self, reply, sent) or expect_shapes(reply, proto=(C, d), counts=(C,), h=(C, d), v=(1,))

    def aggregate(self, state: FedPACState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedPACState:
        replies = model_heads_only([(cid, r) for cid, r in replies if reply_weight(r, self.hp.weighting) > 0],
                                   state.heads, "FedPAC")
        if not replies:
            return state
        new = super().aggregate(state, rnd, replies, ctx)  # f: FedAvg over the shared entries
        fresh, n = aggregate_prototypes([r.array("proto") for _, r in replies],
                                        [r.array("counts") for _, r in replies], "counts")
        seen = n > 0
        protos = torch.where(seen.unsqueeze(1), fresh.to(state.protos), state.protos)
        counts = torch.where(seen, n, state.counts)
        # classifier collaboration among the round's clients
        V = torch.cat([r.array("v").detach().cpu().reshape(1) for _, r in replies])  # (K,)
        H = torch.stack([r.array("h").detach().cpu() for _, r in replies])  # (K, C, d)
        phis = {k: torch.stack([r.group("head")[k].detach().cpu() for _, r in replies])
                for k in state.heads}
        heads = {k: v.clone() for k, v in state.heads.items()}
        combined = state.combined.clone()
        self_weight: list[float] = []
        for i, (cid, _) in enumerate(replies):
            alpha = torch.from_numpy(combination_weights(V, H, i, self.hp.floor))  # (K,)
            self_weight.append(float(alpha[i]))
            for k, phi in phis.items():
                heads[k][cid] = torch.tensordot(alpha.to(phi.dtype), phi, dims=1)
            combined[cid] = True
        ctx.log("pac_self_weight", float(np.mean(self_weight)))
        return dataclasses.replace(new, protos=protos, counts=counts, heads=heads, combined=combined)

    def class_vectors(self, state: FedPACState) -> Optional[torch.Tensor]:
        return state.protos

    # -- client ------------------------------------------------------------------------------
    def aligned_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,  # extractor f, classifier phi
                     extras: Mapping[str, Any]) -> torch.Tensor:
        z = model.body(x)  # (B, d)
        return cast(torch.Tensor,
                    F.cross_entropy(model.head(z), y) + self.hp.lam * ((z - extras["target"][y]) ** 2).mean())

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        assert state is not None  # client_init made it (the initial head)
        w = {**state.weights, **msg.weights}  # f_t, and the combined classifier when the server sent one
        z = await ctx.features(w)  # (n, d) with the received extractor
        mu, _ = class_means(z, y, C)
        v, h = feature_statistics(z, y, C)
        lr = {} if self.hp.head_lr is None else {"lr": self.hp.head_lr}
        head = await ctx.fit(w, trainable=self.personal_prefixes, epochs=self.hp.head_epochs, **lr)  # 1. phi_i
        g_counts = msg.array("proto_counts").to(y.device)
        if bool((g_counts > 0).any()) and self.hp.lam != 0:  # 2. f with feature alignment
            target = torch.where((g_counts > 0).unsqueeze(1), msg.array("protos").to(y.device), mu)
            loss, extras = self.aligned_loss, {"target": target}
        else:
            loss, extras = cross_entropy, {}
        fitted = await ctx.fit(head.weights, loss, extras=extras, trainable=("body.",))
        protos, counts = class_means(await ctx.features(fitted.weights), y, C)
        w = fitted.weights
        reply = Record(weights=self.shared_part(w), arrays={"proto": protos, "counts": counts, "v": v.reshape(1),
                                                            "h": h, "head": self.personal_part(w)})
        return ClientResult(reply, state=Record(weights=self.personal_part(w)), personal=ctx.shared_model(w))
