"""FD, federated distillation (Jeong, Oh, Kim, Park, Bennis & Kim, 2018, arXiv:1811.11479,
"Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data"), the FD half (without FAug's generator).

No weights travel: each client keeps its own model (architectures may differ as long as
they share the C classes) and the clients exchange per-class average logits, FedProto's
pattern in logit space:

    client i, given the teachers F_hat_i^(l) of the classes l that have one:
        E epochs of SGD on  phi(F(x), y) + gamma * phi(F(x), F_hat_i^(y))     (local loss)
        (the second term 0 for samples whose class has no teacher yet; round 1: all)
        F_bar_i^(l) = mean of F(x) over the client's samples of class l     (local average logits)
    server: keeps each client's latest F_bar_i^(l) for every class l, and sends client i
        F_hat_i^(l) = mean over the other clients j != i of F_bar_j^(l)      (global average logits,
        the client's own left out, as in the paper's per-device F_hat^(i))
    personalized model: the client's own model after local training (no global model).

phi is the cross entropy: against the label for the first term, against the teacher's
softmax for the second, -sum_c softmax(F_hat)_c log softmax(F(x))_c (``distill: ce``).

What it rests on: the paper's full text was not at hand here, only its abstract and a
summary of its method (per-label local average logits, their global average, a
cross-entropy distillation regularizer, each device's teacher computed from the other
devices' averages). No equation numbers are cited. PFLlib's FedDistill
(github.com/TsingZ0/PFLlib, clientdistill.py / serverdistill.py), the form most papers of
this family run as their "FD" baseline, was read for this module; where it differs:

* ``distill: mse`` is PFLlib's regularizer: the mean over the batch and the C logits of
  (F(x) - F_hat^(y))^2, samples without a teacher counted as 0 in the batch mean. Its
  ``lamda`` default, 1, is ours for gamma (the paper's value is not known to us).
* PFLlib's teacher is the mean over *all* of the round's uploads, the client's own
  included; ours leaves the client out, as the paper's F_hat^(i) does. Under label skew
  that matters: on a class two clients hold, half of PFLlib's teacher is the student itself.
* PFLlib averages the logits of the training minibatches of every local epoch (train mode,
  the model moving during the epochs), and so does the paper's algorithm. Ours are the
  class means over the client's training set after local training, in eval mode, as for
  FedProto's prototypes, so that they describe the model the client keeps.
* A class no client uploaded this round keeps the uploads it had (each client's latest,
  from the last round the class was uploaded). PFLlib forgets them: its teacher covers only
  the classes of the last round.
* PFLlib evaluates each client's model; so do we (PM(V), PA; GA is their mean over the
  global test set, as for FedProto and FedGH).

Messages (sparse: only classes that have one travel; FedProto's arrays, the per-class
average logits in the ``protos`` slot):
    server -> client i: protos (m, C) its teachers, classes (m,), counts (m,) the number of
        other clients behind each teacher (configure_client; the broadcast is empty)
    client -> server: protos (m_i, C) its average logits, classes (m_i,), counts (m_i,)
Client state: its model's weights. Server state: :class:`LogitState`.

Under ``privacy.mode: prototype`` the average logits and counts are released privately
(:func:`protofl.nn.privacy.release_class_means`, one release a round): FD's whole upload is
then private at the record level, and the teachers are post-processing of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import expect_indices, expect_shapes, Record
from ..nn.privacy import release_class_means
from .base import Algorithm, ClientResult, register, weights_of
from .fedproto import dense, sparse


@dataclass
class FedDistillHyper:
    lam: float = 1.0  # gamma: weight of the distillation term
    distill: Literal["ce", "mse"] = "ce"  # phi of the distillation term: the paper's, or PFLlib's

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")


@dataclass
class LogitState:
    """Each client's latest average logits, one row per (client, class)."""
    logits: torch.Tensor  # (K, C) F_bar_i^(l)
    owner: torch.Tensor  # (K,) int64 the client i of each row
    classes: torch.Tensor  # (K,) int64 the class l of each row


def teachers(state: LogitState, cid: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``cid``'s teachers: (C, C) the mean over the other clients' average logits of
    each class (a zero row where none) and (C,) int64 how many clients each comes from."""
    others = state.owner != cid
    cls = state.classes[others]
    sums = torch.zeros(num_classes, num_classes, dtype=state.logits.dtype)
    sums.index_add_(0, cls, state.logits[others])
    n = torch.bincount(cls, minlength=num_classes)
    return sums / n.clamp(min=1).unsqueeze(1).to(sums.dtype), n


def distillation(scores: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """(B,) per-sample distillation term between the student's logits ``scores`` (B, C) and
    the teachers' ``teacher`` (B, C): the cross entropy against the teacher's softmax
    (``ce``), or the mean squared difference over the C logits (``mse``)."""
    if kind == "ce":
        return -(F.softmax(teacher, dim=1) * F.log_softmax(scores, dim=1)).sum(1)
    if kind == "mse":
        return ((scores - teacher) ** 2).mean(1)
    raise ValueError(f"unknown distillation {kind!r}")


@register
class FedDistill(Algorithm):
    name = "feddistill"
    family = "prototype exchange"
    Hyper = FedDistillHyper
    has_global_model = False
    heterogeneous_models = True
    reply_arrays = ("protos", "classes", "counts")

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx) -> LogitState:
        C = self.info.num_classes
        none = torch.zeros(0, dtype=torch.int64)
        return LogitState(torch.zeros(0, C), none, none.clone())

    def configure(self, state: LogitState, rnd, ctx) -> Record:
        return Record()  # every client's teachers differ: configure_client

    def configure_client(self, state: LogitState, rnd, cid, ctx) -> Record:
        return Record(arrays=sparse(*teachers(state, cid, self.info.num_classes)))

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        n = len(reply.arrays.get("classes", ()))
        return (expect_shapes(reply, protos=(n, self.info.num_classes), classes=(n,), counts=(n,))
                or expect_indices(reply, "classes", self.info.num_classes))

    def aggregate(self, state: LogitState, rnd, replies, ctx) -> LogitState:
        if not replies:
            return state
        rows = [(cid, r.arrays["protos"].detach().cpu().float(), r.arrays["classes"].cpu()) for cid, r in replies]
        logits = torch.cat([p for _, p, _ in rows])
        classes = torch.cat([c for _, _, c in rows])
        owner = torch.cat([torch.full((len(c),), cid, dtype=torch.int64) for cid, _, c in rows])
        # a class uploaded this round takes this round's rows; the others keep theirs
        kept = ~torch.isin(state.classes, classes)
        return LogitState(torch.cat([state.logits[kept], logits]), torch.cat([state.owner[kept], owner]),
                          torch.cat([state.classes[kept], classes]))

    def prototype_releases(self, privacy) -> int:
        return 1  # the average logits and counts, once per round

    # -- client ------------------------------------------------------------------------------
    def client_init(self, ctx) -> Record:
        return Record(weights=weights_of(ctx.shared_model()))

    def distill_loss(self, model, x, y, extras):
        teacher, has = extras["teacher"], extras["has"]
        scores = model(x)  # (B, C)
        m = has[y]  # (B,) samples whose class has a teacher
        target = torch.where(m.unsqueeze(1), teacher[y], scores.detach())
        term = torch.where(m, distillation(scores, target, self.hp.distill), torch.zeros_like(scores[:, 0]))
        return F.cross_entropy(scores, y) + self.hp.lam * term.mean()

    async def client_update(self, msg: Record, state: Optional[Record], ctx) -> ClientResult:
        C = self.info.num_classes
        _, y = ctx.data
        teacher, n = dense(msg, C, C)
        extras = {"teacher": teacher.to(y.device), "has": (n > 0).to(y.device)}
        # one loss for every client of a round (the batched executor stacks them); without a
        # teacher the second term is 0
        fitted = await ctx.fit(state.weights, self.distill_loss, extras=extras)
        z = await ctx.features(fitted.weights) if len(y) else torch.zeros(0, self.info.feature_dim, device=y.device)
        model = ctx.shared_model(fitted.weights)
        with torch.no_grad():
            scores = model.head(z)  # (N, C) the logits after training, eval mode
        logits, counts = release_class_means(ctx, scores, y, C)  # private under privacy.mode: prototype
        reply = Record(arrays=sparse(logits.detach().cpu(), counts.cpu()))
        return ClientResult(reply, state=Record(weights=fitted.weights), personal=model)
