"""MOON (Li, He & Song, CVPR 2021, "Model-Contrastive Federated Learning"), Algorithm 1.

    network: base encoder -> projection head (2-layer MLP) -> output layer; z = the
             projection head's output, the representation the output layer classifies
    server: send w^t; w^{t+1} = sum_i (n_i / n) w_i  (FedAvg)
    client i (z = R_w(x), z_glob = R_{w^t}(x), z_prev = R_{w_i^{t-1}}(x)):
        l_con = -log [ exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) ]  (eq. 2)
        minimize  l_sup(w; (x, y)) + mu * l_con(w; w^t, w_i^{t-1}; x)                               (eq. 3)
        sim = cosine similarity; the global and the previous local model are frozen

Defaults mu = 1, tau = 0.5 (the paper: tau = 0.5 throughout, mu = 5 for CIFAR-10 and 1 for
CIFAR-100 / Tiny-ImageNet; the authors' README runs CIFAR-10 with --mu=5; mu = 1 is their
code's argparse default and the value of the ReBaFL authors' MOON).

Architecture (``adapt_model``): the model's body is followed by the projection head
Linear(d, d) -> ReLU -> Linear(d, proj_dim) as in the paper, and the classifier is a new
Linear(proj_dim, C) on top of it (the original head is dropped). ``proj_dim`` defaults to
256, the authors' code's ``out_dim``.

Choices where the paper is silent, and details:
* The frozen global and previous models compute their representations in eval mode
  (BatchNorm running statistics, no dropout), without gradient.
* A client's previous local model w_i^{t-1} is the model it returned at its last
  participation (kept in its state). At its first participation it has none: the global
  model stands in, so both similarities are equal, l_con = log 2 and its gradient is 0
  (plain FedAvg for that round). The authors' code differs here (below).
* Personalized model (PM/PA metrics): the client's model after local training.

Deviations from the authors' code (github.com/QinbinLi/MOON): the code keeps a pool of
``model_buffer_size`` previous models (default 1, which is the paper and this module)
and builds the projection head into each network class; here it is added for any model.
The code's aggregation weights are n_i, as here. The code's pool holds every party's
network after each round (``main.py``: ``old_nets = copy.deepcopy(nets)``), and the
networks come from ``init_nets``, one independently initialized network per party, loaded
with the global weights only when the party is sampled. In round 1 the pool is empty and
the contrastive loss is 0; a party first sampled in a later round therefore contrasts with
its own untrained, independently initialized network as its "previous model". protofl
does not keep a model per client that has never trained (its state starts at the first
participation) and contrasting with an unrelated random network is an artefact of the
code, not the paper's method, so the global model stands in (loss constant).
The ReBaFL authors' MOON (github.com/JianXu95/ReBaFL, ``methods/moon.py``), whose
numbers ReBaFL's Table 1 reports, uses mu = 1, tau = 0.5, takes the contrastive
representation from a projection branch beside the classifier (the classifier reads the
unprojected features), and uses the run's initial model w_0 as the previous model at a
client's first turn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import require, require_size
from ..messages import Record
from ..models.base import FLModel
from ..nn.modes import eval_mode
from .base import ClientContext, ClientResult, register, WeightsState
from .fedavg import FedAvg
from .serveropt import ServerOptHyper


@dataclass
class MOONHyper(ServerOptHyper):
    mu: float = 1.0  # weight of the model-contrastive loss
    tau: float = 0.5  # temperature
    proj_dim: int = 256  # output width of the projection head
    weighting: Literal["samples", "uniform"] = "samples"

    def validate(self, section: str) -> None:
        require(self.mu >= 0, f"{section}.mu", self.mu, "must be >= 0")
        require(self.tau > 0, f"{section}.tau", self.tau, "must be > 0")
        require_size(self, section, "proj_dim")


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                           tau: float) -> torch.Tensor:
    """Eq. 2, averaged over the batch: z, z_glob, z_prev (B, d) -> scalar."""
    pos = F.cosine_similarity(z, z_glob, dim=1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=1) / tau
    logits = torch.stack([pos, neg], dim=1)  # (B, 2); the positive is class 0
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def representation(model: FLModel, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """z = R_w(x) of a frozen model: ``model.body`` with other weights, in eval mode, no grad."""
    body = model.body
    with eval_mode(body), torch.no_grad():
        return cast(torch.Tensor, functional_call(body, weights, (x,)))


@register
class MOON(FedAvg[WeightsState]):
    name = "moon"
    family = "global-model baselines"
    Hyper = MOONHyper
    hp: MOONHyper

    def adapt_model(self, model: nn.Module) -> nn.Module:
        model = cast(FLModel, model)  # the zoo's models
        d, k = model.feature_dim, self.hp.proj_dim
        projection = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, k))
        return FLModel(nn.Sequential(model.body, projection), nn.Linear(k, model.num_classes), k,
                       model.num_classes, is_conv=model.is_conv, channels_last=model.channels_last)

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        glob = ctx.like_model(msg.weights)  # w^t, frozen
        prev = ctx.like_model(state.weights) if state is not None else glob  # w_i^{t-1}, frozen
        body = {k[len("body."):]: v for k, v in glob.items() if k.startswith("body.")}
        prev_body = {k[len("body."):]: v for k, v in prev.items() if k.startswith("body.")}
        fitted = await ctx.fit(glob, self.contrastive_loss, extras={"glob": body, "prev": prev_body})
        w = fitted.weights
        return ClientResult(Record(weights=w), state=Record(weights=w), personal=ctx.shared_model(w))

    def contrastive_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                         extras: Mapping[str, Any]) -> torch.Tensor:
        """Eq. 3: l_sup + mu * l_con, the frozen representations computed with the global and
        the previous weights (equal for a client's first participation: l_con = log 2, no gradient)."""
        z = model.body(x)
        value = F.cross_entropy(model.head(z), y)
        if self.hp.mu == 0:
            return value
        z_glob = representation(model, extras["glob"], x)
        z_prev = representation(model, extras["prev"], x)
        return value + self.hp.mu * model_contrastive_loss(z, z_glob, z_prev, self.hp.tau)
