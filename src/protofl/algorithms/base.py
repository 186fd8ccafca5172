"""The small interface every federated method implements.

A method owns both halves of its algorithm and nothing else:

server half                                       client half
-----------                                       -----------
``server_init(ctx) -> S``                          ``client_init(ctx) -> Record | None``
``configure(S, rnd, ctx) -> Record``           ->  ``async client_update(msg, state, ctx) -> ClientResult``
``configure_client(S, rnd, cid, ctx)``  (opt.) ->      (reply Record, new state, personalized predictor)
``aggregate(S, rnd, replies, ctx) -> S``       <-
``global_predictor(S, ctx) -> Predictor``

``configure`` is the round's broadcast, the same for every sampled client (fedjax's
shared input): the engine builds it once per round and moves it to the training device
once. ``configure_client`` adds what one client alone receives (FeSEM: its cluster's
model); a client's ``msg`` is the two together. Messages and per-client state are
:class:`~protofl.messages.Record` s; server state ``S`` is the method's own dataclass.
The engine owns everything around it: sampling, participation, the local training loop,
execution backends, evaluation, checkpoints and logging. It attaches each reply's sample
count (``Record.num_samples``: n_k, the client's training-set size).

**The local update, stated once.** ``client_update`` is a coroutine that reads like the
paper's client step and hands the heavy work to the engine with ``await``:

* ``await ctx.fit(weights, loss, extras=...)`` -> :class:`Fitted`: E epochs (or
  ``training.steps``) of the run's optimizer from ``weights`` on ``loss(model, x, y, extras)``,
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
``extras``), must not branch in Python on the values of tensors, and the ``extras`` of
the clients of a round must have the same shapes (pad a per-client list to a fixed
length, as ReBaFL pads its target classes to C).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, cast, ClassVar, Generator, Generic, Iterable, Mapping, Optional,
                    Protocol, Sequence, TypeVar, Union)

import torch
from torch import nn
from torch.nn import functional as F

from ..messages import Record
from ..registry import Registry
from .serveropt import server_step

if TYPE_CHECKING:
    from ..models.base import FLModel


# every method by its name; a method module registers its classes with @register (the
# package imports every module in it), a third-party package through the entry points of
# the group "protofl.algorithms" (registry.py)
ALGORITHMS: Registry[type[Algorithm[Any]]] = Registry("algorithm", "protofl.algorithms")

M = TypeVar("M", bound="type[Algorithm[Any]]")


def register(cls: M) -> M:
    """Class decorator: add a method to :data:`ALGORITHMS` under its ``name``."""
    ALGORITHMS.add(cls.name, cls)
    return cls


# the families of methods (``Algorithm.family``), in the order `protofl list` and the README show them
FAMILIES = ("fixed and calibrated heads", "prototype exchange", "calibrated softmax", "classifier calibration",
            "baselines", "global-model baselines", "server optimizers", "personalization", "other")


def by_family(names: Iterable[str]) -> dict[str, list[str]]:
    """The registered methods ``names`` grouped by family, in :data:`FAMILIES` order."""
    groups: dict[str, list[str]] = {f: [] for f in FAMILIES}
    for n in names:
        groups.setdefault(ALGORITHMS.get(n).family, []).append(n)
    return {f: ns for f, ns in groups.items() if ns}


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
    input_shape: tuple[int, ...]
    seed: int
    rounds: int


@dataclass
class NoHyper:
    """For methods without hyper-parameters."""


@dataclass
class WeightsState:
    """The server state of a method with one global model (a full state dict); methods extend
    it with their own fields."""

    weights: dict[str, torch.Tensor]
    # the server optimizer's moments (serveropt.py; None: none yet, or ``server_opt: none``).
    # Keyword-only with a default, so every method's own fields keep their positions; a
    # class attribute, so a state saved before it existed reads None
    server_opt_state: Optional[dict[str, Any]] = field(default=None, kw_only=True)


@dataclass
class TrainStats:
    loss: float  # sample-weighted mean of the minibatch losses
    steps: int
    samples: int  # samples processed (epochs x client size, or steps x batch)


# loss(model, x, y, extras) -> scalar: the objective of one minibatch. ``model`` is the
# client's architecture holding its current parameters (in the batched executor, one
# client's slice of the stack), ``extras`` the client's own tensors given to ``ctx.fit``.
LossFn = Callable[["FLModel", torch.Tensor, torch.Tensor, Mapping[str, Any]], torch.Tensor]
# grad(grads, extras, params) -> grads: a transform of the minibatch gradient by parameter
# name, applied before clipping and the optimizer step (SCAFFOLD's corrected gradient);
# ``params``: the current values of the moving parameters, by name (APFL's projected alpha)
GradFn = Callable[[dict[str, torch.Tensor], Mapping[str, Any], dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
    """The plain objective: cross-entropy of the model's logits."""
    return F.cross_entropy(model(x), y)


# ---------------------------------------------------------------------------------------
# what client_update awaits
# ---------------------------------------------------------------------------------------
A = TypeVar("A")  # what a request is answered with


class Request(Generic[A]):
    """What ``client_update`` awaits: a piece of work the engine runs (:class:`Fit`,
    :class:`Features`), answered with an ``A``. ``ctx.fit(...)`` and ``ctx.features(...)``
    make them; awaiting one hands it to the executor that drives ``client_update`` and
    gives back its answer."""

    def __await__(self) -> Generator["Request[A]", A, A]:
        answer = yield self
        return answer


@dataclass
class Fit(Request["Fitted"]):
    """Local training (``await ctx.fit(...)``), answered with :class:`Fitted`.

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
    step_extras: Optional[Callable[[Sequence[int]], dict[str, torch.Tensor]]] = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    report: bool = True


@dataclass
class Fitted:
    """The answer to a :class:`Fit`: the trained weights (a full state dict, the caller's
    own copy) and the training statistics."""

    weights: dict[str, torch.Tensor]
    stats: TrainStats


@dataclass
class Features(Request[torch.Tensor]):
    """Features (``await ctx.features(...)``): ``model.<part>`` with ``weights`` applied in
    eval mode to ``x`` (None: the client's training inputs); the answer is (n, d)."""

    weights: Mapping[str, torch.Tensor]
    part: str = "body"
    x: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------
# the contexts (the engine implements them; it builds on this module, never the other way)
# ---------------------------------------------------------------------------------------
class ClientContext(Protocol):
    """What ``client_init`` and ``client_update`` may use: everything is this (round,
    client)'s own. Facts are properties; what takes arguments or makes something is a
    method. The engine's :class:`protofl.engine.client.ClientContext` implements it."""

    cid: int
    rnd: int
    info: TaskInfo
    num_classes: int
    evaluating: bool  # whether the engine evaluates the personalized model after this update
    # privacy.* of this turn (None without privacy.mode): what protofl.nn.privacy's
    # release_class_means / release_class_kmeans read (clip, noise, streams) and count
    privacy: Any

    @property
    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): the client's normalized training data on the device."""

    @property
    def num_samples(self) -> int: ...

    @property
    def class_counts(self) -> torch.Tensor:
        """(C,) int64 training label counts."""

    @property
    def lr(self) -> float:
        """This round's learning rate (after ``training.schedule``)."""

    @property
    def step_size(self) -> float:
        """The optimizer's steady-state step per unit gradient (lr / (1 - momentum) for SGD)."""

    @property
    def architecture(self) -> nn.Module:
        """The client's model object, whatever weights it holds (for names and shapes)."""

    @property
    def channels_last(self) -> bool:
        """Whether the run feeds 4-d inputs to the model in channels-last memory format: a
        method that runs the model on batches of its own converts them alike (CReFF)."""

    def training_settings(self, overrides: Mapping[str, Any] = ...) -> Any:
        """The run's local-training settings for this round (an ``engine.train.TrainSettings``:
        ``lr`` after its schedule, ``batch_size``, ``epochs``, ``steps``, the optimizer's),
        with ``overrides`` for one call; for a method that sizes its own work by them."""

    def rng(self, *keys: object) -> Any:
        """A numpy ``Generator`` for this (round, client) and purpose."""

    def shared_model(self, weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
        """The client's one model object with ``weights`` loaded (None: the run's initial
        ones). Shared: the next ``shared_model`` call loads other weights into the same
        object, so a method holds one at a time (its personalized predictor is evaluated
        as soon as ``client_update`` returns)."""

    def like_model(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def trainable(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def fit(self, weights: Mapping[str, torch.Tensor], loss: LossFn = ..., **options: Any) -> Fit:
        """``await`` it: a :class:`Fit` answered with :class:`Fitted`."""

    def features(self, weights: Mapping[str, torch.Tensor], part: str = "body",
                 x: Optional[torch.Tensor] = None) -> Features:
        """``await`` it: :class:`Features` answered with an (n, d) tensor."""


class ServerContext(Protocol):
    """What the server half may use; the engine's :class:`protofl.engine.server.ServerContext`
    implements it."""

    info: TaskInfo
    device: torch.device

    def shared_model(self, weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
        """The server's one model object with ``weights`` loaded (None: the initial ones)."""

    def init_weights(self) -> dict[str, torch.Tensor]: ...

    def rng(self, rnd: int, *keys: object) -> Any: ...

    def log(self, key: str, value: float) -> None:
        """Add a number to this round's metrics row."""


@dataclass
class ClientResult:
    reply: Record
    state: Optional[Record] = None  # the client's new persistent state (None = keep none)
    personal: Optional[Predictors] = None  # the personalized model, for PM(V)/PM(L)/PA


# ---------------------------------------------------------------------------------------
# the method
# ---------------------------------------------------------------------------------------
S = TypeVar("S")  # a method's server state (its own dataclass)
WS = TypeVar("WS", bound=WeightsState)  # the server state of a method with one global model


class Algorithm(ABC, Generic[S]):
    """A federated method, generic in its server state ``S`` (``class FedX(Algorithm[FedXState])``).

    A client's state is always a :class:`~protofl.messages.Record` (or None): the engine keeps,
    checkpoints and ships it (Ray, Flower), so it is not a type parameter."""

    name: ClassVar[str] = "?"
    family: ClassVar[str] = "other"  # one of FAMILIES
    Hyper: ClassVar[type] = NoHyper
    # False for methods with no global model (Local, FedProto): GA is then the mean of
    # the personalized models' accuracy on the global test set
    has_global_model: ClassVar[bool] = True
    # True only for methods that never average weights (clients may differ in architecture)
    heterogeneous_models: ClassVar[bool] = False
    # names of the arrays (glob patterns; a group counts by its name) a reply may hold besides
    # its model weights (None: not checked); the server rejects any other (engine/validate.py)
    reply_arrays: ClassVar[Optional[tuple[str, ...]]] = None
    # the group of arrays in which a method replies its model update itself, when it sends one
    # instead of its weights (SCAFFOLD's Delta y_i, FedNova's d_i): the server's outlier-update
    # rule measures that group's norm (engine/validate.py update_outliers)
    update_group: ClassVar[Optional[str]] = None
    # True for a method whose updates depend on the total number of rounds (info.rounds,
    # e.g. a schedule over the run): its finished runs are then never extended to more
    # rounds (the reuse rule in api.py)
    uses_total_rounds: ClassVar[bool] = False
    # True for a method whose local loss couples the samples of a batch (a statistic of the
    # batch's features): DP-SGD evaluates it one sample at a time, which would change it, so
    # privacy.mode: sample refuses the method, and the batched executor does not pad its
    # short batches (execution.pad_batches). False promises that each loss it trains is a
    # mean over the batch's samples of one-sample terms plus terms that read no sample
    # (tests/test_algorithms_common.py checks the promise in float64 for every method)
    couples_samples: ClassVar[bool] = False

    def __init__(self, hp: Any, info: TaskInfo) -> None:
        self.hp = hp
        self.info = info

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        update = cls.__dict__.get("client_update")
        if update is not None and not inspect.iscoroutinefunction(update):
            raise TypeError(f"{cls.__name__}.client_update must be written `async def client_update(...)`: the "
                            "engine drives it and runs the work it awaits (ctx.fit, ctx.features)")

    # -- model ---------------------------------------------------------------------------
    def adapt_model(self, model: nn.Module) -> nn.Module:
        """Change the architecture for this method (e.g. fix the head); identity by default."""
        return model

    # -- server half ---------------------------------------------------------------------
    @abstractmethod
    def server_init(self, ctx: ServerContext) -> S:
        """The server state before round 1."""

    @abstractmethod
    def configure(self, state: S, rnd: int, ctx: ServerContext) -> Record:
        """The round's broadcast: what every client sampled in round ``rnd`` receives."""

    def configure_client(self, state: S, rnd: int, cid: int, ctx: ServerContext) -> Optional[Record]:
        """What client ``cid`` alone receives in round ``rnd``, on top of the broadcast
        (None, the default: nothing)."""
        return None

    @abstractmethod
    def aggregate(self, state: S, rnd: int, replies: list[tuple[int, Record]], ctx: ServerContext) -> S:
        """The new server state from the replies that arrived (in client-id order; possibly none)."""

    def global_predictor(self, state: S, ctx: ServerContext) -> Optional[Predictors]:
        """The global model's predictor (GM, GA); None for a method without one."""
        return None

    def prototype_releases(self, privacy: Any) -> int:
        """Under ``privacy.mode: sample``: how many private releases of its records a client
        makes per round (each call of :func:`protofl.nn.privacy.release_class_means` is one;
        ``release_class_kmeans`` is 1 + ``privacy.kmeans_steps``). 0, the default: the method
        sends no prototypes that mode makes private, so a reply with arrays is refused."""
        return 0

    def private_fits(self, evaluating: bool, final: bool = False) -> list[dict[str, Any]]:
        """The ``ctx.fit`` calls of one client turn, as their settings overrides (``{}``: the
        run's settings; ``{"epochs": 5}``), for the privacy budget's plan under
        ``privacy.mode: sample`` (each is DP-SGD: it spends). ``evaluating``: a turn whose
        personalized model the engine evaluates (fine-tuning for it spends too); ``final``:
        the turn of the final evaluation of every client, after the last round. The
        default: one fit. A method that fits more declares it; the ledger counts what a
        client did in any case, and a test checks that the two agree for every method."""
        return [{}]

    def check_reply(self, reply: Record, sent: Record) -> Optional[str]:
        """The method's own schema check of a reply that passed the engine's generic
        checks (finite values, counts, weight shapes, names, size): return the reason to
        reject it, or None. Runs on the server before ``aggregate``."""
        return None

    # -- client half ---------------------------------------------------------------------
    def client_init(self, ctx: ClientContext) -> Optional[Record]:
        """A client's persistent state before its first turn (None: none)."""
        return None

    @abstractmethod
    async def client_update(self, msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
        """The client's turn: ``await ctx.fit(...)`` / ``await ctx.features(...)`` for the
        engine's work, the rest in plain code; returns the reply, the new state and the
        personalized predictor."""


class Diagnostics(Generic[S]):
    """Optional hooks: what the engine saves and logs beside a method's own work. A method
    derives from this class and overrides what it has; the others answer None.

    * ``model_weights(S)``: the global model in the server state, saved as ``model.pt``
      after the run;
    * ``class_vectors(S)``: the (C, d) class prototypes or fixed-head rows the server holds
      (a zero row: none for that class yet), for the geometry logs (``proto_min_angle``
      every evaluation, ``proto_cos`` in the last round);
    * ``cluster_assignment(S)``: for methods that cluster their clients (FeSEM), each
      client's cluster after this round's aggregation; where the scenario knows its client
      groups (feature skew ``rotate``, ``domains``, ``writers``; the ``clustered``
      partition) the engine logs the purity of this clustering (``cluster_purity``).

    The weight diversity of ReBaFL's eq. (24) needs no hook: the engine computes it from
    the replies' model weights (``Record.weights``) of every method that averages weights.
    """

    def model_weights(self, state: S) -> Optional[dict[str, torch.Tensor]]:
        return None

    def class_vectors(self, state: S) -> Optional[torch.Tensor]:
        return None

    def cluster_assignment(self, state: S) -> Optional[Sequence[int]]:
        return None


class GlobalModel(Algorithm[WS], Diagnostics[WS]):
    """A method with one global model w (FedAvg's server half, Algorithm 1 of McMahan et al.):

        server_init: w_0, the run's initial weights
        configure:   send w_t to every sampled client
        aggregate:   w_{t+1} = sum_k a_k w_k / sum_k a_k over the replies' weights (a_k = n_k,
                     or 1 with ``weighting: uniform``); entries no reply carries (a fixed
                     head) keep their value; nobody arrived: w_t
        predictor:   the global model w

    Then the server optimizer (``algorithm.server_opt``, serveropt.py: FedAvgM, FedAdam,
    FedYogi, FedAdagrad) takes w_{t+1} from w_t and that average (``server_update``; with
    ``server_opt: none``, the default, w_{t+1} is the average itself). Its hyper-parameters
    have a ``weighting`` and derive from :class:`~protofl.algorithms.serveropt.ServerOptHyper`.
    Methods extend the server state with their own fields (``dataclasses.replace`` keeps
    them, the optimizer's moments included) and call ``super().aggregate``; a method with its
    own aggregation passes its new model through ``server_update``. Generic in its state
    ``WS`` (a :class:`WeightsState`): a method with its own fields makes its own in
    ``server_init``.
    """

    def server_init(self, ctx: ServerContext) -> WS:
        return cast(WS, WeightsState(ctx.init_weights()))

    def configure(self, state: WS, rnd: int, ctx: ServerContext) -> Record:
        return Record(weights=state.weights)

    def aggregate(self, state: WS, rnd: int, replies: list[tuple[int, Record]], ctx: ServerContext) -> WS:
        avg = average((r for _, r in replies), self.hp.weighting)
        if not avg:
            return state  # nobody arrived: keep w_t
        return self.server_update(state, avg, ctx)

    def server_update(self, state: WS, x_bar: Mapping[str, torch.Tensor], ctx: ServerContext) -> WS:
        """``state`` with w_{t+1} from w_t and the round's aggregate ``x_bar`` (the entries the
        replies carried; the others keep w_t's): ``x_bar`` itself with ``server_opt: none``,
        else one step of the server optimizer on Delta_t = x_bar - w_t (serveropt.py)."""
        if getattr(self.hp, "server_opt", "none") == "none":
            return dataclasses.replace(state, weights={**state.weights, **x_bar})
        if getattr(self, "_param_names", None) is None:  # the architecture is fixed for the run
            self._param_names = frozenset(k for k, _ in ctx.shared_model().named_parameters())
        weights, moments = server_step(self.hp, state.weights, x_bar, state.server_opt_state, self._param_names)
        return dataclasses.replace(state, weights=weights, server_opt_state=moments)

    def global_predictor(self, state: WS, ctx: ServerContext) -> Optional[Predictors]:
        return ctx.shared_model(state.weights)

    def model_weights(self, state: WS) -> Optional[dict[str, torch.Tensor]]:
        return state.weights if self.has_global_model else None


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
    if weighting != "samples":
        return 1.0
    if reply.num_samples is None:  # the engine attaches every reply's count
        raise ValueError("a reply without its sample count (Record.num_samples)")
    return float(reply.num_samples)


def average(replies: Iterable[Record], weighting: str,
            part: Callable[[Record], Mapping[str, torch.Tensor]] = lambda r: r.weights) -> dict[str, torch.Tensor]:
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
        # one layer whatever |S_t| is; sums in float64
        mean = torch.zeros(models[0][k].shape, dtype=torch.float64)
        for m in models:
            mean.add_(m[k].detach().to(torch.float64).cpu())
        mean.div_(n)
        diff = torch.empty_like(mean)
        for m in models:
            torch.sub(m[k].detach().to(torch.float64).cpu(), mean, out=diff)
            total += float(diff.pow_(2).sum())
    return total / n


def fine_tune_fits(evaluating: bool, epochs: int) -> list[dict[str, Any]]:
    """:meth:`Algorithm.private_fits` of a FedAvg-like turn that fine-tunes for evaluation
    (:func:`fine_tuned`): the local update, and the fine-tuning when evaluating."""
    return [{}, {"epochs": epochs}] if evaluating else [{}]


async def fine_tuned(ctx: ClientContext, weights: Mapping[str, torch.Tensor], epochs: int) -> Optional[nn.Module]:
    """A personalized model made by fine-tuning: ``weights`` trained for ``epochs`` epochs of
    the run's optimizer on cross-entropy over all parameters, on the client's data.

    Only when the engine evaluates this client (``ctx.evaluating``; None otherwise): the
    extra epochs cost nothing in the other rounds. It runs after everything the reply and
    the client's state depend on, and its statistics are not the client's reported
    training statistics, so turning personalized evaluation on or off leaves training
    bit-identical."""
    if not ctx.evaluating:
        return None
    tuned = await ctx.fit(weights, epochs=epochs, report=False)
    return ctx.shared_model(tuned.weights)
