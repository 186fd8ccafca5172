"""FeSEM (Xie et al., "Multi-center federated learning", arXiv 2005.01026, 2020):
federated stochastic expectation maximization over K centre models.

The objective clusters the clients' models around K centres,

    min_{r, W~}  sum_i sum_k r_ik ||W_i - W~_k||^2  (+ each client's own loss on W_i)

and is optimized by alternating, once per round:

    client i: W_i <- local SGD on its data, starting from its centre W~_{c(i)}
    E-step:   c(i) = argmin_k ||W_i - W~_k||_2          (L2 on the flattened parameters)
    M-step:   W~_k = 1/|C_k| sum_{i in C_k} W_i          (C_k = the replies assigned to k)
              a centre with no member this round keeps its weights

The personalized model of client i is its centre W~_{c(i)} (the one it received this
round, i.e. after the previous M-step). The generic (global) model, for GM and the saved
``model.pt``, is the sample-weighted mean of the centres: sum_k n_k W~_k / sum_k n_k,
n_k the training samples of the clients currently assigned to k (this is the
"generic model" FedProto's Table 1 compares against).

Options and deviations. "Authors' code" below is the authors' release
(github.com/mingxuts/multi-center-fed-learning: ``models/fedsem.py``,
``mlhead_clus_server.py``, ``kmean_model.py``, ``server.py``, ``configs/fedsem/job.yaml``),
which was read. It measures the distance on one layer, the logits layer's kernel
(``dense_1/kernel`` for FEMNIST); it starts from a random assignment (k-means on
uniform(-0.01, 0.01) noise standing in for the clients' layers), all centres equal to
the initial model; and its shipped configuration never re-clusters
(``update-center-every: 150`` with ``num-rounds: 60``). Where it re-clusters, its E-step
is Lloyd's k-means over the clients' layer vectors with its own persistent centroids
(initialized from the first K points; five Lloyd iterations at the first call, one at
each later one), not the distance to the centre models. Its M-step under its configured ``mode: 'no_size'``
weights members by their sample counts (``update_model_wmode``). Each round every
cluster trains only min(3, |C_k|) members drawn at random (``clients-per-round: 3``), and a
cluster with at most one member is skipped. protofl keeps the paper's E-step (distance
to the centre models, on the arriving clients) and the engine's client sampling; the
code's choices that fit the paper's scheme are options. A later re-implementation of
FeSEM as a baseline (FlexCFL, Duan et al., ``flearn/trainer/fesem.py``), also read,
initializes the K centres as K independently seeded models and measures the distance on
all parameters: ``init: random_centers`` with the default ``layers``.

* ``layers`` (default null = every parameter): the distance of the E-step is computed on
  the parameters whose names start with one of these prefixes (a name that matches no
  parameter is a ConfigError). The authors' code measures it on the logits layer's
  kernel only; ``layers: [head.weight]`` does that for every model of the zoo.
  Buffers (BatchNorm statistics) never enter the distance; they are averaged in the
  M-step like weights.
* ``init`` (default ``random_assignment``, the authors' code in effect): every client
  starts in a centre drawn uniformly at random (seeded), all centres start from the run's shared
  initial weights, and the first E-step runs after the first M-step has separated them
  (in round 1 all centres are equal and every distance ties). ``random_centers``: K
  centres initialized independently (the model's own initializer under K seeds), clients
  still start in a random centre, and the E-step runs from round 1.
* ``recluster`` (default true, the paper): an E-step every round. The authors' shipped
  configuration never re-clusters after the initial assignment; ``recluster: false``
  keeps the initial assignment (FeSEM is then K independent FedAvg groups).
* ``weighting`` (default ``uniform``, the paper's M-step): the plain mean of the members;
  ``samples`` weights members by their training samples, as the authors' code does.
* ``personal`` (default ``center``): the personalized model evaluated for PM/PA is the
  client's centre as received this round; ``trained`` evaluates the client's model after
  its local training instead (the convention of FedAvg/FedProx rows in protofl's tables).
* Only clients whose reply arrived are re-assigned; the others keep their centre. Ties
  in the E-step go to the lowest centre index.

Messages: server -> client: the weights of its centre; client -> server: its trained
weights and ``num_samples``. Server state: :class:`FeSEMState`. Logs per round:
``fesem_moved`` (clients whose centre changed) and ``fesem_size<k>`` (clients per centre);
where the scenario knows its client groups, the engine adds ``cluster_purity`` of the
assignment c(i) against them (:meth:`FeSEM.cluster_assignment`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast, Literal, Optional, Sequence

import numpy as np
import torch

from ..rng import seed_for
from ..errors import ConfigError, require, require_size
from ..messages import Record
from .base import (Algorithm, average, ClientResult, ClientContext, Diagnostics, Predictors, register,
                   ServerContext, weighted_mean, weights_of)


@dataclass
class FeSEMHyper:
    centers: int = 3
    layers: Optional[list[str]] = None
    init: Literal["random_assignment", "random_centers"] = "random_assignment"
    recluster: bool = True
    weighting: Literal["uniform", "samples"] = "uniform"
    personal: Literal["center", "trained"] = "center"

    def validate(self, section: str) -> None:
        require_size(self, section, "centers")
        require(self.layers is None or len(self.layers) > 0, f"{section}.layers", self.layers,
                "must be null (all parameters) or a non-empty list of parameter-name prefixes")


@dataclass
class FeSEMState:
    centers: list[dict[str, torch.Tensor]]  # W~_k
    assignment: np.ndarray  # (num_clients,) c(i)
    samples: np.ndarray  # (num_clients,) last reported training samples (0 = not yet)
    keys: list[str]  # the parameters the E-step's distance runs over
    steps: int = 0  # M-steps done
    weights: Optional[dict[str, torch.Tensor]] = None  # the generic model

    def generic(self) -> dict[str, torch.Tensor]:
        n = np.array([self.samples[self.assignment == k].sum() for k in range(len(self.centers))], dtype=float)
        if n.sum() <= 0:
            n = np.ones(len(self.centers))
        return weighted_mean((w, c) for w, c in zip(n, self.centers) if w > 0)


def flatten(weights: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    """The named tensors as one float64 vector (in ``keys`` order)."""
    return torch.cat([weights[k].detach().reshape(-1).to(torch.float64) for k in keys])


def assign_nearest(points: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """E-step: index of the nearest centre (squared L2) per row; ties -> lowest index."""
    d = ((points[:, None, :] - centers[None, :, :]) ** 2).sum(-1)
    return d.argmin(dim=1)


def distance_keys(param_names: list[str], layers: Optional[list[str]]) -> list[str]:
    if layers is None:
        return list(param_names)
    keys = [n for n in param_names if any(n == p or n.startswith(p.rstrip(".") + ".") for p in layers)]
    if not keys:
        raise ConfigError("algorithm.layers", layers, f"matches no parameter; parameters: {', '.join(param_names)}")
    return keys


@register
class FeSEM(Algorithm[FeSEMState], Diagnostics[FeSEMState]):
    name = "fesem"
    family = "baselines"
    reply_arrays = ()  # the trained weights only
    Hyper = FeSEMHyper

    # -- server --------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> FeSEMState:
        K, n = self.hp.centers, self.info.num_clients
        model = ctx.shared_model()
        keys = distance_keys([k for k, _ in model.named_parameters()], self.hp.layers)
        init = ctx.init_weights()
        if self.hp.init == "random_centers":
            centers: list[dict[str, torch.Tensor]] = []
            for k in range(K):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed_for(self.info.seed, "fesem-center", k))
                    for m in model.modules():
                        if hasattr(m, "reset_parameters"):
                            cast(Callable[[], None], m.reset_parameters)()  # a layer's own initializer
                centers.append(weights_of(model))
            model.load_state_dict(init)
        else:
            centers = [{k: v.clone() for k, v in init.items()} for _ in range(K)]
        rng = np.random.default_rng(seed_for(self.info.seed, "fesem-assign"))
        assignment = rng.integers(0, K, size=n).astype(np.int64)
        state = FeSEMState(centers, assignment, np.zeros(n, dtype=np.int64), keys)
        state.weights = state.generic()
        return state

    def configure(self, state: FeSEMState, rnd: int, ctx: ServerContext) -> Record:
        return Record()  # nothing is the same for every client: each gets its cluster's model

    def configure_client(self, state: FeSEMState, rnd: int, cid: int, ctx: ServerContext) -> Record:
        return Record(weights=state.centers[int(state.assignment[cid])])

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        # the engine admits a subset of the weights sent; here the E-step flattens every
        # distance key and the M-step builds a whole centre from the members, so each reply
        # must hold the whole model (shapes and dtypes are the engine's check)
        missing = sorted(set(sent.weights) - set(reply.weights))
        return f"the reply lacks model weights {missing[:3]}; FeSEM needs the whole trained model" if missing else None

    def e_step_now(self, state: FeSEMState) -> bool:
        if not self.hp.recluster:
            return False
        return self.hp.init == "random_centers" or state.steps > 0

    def aggregate(self, state: FeSEMState, rnd: int, replies: list[tuple[int, Record]],
                  ctx: ServerContext) -> FeSEMState:
        if not replies:
            return state
        cids = [cid for cid, _ in replies]
        ws = [r.weights for _, r in replies]
        ns = [r.num_samples for _, r in replies]
        assignment, samples = state.assignment.copy(), state.samples.copy()
        if self.e_step_now(state):  # E-step
            pts = torch.stack([flatten(w, state.keys) for w in ws])
            ctr = torch.stack([flatten(c, state.keys) for c in state.centers])
            new = assign_nearest(pts, ctr).numpy()
        else:
            new = assignment[cids]
        moved = int((assignment[cids] != new).sum())
        assignment[cids] = new
        samples[cids] = ns
        centers: list[dict[str, torch.Tensor]] = []
        for k, c in enumerate(state.centers):  # M-step
            members = average((r for (_, r), a in zip(replies, new) if a == k), self.hp.weighting)
            centers.append(members or c)
        out = FeSEMState(centers, assignment, samples, state.keys, state.steps + 1)
        out.weights = out.generic()
        ctx.log("fesem_moved", moved)
        for k in range(len(centers)):
            ctx.log(f"fesem_size{k}", int((assignment == k).sum()))
        return out

    def cluster_assignment(self, state: FeSEMState) -> Optional[Sequence[int]]:
        return cast(Sequence[int], state.assignment)  # c(i) after this round's E-step (an int64 array)

    def global_predictor(self, state: FeSEMState, ctx: ServerContext) -> Optional[Predictors]:
        return ctx.shared_model(state.weights)

    def model_weights(self, state: FeSEMState) -> Optional[dict[str, torch.Tensor]]:
        return state.weights  # the generic model

    # -- client --------------------------------------------------------------------------
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        center = msg.weights
        fitted = await ctx.fit(center)  # W_i <- local SGD from its centre
        reply = Record(weights=fitted.weights)
        # the personalized model: the client's centre (default) or its trained model
        personal = ctx.shared_model(center if self.hp.personal == "center" else fitted.weights)
        return ClientResult(reply, personal=personal)
