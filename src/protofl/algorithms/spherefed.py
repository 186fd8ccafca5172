"""SphereFed (Dong, Zhang, Li & Kung, ECCV 2022, "SphereFed: Hyperspherical Federated
Learning"): every client learns features on the unit hypersphere against one fixed
classifier of orthonormal class vectors; after training the server calibrates that
classifier in closed form, by least squares, from statistics the clients send.

    model: body f; features h = f(x) / ||f(x)|| on the unit hypersphere; fixed classifier
           W (C, d) with orthonormal rows (d >= C), the same on every client, never trained
    client k: FedAvg's local update of the body on cross-entropy of the logits s W h
           (``loss: mse``: the squared error ||W h - e_y||^2 instead); W is in no reply
    server: the body averaged as in FedAvg
    calibration: W^ = argmin_W sum_i ||W h_i - e_{y_i}||^2 over the samples of all clients,
           W^T = (H^T H)^+ H^T Y,  H^T H = sum_k H_k^T H_k (d, d),  H^T Y = sum_k H_k^T Y_k (d, C)
           (column c of H_k^T Y_k is client k's sum of h over its class c): each client sends
           its two sums, computed with the received model; the server adds them and solves
    global model (GM): body with W^, logits W^ h

When calibration happens: as in CCVR (:class:`protofl.algorithms.ccvr.CalibratedEachRound`),
every round on the model the round's clients received, w_t, from their statistics; it is
the global model evaluated (``gm``; ``gm@uncalibrated`` is w_t with the fixed W) and is never
sent back, so the training is the paper's (which calibrates once, after training). With
partial participation the sums are the round's arrivals'.

Sources and choices: the paper's text was not at hand when this was written, only its
abstract: a fixed classifier "whose weights span the unit hypersphere", representations
constrained to the unit hypersphere, and "a closed-form solution by minimizing a mean
squared loss" that is "computed efficiently and distributedly without direct access of
local data". The following are therefore ours; check them against the paper:
* the local loss: cross-entropy of s W h with a fixed s = 10 (cosine logits in [-1, 1]
  need a scale to reach confident predictions); ``loss: mse`` trains on the calibration's
  own objective. ``learn_scale`` makes s a parameter averaged with the body.
* d < C (no orthonormal frame exists): FedNH's maximally separated unit vectors
  (:func:`protofl.nn.heads.max_separated_prototypes`).
* a singular H^T H (d > samples, collapsed features) takes the pseudo-inverse, the
  minimum-norm least-squares solution; ``ridge`` lambda > 0 solves (H^T H + lambda I) instead.
* the targets are one-hot, the calibrated classifier has no bias and its scale is 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Literal, Mapping, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import require
from ..messages import Arrays, Record, expect_arrays, expect_shapes
from ..models.base import FLModel
from ..nn.heads import FixedHead, max_separated_prototypes, orthonormal_prototypes
from .base import ClientContext, cross_entropy, LossFn, register, ServerContext
from .ccvr import CalibratedEachRound, CalibratedState
from .fedavg import FedAvgHyper


@dataclass
class SphereFedHyper(FedAvgHyper):
    loss: Literal["ce", "mse"] = "ce"  # the local loss against the fixed classifier
    scale: float = 10.0  # s of the cross-entropy's logits s W h
    learn_scale: bool = False
    ridge: float = 0.0  # lambda of the calibration; 0 = the plain least squares (pseudo-inverse)

    def validate(self, section: str) -> None:
        require(self.scale > 0, f"{section}.scale", self.scale, "must be > 0")
        require(self.ridge >= 0, f"{section}.ridge", self.ridge, "must be >= 0")


def least_squares_classifier(gram: torch.Tensor, sums: torch.Tensor, ridge: float = 0.0) -> torch.Tensor:
    """The calibrated classifier W^ (C, d): argmin_W sum_i ||W h_i - e_{y_i}||^2 + ridge ||W||^2,
    given gram = H^T H (d, d) and sums = Y^T H (C, d) (per class, the sum of its features)."""
    G = gram.double() + ridge * torch.eye(len(gram), dtype=torch.float64, device=gram.device)
    return cast(torch.Tensor, (torch.linalg.pinv(G, hermitian=True) @ sums.double().T).T)  # (C, d)


@register
class SphereFed(CalibratedEachRound):
    name = "spherefed"
    family = "fixed and calibrated heads"
    reply_arrays = ("gram", "sums")  # besides the body
    Hyper = SphereFedHyper
    head_keys = ("head.weight", "head.scale")

    # -- model: the fixed hyperspherical classifier ------------------------------------------
    def adapt_model(self, model: nn.Module) -> nn.Module:
        fl = cast(FLModel, model)  # the zoo's models
        C, d, seed = fl.num_classes, fl.feature_dim, self.info.seed
        W = orthonormal_prototypes(C, d, seed) if d >= C else max_separated_prototypes(C, d, seed)
        model.head = FixedHead(W, scale=self.hp.scale, learn_scale=self.hp.learn_scale)  # s W h / ||h||
        return model

    # -- client -------------------------------------------------------------------------------
    def objective(self, msg: Record, ctx: ClientContext) -> tuple[LossFn, dict[str, Any]]:
        return (cross_entropy if self.hp.loss == "ce" else self.squared_error), {}

    @staticmethod
    def squared_error(model: FLModel, x: torch.Tensor, y: torch.Tensor,
                      extras: Mapping[str, Any]) -> torch.Tensor:
        # the zoo's models; the head's weight is the FixedHead's buffer W
        out = F.normalize(model.body(x), dim=1) @ cast(torch.Tensor, model.head.weight).T  # (B, C) W h
        return ((out - F.one_hot(y, out.shape[1]).to(out.dtype)) ** 2).sum(1).mean()

    def reply_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # W never moves; a fixed s neither: averaging copies would only add rounding
        return {k: v for k, v in weights.items() if k != "head.weight" and (k != "head.scale" or self.hp.learn_scale)}

    def statistics(self, z: torch.Tensor, y: torch.Tensor) -> Arrays:
        h = F.normalize(z, dim=1)  # (n_k, d) on the hypersphere
        sums = h.new_zeros(self.info.num_classes, h.shape[1]).index_add_(0, y, h)  # (C, d) = Y_k^T H_k
        return {"gram": h.T @ h, "sums": sums}

    # -- server -------------------------------------------------------------------------------
    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        C, d = self.info.num_classes, self.info.feature_dim
        return expect_arrays(reply, "gram", "sums") or expect_shapes(reply, gram=(d, d), sums=(C, d))  # both read

    def calibrate(self, w: dict[str, torch.Tensor], replies: list[Record], rnd: int,
                  ctx: ServerContext) -> dict[str, torch.Tensor]:
        gram = cast(torch.Tensor, sum(r.array("gram").double() for r in replies))  # H^T H
        sums = cast(torch.Tensor, sum(r.array("sums").double() for r in replies))  # (H^T Y)^T
        W = least_squares_classifier(gram, sums, self.hp.ridge).to(w["head.weight"])
        return {"head.weight": W, "head.scale": torch.ones_like(w["head.scale"])}

    def class_vectors(self, state: CalibratedState) -> Optional[torch.Tensor]:
        return state.weights["head.weight"]  # the fixed orthonormal W (C, d)
