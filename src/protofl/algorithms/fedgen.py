"""FedGen (Zhu, Hong & Zhou, ICML 2021, "Data-Free Knowledge Distillation for
Heterogeneous Federated Learning"), Algorithm 1.

    server state: the global model theta (FedAvg), a generator G_w(z | y) that maps noise
                  eps ~ N(0, I) and a label y to a feature z in the head's input space, and
                  the label distribution p^(y) of the clients' data
    server -> client k: theta, w and p^(y)
    client k: minimize  L_k(theta_k) + alpha * E_{y ~ p^(y), z ~ G_w(z|y)} CE(g(z; theta_k^p), y)
              (g = the head, theta^p its parameters; G is fixed on the client)
              reply theta_k and its label counts n_k
    server:   theta <- sum_k (n_k / n) theta_k                                          (FedAvg)
              p^(y) <- the label counts of every client seen so far, normalized
              ``gen_steps`` Adam steps on w minimizing
                  J(w) = E_{y ~ p^(y)} E_{z ~ G_w(z|y)} CE( (1/K) sum_k g(z; theta_k^p), y )
              over the K heads that arrived this round
    round 1: the generator is untrained and not sent (clients train as in FedAvg)

Equation numbers are not cited: the paper's text was not at hand when this was written;
the objectives above are its Algorithm 1's.

Generator (the paper's "lightweight" generator): [eps ; one-hot(y)] -> Linear(noise_dim + C,
hidden) -> ReLU -> Linear(hidden, d), d the model's feature dimension.

Choices where the paper is silent, and details:
* ``ensemble``: "uniform" averages the K heads' logits as in the paper's J(w); "counts"
  weights head k's logits for label y by n_ky / sum_k n_ky, n_ky the client's label
  counts: CE(sum_k w_ky g(z; theta_k^p), y). This is not the authors' code's objective
  (below), only its idea of per-label client weights.
* The client draws ``training.batch_size`` generated features per step; its labels come
  from p^(y) as in the paper's client objective, its noise from the client's own stream of the round.
* The generator's Adam state persists across rounds (in the server state); its batches
  come from the server's stream of the round.
* ``diversity`` (default 0, as in the paper's objective) adds the code's diversity term
  exp(-mean_{ij} ||eps_i - eps_j||^2 * |z_i - z_j|_1) to J, each distance the mean over
  dimensions; the authors' code uses weight 1.

Deviations from the authors' code (github.com/zhuangdizhu/FedGen: ``userpFedGen.py``,
``serverpFedGen.py``, ``generator.py``, ``utils/model_config.py``), none of them followed:
* Client: besides the generated-feature CE the loss has a KL term between the model's
  prediction on the real batch and its prediction on generated features of the batch's
  labels; the two terms are weighted by ``generative_alpha`` and ``generative_beta`` (both 10
  for MNIST) with a 0.98 per-round decay. The CE term's labels are drawn
  uniformly from the union of every client's labels (``np.random.choice(
  self.available_labels)``), ``--gen_batch_size`` (32) of them per step; only the KL term
  uses the batch's own labels. A code "epoch" is ``--K`` = 1 minibatch, and its "stop
  after 20 local epochs" (``early_stop = 20``) compares that counter with 20: with the
  README's ``--local_epochs 20`` it never stops.
* Server: the generator's loss is sum_k mean(w_ky CE(g(z; theta_k^p), y)), a weighted sum
  of the heads' cross-entropies (not the CE of a weighted ensemble), with w_ky from 1 + the
  label counts of the batches client k drew that round, normalized over the round's
  clients, plus the diversity term with weight 1; its labels are drawn uniformly over the
  labels some client of the round drew more than once. The noise is ``torch.rand``
  (uniform on [0, 1)), not N(0, I). Adam (lr 3e-4, ``weight_decay`` 1e-2) with an
  ``ExponentialLR(gamma=0.98)`` stepped once per round; 50 steps per round of ``--batch_size``
  samples (32 in the README's commands; the config's ``ensemble_batch_size`` = 128 sizes
  a loader of the pooled data, not the generator's batch). The generator has BatchNorm after the hidden layer.
Here: the paper's objective with weight ``alpha`` (default 1), labels from p^(y) on both
sides, N(0, I) noise, no BatchNorm, no weight decay or learning-rate decay for the
generator. The code's lr 3e-4, 50 steps per round, noise 32 and hidden 256 (its MNIST
configuration) are the defaults here; ``gen_batch`` = 128 is protofl's choice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, cast, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import require, require_size
from ..messages import Arrays, Record, expect_shapes
from ..models.base import FLModel
from .base import ClientContext, ClientResult, register, ServerContext, WeightsState
from .fedavg import FedAvg
from .serveropt import ServerOptHyper


@dataclass
class FedGenHyper(ServerOptHyper):
    alpha: float = 1.0  # weight of the generated-feature loss on the clients
    noise_dim: int = 32
    hidden: int = 256
    gen_lr: float = 3e-4
    gen_steps: int = 50  # generator updates per round
    gen_batch: int = 128
    ensemble: Literal["uniform", "counts"] = "uniform"
    diversity: float = 0.0
    weighting: Literal["samples", "uniform"] = "samples"

    def validate(self, section: str) -> None:
        require(self.alpha >= 0, f"{section}.alpha", self.alpha, "must be >= 0")
        require(self.diversity >= 0, f"{section}.diversity", self.diversity, "must be >= 0")
        require(self.gen_lr > 0, f"{section}.gen_lr", self.gen_lr, "must be > 0")
        require_size(self, section, "noise_dim", "hidden", "gen_batch")
        require(self.gen_steps >= 0, f"{section}.gen_steps", self.gen_steps, "must be >= 0")


@dataclass
class FedGenState(WeightsState):
    generator: dict[str, torch.Tensor]
    counts: torch.Tensor  # (N, C) label counts of each client seen so far
    trained: bool = False
    optimizer: dict[str, Any] = field(default_factory=dict)  # the generator's Adam state


class Generator(nn.Module):
    """G_w(z | y): [eps ; one-hot(y)] -> hidden (ReLU) -> d."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.net = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden), nn.ReLU(), nn.Linear(hidden, out_dim))

    def forward(self, eps: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(torch.cat([eps, F.one_hot(y, self.num_classes).to(eps.dtype)], dim=1))
        return out


# ---------------------------------------------------------------------------------------
# the math, on plain tensors
# ---------------------------------------------------------------------------------------
def ensemble_logits(head: nn.Module, heads: list[dict[str, torch.Tensor]], z: torch.Tensor, y: torch.Tensor,
                    label_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum_k a_k(y) g(z; theta_k^p); a_k = 1/K (the paper) or label_weights[k, y] (K, C)."""
    out: Union[torch.Tensor, float] = 0.0
    for k, params in enumerate(heads):
        a = (1.0 / len(heads)) if label_weights is None else label_weights[k, y].unsqueeze(1)
        out = out + a * functional_call(head, params, (z,))
    return cast(torch.Tensor, out)  # a tensor after the first head (there is at least one)


def diversity_loss(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """exp(-mean_ij d_eps(i, j) d_z(i, j)): squared-L2 noise distance, L1 feature distance (means)."""
    d_eps = ((eps.unsqueeze(0) - eps.unsqueeze(1)) ** 2).mean(dim=2)
    d_z = (z.unsqueeze(0) - z.unsqueeze(1)).abs().mean(dim=2)
    return torch.exp(-(d_eps * d_z).mean())


def generator_objective(head: nn.Module, heads: list[dict[str, torch.Tensor]], z: torch.Tensor,
                        y: torch.Tensor, label_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """J(w) on one batch: CE of the ensemble's logits on generated features z for labels y."""
    return F.cross_entropy(ensemble_logits(head, heads, z, y, label_weights), y)


@register
class FedGen(FedAvg[FedGenState]):
    name = "fedgen"
    family = "global-model baselines"
    reply_arrays = ("counts",)  # besides theta_k
    Hyper = FedGenHyper
    hp: FedGenHyper

    def generator(self, feature_dim: int) -> Generator:
        return Generator(self.hp.noise_dim, self.info.num_classes, self.hp.hidden, feature_dim)

    # -- server ------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FedGenState:
        w = ctx.init_weights()
        d = cast(int, ctx.shared_model(w).feature_dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(ctx.rng(0, "fedgen-init").integers(2**62)))
            gen = {k: v.to(ctx.device) for k, v in self.generator(d).state_dict().items()}
        counts = torch.zeros(self.info.num_clients, self.info.num_classes, dtype=torch.int64)
        return FedGenState(w, gen, counts)

    @staticmethod
    def prior(counts: torch.Tensor) -> torch.Tensor:
        total = counts.sum(0).to(torch.float32)
        return total / total.sum() if total.sum() > 0 else torch.full_like(total, 1.0 / len(total))

    def configure(self, state: FedGenState, rnd: int, ctx: ServerContext) -> Record:
        arrays: Arrays = {}
        if state.trained and self.hp.alpha > 0:
            arrays = {"generator": state.generator, "prior": self.prior(state.counts)}
        return Record(weights=state.weights, arrays=arrays)

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        counts = reply.arrays.get("counts")  # p^(y) and the label weights are built from them
        if not isinstance(counts, torch.Tensor) or counts.is_floating_point():
            return "counts must be the client's (C,) integer label counts"
        if counts.numel() and int(counts.min()) < 0:  # also checked by the engine for integer arrays
            return "counts must be >= 0"
        return expect_shapes(reply, counts=(self.info.num_classes,))

    def aggregate(self, state: FedGenState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FedGenState:
        if not replies:
            return state
        avg = super().aggregate(state, rnd, replies, ctx)
        counts = state.counts.clone()
        for cid, r in replies:
            counts[cid] = r.array("counts").to(torch.int64).cpu()
        prior = self.prior(counts).to(ctx.device)
        head = cast(nn.Module, ctx.shared_model().head)
        heads = [{k[len("head."):]: v for k, v in r.weights.items() if k.startswith("head.")} for _, r in replies]
        label_weights = None
        if self.hp.ensemble == "counts":
            n = torch.stack([r.array("counts").to(torch.float32)
                             for _, r in replies]).to(ctx.device)  # (K, C)
            label_weights = n / n.sum(0).clamp_min(1.0)
        gen = self.generator(cast(int, ctx.shared_model().feature_dim)).to(ctx.device)
        gen.load_state_dict(state.generator)
        opt = torch.optim.Adam(gen.parameters(), lr=self.hp.gen_lr)
        if state.optimizer:
            opt.load_state_dict(state.optimizer)
        g = torch.Generator(device=ctx.device)
        g.manual_seed(int(ctx.rng(rnd, "fedgen").integers(2**62)))
        B = self.hp.gen_batch
        for _ in range(self.hp.gen_steps):
            y = torch.multinomial(prior, B, replacement=True, generator=g)
            eps = torch.randn(B, self.hp.noise_dim, generator=g, device=ctx.device)
            z = gen(eps, y)
            loss = generator_objective(head, heads, z, y, label_weights)
            if self.hp.diversity > 0:
                loss = loss + self.hp.diversity * diversity_loss(eps, z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if self.hp.gen_steps > 0:
            ctx.log("generator_loss", float(loss.detach()))
        return dataclasses.replace(avg, generator={k: v.detach().clone() for k, v in gen.state_dict().items()},
                                   counts=counts, trained=state.trained or self.hp.gen_steps > 0,
                                   optimizer=opt.state_dict())

    # -- client ------------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        w_t = msg.weights
        if "prior" not in msg.arrays:  # round 1 (no trained generator yet) or alpha = 0: FedAvg
            fitted = await ctx.fit(w_t)
        else:
            fitted = await ctx.fit(w_t, self.distilled_loss, step_extras=self.generated(msg, ctx))
        reply = Record(weights=fitted.weights, arrays={"counts": ctx.class_counts})
        return ClientResult(reply, personal=ctx.shared_model(fitted.weights))

    def generated(self, msg: Record, ctx: ClientContext) -> Callable[[Sequence[int]], dict[str, torch.Tensor]]:
        """The features G_w(z | y) the client's steps distill from: per step, as many labels
        y ~ p^(y) and noise draws as the step has samples, from the client's own stream, then
        G's features (G fixed, no gradient)."""
        prior, nd = msg.array("prior"), self.hp.noise_dim
        gen = self.generator(cast(int, ctx.architecture.feature_dim)).to(prior.device)
        gen.load_state_dict(msg.group("generator"))
        gen.eval()
        g = torch.Generator(device=prior.device)
        g.manual_seed(int(ctx.rng("fedgen").integers(2**62)))

        def draw(sizes: Sequence[int]) -> dict[str, torch.Tensor]:
            B = max(sizes, default=0)
            y_gen = torch.zeros(len(sizes), B, dtype=torch.int64, device=prior.device)
            z = torch.zeros(len(sizes), B, cast(nn.Linear, gen.net[-1]).out_features, device=prior.device)
            with torch.no_grad():
                for s, b in enumerate(sizes):  # one step after another, as the loss would draw them
                    y_gen[s, :b] = torch.multinomial(prior, b, replacement=True, generator=g)
                    z[s, :b] = gen(torch.randn(b, nd, generator=g, device=prior.device), y_gen[s, :b])
            return {"z": z, "y_gen": y_gen}

        return draw

    def distilled_loss(self, model: FLModel, x: torch.Tensor, y: torch.Tensor,
                       extras: Mapping[str, Any]) -> torch.Tensor:
        """L_k + alpha * CE(g(z; theta^p), y) on the step's generated features."""
        value = F.cross_entropy(model(x), y)
        z, y_gen = extras["z"], extras["y_gen"]
        return value + self.hp.alpha * F.cross_entropy(model.head(z.to(x.device)), y_gen.to(y.device))
