"""The small interface every federated method implements.

A method owns both halves of its algorithm and nothing else:

server half                                   client half
-----------                                   -----------
``server_init(ctx) -> S``                      ``client_init(ctx) -> Record | None``
``configure(S, rnd, cid, ctx) -> Record``  ->  ``client_update(msg, state, ctx) -> ClientResult``
``aggregate(S, rnd, replies, ctx) -> S``   <-  (reply Record, new state, personalized predictor)
``global_predictor(S, ctx) -> Predictor``

Messages and per-client state are :class:`~protofl.messages.Record` s; server state ``S``
is the method's own dataclass. The engine owns everything around it: sampling,
participation, the local training loop (``ctx.train``), execution backends,
evaluation, checkpoints and logging. A method customizes training through the loss
function and the parameter list it hands to ``ctx.train``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..messages import Record

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.client import ClientContext
    from ..engine.server import ServerContext

Predictor = Callable[[torch.Tensor], torch.Tensor]  # inputs (B, ...) -> class scores (B, C)
# one predictor, or several named ones (the first is the primary, e.g. FedProto's
# nearest-prototype rule next to its local classifier)
Predictors = Union[Predictor, Mapping[str, Predictor]]


@dataclass(frozen=True)
class TaskInfo:
    """Facts about the task every method may use (same on server and clients)."""

    num_classes: int
    num_clients: int
    feature_dim: int
    input_shape: tuple
    seed: int
    rounds: int


@dataclass
class NoHyper:
    """For methods without hyper-parameters."""


@dataclass
class BatchPlan:
    """One client's local update in the form the batched executor (engine/batched.py)
    runs for many clients at once: ``ctx.train`` of every trainable parameter, starting from
    ``weights`` (a full state dict), on the objective ``loss(forward, params, x, y, extras)``.

    ``loss`` is a pure function of its arguments: ``forward(x)`` is the model with the
    client's current parameters, ``params`` those parameters by name, ``extras`` this
    client's own tensors (e.g. FedProx's anchor w_t). It must be the same function for
    every client of a round (the per-client parts go in ``extras``).
    """

    weights: dict[str, torch.Tensor]
    loss: Callable[..., torch.Tensor]
    extras: dict[str, torch.Tensor]


@dataclass
class ClientResult:
    reply: Record
    state: Optional[Record] = None  # the client's new persistent state (None = keep none)
    personal: Optional[Predictors] = None  # the personalized model, for PM(V)/PM(L)/PA


class Algorithm:
    name: ClassVar[str] = "?"
    Hyper: ClassVar[type] = NoHyper
    # False for methods with no global model (Local, FedProto): GA is then the mean of
    # the personalized models' accuracy on the global test set
    has_global_model: ClassVar[bool] = True
    # True only for methods that never average weights (clients may differ in architecture)
    heterogeneous_models: ClassVar[bool] = False
    # glob patterns of the array names a client's reply may hold (None: not checked); the
    # server rejects a reply with any other array (engine/validate.py)
    reply_arrays: ClassVar[Optional[tuple[str, ...]]] = None
    # True for a method whose updates depend on the total number of rounds (info.rounds,
    # e.g. a schedule over the run): its finished runs are then never extended to more
    # rounds (the reuse rule in api.py)
    uses_total_rounds: ClassVar[bool] = False

    def __init__(self, hp: Any, info: TaskInfo) -> None:
        self.hp = hp
        self.info = info

    # -- model ---------------------------------------------------------------------------
    def adapt_model(self, model: nn.Module) -> nn.Module:
        """Change the architecture for this method (e.g. fix the head); identity by default."""
        return model

    # -- server half ---------------------------------------------------------------------
    def server_init(self, ctx: "ServerContext") -> Any:
        raise NotImplementedError

    def configure(self, state: Any, rnd: int, cid: int, ctx: "ServerContext") -> Record:
        raise NotImplementedError

    def aggregate(self, state: Any, rnd: int, replies: list[tuple[int, Record]],
                  ctx: "ServerContext") -> Any:
        raise NotImplementedError

    def global_predictor(self, state: Any, ctx: "ServerContext") -> Optional[Predictors]:
        return None

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        """The method's own schema check of a reply that passed the engine's generic
        checks (finite values, counts, weight shapes, names, size): return the reason to
        reject it, or None. Runs on the server before ``aggregate``."""
        return None

    def cluster_assignment(self, state: Any) -> Optional[Sequence[int]]:
        """For methods that cluster their clients (FeSEM): the cluster of every client, one
        entry per client id, as the server holds it after this round's aggregation. When the
        scenario knows its client groups (feature skew ``rotate``, ``domains``, ``writers``;
        the ``clustered`` partition) the engine logs the purity of this clustering against
        them every round (``cluster_purity``, 1.0 = every cluster holds clients of one group
        only). None (default): the method does not cluster clients."""
        return None

    def class_vectors(self, state: Any) -> Optional[torch.Tensor]:
        """The (C, d) class prototypes or fixed-head rows the server holds, for the geometry
        logs (``proto_min_angle`` every evaluation, ``proto_cos`` in the last round); a zero
        row = no vector for that class yet. None (default) for methods without them."""
        return None

    # -- client half ---------------------------------------------------------------------
    def client_init(self, ctx: "ClientContext") -> Optional[Record]:
        return None

    def client_update(self, msg: Record, state: Optional[Record], ctx: "ClientContext") -> ClientResult:
        raise NotImplementedError

    # -- batched execution (optional; engine/batched.py) -----------------------------------
    # the methods whose behaviour ``batch_plan``/``batch_result`` restate: a subclass that
    # overrides any of them is not batched unless it also defines ``batch_plan`` itself
    batch_hooks: ClassVar[tuple[str, ...]] = ("client_update", "client_init")

    def batch_plan(self, msg: Record, ctx: "ClientContext") -> Optional[BatchPlan]:
        """The client update as a :class:`BatchPlan`; None (default): not batchable."""
        return None

    def batch_result(self, msg: Record, ctx: "ClientContext", model: nn.Module) -> ClientResult:
        """The client's result once its plan has been trained (``model`` holds the weights)."""
        raise NotImplementedError

    def batchable(self) -> bool:
        """Whether this method's clients can be trained together (its class or an ancestor
        defines ``batch_plan`` and no subclass below that one overrides ``batch_hooks``)."""
        cls = type(self)
        owner = next(c for c in cls.__mro__ if "batch_plan" in c.__dict__)
        if owner is Algorithm:
            return False
        return all(getattr(cls, h, None) is getattr(owner, h, None) for h in (*owner.batch_hooks, "batch_result"))


# ---------------------------------------------------------------------------------------
# shared helpers for methods
# ---------------------------------------------------------------------------------------
def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's state (parameters and buffers)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def weighted_mean(items: Iterable[tuple[float, Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Running weighted average of state dicts (never holds a list of N models).

    Floating tensors are averaged with the given weights; integer buffers (e.g.
    BatchNorm's ``num_batches_tracked``) take the maximum. Returns {} for no items.
    """
    acc: dict[str, torch.Tensor] = {}
    total = 0.0
    for w, tensors in items:
        w = float(w)
        if w < 0:
            raise ValueError("aggregation weights must be >= 0")
        total += w
        for k, t in tensors.items():
            if t.is_floating_point():
                if k in acc:
                    acc[k].add_(t, alpha=w)
                else:
                    acc[k] = t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32) * w
            else:
                acc[k] = t.clone() if k not in acc else torch.maximum(acc[k], t)
    if not acc:
        return {}
    if total <= 0:
        raise ValueError("aggregation weights sum to zero")
    return {k: (v / total if v.is_floating_point() else v) for k, v in acc.items()}


def weight_diversity(models: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """ReBaFL eq. (24): Lambda = 1/|S_t| sum_i ||w_i - w_bar||^2, w_bar = 1/|S_t| sum_i w_i.

    ``models`` are the local models (state dicts) received this round; the norm runs over
    all their floating-point entries (in float64), w_bar is their plain (unweighted)
    average as in the paper. nan when no model arrived.
    """
    if not models:
        return math.nan
    keys = [k for k, v in models[0].items() if v.is_floating_point()]
    n = len(models)
    total = 0.0
    for k in keys:
        # two passes over the models, one layer at a time: memory is two float64 copies of
        # one layer whatever |S_t| is (a stacked (|S_t|, ...) buffer took 420 MB for 100
        # clients of fedavg_cnn's 1024x512 layer); sums in float64, so the value agrees with
        # the stacked form to ~1e-15 relative (not bit for bit)
        mean = torch.zeros(models[0][k].shape, dtype=torch.float64)
        for m in models:
            mean.add_(m[k].detach().to(torch.float64))
        mean.div_(n)
        diff = torch.empty_like(mean)
        for m in models:
            torch.sub(m[k].detach().to(torch.float64), mean, out=diff)
            total += float(diff.pow_(2).sum())
    return total / n


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)
