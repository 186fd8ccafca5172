"""FedBR (Guo, Tang & Lin, ICML 2023, "FedBR: Improving Federated Learning on Heterogeneous
Data via Local Learning Bias Reduction", arXiv:2205.13462; an earlier version is the ICLR 2023
submission "FedDebias"): FedAvg whose clients reduce two local learning biases with a small
set of pseudo-data x_p shared by every client.

    pseudo-data (RSM, random sample means): P = 32 inputs, each the mean of K = 10 inputs
        drawn at random, with replacement, from the training data of one client chosen
        uniformly; built once, before FedBR's local objective starts, and shared with every
        client; the pseudo-data's label y~_p is uniform, 1/C for every class
    client i, from the global model (phi_g, h_g) and the projection layer psi (an MLP):
        min over (phi_i, h_i):  CE(h(phi_i(x)), y) + lam * CE(h(phi_i(x_p)), y~_p) + mu * L_con
        max over psi:           L_con
        L_con = -log  e^{tau1 s(a, g)} / (e^{tau1 s(a, g)} + e^{tau2 s(a, n)}),
                a = psi(phi_i(x_p)),  g = psi(phi_g(x_p)),  n = psi(phi_i(x)),  s = cosine
      component 1 (the second term) balances the local classifier's output on label-agnostic
      inputs; component 2 (L_con) pulls the local features of the pseudo-data to the global
      model's and away from the local data's, in the space of a psi trained to tell them apart
    server: w_{t+1} = sum_i (n_i / n) w_i over (phi, h, psi)  (FedAvg)

Sources. The paper's method section could not be read here (only its abstract, the start of
its introduction and Figure 4's caption: "the three terms in (2) and (3)": the cross-entropy of (x, y) and of
(x_p, y~_p), and a contrastive loss of phi_i(x), phi_i(x_p) and phi_g(x_p); we read (2) as
the min and (3) as the max objective above). The objective, its signs and temperatures, the
pseudo-data and every default are taken from the authors' code (github.com/lins-lab/fedbr:
``FedBR.update`` in ``fedbr/algorithms.py``, ``get_augmentation_mean_data`` in
``fedbr/scripts/train_fed.py``): mu = 0.5, lam = 1, tau1 = tau2 = 2 (they multiply the
cosine, so tau2 = 0 removes the negative), P = 32 (the code: its batch size, 32 on CIFAR, 64
on RotatedMNIST, 128 otherwise), K = 10; psi is
Linear(d, 2d) -> ReLU -> Linear(2d, 2d) -> ReLU -> Linear(2d, d), averaged like the model.
A third-party reproduction (github.com/kvu228/FedBR, REPRODUCE.md) quotes the paper's
Appendix A as 32 pseudo-data sent once, tau1 = tau2 = 2, mu = 0.5, lam = 1 (as the code) and psi
of width 256 and output 128 (unverified here; the code's 2d and d are used).
PFLlib, FL-bench and fluke do not implement FedBR.

Inputs must be real-valued (a model reading token ids is refused: a mean of token ids is no
input). Privacy: every client of the pseudo-data round uploads P means of K = 10 of its raw
inputs (the server keeps about P / |S_1| of each client's) and the kept ones are broadcast
to every client. That is a release of (averaged) training data, which no
privacy mode of protofl covers: ``privacy.mode`` client and sample are refused.

On the engine: ``adapt_model`` adds ``model.proj`` (psi). Round 1 (the first round in which
replies arrive) is the pseudo-data round: its clients train plain FedAvg (psi does not move)
and each sends P random sample means (array ``pseudo``, (P, *input)); the server fills slot
j of the pseudo-data with the j-th mean of a client drawn uniformly from those that arrived.
From then on every broadcast carries x_p; each client computes g = phi_g(x_p) once per round
and trains the objective above; psi ascends L_con through the gradient transform
:meth:`FedBR.ascend_projection`.

Deviations from the authors' code, and choices:
* The code builds the pseudo-data in the simulator, before round 1, from every training
  client. Here the clients of round 1 build them (the server holds no data), and round 1 is
  plain FedAvg. With partial participation only round 1's clients contribute.
* The broadcast carries x_p every round (the paper, as the reproduction above quotes its
  Appendix A: sent once); a client keeps nothing.
* Min and max in one step (simultaneous descent-ascent): psi's gradient of the step's loss
  is replaced by -(1/mu) times it, so psi takes a step of lr * dL_con/dpsi up while the
  model steps down, both from the same point. The code alternates: psi steps first (on
  detached features), then the model steps with the new psi. Both steps use the run's
  optimizer (the code: plain SGD for both, no momentum).
* Pairing: the code pairs pseudo-datum j with local sample j of the batch (P equals its
  batch size); here with sample j mod B, so any batch size B works (equal to the code's
  when B = P).
* g = phi_g(x_p) is computed in eval mode (the code: train mode; its featurizers have no
  BatchNorm, so only the ViT's dropout differs there).
* The code's options ``use_Mixture`` (the pseudo-data are mixed with a local sample and
  take a soft label) and ``use_Mixup`` are off by default and not implemented.
* The server averages with the run's weighting, n_i / n by default; the code averages the
  sampled clients uniformly (``algorithm.weighting=uniform`` does that).
* With ``training.clip_grad`` set, psi's reversed gradient is clipped together with the
  model's (one global norm), so psi's ascent can shrink the model's step; the code clips
  nothing.
* A client without training data sends no means in the pseudo-data round.
* Personalized model (PM, PA): the client's model after local training.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, require, require_size
from ..messages import expect_shapes, Record
from ..models.base import FLModel
from .base import ClientContext, ClientResult, register, ServerContext, WeightsState
from .fedavg import FedAvg, FedAvgHyper

PROJ = "proj."


@dataclass
class FedBRHyper(FedAvgHyper):
    mu: float = 0.5  # weight of the contrastive loss L_con (the authors' code)
    lam: float = 1.0  # weight of the pseudo-data's balancing cross-entropy (the authors' code)
    tau1: float = 2.0  # multiplier of the positive pair's cosine (the authors' code)
    tau2: float = 2.0  # multiplier of the negative pair's cosine (the authors' code)
    num_pseudo: int = 32  # P pseudo-data (the authors' code: the batch size, 32)
    mean_of: int = 10  # K inputs averaged into one pseudo-datum (the authors' code)

    def validate(self, section: str) -> None:
        for key in ("mu", "lam", "tau1", "tau2"):
            require(getattr(self, key) >= 0, f"{section}.{key}", getattr(self, key), "must be >= 0")
        require_size(self, section, "num_pseudo", "mean_of")


@dataclass
class FedBRState(WeightsState):
    pseudo: Optional[torch.Tensor] = None  # x_p (P, *input), fixed after the pseudo-data round


def random_sample_means(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """RSM: (n, *input) inputs and (P, K) row indices -> (P, *input), row j the mean of x[idx[j]]."""
    return x[idx].mean(1)


def balancing_loss(logits: torch.Tensor) -> torch.Tensor:
    """Component 1: the cross-entropy of (P, C) logits with the uniform label 1/C."""
    return -F.log_softmax(logits, dim=1).mean(1).mean()


def contrastive_loss(a: torch.Tensor, g: torch.Tensor, n: torch.Tensor, tau1: float, tau2: float) -> torch.Tensor:
    """L_con over the rows of (P, k) anchors a, positives g and negatives n:
    mean_j -log e^{tau1 s(a_j, g_j)} / (e^{tau1 s(a_j, g_j)} + e^{tau2 s(a_j, n_j)})."""
    pos = tau1 * F.cosine_similarity(a, g, dim=1)
    neg = tau2 * F.cosine_similarity(a, n, dim=1)
    return (torch.logaddexp(pos, neg) - pos).mean()


def projection(d: int) -> nn.Module:
    """psi: the authors' MLP, d -> 2d -> 2d -> d."""
    return nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))


@register
class FedBR(FedAvg[FedBRState]):
    name = "fedbr"
    family = "calibrated softmax"
    Hyper = FedBRHyper
    hp: FedBRHyper
    reply_arrays = ("pseudo",)  # the random sample means, in the pseudo-data round only
    couples_samples = True  # L_con pairs the pseudo-data with the samples of the batch

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model.proj = projection(cast(FLModel, model).feature_dim)
        return model

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedBRState:
        if any(isinstance(m, nn.Embedding) for m in ctx.shared_model().modules()):
            raise ConfigError("algorithm.name", self.name, "averages raw inputs into its pseudo-data, which needs "
                              "real-valued inputs; this model reads token ids (an embedding)")
        return FedBRState(ctx.init_weights())

    def configure(self, state: FedBRState, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights, arrays={} if state.pseudo is None else {"pseudo": state.pseudo})

    def aggregate(self, state: FedBRState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedBRState:
        new = super().aggregate(state, rnd, replies, ctx)
        # check_reply: a reply's "pseudo" is a tensor
        means = [r.array("pseudo") for _, r in replies if "pseudo" in r.arrays]
        if state.pseudo is None and means:  # the pseudo-data round: slot j from a client drawn uniformly
            pick = ctx.rng(rnd, "fedbr-pseudo").integers(0, len(means), size=self.hp.num_pseudo)
            pseudo = torch.stack([means[int(k)][j] for j, k in enumerate(pick)])
            new = dataclasses.replace(new, pseudo=pseudo)
        return new

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        if "pseudo" in sent.arrays:
            return "pseudo-data sent after the pseudo-data round" if "pseudo" in reply.arrays else None
        if "pseudo" not in reply.arrays and reply.num_samples == 0:
            return None  # a client without data sends no means
        if not isinstance(reply.arrays.get("pseudo"), torch.Tensor):  # aggregate builds x_p from it
            return "the random sample means (array 'pseudo') missing from a reply of the pseudo-data round"
        return expect_shapes(reply, pseudo=(self.hp.num_pseudo, *self.info.input_shape))

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        x_p = cast(Optional[torch.Tensor], msg.arrays.get("pseudo"))  # configure sends a tensor
        if x_p is None:  # the pseudo-data round: FedAvg, and P random sample means of the local data
            fitted = await ctx.fit(msg.weights, trainable=("body.", "head."))
            x = ctx.data[0]
            result = self.result(fitted, ctx)
            if len(x):  # a client without data has no means to send
                idx = ctx.rng("fedbr-rsm").integers(0, len(x), size=(self.hp.num_pseudo, self.hp.mean_of))
                result.reply.arrays["pseudo"] = random_sample_means(x, torch.as_tensor(idx, device=x.device))
            return result
        x_p = x_p.to(ctx.data[0].device)
        # phi_g(x_p), the frozen global features (made under inference mode: cloned, psi is applied to them)
        g = (await ctx.features(msg.weights, "body", x=x_p)).clone()
        moving = None if self.hp.mu > 0 else ("body.", "head.")  # mu = 0: psi has no gradient
        fitted = await ctx.fit(msg.weights, self.fedbr_loss, extras={"pseudo": x_p, "glob": g},
                               trainable=moving, grad=self.ascend_projection if self.hp.mu > 0 else None)
        return self.result(fitted, ctx)

    def fedbr_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
        """CE(h(phi(x)), y) + lam CE(h(phi(x_p)), 1/C) + mu L_con."""
        z = model.body(x)
        value: torch.Tensor = F.cross_entropy(model.head(z), y)
        if self.hp.lam == 0 and self.hp.mu == 0:
            return value
        z_p = model.body(extras["pseudo"])
        value = value + self.hp.lam * balancing_loss(model.head(z_p))
        if self.hp.mu == 0:
            return value
        pair = torch.arange(len(z_p), device=z.device) % len(z)  # pseudo-datum j with local sample j mod B
        proj = cast(nn.Module, model.proj)
        l_con = contrastive_loss(proj(z_p), proj(extras["glob"]), proj(z[pair]), self.hp.tau1, self.hp.tau2)
        return value + self.hp.mu * l_con

    def ascend_projection(self, grads: dict[str, torch.Tensor], extras: Mapping[str, Any],
                          params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """psi's gradient mu dL_con/dpsi becomes -dL_con/dpsi: the optimizer's descent step is
        psi's ascent on L_con (the max step); the model's gradients pass unchanged."""
        return {k: (-g / self.hp.mu if k.startswith(PROJ) else g) for k, g in grads.items()}
