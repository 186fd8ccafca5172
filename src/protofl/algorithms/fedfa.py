"""FedFA (Zhou, Zhang & Tsang, IEEE Transactions on Mobile Computing 23(6), 2024; arXiv:2211.09299,
"FedFA: Federated Learning with Feature Anchors to Align Features and Classifiers for
Heterogeneous Data").

FedAvg with one shared table of class feature anchors a (C, d). Each client pulls its
features towards the anchor of their class (feature alignment) and, in the same local
training, teaches its classifier to label every anchor with its class (classifier
calibration), so that all clients train in one feature space against consistent
classifiers; the server averages the clients' updated anchors as it averages the models:

    server -> client k: w_t, the anchors a (C, d)
    client k, E epochs of SGD from w_t on, per minibatch B with z = f(x) (``model.body``):
        L = CE(h(z), y)                                                    (classification)
          + lam / C * sum_{c in B} 1/|B_c| sum_{i in B_c} ||z_i - a_c||^2      (anchor loss)
          + gamma * 1/C * sum_c CE(h(a_c), c)                        (classifier calibration)
        then, for each class c it holds (mu_c: the class mean of f(x) after training):
        a_c^k = m^e a_c + (1 - m^e) mu_c,   e the epochs it trained;  a_c^k = a_c otherwise
        reply w_k and a^k
    server: w_{t+1} = FedAvg;  a <- sum_k n_k a^k / sum_k n_k          (the same weights)
            (a client lacking class c sends a_c back unchanged and counts in its average,
            as in the code: a class's anchor moves by the share of the clients holding it)
    init:   C <= d: a = C distinct rows of the d x d identity, chosen at random;
            C > d: rows drawn from N(0, I) and scaled to unit norm

Family: prototype exchange. The anchors are class prototypes that travel both ways every
round, are built from the clients' class means and serve as the alignment target, the
loop of FedProto and FPL; the calibration is the clients' own, a term of the local loss,
not a repair the server makes from feature statistics as CCVR and CReFF do.

What it rests on: the paper's text beyond its abstract was not at hand (the abstract says
the anchors "align features and calibrate classifiers across clients simultaneously"), so
no equation numbers are cited; the steps above are those of the authors' release
(github.com/TailinZhou/FedFA: utils/AnchorLoss.py, utils/optimizer.py's
fedfa_cl_optimizer, server_se1.py's fedfa_anchorloss, read for this module). Defaults from
its args_fmnist.py and args_cifar10_c2.py: lam = 0.1 (``--lambda_anchor``), m = 0.5 per
epoch (``--momentum_anchor``); gamma = 1, the code's unweighted calibration loss (its
weight, not its step: the code's Adam step moves each classifier parameter by about its
lr, 1e-3, whatever the gradient's size, where here the step is lr * gamma * gradient).
PFLlib, FL-bench and fluke do not implement it.

Choices and deviations:
* Calibration: the code takes, after each SGD step on CE + anchor loss, one step of a
  separate Adam optimizer (lr 1e-3, its state kept through the round) on the classifier
  alone, on CE(h(a_c), c) over all C anchors. Here that term joins the local loss with
  weight gamma: its gradient reaches only the classifier (the anchors are constants) and
  is taken in the same step of the run's optimizer, at the classifier before the step.
* Local anchors: the code accumulates, during each epoch, every batch's class means of the
  training-mode features and, at the epoch's end, divides the sum by the number of batches
  of the epoch (not by the number holding the class, which shrinks a rare class's mean
  towards 0; not followed) and applies a_c <- m a_c + (1 - m) mean. Here the E per-epoch
  updates are made as one, with the class mean mu_c of the trained model's features over the
  whole training set (eval mode, as every protofl prototype method) standing for each
  epoch's mean: a_c^k = m^E a_c + (1 - m^E) mu_c, the code's weight m^E on the received
  anchor. With ``training.steps``, e = samples processed / n_k (fractional epochs).
* The anchor loss divides by C, every class, not by the number of classes in the batch,
  as the code does.
* Optimizer, lr decay and weight decay are the run's (``training.*``); the code's FedFA
  uses SGD with weight decay 1e-3 (its FedAvg 1e-4) and lr 0.01 * 0.99^t.
* The code's ablations (fixed anchors, calibration before/after the epochs, random or
  loaded anchor initialization) are not offered.
* With ``algorithm.server_opt`` the server optimizer steps the model only; the anchors are
  always the plain weighted average (the code has no server optimizer).

Messages: down ``w.*`` and ``anchors`` (C, d); up ``w.*`` and ``anchors`` (C, d).
Personalized model: the client's model after local training (FedAvg's convention). The
anchors are the ``proto_*`` geometry logs' class vectors. ``privacy.mode: sample`` refuses
FedFA (its anchor loss averages each class over the batch's samples, which DP-SGD's
per-sample gradients cannot bound); the class means behind its anchors go through
:func:`protofl.nn.privacy.release_class_means` all the same, which reads which classes a
client holds from the noisy counts of a private release where one is made.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import require
from ..messages import Record, expect_arrays, expect_shapes
from ..models.base import FLModel
from ..nn.privacy import release_class_means
from .base import ClientContext, ClientResult, average, register, ServerContext, WeightsState
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class FedFAHyper(FedAvgHyper):  # weighting: the weights of the models and of the anchors; server_opt
    lam: float = 0.1  # weight of the anchor loss (the code's --lambda_anchor)
    anchor_momentum: float = 0.5  # m, per epoch of local training (the code's --momentum_anchor)
    calibration: float = 1.0  # gamma, weight of the classifier calibration term (the code: 1)

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")
        require(0 <= self.anchor_momentum <= 1, f"{section}.anchor_momentum", self.anchor_momentum,
                "must be in [0, 1]")
        require(self.calibration >= 0, f"{section}.calibration", self.calibration, "must be >= 0")


@dataclass
class FedFAState(WeightsState):
    anchors: torch.Tensor  # (C, d) the global feature anchors a


def initial_anchors(num_classes: int, dim: int, rng: np.random.Generator) -> torch.Tensor:
    """(C, d) anchors: C distinct rows of the d x d identity chosen at random when C <= d, else
    Gaussian rows scaled to unit norm (the authors' AnchorLoss)."""
    if num_classes <= dim:
        return torch.eye(dim)[torch.from_numpy(rng.choice(dim, num_classes, replace=False))]
    return F.normalize(torch.from_numpy(rng.standard_normal((num_classes, dim))).float(), dim=1)


def anchor_loss(z: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """1/C sum over the batch's classes c of the mean over its samples of ||z_i - a_c||^2, for
    features z (B, d), labels y (B,) and anchors (C, d)."""
    C = anchors.shape[0]
    # one-hot by comparison, counts by sum: no bincount, so the batched executor's vmap runs it
    onehot = (y.unsqueeze(1) == torch.arange(C, device=y.device)).to(z.dtype)  # (B, C)
    counts = onehot.sum(0)  # (C,) samples of each class in the batch
    sq = ((z - onehot @ anchors) ** 2).sum(1)  # (B,) ||z_i - a_{y_i}||^2
    return (sq / counts[y]).sum() / C


def local_anchors(anchors: torch.Tensor, means: torch.Tensor, counts: torch.Tensor, momentum: float,
                  epochs: float) -> torch.Tensor:
    """a_c^k = m^e a_c + (1 - m^e) mu_c for the classes the client holds (counts > 0), a_c for the
    others: e per-epoch momentum updates with the same class mean."""
    beta = momentum ** epochs
    return torch.where((counts > 0).unsqueeze(1), beta * anchors + (1 - beta) * means.to(anchors), anchors)


@register
class FedFA(FedAvg[FedFAState]):
    name = "fedfa"
    family = "prototype exchange"
    Hyper = FedFAHyper
    reply_arrays = ("anchors",)  # besides w_k
    couples_samples = True  # the anchor loss averages each class over the batch's samples of it

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedFAState:
        rng = ctx.rng(0, "fedfa-anchors")
        return FedFAState(ctx.init_weights(), initial_anchors(self.info.num_classes, self.info.feature_dim, rng))

    def configure(self, state: FedFAState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights, arrays={"anchors": state.anchors})

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        return expect_arrays(reply, "anchors") or expect_shapes(
            reply, anchors=(self.info.num_classes, self.info.feature_dim))

    def aggregate(self, state: FedFAState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedFAState:
        new = super().aggregate(state, rnd, replies, ctx)  # FedAvg (and the server optimizer's moments)
        # check_reply: every reply's "anchors" is a tensor
        avg = average((r for _, r in replies), self.hp.weighting,
                      part=lambda r: {"a": r.array("anchors")})
        if not avg:
            return new  # nobody arrived: the anchors stay
        return dataclasses.replace(new, anchors=avg["a"].to(state.anchors))

    def class_vectors(self, state: FedFAState) -> Optional[torch.Tensor]:
        return state.anchors

    def prototype_releases(self, privacy: Any) -> int:
        return 1  # the class means and counts behind the local anchors

    # -- client ------------------------------------------------------------------------------
    def anchored_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                      extras: Mapping[str, Any]) -> torch.Tensor:
        a = extras["anchors"]  # (C, d)
        z = model.body(x)
        value: torch.Tensor = F.cross_entropy(model.head(z), y) + self.hp.lam * anchor_loss(z, y, a)
        if self.hp.calibration:  # every anchor labelled with its class by the classifier
            value = value + self.hp.calibration * F.cross_entropy(model.head(a), torch.arange(len(a), device=a.device))
        return value

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        _, y = ctx.data
        a = msg.array("anchors").to(y.device)  # configure sends a tensor
        fitted = await ctx.fit(msg.weights, self.anchored_loss, extras={"anchors": a})
        z = await ctx.features(fitted.weights)
        means, counts = release_class_means(ctx, z, y, self.info.num_classes)  # private under privacy.*
        epochs = fitted.stats.samples / max(ctx.num_samples, 1)
        local = local_anchors(a, means, counts, self.hp.anchor_momentum, epochs)
        reply = Record(weights=fitted.weights, arrays={"anchors": local.detach().cpu()})
        return ClientResult(reply, personal=ctx.shared_model(fitted.weights))
