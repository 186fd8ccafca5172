"""FD, federated distillation (Jeong, Oh, Kim, Park, Bennis & Kim, 2018, arXiv:1811.11479,
"Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data"), Algorithm 1 (FD, without FAug's generator).

No weights travel: each client keeps its own model (architectures may differ as long as
they share the C classes) and the clients exchange per-label average outputs, FedProto's
pattern in output space. F(w, x) is the model's output normalized by the softmax (the
paper's "logit vector"):

    client i, given the teachers F_hat_i^(l) of the labels l that have one:
        E epochs of SGD on  phi(F(x), y) + gamma * phi(F(x), F_hat_i^(y))     (Alg. 1, line 5)
        (the second term 0 for samples whose label has no teacher yet; round 1: all)
        F_bar_i^(l) = mean of F(x) over the client's samples of label l     (local averages, l. 6-8)
    server: keeps every client's latest upload F_bar_j (the paper's devices all upload every
        round; here each keeps its last), and sends client i
        F_hat_i^(l) = mean over the other clients j != i that uploaded l of F_bar_j^(l)
                                                                             (l. 12-15: the global
        average with the client's own left out)
    personalized model: the client's own model after local training (no global model).

phi is the cross entropy, against the label for the first term and against the teacher's
distribution for the second: -sum_c F_hat_c log F(x)_c (``distill: ce``).

What it rests on: the paper's text, Algorithm 1 and its definitions (read for this module;
its equations are not numbered, so the algorithm's lines are cited). PFLlib's FedDistill
(github.com/TsingZ0/PFLlib, clientdistill.py / serverdistill.py, since 2025 clientfd.py /
serverfd.py; HtFLlib, the library of FedTGP's authors, lists it as its "FD"), was read
too. Choices and deviations:

* gamma = 1: the paper gives no value (nor a learning rate or a temperature; none is
  used); 1 is PFLlib's default ``lamda``.
* ``distill: mse`` is PFLlib's form until April 2024 (commit 83e2182): the averages are of
  the raw (pre-softmax) outputs and the term is their mean squared difference over the C
  outputs, samples without a teacher counted as 0 in the batch mean. PFLlib then took the
  cross entropy against the softmax of the averaged raw outputs (samples without a teacher
  distilled from their own softmax), and since November 2025 against the averaged raw
  outputs themselves, which are no distribution; neither is offered. PFLlib's teacher also
  includes the client's own upload (on a label two clients hold, half of it is the
  student); ours leaves it out in both forms, as the paper does.
* The paper (and PFLlib) average the outputs met during the local iterations, the model
  changing between them. Ours are the class means over the client's training set after
  local training, in eval mode, as for FedProto's prototypes, so that they describe the
  model the client keeps.
* The paper assumes every device in every round and says nothing of round 1 or of a label
  a device lacks. Here: no teacher, no term (round 1); a client sends only the labels it
  holds; the server keeps each client's latest upload until the client uploads again (the
  paper's average over all devices, each as of its last round), so a teacher averages
  every other client that has uploaded the label; it needs at least one.
* Under ``privacy.mode: sample`` a noisy teacher may leave the simplex, and the cross
  entropy against a negative entry has no lower bound: the client clips it at 0 and
  rescales it to sum to 1 (post-processing), and a row with nothing left is no teacher.
* Evaluation: each client's own model (PM(V), PA; GA is their mean over the global test
  set, as for FedProto and FedGH).

Messages (sparse: only labels that have one travel; FedProto's arrays, the per-label
averages in the ``protos`` slot):
    server -> client i: protos (m, C) its teachers, classes (m,), counts (m,) the number of
        other clients behind each teacher (configure_client; the broadcast is empty)
    client -> server: protos (m_i, C) its averages, classes (m_i,), counts (m_i,)
Client state: its model's weights. Server state: :class:`DistillState`.

Under ``privacy.mode: sample`` the model trains by DP-SGD and the averages and counts are
released privately (:func:`protofl.nn.privacy.release_class_means`, one release a round):
FD's whole upload is then private at the record level, and the teachers are
post-processing of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import require
from ..messages import expect_arrays, expect_indices, expect_shapes, Record
from ..models.base import FLModel
from ..nn.privacy import release_class_means
from ..nn.prototypes import class_means
from .base import Algorithm, ClientContext, ClientResult, register, ServerContext, weights_of
from .fedproto import dense, sparse


@dataclass
class FedDistillHyper:
    lam: float = 1.0  # gamma: weight of the distillation term
    distill: Literal["ce", "mse"] = "ce"  # the paper's (softmax averages, cross entropy) or PFLlib's

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")


@dataclass
class DistillState:
    """Each client's latest upload: its per-label averages, one row per (client, label)."""
    averages: torch.Tensor  # (K, C) F_bar_i^(l)
    owner: torch.Tensor  # (K,) int64 the client i of each row
    classes: torch.Tensor  # (K,) int64 the class l of each row


def teachers(state: DistillState, cid: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``cid``'s teachers: (C, C) the mean over the other clients' averages of each
    label (a zero row where none) and (C,) int64 how many clients each comes from."""
    others = state.owner != cid
    return class_means(state.averages[others], state.classes[others], num_classes)


def on_simplex(t: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` (m, C) as distributions: clipped at 0 and rescaled to sum to 1 (a row of
    averaged softmax outputs is left as it is, up to rounding); a row with nothing left
    above 0 becomes zeros."""
    t = t.clamp(min=0)
    s = t.sum(1, keepdim=True)
    return torch.where(s > 0, t / s.clamp(min=torch.finfo(t.dtype).tiny), torch.zeros_like(t))


def outputs(scores: torch.Tensor, kind: str) -> torch.Tensor:
    """What is averaged and distilled: the softmax of the raw outputs ``scores`` (``ce``,
    the paper's F) or the raw outputs themselves (``mse``)."""
    return F.softmax(scores, dim=1) if kind == "ce" else scores


def distillation(scores: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """(B,) per-sample distillation term between the student's raw outputs ``scores`` (B, C)
    and its teachers ``teacher`` (B, C): the cross entropy -sum_c t_c log softmax(s)_c against
    the teacher's distribution (``ce``), or the mean squared difference of the raw outputs
    over the C classes (``mse``)."""
    if kind == "ce":
        return -(teacher * F.log_softmax(scores, dim=1)).sum(1)
    if kind == "mse":
        return ((scores - teacher) ** 2).mean(1)
    raise ValueError(f"unknown distillation {kind!r}")


@register
class FedDistill(Algorithm[DistillState]):
    name = "feddistill"
    family = "prototype exchange"
    Hyper = FedDistillHyper
    hp: FedDistillHyper
    has_global_model = False
    heterogeneous_models = True
    reply_arrays = ("protos", "classes", "counts")

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> DistillState:
        C = self.info.num_classes
        none = torch.zeros(0, dtype=torch.int64)
        return DistillState(torch.zeros(0, C), none, none.clone())

    def configure(self, state: DistillState, rnd: int, ctx: ServerContext) -> Record:
        return Record()  # every client's teachers differ: configure_client

    def configure_client(self, state: DistillState, rnd: int, cid: int, ctx: ServerContext) -> Record:
        return Record(arrays=sparse(*teachers(state, cid, self.info.num_classes)))

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        if (missing := expect_arrays(reply, "protos", "classes", "counts")) is not None:
            return missing  # aggregate reads them all (a client without data sends them empty)
        n = len(reply.array("classes"))
        return (expect_shapes(reply, protos=(n, self.info.num_classes), classes=(n,), counts=(n,))
                or expect_indices(reply, "classes", self.info.num_classes, unique=True))

    def aggregate(self, state: DistillState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> DistillState:
        if not replies:
            return state
        # "protos" and "classes": tensors, as the clients send them (check_reply checks their shapes)
        rows = [(cid, r.array("protos").detach().cpu().float(),
                 r.array("classes").cpu()) for cid, r in replies]
        averages = torch.cat([p for _, p, _ in rows])
        classes = torch.cat([c for _, _, c in rows])
        owner = torch.cat([torch.full((len(c),), cid, dtype=torch.int64) for cid, _, c in rows])
        # a client's upload replaces its previous one; the others' stay
        kept = ~torch.isin(state.owner, torch.tensor([cid for cid, _, _ in rows], dtype=torch.int64))
        return DistillState(torch.cat([state.averages[kept], averages]), torch.cat([state.owner[kept], owner]),
                            torch.cat([state.classes[kept], classes]))

    def prototype_releases(self, privacy: Any) -> int:
        return 1  # the averages and counts, once per round

    # -- client ------------------------------------------------------------------------------
    def client_init(self, ctx: ClientContext) -> Record:
        return Record(weights=weights_of(ctx.shared_model()))

    def distill_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                     extras: Mapping[str, Any]) -> torch.Tensor:
        teacher, has = extras["teacher"], extras["has"]
        scores = model(x)  # (B, C) raw outputs
        m = has[y]  # (B,) samples whose label has a teacher
        target = torch.where(m.unsqueeze(1), teacher[y], outputs(scores.detach(), self.hp.distill))
        term = torch.where(m, distillation(scores, target, self.hp.distill), torch.zeros_like(scores[:, 0]))
        return F.cross_entropy(scores, y) + self.hp.lam * term.mean()

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        teacher, n = dense(msg, C, C)
        has = n > 0
        if self.hp.distill == "ce":  # distributions (privacy noise may push them off the simplex)
            teacher = on_simplex(teacher)
            has &= teacher.sum(1) > 0
        extras = {"teacher": teacher.to(y.device), "has": has.to(y.device)}
        # one loss for every client of a round (the batched executor stacks them); without a
        # teacher the second term is 0
        assert state is not None  # client_init made it (the initial model)
        fitted = await ctx.fit(state.weights, self.distill_loss, extras=extras)
        z = await ctx.features(fitted.weights)
        model = ctx.shared_model(fitted.weights)
        with torch.no_grad():  # (N, C) after training, eval mode
            out = outputs(cast(nn.Module, model.head)(z), self.hp.distill)
        means, counts = release_class_means(ctx, out, y, C)  # F_bar_i; private under privacy.mode: sample
        reply = Record(arrays=sparse(means.detach().cpu(), counts.cpu()))
        return ClientResult(reply, state=Record(weights=fitted.weights), personal=model)
