"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma & Guan, KDD 2023, "FedCP: Separating Feature
Information for Personalized Federated Learning via Conditional Policy"): a conditional
policy network (CPN) splits each sample's feature into a global and a personalized part,
fed to a global and a personal head.

    modules: feature extractor f (shared, trained locally), CPN (shared, trained locally),
             global head h_g (shared, frozen during local training), personal head h_i
             (stays on the client), a frozen copy f_g of the received feature extractor
    client i, context c_i = normalize(sum of the rows of h_i's weight) (from its head
             before training), per minibatch, z = f(x):
        (s, 1 - s) = GumbelSoftmax_tau( CPN(z (.) c_i) reshaped (B, 2, d), over the pair )
        out = h_i(z (.) s) + h_g(z (.) (1 - s))
        L = CE(out, y) + lam MMD^2(z, f_g(x))      (RBF kernels, bandwidths 10, 15, 20, 50)
      after training: upload (f, CPN, (h_i + h_g) / 2); keep h_i
    server: (f, CPN, h_g)_{t+1} = sum_i (n_i / n) (f, CPN, h_g)_i   over the replies
    CPN: Linear(d, 2d) + LayerNorm(2d) + ReLU
    personalized model (PM, PA): out with s = softmax_tau(...) (no Gumbel noise); no
    global model (GA is the mean of the personalized models on the global test set)

On the engine: ``adapt_model`` adds ``model.cpn``, ``model.ghead`` (h_g) and ``model.gbody``
(f_g); the personal part is ``model.head`` (FedPer's split); f_g is set from the received
f every round and never sent back. One ``ctx.fit`` trains f, the CPN and h_i (h_g and f_g
frozen). The Gumbel noise is drawn up front from the client's own stream, one (B, 2, d)
draw per step (``step_extras``), so both executors see the same noise.

Defaults (the authors' code, github.com/TsingZ0/FedCP): lam = 5 (their ``run_me.sh``,
MNIST), tau = 1 (hard-coded in ``clientcp.py``, ``self.tau = 1``).

Choices and deviations:
* A client's context before its first turn ends is c_i of its initial head here; the
  authors' code starts it at ``torch.rand(1, in_dim)`` and sets it from the head at the
  end of each turn (``set_head_g``), the value protofl uses at the client's next turn.
* Evaluation uses the noise-free soft mask; the authors' code samples Gumbel noise at test
  time too.
* The authors' server sends the new h_g and CPN only to the clients that just trained (the
  others keep older copies until their next turn) and f to all; here every sampled client
  receives the current f, CPN and h_g.
* The MMD is the code's biased estimator (the mean of the kernel matrices, diagonals
  included).
* The personalized model is evaluated after local training; the authors' code evaluates
  it at the start of a round, before local training.
* The paper's text was not available while writing this module; the method is stated from
  the authors' code.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, cast, Mapping, Optional, Sequence, TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import require
from ..messages import Record
from .base import ClientContext, ClientResult, register, weights_of, WeightsState
from .fedavg import FedAvgHyper
from .fedper import FedPer

if TYPE_CHECKING:
    from ..models.base import FLModel

    class CPModel(FLModel):
        """The model :meth:`FedCP.adapt_model` makes: the FLModel with the CPN and the global
        head and body."""

        cpn: nn.Module
        ghead: nn.Module
        gbody: nn.Module

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)


@dataclass
class FedCPHyper(FedAvgHyper):
    lam: float = 5.0  # weight of the MMD between local and global features
    tau: float = 1.0  # Gumbel-softmax temperature

    def validate(self, section: str) -> None:
        require(self.lam >= 0, f"{section}.lam", self.lam, "must be >= 0")
        require(self.tau > 0, f"{section}.tau", self.tau, "must be > 0")


def mmd_rbf(a: torch.Tensor, b: torch.Tensor, bandwidths: Sequence[float] = BANDWIDTHS) -> torch.Tensor:
    """Biased MMD^2 of the samples a (B, d) and b (B, d): mean(K_aa + K_bb - 2 K_ab) with the
    sum of RBF kernels exp(-||u - v||^2 / (2 s)) over the bandwidths s."""
    def sq_dists(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (u * u).sum(1)[:, None] + (v * v).sum(1)[None, :] - 2 * u @ v.T

    daa, dbb, dab = sq_dists(a, a), sq_dists(b, b), sq_dists(a, b)
    k = sum(torch.exp(-0.5 * daa / s) + torch.exp(-0.5 * dbb / s) - 2 * torch.exp(-0.5 * dab / s)
            for s in bandwidths)
    return cast(torch.Tensor, k).mean()  # a tensor: there is at least one bandwidth


def context_of(head_weight: torch.Tensor) -> torch.Tensor:
    """c_i: the rows of the personal head's (C, d) weight summed, L2-normalized (d,)."""
    return F.normalize(head_weight.sum(0), dim=0)


def masks(model: nn.Module, z: torch.Tensor, c: torch.Tensor, tau: float,
          gumbel: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s (B, d): the personalized share of each feature, the first of the CPN's pair of
    (Gumbel-)softmax outputs; ``gumbel`` (B, 2, d) noise, or None for the noise-free mask."""
    logits = cast("CPModel", model).cpn(z * c).view(len(z), 2, -1)
    if gumbel is not None:
        logits = logits + gumbel
    return F.softmax(logits / tau, dim=1)[:, 0]


def split_logits(model: nn.Module, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    net = cast("CPModel", model)
    out: torch.Tensor = net.head(z * s) + net.ghead(z * (1 - s))
    return out


class ConditionalPolicy(nn.Module):
    """FedCP's personalized predictor: h_i(z s) + h_g(z (1 - s)) with the noise-free mask."""

    def __init__(self, model: nn.Module, c: torch.Tensor, tau: float) -> None:
        super().__init__()
        self.model, self.tau = model, tau
        self.register_buffer("c", c)

    if TYPE_CHECKING:
        c: torch.Tensor  # the buffer registered above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z: torch.Tensor = cast("CPModel", self.model).body(x)
        return split_logits(self.model, z, masks(self.model, z, self.c, self.tau))


@register
class FedCP(FedPer[WeightsState]):
    name = "fedcp"
    Hyper = FedCPHyper
    hp: FedCPHyper
    couples_samples = True  # the MMD compares the batch's features as a set
    personal_prefixes = ("head.", "gbody.")  # gbody: set from the received body, never sent

    def adapt_model(self, model: nn.Module) -> nn.Module:
        net = cast("FLModel", model)
        d = net.feature_dim
        model.cpn = nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.ReLU())
        model.ghead = copy.deepcopy(net.head)
        model.gbody = copy.deepcopy(net.body)
        return model

    def client_init(self, ctx: ClientContext) -> Record:
        w0 = weights_of(ctx.shared_model())
        return Record(weights={k: v for k, v in w0.items() if k.startswith("head.")})  # the initial h_i

    def cp_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                extras: Mapping[str, Any]) -> torch.Tensor:
        net = cast("CPModel", model)
        z: torch.Tensor = net.body(x)
        s = masks(model, z, extras["c"], self.hp.tau, extras["gumbel"])
        with torch.no_grad():
            z_g: torch.Tensor = net.gbody(x)
        return F.cross_entropy(split_logits(model, z, s), y) + self.hp.lam * mmd_rbf(z, z_g)

    def gumbel_noise(self, ctx: ClientContext) -> Callable[[Sequence[int]], dict[str, torch.Tensor]]:
        """Per step, -log(-log U) for (batch, 2, d), drawn from the client's own stream."""
        g = torch.Generator().manual_seed(int(ctx.rng("fedcp-gumbel").integers(2**62)))
        d, dev = cast(int, ctx.architecture.feature_dim), ctx.data[1].device

        def draw(sizes: Sequence[int]) -> dict[str, torch.Tensor]:
            u = torch.rand(len(sizes), max(sizes, default=0), 2, d, generator=g).clamp_(1e-20, 1.0)
            return {"gumbel": (-torch.log(-torch.log(u))).to(dev)}

        return draw

    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        assert state is not None  # client_init made it (the initial h_i)
        w_t = msg.weights
        head = {k: v for k, v in state.weights.items() if k.startswith("head.")}
        gbody = {"g" + k: v for k, v in w_t.items() if k.startswith("body.")}  # f_g = the received f
        c = context_of(head["head.weight"])
        fitted = await ctx.fit({**w_t, **head, **gbody}, self.cp_loss, extras={"c": c},
                               trainable=("body.", "cpn.", "head."), step_extras=self.gumbel_noise(ctx))
        w = dict(fitted.weights)
        model = ctx.shared_model(w)
        personal = ConditionalPolicy(model, c, self.hp.tau)
        # upload h_g <- (h_i + h_g) / 2; the personalized model keeps the h_g it trained with
        upload = {k: 0.5 * w["head." + k[len("ghead."):]] + 0.5 * v for k, v in w.items() if k.startswith("ghead.")}
        reply = Record(weights={**self.shared_part(w), **upload})
        return ClientResult(reply, state=Record(weights={k: v for k, v in w.items() if k.startswith("head.")}),
                            personal=personal)
