"""ReBaFL (Xu, Yang, Ding & Huang, 2023, "Stabilizing and Improving Federated Learning
with Non-IID Data and Client Dropout", arXiv:2303.06314): FedAvg whose clients re-balance
their classifier with a relaxed balanced softmax and prototype-based feature augmentation.

    server: send w_t and the global prototypes P = {p_c}
    client k (n_kc samples of class c, features h = body(x), logits z = head(h)):
      pi_kc = (1 - eps) n_kc / n_k + eps / C                                   (eq. 10)
      l     = -log [ pi_ky exp(z_y) / sum_j pi_kj exp(z_j) ]                   (eq. 9)
      p_c  <- local class mean of h for every class the client holds           (eq. 18)
      h~    = p_j + lam (h - p_i)   for a sample (h, i), with label j          (eq. 15)
      l_aug = eq. 9 on (head(h~), j), prior recomputed from the labels j      (eq. 16)
      minimize l + mu_aug * l_aug; reply w_k, local prototypes and n_kc
    server: w_{t+1} = sum_k n_k w_k / sum_k n_k;
            p_c = sum_k n_kc p_kc / sum_k n_kc                                 (eq. 23)
            (the engine logs the weight diversity Lambda of eq. 24)

Details:
* h is the body output that the head consumes (``model.body``), for the prototypes and
  the augmentation alike. The augmented features are detached from the body: l_aug
  trains only the classifier head.
* Targets j cycle over the classes that have a prototype (the client's own plus the
  received global ones): the i-th sample of a mini-batch gets j = A[i mod |A|], so each
  mini-batch covers all of them. No global prototypes yet (round 1) -> no augmentation.
* The prototypes of eq. 18 are computed with the received model before local training;
  the prototypes in the reply with the trained model. Both in eval mode.
* A client with a single class: with eps = 0 (BSM) its prior is one-hot, the balanced
  softmax is identically 1 and both loss and gradient vanish, so it contributes the
  unchanged global model. The relaxed prior (eps > 0) gives the absent classes mass
  eps / C, which keeps a (small) gradient; the feature augmentation supplies the other
  classes from their prototypes and trains the head on them.
* Lambda (eq. 24), the weight diversity 1/|S_t| sum_i ||w_i - w_bar||^2 with w_bar the
  plain average of the received local models, is logged by the engine for every method
  that averages weights (``weight_diversity``, :func:`protofl.algorithms.base.weight_diversity`),
  so it compares methods as the paper's Fig. 7 does.
* Checked against sections 4-5 of the paper: eq. (9)-(10) relaxed balanced softmax on
  the logits with the smoothed local prior; eq. (15) transfer in the feature space of
  f_theta (the representation the classifier phi consumes, eq. 12-14: h = f_theta(x));
  eq. (16)/(19) the augmented term trains only phi, weighted by mu; targets cycle over
  the label set "until the mini-batch features are all utilized" (section 4.2), and the
  prior of the augmented features is recomputed from their labels (section 4.3).

Deviations from the paper or the authors' released code (github.com/JianXu95/ReBaFL,
methods/rebafl.py, tools.py, models/cnn.py):
* Eq. (18) and eq. (15) follow the paper. The code computes the client's own prototypes
  before training (``local_protos1 = self.get_local_protos()``) but never uses them (the
  line ``# global_protos = local_protos1`` is commented out), so eq. (18) is not in it;
  its augmentation is ``global_protos[y] - global_protos[yi] + feature``, i.e. with the
  *global* prototype of the sample's class as p_i, and it augments a sample only when
  both its class and the target class have a global prototype.
* The code computes prototypes in another space than the head's input but feeds the
  augmented features to the head: for CNN_FMNIST (its Fashion-MNIST model) the
  L2-normalized output of a linear ``reshape`` layer, for CifarCNN the output of an
  unnormalized projection MLP (``proj``: linear, ReLU, linear). Here both are the body
  output.
* ``mu_aug``: the paper uses 0.1, the code's default (``--lam``) is 0.5.
* Targets: the code uses j = i mod C and leaves a sample unchanged (its own label) when
  class j or the sample's class has no global prototype; here j cycles over the classes
  that have a prototype (the client's own, eq. 18, and the received global ones).
* Single-class clients: the code turns the augmentation off for them (lam = 0 when the
  client holds one class) and leaves out their prototypes on the server; here they
  augment and send prototypes like every client.
* ``prototype_memory`` (default off, as in the paper and the code): the global prototypes
  are aggregated over the arriving clients only (Algorithm 1 lines 6-9, a sum over S_t, and
  the sentence after eq. 23; eqs. 22-23 print the sums over all m clients), so a
  class that no arriving client holds has none that round. The paper expects this
  ("the global prototypes might not contain all classes, therefore we only augment those
  available classes"; eq. 18 is "designed mainly in consideration of the possible missing
  prototypes from previous round"), and the code drops such a class (the server calls
  ``tools.protos_aggregation`` without the old prototypes; ``update_local_model`` replaces
  the client's dictionary). ``prototype_memory: true`` keeps a class's last global
  prototype instead (an extension: under strong dropout, p = 0.1 and about two arrivals
  a round, most classes would otherwise have no target). It was the default before.
* Missing classes with eps = 0 get log pi = -inf, exactly out of the softmax. The code
  computes the softmax as pi exp(z) / (sum_j pi_j exp(z_j) + 1e-8): the 1e-8 is in the
  denominator, and a class with pi = 0 is out of it exactly as well.

``privacy.mode: sample`` refuses ReBaFL: eq. 16's prior of the augmented batch couples the
samples of a batch, which DP-SGD's per-sample gradients cannot bound (docs/privacy.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import Arrays, Record, expect_arrays, expect_shapes
from ..models.base import FLModel
from ..nn.losses import balanced_logits, label_counts, relaxed_prior
from ..nn.privacy import release_class_means
from ..nn.prototypes import aggregate_prototypes, class_means
from .base import ClientContext, ClientResult, LossFn, register, reply_weight, ServerContext, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class ReBaFLHyper(FedAvgHyper):
    epsilon: float = 0.01  # eq. 10 smoothing of the local prior
    mu_aug: float = 0.1  # weight of l_aug (paper 0.1; the authors' code defaults to 0.5)
    lam: float = 1.0  # eq. 15 scale of the transferred intra-class variation
    rbsm: bool = True  # relaxed balanced softmax; false = plain softmax (ablation "F-Aug only")
    faug: bool = True  # prototype feature augmentation; false = ablation "R-BSM only"
    prototype_memory: bool = False  # true: keep the last global prototype of classes nobody sent

    def validate(self, section: str) -> None:
        require(0.0 <= self.epsilon <= 1.0, f"{section}.epsilon", self.epsilon, "must be in [0, 1]")
        require(self.mu_aug >= 0.0, f"{section}.mu_aug", self.mu_aug, "must be >= 0")
        require(self.lam >= 0.0, f"{section}.lam", self.lam, "must be >= 0")


@dataclass
class ReBaFLState(WeightsState):  # weights: the global model
    prototypes: torch.Tensor  # (C, d) global prototypes p_c
    counts: torch.Tensor  # (C,) int64 samples behind p_c; 0 = no prototype yet


# ---------------------------------------------------------------------------------------
# the math, on plain tensors
# ---------------------------------------------------------------------------------------
def augment_features(h: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor,
                     available: torch.Tensor, lam: float,
                     count: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 15: h~ = p_j + lam (h - p_i) for each sample (h, i), with label j.

    h (B, d) features, y (B,) their classes i, prototypes (C, d), available (A,) the
    classes that have a prototype (must include every class in y). The i-th sample of
    the batch gets target j = available[i mod A]. ``count``: A as a 0-dim tensor, for an
    ``available`` padded to a fixed length (what the batched executor stacks). Returns
    h~ (B, d) and j (B,).
    """
    A = len(available) if count is None else count
    j = available[torch.arange(len(y), device=y.device) % A]  # (B,)
    return prototypes[j] + lam * (h - prototypes[y]), j


def client_prototypes(local: torch.Tensor, n: torch.Tensor, glob: torch.Tensor,
                      glob_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 18: the client's own class means replace the global prototypes of its classes.

    local (C, d) and n (C,) the client's class means and counts; glob (C, d) and glob_n
    (C,) the received global prototypes and their counts (0 = none). Returns the
    prototypes (C, d) and the (A,) ids of the classes that have one.
    """
    own = n > 0
    P = torch.where(own.unsqueeze(1), local, glob)
    return P, torch.nonzero(own | (glob_n > 0)).flatten()


# ---------------------------------------------------------------------------------------
@register
class ReBaFL(FedAvg[ReBaFLState]):
    name = "rebafl"
    family = "calibrated softmax"
    reply_arrays = ("proto", "counts")  # besides w_k
    Hyper = ReBaFLHyper
    hp: ReBaFLHyper
    couples_samples = True  # eq. 16's prior comes from the augmented batch's labels

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> ReBaFLState:
        C, d = self.info.num_classes, self.info.feature_dim
        return ReBaFLState(ctx.init_weights(), torch.zeros(C, d, device=ctx.device),
                           torch.zeros(C, dtype=torch.int64, device=ctx.device))

    def configure(self, state: ReBaFLState, rnd: int, ctx: ServerContext) -> Record:
        arrays: Arrays = {"proto": state.prototypes, "proto_counts": state.counts} if self.hp.faug else {}
        return Record(weights=state.weights, arrays=arrays)

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        C, d = self.info.num_classes, self.info.feature_dim
        # with feature augmentation eq. (23) reads both arrays
        return ((expect_arrays(reply, "proto", "counts") if self.hp.faug else None)
                or expect_shapes(reply, proto=(C, d), counts=(C,)))

    def aggregate(self, state: ReBaFLState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> ReBaFLState:
        replies = [(cid, r) for cid, r in replies if reply_weight(r, self.hp.weighting) > 0]
        if not replies:  # nobody arrived: keep w_t and P
            return state
        new = super().aggregate(state, rnd, replies, ctx)
        protos, counts = state.prototypes, state.counts
        if self.hp.faug:  # eq. 23, class by class, weighted by n_kc
            fresh, n = aggregate_prototypes([r.array("proto") for _, r in replies],
                                            [r.array("counts") for _, r in replies],
                                            weighting="counts")
            if self.hp.prototype_memory:
                seen = n > 0
                protos = torch.where(seen.unsqueeze(1), fresh, state.prototypes)
                counts = torch.where(seen, n, state.counts)
            else:
                protos, counts = fresh, n
        return dataclasses.replace(new, prototypes=protos, counts=counts)

    def class_vectors(self, state: ReBaFLState) -> Optional[torch.Tensor]:
        return state.prototypes if self.hp.faug else None  # the global prototypes p_c of eq. 23

    def prototype_releases(self, privacy: Any) -> int:
        return 1 if self.hp.faug else 0  # the reply's prototypes (eq. 18's stay on the client)

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        w_t, y, C = msg.weights, ctx.data[1], self.info.num_classes
        # eq. 18 uses the class means of the received model's features, before local training
        local = class_means(await ctx.features(w_t), y, C) if self.augments(msg) else None
        loss, extras = self.local_objective(msg, ctx, local)
        fitted = await ctx.fit(w_t, loss, extras=extras)
        arrays: Arrays = {}
        if self.hp.faug:  # local prototypes of the trained body, for eq. 23 (they leave the client)
            arrays["proto"], arrays["counts"] = release_class_means(ctx, await ctx.features(fitted.weights), y, C)
        return ClientResult(Record(weights=fitted.weights, arrays=arrays), personal=ctx.shared_model(fitted.weights))

    def augments(self, msg: Record) -> bool:
        """Whether the client augments features this round: only once global prototypes exist."""
        return self.hp.faug and self.hp.mu_aug != 0 and bool((msg.array("proto_counts") > 0).any())

    def local_objective(self, msg: Record, ctx: ClientContext, local: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                        ) -> tuple[LossFn, dict[str, torch.Tensor]]:
        """(loss, extras): eq. 9 with the client's relaxed prior (eq. 10), plus eq. 16 on the
        augmented features when ``local`` (its class means and counts, eq. 18) is given."""
        hp, y = self.hp, ctx.data[1]
        extras = {"prior": relaxed_prior(ctx.class_counts, hp.epsilon).to(y.device)}  # (C,) eq. 10
        if local is None:
            return self.balanced_loss, extras
        means, n = local
        P, available = client_prototypes(means.clone(), n, msg.array("proto").to(y.device),
                                         msg.array("proto_counts").to(y.device))  # eq. 18
        targets = torch.zeros(len(n), dtype=torch.int64, device=y.device)  # padded to C: one shape for all
        targets[:len(available)] = available
        extras.update(prototypes=P, targets=targets, n_targets=torch.tensor(len(available), device=y.device))
        return self.augmented_loss, extras

    def balance(self, z: torch.Tensor, y: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
        """Eq. 9 (relaxed balanced softmax with the prior pi), or plain CE for the ablation."""
        return F.cross_entropy(balanced_logits(z, pi) if self.hp.rbsm else z, y)

    def balanced_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,  # body h = f(x), head z = phi(h)
                      extras: Mapping[str, Any]) -> torch.Tensor:
        return self.balance(model.head(model.body(x)), y, extras["prior"])

    def augmented_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                       extras: Mapping[str, Any]) -> torch.Tensor:
        hp = self.hp
        h = model.body(x)  # (B, d)
        value = self.balance(model.head(h), y, extras["prior"])
        h_aug, y_aug = augment_features(h.detach(), y, extras["prototypes"], extras["targets"], hp.lam,
                                        extras["n_targets"])  # eq. 15
        pi_aug = relaxed_prior(label_counts(y_aug, self.info.num_classes), hp.epsilon).to(y.device)
        return value + hp.mu_aug * self.balance(model.head(h_aug), y_aug, pi_aug)  # eq. 16
