"""CReFF (Shang, Lu, Huang & Wang, IJCAI 2022, "Federated Learning on Heterogeneous and
Long-Tailed Data via Classifier Re-training with Federated Features"), Algorithm 1.

    server state: the FedAvg model w = (body f, classifier W), the re-trained classifier
                  W_re, and M federated features per class F = {F_c}, F_c in R^{M x d}
    server -> client k: w and W_re
    client k:
        for every class c it holds (n_kc samples), R times: draw ``batch_real`` samples of c,
            g_kc += grad_{W_re} CE(W_re(f(x)), c) / R    (real-feature gradients)
        local training from w as in FedAvg; reply w_k and {g_kc}
    server:
        w <- sum_k (n_k / n) w_k                                                   (FedAvg)
        g_c = mean of g_kc over the clients that sent class c
        S steps of SGD (lr ``feature_lr``) on F minimizing the gradient-matching loss
            sum_c D( grad_{W_re} CE(W_re(F_c), c), g_c )
            D(A, B) = sum_i (1 - <A_i, B_i> / (||A_i|| ||B_i|| + 1e-6))  over the output rows
                      i of each classifier parameter (a bias is one row)
        W_re <- a freshly initialized classifier trained for ``retrain_epochs`` epochs
                of SGD (lr ``retrain_lr``, batch ``retrain_batch``) on (F, labels)
    evaluation (GM): body of w with the classifier W_re

The steps follow the paper's Algorithm 1 as its authors' code runs it (equation numbers
are not cited: the paper's text was not at hand when this was written; check them).
Defaults are the paper's and its code's: M = 100 features per class, S = 100 matching
steps, feature lr 0.1, 300 re-training epochs with lr 0.01 and batch 32, R = 10 repeats of
32 real samples per class.

Choices where the paper is silent, and details:
* The classifier is the model's ``head`` and must be a linear layer (every model in the
  zoo): the server's matching and re-training use its gradients in closed form
  (:func:`linear_class_gradients`, checked against autograd in the tests); the clients use
  autograd. Class gradients travel as arrays ``g.weight`` (C, O, d) and ``g.bias`` (C, O)
  with a (C,) mask ``g_mask`` of the classes the client sent.
* The features F are initialized from N(0, 1) once (server stream of round 0) and kept
  and refined across rounds; the re-trained classifier before round 1 is the model's
  initial head (the authors' code starts from an independently initialized
  ``nn.Linear(256, 10)``, ``temp_model`` in ``main.py``: both are random classifiers
  that only serve round 1's real-feature gradients, so this has no practical effect).
  Re-training draws its initialization and batch order from the server's stream of the
  round.
* Real-feature gradients are computed with the body in eval mode, before local training,
  with the received global body and W_re (the classifier they are matched against).
* A round without arrivals keeps everything; classes nobody sent this round do not enter
  the matching loss.

Deviations from the authors' code (github.com/shangxinyi/CReFF-FL): the code applies
differentiable Siamese augmentation to the real samples before their gradients and random
crops/flips in local training; no augmentation here. The code hard-codes 256-d features
and ResNet-8; here d is the model's feature dimension.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import ConfigError, require, require_size
from ..messages import Record
from ..models.base import FLModel
from ..nn.modes import eval_mode
from .base import ClientContext, ClientResult, Predictors, register, ServerContext, WeightsState
from .fedavg import FedAvg
from .serveropt import ServerOptHyper


@dataclass
class CReFFHyper(ServerOptHyper):
    num_features: int = 100  # M, federated features per class
    match_steps: int = 100  # S, gradient-matching steps per round
    feature_lr: float = 0.1
    retrain_epochs: int = 300
    retrain_lr: float = 0.01
    retrain_batch: int = 32
    batch_real: int = 32  # real samples per class for one gradient
    repeats: int = 10  # R, gradients averaged per class
    weighting: Literal["samples", "uniform"] = "samples"

    def validate(self, section: str) -> None:
        require_size(self, section, "num_features", "retrain_batch", "batch_real")
        require(self.repeats >= 1, f"{section}.repeats", self.repeats, "must be >= 1")
        for key in ("match_steps", "retrain_epochs"):
            require(getattr(self, key) >= 0, f"{section}.{key}", getattr(self, key), "must be >= 0")
        for key in ("feature_lr", "retrain_lr"):
            require(getattr(self, key) > 0, f"{section}.{key}", getattr(self, key), "must be > 0")


@dataclass
class CReFFState(WeightsState):
    head: dict[str, torch.Tensor]  # W_re, the re-trained classifier
    features: torch.Tensor  # (C * M, d) federated features, class-major


# ---------------------------------------------------------------------------------------
# the math, on plain tensors (the classifier is a linear layer: logits = h W^T + b)
# ---------------------------------------------------------------------------------------
def class_gradient(head: nn.Module, params: dict[str, torch.Tensor], h: torch.Tensor, c: int
                   ) -> dict[str, torch.Tensor]:
    """grad_W CE(head_W(h), c) by autograd, for features h (B, d) that all belong to class c."""
    out = functional_call(head, params, (h,))
    loss = F.cross_entropy(out, torch.full((len(h),), c, dtype=torch.long, device=h.device))
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def linear_class_gradients(W: torch.Tensor, b: Optional[torch.Tensor], feats: torch.Tensor
                           ) -> dict[str, torch.Tensor]:
    """The same gradients in closed form, for all classes at once (differentiable in feats).

    feats (C, M, d): M features of each class c. With P = softmax(F_c W^T + b) and E_c the
    one-hot rows of c: dCE/dW = (P - E_c)^T F_c / M, dCE/db = sum_rows (P - E_c) / M.
    Returns {"weight": (C, O, d), "bias": (C, O)} (no "bias" without one).
    """
    C, M, _ = feats.shape
    logits = feats @ W.T + (b if b is not None else 0.0)  # (C, M, O)
    G = torch.softmax(logits, dim=2)
    G = (G - F.one_hot(torch.arange(C, device=feats.device), W.shape[0]).to(G.dtype).unsqueeze(1)) / M
    out = {"weight": G.transpose(1, 2) @ feats}
    if b is not None:
        out["bias"] = G.sum(dim=1)
    return out


def row_cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per leading index (class): sum over output rows i of 1 - cos(a_i, b_i), eps 1e-6.

    a, b (C, O, d) for a weight or (C, O) for a bias (a bias is one row).
    """
    if a.dim() == 2:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    return torch.sum(1 - torch.sum(a * b, dim=2) / (a.norm(dim=2) * b.norm(dim=2) + 1e-6), dim=1)


def matching_loss(W: torch.Tensor, b: Optional[torch.Tensor], feats: torch.Tensor,
                  targets: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The gradient-matching loss: sum over the classes c with mask[c] of D(grad_W CE(W(F_c), c), g_c).

    feats (C, M, d); targets {"weight": (C, O, d), "bias": (C, O)} the g_c; mask (C,) bool.
    """
    syn = linear_class_gradients(W, b, feats)
    per_class = cast(torch.Tensor, sum(row_cosine_distance(syn[k], targets[k]) for k in syn))  # syn has "weight"
    return per_class[mask].sum()


def retrain_linear(W: torch.Tensor, b: Optional[torch.Tensor], feats: torch.Tensor, labels: torch.Tensor,
                   epochs: int, lr: float, batch: int,
                   rng: np.random.Generator) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Minibatch SGD on CE(h W^T + b, y) over (feats, labels), closed-form gradients."""
    W, b = W.clone(), (b.clone() if b is not None else None)
    onehot = F.one_hot(labels, W.shape[0]).to(feats.dtype)
    n = len(labels)
    for _ in range(epochs):
        perm = torch.from_numpy(rng.permutation(n)).to(feats.device)
        fp, yp = feats[perm], onehot[perm]
        for i in range(0, n, batch):
            f, y = fp[i:i + batch], yp[i:i + batch]
            G = torch.softmax(f @ W.T + (b if b is not None else 0.0), dim=1).sub_(y).div_(len(f))
            W.sub_(G.T @ f, alpha=lr)
            if b is not None:
                b.sub_(G.sum(0), alpha=lr)
    return W, b


@register
class CReFF(FedAvg[CReFFState]):
    name = "creff"
    family = "classifier calibration"
    reply_arrays = ("grad", "grad_mask")  # besides w_k: per-class classifier gradients
    Hyper = CReFFHyper

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> CReFFState:
        w = ctx.init_weights()
        model = ctx.shared_model(w)
        if not isinstance(model.head, nn.Linear):
            raise ConfigError("algorithm.name", self.name,
                              f"needs a linear classifier head; model's head is {type(model.head).__name__}")
        head = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
        C, M, d = self.info.num_classes, self.hp.num_features, model.feature_dim
        feats = torch.from_numpy(ctx.rng(0, "creff-features").standard_normal((C * M, d))).float()
        return CReFFState(w, head, feats.to(ctx.device))

    def configure(self, state: CReFFState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights, arrays={"head": state.head})  # w_t and W_re

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        C = self.info.num_classes
        mask = reply.arrays.get("grad_mask")
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (C,) or mask.is_floating_point() \
                or int(mask.max()) > 1 or int(mask.min()) < 0:
            return f"grad_mask must be a (C,) = ({C},) 0/1 mask"
        grads = reply.arrays.get("grad")
        if not isinstance(grads, dict):
            return "grad must be a group of per-class gradients"
        # W_re as sent: one class gradient per parameter of it
        head = sent.group("head")
        if set(grads) != set(head):
            return f"grad has {sorted(grads)}, the classifier sent has {sorted(head)}"
        bad = [k for k, g in grads.items() if tuple(g.shape) != (C, *head[k].shape)]
        return (f"class gradients {bad} do not have the shape (C, *parameter shape) = "
                f"{[(C, *head[k].shape) for k in bad]}") if bad else None

    def aggregate(self, state: CReFFState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> CReFFState:
        avg = super().aggregate(state, rnd, replies, ctx)
        if not replies:
            return state
        C, M = self.info.num_classes, self.hp.num_features
        # per class, the mean over the clients that sent it
        sent = torch.stack([r.array("grad_mask")
                            for _, r in replies]).to(torch.float32)  # (K, C)
        n = sent.sum(0)  # (C,)
        mask = n > 0
        grads = [r.group("grad") for _, r in replies]
        targets: dict[str, torch.Tensor] = {}
        for k in state.head:
            total = cast(torch.Tensor, sum(g[k] * sent[j].view(-1, *[1] * (g[k].dim() - 1))
                                           for j, g in enumerate(grads)))  # a tensor: replies is not empty
            targets[k] = total / n.clamp_min(1).view(-1, *[1] * (total.dim() - 1))
        W, b = state.head["weight"], state.head.get("bias")
        feats = state.features.detach().clone().view(C, M, -1).requires_grad_(True)
        opt = torch.optim.SGD([feats], lr=self.hp.feature_lr)
        for _ in range(self.hp.match_steps):
            loss = matching_loss(W, b, feats, targets, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        features = feats.detach().view(C * M, -1)
        rng = ctx.rng(rnd, "creff-retrain")
        with torch.random.fork_rng(devices=[]):  # re-training starts from a fresh classifier
            torch.manual_seed(int(rng.integers(2**62)))
            fresh = nn.Linear(W.shape[1], W.shape[0], bias=b is not None).to(W.device)
        labels = torch.arange(C, device=features.device).repeat_interleave(M)
        W_re, b_re = retrain_linear(fresh.weight.detach(), None if b is None else fresh.bias.detach(), features,
                                    labels, self.hp.retrain_epochs, self.hp.retrain_lr, self.hp.retrain_batch, rng)
        head = {"weight": W_re} if b_re is None else {"weight": W_re, "bias": b_re}
        return dataclasses.replace(avg, head=head, features=features)

    def global_predictor(self, state: CReFFState, ctx: ServerContext) -> Predictors:
        weights = dict(state.weights)
        weights.update({"head." + k: v for k, v in state.head.items()})  # the re-trained classifier
        return ctx.shared_model(weights)

    # -- client ------------------------------------------------------------------------------
    def real_gradients(self, model: FLModel, head: dict[str, torch.Tensor],
                       ctx: ClientContext) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per class, the mean of ``repeats`` classifier gradients on real features."""
        x, y = ctx.data
        C, hp = self.info.num_classes, self.hp
        rng = ctx.rng("creff-real")
        grads = {k: torch.zeros((C, *v.shape), device=v.device) for k, v in head.items()}
        mask = torch.zeros(C, dtype=torch.int64)
        params = {k: v.detach().clone().requires_grad_(True) for k, v in head.items()}
        with eval_mode(model):
            for c in torch.unique(y).tolist():
                idx_c = torch.nonzero(y == c).flatten().cpu().numpy()
                for _ in range(hp.repeats):
                    pick = torch.from_numpy(rng.permutation(idx_c)[:hp.batch_real]).to(y.device)
                    xb = x[pick]
                    if ctx.channels_last and xb.dim() == 4:
                        xb = xb.contiguous(memory_format=torch.channels_last)
                    with torch.no_grad():
                        h: torch.Tensor = model.body(xb)
                    for k, g in class_gradient(model.head, params, h, c).items():
                        grads[k][c] += g / hp.repeats
                mask[c] = 1
        return grads, mask

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        w_t = msg.weights
        head = msg.group("head")
        grads, mask = self.real_gradients(cast(FLModel, ctx.shared_model(w_t)), head, ctx)  # before training
        fitted = await ctx.fit(w_t)  # FedAvg's local update
        reply = Record(weights=fitted.weights, arrays={"grad": grads, "grad_mask": mask})
        return ClientResult(reply, personal=ctx.shared_model(fitted.weights))
