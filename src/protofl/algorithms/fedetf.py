"""FedETF (Li, Shang, He, Lin & Wu, ICCV 2023, "No Fear of Classifier Biases: Neural Collapse
Inspired Federated Learning with Synthetic and Fixed Classifier"): every client trains its
features against one synthetic, fixed simplex-ETF classifier, through a learnable projection
and feature normalization, on a balanced loss with a learnable temperature; a personalized
model comes from fine-tuning the classifier and the projection locally.

    model: body f, projection P (d -> p), normalized feature mu = P f(x) / ||P f(x)||;
           classifier: the simplex ETF V = sqrt(C/(C-1)) U (I_C - 1 1^T / C), U^T U = I_C (p x C,
           unit columns, pairwise cosine -1/(C-1)), fixed; logits beta V^T mu, beta learnable
    client k: E epochs of SGD on f, P and beta (V fixed) on the balanced feature loss
           -log [ n_{k,y} exp(beta v_y^T mu) / sum_c n_{k,c} exp(beta v_c^T mu) ]
    server: f, P and beta averaged as in FedAvg (weights n_k); V is in no reply
    global model (GM, GA): the averaged f, P, beta with V
    personalized model (local fine-tuning, after training): the client's local update from
           the final global model, then ``finetune_rounds`` times: V alone, then P alone,
           ``finetune_epochs`` epochs each of SGD on plain cross-entropy (the local
           distribution is the target now)

Sources: the paper's text was not at hand when this was written beyond its abstract and
introduction (a synthetic fixed ETF classifier, a projection layer, feature normalization,
a balanced feature loss with learnable temperature, local fine-tuning), so its equation
numbers are not cited; the details follow the authors' code (github.com/ZexiLee/ICCV-2023-FedETF:
client_funct.py, nodes.py, models_dict/), except where listed below: the loss is balanced
softmax on the counts n_{k,c} with logits scaled by a learnable temperature averaged with
the model, and the fine-tuning is their ``Client_personalization``. Defaults from that code: beta starts at 1.0 (their
ResNets; their small CNN starts at 10); fine-tuning 20 rounds of 3 epochs each, lr 0.1
for V (plain SGD) and 0.05 for P (with the run's momentum and weight decay).

Choices and deviations:
* The defaults mix the authors' two model families: p = d (``proj_dim: null``) is their
  small CNN's, beta = 1 (``scale``) their ResNets' (their CNN starts beta at 10, their
  ResNets project to p = C). An ETF of C classes needs p >= C - 1 (a configuration error
  otherwise).
* A client's optimizer is created afresh for every local update (protofl's engine: no
  optimizer state survives a round); the authors create each client's optimizer once
  (``Node.__init__``, nodes.py) and reuse it, momentum buffers included, across rounds.
* A class the client lacks counts as one sample in the balanced softmax (log 1 = 0), as in
  the authors' code (``generate_sample_per_class``), rather than leaving the softmax.
* The ETF is a parameter of the model (so that the fine-tuning can move it) that
  federated training never selects (``trainable``): it stays bit-identical on every
  client and the server. Its orientation U is drawn from the run's seed (the authors draw
  it from numpy's global RNG).
* When: as in the paper, once after training: in protofl that is the evaluation of every
  client after the last round (``eval.final_all_clients``, the ``all_*`` metrics: a local
  update from the final global model, then the fine-tuning). In the training rounds the
  personalized model (``pa``) is the client's model after its local update, without the
  fine-tuning (120 epochs by default, some 25 times a round's training);
  ``finetune: every_eval`` fine-tunes in every evaluation round too. Either way it runs
  only for a client the engine evaluates, after its reply is fixed: training never
  depends on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Literal, Mapping, Optional, TYPE_CHECKING

import torch
from torch import nn

from ..errors import ConfigError, require, require_size
from ..messages import Record
from ..nn.heads import FixedHead, simplex_etf
from ..nn.losses import balanced_softmax_loss, relaxed_prior
from .base import ClientContext, ClientResult, register, TaskInfo, WeightsState
from .fedavg import FedAvg, FedAvgHyper

if TYPE_CHECKING:
    from ..models.base import FLModel

ETF, PROJECTION = "head.weight", "body.1."  # V (C, p) and P inside the model's state dict


@dataclass
class FedETFHyper(FedAvgHyper):
    proj_dim: Optional[int] = None  # p; null = the body's feature dimension
    scale: float = 1.0  # the initial temperature beta (learnable)
    finetune_rounds: int = 20  # alternations of the fine-tuning; 0 = the locally updated model
    finetune_epochs: int = 3  # per alternation, for V and for P each
    etf_lr: float = 0.1
    proj_lr: float = 0.05
    finetune: Literal["final", "every_eval"] = "final"  # after training only, or in every evaluation

    def validate(self, section: str) -> None:
        require_size(self, section, "proj_dim")  # (null: the feature dimension)
        require(self.finetune_rounds >= 0, f"{section}.finetune_rounds", self.finetune_rounds, "must be >= 0")
        require(self.finetune_epochs >= 1, f"{section}.finetune_epochs", self.finetune_epochs, "must be >= 1")
        for key in ("scale", "etf_lr", "proj_lr"):
            require(getattr(self, key) > 0, f"{section}.{key}", getattr(self, key), "must be > 0")


class ETFHead(FixedHead):
    """logits = beta * V^T mu, mu = h / ||h||: :class:`FixedHead`'s forward with V (C, p) and beta
    both parameters (V moves only when a fine-tuning selects it)."""

    def __init__(self, weight: torch.Tensor, scale: float) -> None:
        nn.Module.__init__(self)
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone())  # (C, p)
        self.scale = nn.Parameter(torch.tensor(float(scale)))


@register
class FedETF(FedAvg[WeightsState]):
    name = "fedetf"
    family = "fixed and calibrated heads"
    Hyper = FedETFHyper
    reply_arrays = ()  # f, P and beta only
    # the fine-tuning waits for the rounds past info.rounds; training does not depend on it,
    # but runs are kept per number of rounds (the reuse rule's safe side, api.py)
    uses_total_rounds = True

    def __init__(self, hp: Any, info: TaskInfo) -> None:
        super().__init__(hp, info)
        C, p = info.num_classes, self.proj_dim(info.feature_dim)
        if p < C - 1:
            raise ConfigError("algorithm.proj_dim", hp.proj_dim,
                              f"the simplex ETF of {C} classes needs a projection to p >= num_classes - 1 = {C - 1} "
                              f"dimensions, but p = {p}; set algorithm.proj_dim")

    def proj_dim(self, d: int) -> int:
        return d if self.hp.proj_dim is None else self.hp.proj_dim

    # -- model: projection, normalization, the fixed ETF ---------------------------------------
    def adapt_model(self, model: nn.Module) -> nn.Module:
        flm = cast("FLModel", model)  # a protofl model: a body and a head
        d, C = flm.feature_dim, flm.num_classes
        p = self.proj_dim(d)
        flm.body = nn.Sequential(flm.body, nn.Linear(d, p))  # P: body.1 (the normalization is the head's)
        flm.feature_dim = p
        flm.head = ETFHead(simplex_etf(C, p, self.info.seed).T, self.hp.scale)  # V^T (C, p), unit rows
        return model

    # -- client -------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        n = ctx.class_counts.clamp(min=1)  # an absent class counts as one sample (the authors' code)
        prior = relaxed_prior(n, 0.0).to(ctx.data[1].device)  # n_{k,c} / n_k
        fitted = await ctx.fit(msg.weights, self.balanced_feature_loss, extras={"prior": prior},
                               trainable=("body.", "head.scale"))  # V stays fixed
        reply = Record(weights={k: v for k, v in fitted.weights.items() if k != ETF})
        return ClientResult(reply, personal=await self.fine_tuned(ctx, fitted.weights))

    @staticmethod
    def balanced_feature_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                              extras: Mapping[str, Any]) -> torch.Tensor:
        return balanced_softmax_loss(model(x), y, extras["prior"])  # logits beta V^T mu, + log n_{k,c}

    def private_fits(self, evaluating: bool, final: bool = False) -> list[dict[str, Any]]:
        """The local update, and when the personalized model is fine-tuned, V's and P's
        ``finetune_rounds`` alternating fits."""
        hp = self.hp
        if not evaluating or (hp.finetune == "final" and not final):
            return [{}]
        return [{}] + [{"epochs": hp.finetune_epochs}] * (2 * hp.finetune_rounds)

    async def fine_tuned(self, ctx: ClientContext, weights: dict[str, torch.Tensor]) -> Optional[nn.Module]:
        """The personalized model: V and P fine-tuned alternately on cross-entropy, after
        training (``ctx.rnd`` past the last round: the final evaluation of every client) or
        in every evaluation; else the locally updated model."""
        hp = self.hp
        if not ctx.evaluating or (hp.finetune == "final" and ctx.rnd <= self.info.rounds):
            return ctx.shared_model(weights) if ctx.evaluating else None  # the locally updated model
        for _ in range(hp.finetune_rounds):
            weights = (await ctx.fit(weights, trainable=(ETF,), epochs=hp.finetune_epochs, lr=hp.etf_lr,
                                     momentum=0.0, weight_decay=0.0, report=False)).weights
            weights = (await ctx.fit(weights, trainable=(PROJECTION,), epochs=hp.finetune_epochs, lr=hp.proj_lr,
                                     report=False)).weights
        return ctx.shared_model(weights)

    # -- server: FedAvg's average of f, P and beta (V, in no reply, keeps its value) ----------------
    def class_vectors(self, state: WeightsState) -> Optional[torch.Tensor]:
        return state.weights[ETF]  # the ETF's columns, one row per class (C, p)
