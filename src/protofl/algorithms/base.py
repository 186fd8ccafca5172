"""The small interface every federated method implements.

A method owns both halves of its algorithm and nothing else:

server half                                   client half
-----------                                   -----------
``server_init(ctx) -> S``                      ``client_init(ctx) -> Record | None``
``configure(S, rnd, cid, ctx) -> Record``  ->  ``async client_update(msg, state, ctx) -> ClientResult``
``aggregate(S, rnd, replies, ctx) -> S``   <-  (reply Record, new state, personalized predictor)
``global_predictor(S, ctx) -> Predictor``

Messages and per-client state are :class:`~protofl.messages.Record` s; server state ``S``
is the method's own dataclass. The engine owns everything around it: sampling,
participation, the local training loop, execution backends, evaluation, checkpoints and
logging.

**The local update, stated once.** ``client_update`` is a coroutine that reads like the
paper's client step and hands the heavy work to the engine with ``await``:

* ``await ctx.fit(weights, loss, extras=...)`` -> :class:`Fitted`: E epochs (or
  ``training.steps``) of the run's SGD from ``weights`` on ``loss(model, x, y, extras)``,
  a pure function of the model (with the client's current parameters), a batch and the
  client's own tensors ``extras`` (FedProx's anchor, FedGELA's Phi, a prototype table).
  Options: which parameters move (``trainable``), a gradient transform (``grad``:
  SCAFFOLD's g + c - c_i), per-step random tensors (``step_extras``) and per-call
  training settings (``epochs=10``).
* ``await ctx.features(weights, "body")`` -> (n_k, d): a part of the model applied to the
  client's training inputs in eval mode (prototypes).

Between the awaits the method computes what it likes (class means, k-means, its
reply). The sequential executor runs each request at once, for one client; the batched
executor (``engine/batched.py``) runs the requests of many clients together, in one
stack of parameters: the method is written once and both executors run it. For that,
``loss``, ``grad`` and ``step_extras`` must be the same function for every client of a
round (module-level functions or bound methods of the method; per-client values go in
``extras``), and must not branch in Python on the values of tensors. A method whose
``client_update`` is a plain function (``ctx.train(model, ...)`` on a live model) still
runs, sequentially.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Protocol, Sequence, Union

import torch
from torch import nn
from torch.nn import functional as F

from ..messages import Record
from ..registry import Registry


# every method by its name; a method module registers its classes with @register (the
# package imports every module in it), a third-party package through the entry points of
# the group "protofl.algorithms" (registry.py)
ALGORITHMS: Registry = Registry("algorithm", "protofl.algorithms")


def register(cls: type) -> type:
    """Class decorator: add a method to :data:`ALGORITHMS` under its ``name``."""
    ALGORITHMS.add(cls.name, cls)
    return cls


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
class WeightsState:
    """The server state of a method with one global model (a full state dict); methods extend
    it with their own fields. :meth:`Algorithm.model_weights` reads it."""

    weights: dict[str, torch.Tensor]


@dataclass
class TrainStats:
    loss: float  # sample-weighted mean of the minibatch losses
    steps: int
    samples: int  # samples processed (epochs x client size, or steps x batch)


# loss(model, x, y, extras) -> scalar: the objective of one minibatch. ``model`` is the
# client's architecture holding its current parameters (in the batched executor, one
# client's slice of the stack), ``extras`` the client's own tensors given to ``ctx.fit``.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, Mapping[str, Any]], torch.Tensor]
# grad(grads, extras) -> grads: a transform of the minibatch gradient by parameter name,
# applied before clipping and the optimizer step (SCAFFOLD's corrected gradient)
GradFn = Callable[[dict, Mapping[str, Any]], dict]


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
    """The plain objective: cross-entropy of the model's logits."""
    return F.cross_entropy(model(x), y)


@dataclass
class Fit:
    """A request for local training (``ctx.fit``); the engine answers with :class:`Fitted`.

    ``weights``: the full state dict to start from. ``loss``: the objective (see
    :data:`LossFn`). ``extras``: this client's own tensors (nested dicts of tensors).
    ``trainable``: prefixes of the parameter names that move (None: every trainable
    parameter). ``grad``: a gradient transform (:data:`GradFn`). ``step_extras``: given the
    client's minibatch sizes, one step after another, returns tensors (steps, max size, ...)
    whose row of a step, cut to that step's batch size, joins ``extras`` at that step
    (random draws the sequential loop would make inside the loss, made up front in the same
    order). ``settings``: per-call training settings (``epochs``, ``steps``, ``clip_grad``,
    ``lr``, ...). ``report``: whether its loss and step count are the client's reported
    training statistics (the last such call's are).
    """

    weights: Mapping[str, torch.Tensor]
    loss: LossFn = cross_entropy
    extras: Mapping[str, Any] = field(default_factory=dict)
    trainable: Optional[tuple[str, ...]] = None
    grad: Optional[GradFn] = None
    step_extras: Optional[Callable[[Sequence[int]], dict]] = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    report: bool = True


@dataclass
class Fitted:
    """The answer to a :class:`Fit`: the trained weights (a full state dict, the caller's
    own copy) and the training statistics."""

    weights: dict[str, torch.Tensor]
    stats: TrainStats


@dataclass
class Features:
    """A request for features (``ctx.features``): ``model.<part>`` with ``weights`` applied
    in eval mode to ``x`` (None: the client's training inputs); the answer is (n, d)."""

    weights: Mapping[str, torch.Tensor]
    part: str = "body"
    x: Optional[torch.Tensor] = None


class Pending:
    """What ``ctx.fit`` and ``ctx.features`` return: awaiting it hands the request to the
    executor that drives ``client_update`` and gives back its answer."""

    __slots__ = ("request",)

    def __init__(self, request: Union[Fit, Features]) -> None:
        self.request = request

    def __await__(self):
        answer = yield self.request
        return answer


class ClientContext(Protocol):
    """What ``client_init`` and ``client_update`` may use: everything is this (round,
    client)'s own. The engine's :class:`protofl.engine.client.ClientContext` implements it
    (the engine builds on this module, never the other way round)."""

    cid: int
    round: int
    info: TaskInfo
    num_classes: int
    evaluating: bool  # whether the engine evaluates the personalized model after this update

    @property
    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): the client's normalized training data on the device."""

    @property
    def num_samples(self) -> int: ...

    @property
    def class_counts(self) -> torch.Tensor:
        """(C,) int64 training label counts."""

    def rng(self, *keys: object) -> Any:
        """A numpy ``Generator`` for this (round, client) and purpose."""

    def model(self, weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
        """The client's live model object with ``weights`` loaded (None: the initial ones)."""

    def architecture(self) -> nn.Module: ...

    def like_model(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def trainable(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def lr(self) -> float: ...

    def step_size(self) -> float: ...

    def fit(self, weights: Mapping[str, torch.Tensor], loss: LossFn = ..., **options) -> Pending:
        """``await`` it: a :class:`Fit` answered with :class:`Fitted`."""

    def features(self, weights: Mapping[str, torch.Tensor], part: str = "body",
                 x: Optional[torch.Tensor] = None) -> Pending:
        """``await`` it: :class:`Features` answered with an (n, d) tensor."""


class ServerContext(Protocol):
    """What the server half may use; the engine's :class:`protofl.engine.server.ServerContext`
    implements it."""

    info: TaskInfo
    device: torch.device

    def model(self, weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module: ...

    def init_weights(self) -> dict[str, torch.Tensor]: ...

    def rng(self, rnd: int, *keys: object) -> Any: ...

    def log(self, key: str, value: float) -> None:
        """Add a number to this round's metrics row."""


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

    # -- what the engine may read (the contract beyond the two halves) ------------------------
    def model_weights(self, state: Any) -> Optional[dict[str, torch.Tensor]]:
        """The global model's weights in the server state (saved as ``model.pt`` after the
        run), None for a method without one. Default: the ``weights`` of a
        :class:`WeightsState`."""
        return state.weights if self.has_global_model and isinstance(state, WeightsState) else None

    def local_weights(self, reply: Record) -> Optional[dict[str, torch.Tensor]]:
        """The local model a reply carries (its ``w.*`` arrays), for the weight diversity of
        ReBaFL's eq. (24), which the engine logs for every method; None when the reply
        carries none (prototypes only, SCAFFOLD's updates)."""
        return None if self.heterogeneous_models else (reply.weights() or None)

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

    async def client_update(self, msg: Record, state: Optional[Record], ctx: "ClientContext") -> ClientResult:
        """The client's turn: ``await ctx.fit(...)`` / ``await ctx.features(...)`` for the
        engine's work, the rest in plain code; returns the reply, the new state and the
        personalized predictor."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------
# shared helpers for methods
# ---------------------------------------------------------------------------------------
def trainable_names(model: nn.Module) -> list[str]:
    """The names of the model's trainable parameters, in the model's order."""
    return [k for k, p in model.named_parameters() if p.requires_grad]


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


def reply_weight(reply: Record, weighting: str) -> float:
    """A reply's aggregation weight: its client's training samples n_k (``samples``) or 1
    (``uniform``)."""
    return float(reply.metrics["num_samples"]) if weighting == "samples" else 1.0


def average(replies: Iterable[Record], weighting: str,
            part: Callable[[Record], Mapping[str, torch.Tensor]] = Record.weights) -> dict[str, torch.Tensor]:
    """sum_k a_k part(r_k) / sum_k a_k over the replies, a_k = :func:`reply_weight` (replies with
    a_k = 0 left out); by default the replies' model weights. {} when no reply counts."""
    return weighted_mean((a, part(r)) for r in replies if (a := reply_weight(r, weighting)) > 0)


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


async def fine_tuned(ctx: "ClientContext", weights: Mapping[str, torch.Tensor], epochs: int) -> Optional[nn.Module]:
    """A personalized model made by fine-tuning: ``weights`` trained for ``epochs`` epochs of
    the run's SGD on cross-entropy over all parameters, on the client's data.

    Only when the engine evaluates this client (``ctx.evaluating``; None otherwise): the
    extra epochs cost nothing in the other rounds. It runs after everything the reply and
    the client's state depend on, and its statistics are not the client's reported
    training statistics, so turning personalized evaluation on or off leaves training
    bit-identical."""
    if not ctx.evaluating:
        return None
    tuned = await ctx.fit(weights, epochs=epochs, report=False)
    return ctx.model(tuned.weights)


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The plain objective in the form of the imperative ``ctx.train(model, loss)``."""
    return nn.functional.cross_entropy(model(x), y)
