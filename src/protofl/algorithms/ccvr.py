"""CCVR (Luo, Chen, Hu, Zhang, Liang & Feng, NeurIPS 2021, "No Fear of Heterogeneity:
Classifier Calibration for Federated Learning with Non-IID Data"): FedAvg, and a classifier
calibrated with virtual representations drawn from per-class Gaussians that the server
assembles from the clients' feature statistics.

    model: body f (features z = f(x) in R^d) and a linear classifier g
    training: FedAvg, unchanged (the calibrated classifier is never sent to the clients)
    client k, with the received global model w_t = (f, g), before its local update:
        for every class c it holds (N_{c,k} samples), on z = f(x) in eval mode:
        mu_{c,k} = 1/N_{c,k} sum z,   Sigma_{c,k} = 1/(N_{c,k} - 1) sum (z - mu_{c,k})(z - mu_{c,k})^T
        reply: FedAvg's w_k, and mu_k (C, d), Sigma_k (C, d, d), N_k (C,)
    server: w_{t+1} = FedAvg, and for every class c some arriving client holds:
        N_c = sum_k N_{c,k},   mu_c = sum_k (N_{c,k} / N_c) mu_{c,k}
        Sigma_c = sum_k (N_{c,k} - 1)/(N_c - 1) Sigma_{c,k} + sum_k N_{c,k}/(N_c - 1) mu_{c,k} mu_{c,k}^T
                  - N_c/(N_c - 1) mu_c mu_c^T           (the pooled sample covariance, exactly)
        M_c virtual features per class ~ N(mu_c, Sigma_c); g^ = g trained on them (cross-entropy)
    global model (GM): (f, g^), w_t with the calibrated classifier

When calibration happens: the paper calibrates once, after training, with every client.
Here every round calibrates the model its clients received, w_t, with their statistics, and
that calibrated model is the global model evaluated (``gm``; ``gm@uncalibrated`` is w_t
itself, so their difference is the calibration's gain on the same body). Training never
sees it: the run is FedAvg's bit for bit (tested), and GM lags FedAvg's by the one
aggregation the statistics were not computed on. Under partial participation the
statistics are the round's arrivals'; a class none of them holds keeps its classifier row
and leaves the softmax of the re-training (re-training it on no samples would only push it
down). A class with N_c = 1 has Sigma_c = 0 (its virtual features are its mean).

Defaults and sources: the paper's text was not at hand when this was written (its equation
numbers are not cited; the formulas above are the pooled mean and covariance it uses); the
statistics and the re-training follow the paper's description as implemented by FL-bench
and fluke. Defaults: M_c = 1000 and lr 0.01 are the values of fluke's example
configuration (its ccvr.yaml; fluke's code defaults are M_c = 100, lr 0.1, batch 64;
FL-bench uses M_c = 200 and the run's lr and batch size); one epoch of SGD from the
global classifier (both re-train one epoch from it); the batch of 32 is protofl's own
choice (fluke's configuration: 10).

Choices and deviations:
* Local covariances are the unbiased ones the pooled formula needs; FL-bench and fluke
  send the biased ones (``cov(correction=0)``) into the same formula, which then
  underestimates Sigma_c.
* Sampling: Sigma_c = V diag(lambda) V^T (float64), z = mu_c + V diag(sqrt(max(lambda, 0))) e,
  e ~ N(0, I) from the server's stream of the round; a singular Sigma_c (d > N_c) is fine.
* The classifier must be the model's ``head``, a linear layer; the re-training is
  CReFF's minibatch SGD in closed form (:func:`protofl.algorithms.creff.retrain_linear`).
* Traffic: C d (d + 1) + C numbers per reply beyond FedAvg's (the paper sends them once).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import cast, Optional, Sequence, TYPE_CHECKING, Union

import torch
from torch import nn

from ..errors import ConfigError, require, require_size
from ..messages import Arrays, Record, expect_arrays, expect_shapes
from ..nn.prototypes import class_means
from .base import ClientContext, ClientResult, Predictors, register, ServerContext, WeightsState
from .creff import retrain_linear
from .fedavg import FedAvg, FedAvgHyper


@dataclass
class CCVRHyper(FedAvgHyper):
    num_virtual: int = 1000  # M_c, virtual features per class (fluke's example ccvr.yaml)
    calibration_epochs: int = 1
    calibration_lr: float = 0.01  # fluke's example ccvr.yaml
    calibration_batch: int = 32  # protofl's choice

    def validate(self, section: str) -> None:
        require_size(self, section, "num_virtual", "calibration_batch")
        require(self.calibration_epochs >= 1, f"{section}.calibration_epochs", self.calibration_epochs, "must be >= 1")
        require(self.calibration_lr > 0, f"{section}.calibration_lr", self.calibration_lr, "must be > 0")


@dataclass
class CalibratedState(WeightsState):
    """``weights``: the model being trained (w_{t+1}); ``calibrated``: w_t with its classifier
    calibrated, the global model evaluated; ``head``: w_t's own classifier entries."""

    calibrated: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------
# the math, on plain tensors
# ---------------------------------------------------------------------------------------
def class_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class: the mean (C, d), the unbiased covariance (C, d, d) (zero below 2 samples)
    and the count (C,) of the features z (N, d) with labels y (N,)."""
    mu, n = class_means(z, y, num_classes)
    centered = z - mu[y]
    cov = z.new_zeros(num_classes, z.shape[1], z.shape[1])
    for c in torch.unique(y).tolist():  # one (d, d) product per class held: N d^2 in all
        zc = centered[y == c]
        cov[c] = zc.T @ zc / max(len(zc) - 1, 1)
    return mu, cov, n


def global_gaussians(mu: Union[torch.Tensor, Sequence[torch.Tensor]], cov: Union[torch.Tensor, Sequence[torch.Tensor]],
                     n: Union[torch.Tensor, Sequence[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pooled per-class mean (C, d), covariance (C, d, d) and count (C,) of K clients'
    statistics: mu (K, C, d), cov (K, C, d, d) (unbiased) and n (K, C), stacked tensors or
    sequences of the clients' own; in float64, one client at a time (memory C d^2).

    The covariance of the union of the clients' samples of a class, exactly; zero for a
    class with fewer than 2 samples in all, and mean 0 for one with none."""
    N = cast(torch.Tensor, sum(n_k.double() for n_k in n))  # (C,)
    mean = sum(n_k.double().unsqueeze(1) * mu_k.double() for mu_k, n_k in zip(mu, n)) / N.clamp(min=1).unsqueeze(1)
    scatter = -N[:, None, None] * mean.unsqueeze(2) * mean.unsqueeze(1)  # sum_i (z_i - mu_c)(z_i - mu_c)^T:
    for mu_k, cov_k, n_k in zip(mu, cov, n):  # + sum_k (N_k - 1) Sigma_k + N_k mu_k mu_k^T
        m, n_k = mu_k.double(), n_k.double()[:, None, None]
        scatter += (n_k - 1).clamp(min=0) * cov_k.double() + n_k * m.unsqueeze(2) * m.unsqueeze(1)
    Sigma = scatter / (N - 1).clamp(min=1)[:, None, None]
    Sigma = torch.where((N > 1)[:, None, None], Sigma, torch.zeros_like(Sigma))
    return mean, Sigma, N.round().to(torch.int64)


def virtual_features(mean: torch.Tensor, Sigma: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Draws from N(mean_c, Sigma_c) given standard normal noise: mean (P, d), Sigma (P, d, d)
    (symmetric positive semi-definite), eps (P, M, d) -> (P, M, d) = mean + eps A with A the
    symmetric square root of Sigma, V diag(sqrt(lambda)) V^T for Sigma = V diag(lambda) V^T,
    so that A A^T = Sigma.

    The symmetric root is a continuous function of Sigma; V diag(sqrt(lambda)) alone is
    not (the eigenvectors of nearly equal eigenvalues turn freely under a rounding-sized
    change of Sigma), so the same noise gave other draws on another executor or machine."""
    lam, V = torch.linalg.eigh(Sigma.double())
    A: torch.Tensor = (V * lam.clamp(min=0).sqrt().unsqueeze(1)) @ V.transpose(1, 2)  # (P, d, d), symmetric
    return mean.double().unsqueeze(1) + eps.double() @ A


# ---------------------------------------------------------------------------------------
class CalibratedEachRound(FedAvg[CalibratedState]):
    """FedAvg's training, and a global model whose classifier the server calibrates every
    round from statistics of the features of the model the round's clients received
    (CCVR; SphereFed). Subclasses give ``statistics`` (client) and ``calibrate`` (server)."""

    head_keys: tuple[str, ...] = ("head.weight", "head.bias")  # the entries calibration replaces

    if TYPE_CHECKING:  # what the subclasses give
        def statistics(self, z: torch.Tensor, y: torch.Tensor) -> Arrays: ...

        def calibrate(self, w: dict[str, torch.Tensor], replies: list[Record], rnd: int,
                      ctx: ServerContext) -> dict[str, torch.Tensor]: ...

    def server_init(self, ctx: ServerContext) -> CalibratedState:
        w = ctx.init_weights()
        return CalibratedState(w, dict(w), {k: w[k] for k in self.head_keys if k in w})

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        z = await ctx.features(msg.weights, "body")  # w_t's features: the model calibrated
        stats = self.statistics(z, ctx.data[1])
        loss, extras = self.objective(msg, ctx)
        result = self.result(await ctx.fit(msg.weights, loss, extras=extras), ctx)  # the local update
        result.reply = Record(weights=self.reply_weights(result.reply.weights), arrays=stats)
        return result

    def reply_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return weights

    def aggregate(self, state: CalibratedState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> CalibratedState:
        new = super().aggregate(state, rnd, replies, ctx)  # w_{t+1}, FedAvg's
        if new is state:
            return state  # nobody arrived
        head = self.calibrate(state.weights, [r for _, r in replies], rnd, ctx)
        own = {k: state.weights[k] for k in head}
        return dataclasses.replace(new, calibrated={**state.weights, **head}, head=own)

    def global_predictor(self, state: CalibratedState, ctx: ServerContext) -> Optional[Predictors]:
        model = ctx.shared_model(state.calibrated)
        plain = copy.deepcopy(cast(nn.Module, model.head))  # w_t's own classifier on the same body
        plain.load_state_dict({k[len("head."):]: v for k, v in state.head.items()})
        return {"calibrated": model, "uncalibrated": nn.Sequential(cast(nn.Module, model.body), plain)}

    def model_weights(self, state: CalibratedState) -> Optional[dict[str, torch.Tensor]]:
        return state.calibrated


@register
class CCVR(CalibratedEachRound):
    name = "ccvr"
    family = "classifier calibration"
    reply_arrays = ("mean", "cov", "counts")  # besides w_k
    Hyper = CCVRHyper

    def server_init(self, ctx: ServerContext) -> CalibratedState:
        head = ctx.shared_model().head
        if not isinstance(head, nn.Linear):
            raise ConfigError("algorithm.name", self.name,
                              f"needs a linear classifier head; the model's head is {type(head).__name__}")
        return super().server_init(ctx)

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        C, d = self.info.num_classes, self.info.feature_dim
        return (expect_arrays(reply, "mean", "cov", "counts")  # calibrate reads them all
                or expect_shapes(reply, mean=(C, d), cov=(C, d, d), counts=(C,)))

    def statistics(self, z: torch.Tensor, y: torch.Tensor) -> Arrays:
        mean, cov, counts = class_statistics(z, y, self.info.num_classes)
        return {"mean": mean, "cov": cov, "counts": counts}

    def calibrate(self, w: dict[str, torch.Tensor], replies: list[Record], rnd: int,
                  ctx: ServerContext) -> dict[str, torch.Tensor]:
        """The classifier g^: g re-trained on M_c virtual features of each class present."""
        hp = self.hp
        mean, Sigma, N = global_gaussians(*([r.array(k).to(ctx.device) for r in replies]
                                            for k in ("mean", "cov", "counts")))
        present = torch.nonzero(N > 0).flatten()  # (P,) the classes some arriving client holds
        rng = ctx.rng(rnd, "ccvr")
        d = mean.shape[1]
        draws = [virtual_features(mean[[c]], Sigma[[c]],  # one class at a time: memory M d
                                  torch.from_numpy(rng.standard_normal((1, hp.num_virtual, d))).to(ctx.device))[0]
                 for c in present.tolist()]
        feats = torch.cat(draws) if draws else mean.new_zeros(0, d)  # (P M, d)
        W, b = w["head.weight"], w.get("head.bias")
        labels = torch.arange(len(present), device=W.device).repeat_interleave(hp.num_virtual)  # row of present
        W_p, b_p = retrain_linear(W[present], None if b is None else b[present], feats.to(W.dtype), labels,
                                  hp.calibration_epochs, hp.calibration_lr, hp.calibration_batch, rng)
        W = W.index_copy(0, present, W_p)  # absent classes keep their rows
        if b is None:
            return {"head.weight": W}
        return {"head.weight": W, "head.bias": b.index_copy(0, present, cast(torch.Tensor, b_p))}  # b given: b_p too
