"""Run configuration: one validated dataclass per component.

A config is built at the edge (``cli.py`` or the Python API) from YAML plus dotted
``key=value`` overrides, validated here, and passed down explicitly; nothing in the
library reads globals. Components chosen by name (dataset, partitioner, model,
algorithm) keep their own parameters next to the name and are validated against the
component's own signature (loaders, partitioners, models) or hyper-parameter dataclass
(algorithms), so one method's ``mu`` never leaks into another's namespace.

Every validation failure raises :class:`ConfigError` with the dotted key, the value and
what is allowed; the CLI prints that one line and exits with code 2.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .errors import ConfigError, require  # noqa: F401  (re-exported: protofl.config.ConfigError)


# ---------------------------------------------------------------------------------------
# type checking of YAML values against annotations
# ---------------------------------------------------------------------------------------
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = typing.get_args(tp)
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; int -> float widening and list -> tuple allowed."""
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for a in args:
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(key, value, f"expected {_type_name(tp)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(key, value, f"expected {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, value, "expected null")
    if origin in (list, tuple, typing.Sequence, __import__("collections.abc").abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, f"expected a list ({_type_name(tp)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(key, value, f"expected {len(args)} items ({_type_name(tp)})")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        out = [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "expected a mapping")
        if args:
            return {k: coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, value, "expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER.match(value.strip()):  # YAML 1.1 reads 1e6 as a string
            return float(value)
        raise ConfigError(key, value, "expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "expected a string")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(key, value, f"expected {_type_name(tp)}")


def check_kwargs(fn: Any, params: dict, section: str, skip: int = 0,
                 provided: tuple[str, ...] = ()) -> dict:
    """Validate ``params`` against the keyword parameters of ``fn`` after the first ``skip``.

    Unknown keys are rejected with the list of known ones; values are type-checked
    against the annotations. Returns the coerced kwargs (only those given). Names in
    ``provided`` are supplied by the library (e.g. the natural partition's users).
    """
    sig = inspect.signature(fn)
    plist = list(sig.parameters.values())[skip:]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # pragma: no cover - unresolved annotations: skip type checks
        hints = {}
    known = {p.name: p for p in plist
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in provided}
    out = {}
    for k, v in params.items():
        if k not in known:
            allowed = ", ".join(sorted(known)) or "no parameters"
            raise ConfigError(f"{section}.{k}", v, f"unknown parameter; allowed: {allowed}")
        out[k] = coerce(v, hints.get(k, Any), f"{section}.{k}")
    missing = [n for n, p in known.items() if p.default is inspect.Parameter.empty and n not in out]
    if missing:
        raise ConfigError(f"{section}.{missing[0]}", None, "required parameter is missing")
    # the resolved form: every parameter with its value, defaults included, so that the
    # saved config and the run fingerprint change when a default changes
    defaults = {n: _plain(p.default) for n, p in known.items() if n not in out}
    return {**defaults, **out}


def _plain(value: Any) -> Any:
    """Tuples -> lists (YAML/JSON friendly), recursively."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def check_dataclass(cls: type, params: dict, section: str) -> Any:
    """Build dataclass ``cls`` from ``params`` with type checks; unknown keys rejected."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for k, v in params.items():
        if k not in fields:
            allowed = ", ".join(sorted(fields)) or "no parameters"
            raise ConfigError(f"{section}.{k}", v, f"unknown key; allowed: {allowed}")
        kwargs[k] = coerce(v, hints[k], f"{section}.{k}")
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # a required field missing
        raise ConfigError(section, params, str(e)) from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(section)
    return obj


# ---------------------------------------------------------------------------------------
# component configs
# ---------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    name: str = "digits"
    root: Optional[str] = None  # else PROTOFL_DATA, else the cache dir
    # a seeded uniform random subset of this many training samples, drawn before the
    # partition (MP-FedCL's Table VI trains on 2,000 MNIST images); null = the whole split
    train_size: Optional[int] = None
    params: dict = field(default_factory=dict)  # the loader's own options

    def validate(self, s: str) -> None:
        require(self.train_size is None or self.train_size >= 1, f"{s}.train_size", self.train_size,
                "must be >= 1 or null")


@dataclass
class PartitionConfig:
    name: str = "dirichlet"
    num_clients: int = 10
    params: dict = field(default_factory=dict)  # the partitioner's own parameters


@dataclass
class FeaturesConfig:
    """Feature-distribution skew (data/features.py); ``none`` leaves the data as loaded."""

    name: str = "none"
    params: dict = field(default_factory=dict)  # the scenario's own options


@dataclass
class ModelConfig:
    name: str = "mlp"
    params: dict = field(default_factory=dict)
    # heterogeneous architectures: {kwarg: [v1, v2, ...]}; a list as long as the number of
    # clients is used as is, a shorter one is assigned in contiguous equal blocks
    # (three values -> thirds), as in FedProto's 18/20/22-channel setting
    per_client: dict = field(default_factory=dict)


@dataclass
class TrainingConfig:
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 1.0  # per-round exponential: lr_r = lr * lr_decay ** (r - 1)
    epochs: int = 1
    steps: Optional[int] = None  # if set, local steps per round instead of epochs
    batch_size: int = 32
    clip_grad: Optional[float] = None  # max gradient L2 norm
    # a client whose loss turns NaN/inf: stop the run (reveals a bad lr in simulation) or
    # drop that client's reply for the round (what a deployment wants: one client cannot stop it)
    on_nonfinite: Literal["stop", "drop"] = "stop"

    def validate(self, s: str) -> None:
        require(self.lr > 0, f"{s}.lr", self.lr, "must be > 0")
        require(0 <= self.momentum < 1, f"{s}.momentum", self.momentum, "must be in [0, 1)")
        require(self.weight_decay >= 0, f"{s}.weight_decay", self.weight_decay, "must be >= 0")
        require(0 < self.lr_decay <= 1, f"{s}.lr_decay", self.lr_decay, "must be in (0, 1]")
        require(self.epochs >= 1, f"{s}.epochs", self.epochs, "must be >= 1")
        require(self.steps is None or self.steps >= 1, f"{s}.steps", self.steps, "must be >= 1 or null")
        require(self.batch_size >= 1, f"{s}.batch_size", self.batch_size, "must be >= 1")
        require(self.clip_grad is None or self.clip_grad > 0, f"{s}.clip_grad", self.clip_grad,
                 "must be > 0 or null")


@dataclass
class ParticipationConfig:
    """Who is asked and whose reply arrives.

    ceil(fraction * K) clients are sampled per round (or ``clients_per_round``). A
    sampled client's reply arrives only if it is *available*: client k is available with
    probability p_k (``p``, or ``group_p[group of k]`` for clustered partitions), drawn
    afresh every ``period`` rounds. period = 1 is independent dropout each round;
    period = s > 1 is persistent straggling (the active set is redrawn every s rounds).
    """

    fraction: float = 1.0
    clients_per_round: Optional[int] = None
    p: float = 1.0
    group_p: Optional[list[float]] = None
    period: int = 1

    def validate(self, s: str) -> None:
        require(0 < self.fraction <= 1, f"{s}.fraction", self.fraction, "must be in (0, 1]")
        require(self.clients_per_round is None or self.clients_per_round >= 1,
                 f"{s}.clients_per_round", self.clients_per_round, "must be >= 1 or null")
        require(0 <= self.p <= 1, f"{s}.p", self.p, "must be in [0, 1]")
        for i, q in enumerate(self.group_p or []):
            require(0 <= q <= 1, f"{s}.group_p[{i}]", q, "must be in [0, 1]")
        require(self.period >= 1, f"{s}.period", self.period, "must be >= 1")


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)  # validated against the method's Hyper


@dataclass
class EvalConfig:
    every: int = 1  # global model (GM) and PA every k rounds; the last round always
    personal: bool = True  # evaluate the personalized models of the clients that trained
    # PM(V)/PM(L)/acc need a pass of every personalized model over the full test set: every
    # k rounds and the last (0 = on every evaluation round). PA (local test sets) is cheap
    # and comes with every evaluation round.
    personal_every: int = 10
    batch_size: int = 256  # measured fastest for inference on CPU (cache-sized batches)
    local_test_fraction: Optional[float] = None  # client test size / train size; null = |test|/|train|
    # after the last round, every client's personalized model (a local update from the final
    # server state, nothing aggregated) on the full and local test sets: keys all_* (docs/metrics.md)
    final_all_clients: bool = True

    def validate(self, s: str) -> None:
        require(self.every >= 1, f"{s}.every", self.every, "must be >= 1")
        require(self.personal_every >= 0, f"{s}.personal_every", self.personal_every, "must be >= 0")
        require(self.batch_size >= 1, f"{s}.batch_size", self.batch_size, "must be >= 1")
        require(self.local_test_fraction is None or self.local_test_fraction > 0,
                 f"{s}.local_test_fraction", self.local_test_fraction, "must be > 0 or null")


@dataclass
class ExecutionConfig:
    # auto: one process per CPU core (at most one per client of a round), each with one
    # intra-op thread; 0 = sequential in this process; N = N worker processes
    workers: Union[int, Literal["auto"]] = "auto"
    # intra-op threads of the sequential executor (workers always use 1). With 1 the
    # numbers are the same in every mode and on any number of cores; 0 = torch's default
    threads: int = 1
    channels_last: Union[bool, Literal["auto"]] = "auto"  # auto: the model's measured preference
    # arithmetic of the clients' local training: bf16 = bfloat16 autocast for the forward
    # pass, fp32 weights, messages and aggregation (engine/precision.py); changes the results
    precision: Literal["fp32", "bf16"] = "fp32"
    device: str = "cpu"
    # with worker processes: evaluate round t's global model as a pool task while round t+1
    # trains (same numbers; its row comes when that is done). Not on checkpoint rounds, the
    # last round, or with a callback that must see each row at once (docs/metrics.md)
    overlap_eval: bool = True
    # where client tasks run (engine/executor.py EXECUTORS): local = this machine (the
    # ``workers`` above); ray = actors on a Ray cluster (docs/scale.md). The options below
    # apply to ray only.
    backend: str = "local"
    address: Optional[str] = None  # "host:port" of a running cluster's head; null = a private local Ray
    actors: Union[int, Literal["auto"]] = "auto"  # auto: cluster CPUs / client_resources.num_cpus
    client_resources: dict = field(default_factory=lambda: {"num_cpus": 1.0, "num_gpus": 0.0})
    retries: int = 2  # a task whose actor or node died runs again on another actor this often
    state: Literal["driver", "cluster"] = "driver"  # where per-client state lives between rounds
    data: Literal["ship", "node"] = "ship"  # ship: once through the object store; node: each node loads it
    # how a round's clients train on one device (docs/gpu.md): sequential = one after another;
    # batched = the sampled clients stacked and trained in one set of kernels (methods that
    # support it, else sequential with a note); auto = batched on a GPU, sequential on the CPU
    executor: Literal["auto", "sequential", "batched"] = "auto"
    batch_clients: int = 0  # batched: at most this many clients at a time (slots); 0 = chosen per stack
    # batched: compile the stack's SGD step with torch.compile (on a GPU with CUDA graphs),
    # for stacks whose step has one fixed shape; results within float rounding of eager
    compile: bool = False
    # per-client state (personal models, heads, control variates) kept in memory on the
    # driver; beyond it, the least recently used states go to <run folder>/client_state/ and
    # are read back when their client is sampled. null = no limit (state: driver only)
    state_memory_mb: Optional[float] = 512

    def validate(self, s: str) -> None:
        require(self.batch_clients >= 0, f"{s}.batch_clients", self.batch_clients, "must be >= 0")
        require(self.workers == "auto" or self.workers >= 0, f"{s}.workers", self.workers, "must be >= 0 or auto")
        require(self.threads >= 0, f"{s}.threads", self.threads, "must be >= 0")
        require(self.device == "cpu" or self.device.startswith("cuda"), f"{s}.device", self.device,
                 "expected cpu or cuda[:N]")
        require(self.actors == "auto" or self.actors >= 1, f"{s}.actors", self.actors, "must be >= 1 or auto")
        require(self.retries >= 0, f"{s}.retries", self.retries, "must be >= 0")
        if self.state_memory_mb is not None:
            self.state_memory_mb = coerce(self.state_memory_mb, float, f"{s}.state_memory_mb")
            require(math.isfinite(self.state_memory_mb) and self.state_memory_mb >= 0, f"{s}.state_memory_mb",
                    self.state_memory_mb, "must be >= 0 (MB), or null for no limit")
        unknown = set(self.client_resources) - {"num_cpus", "num_gpus"}
        require(not unknown, f"{s}.client_resources", self.client_resources, "allowed keys: num_cpus, num_gpus")
        res = {"num_cpus": 1.0, "num_gpus": 0.0}
        for k, v in self.client_resources.items():
            res[k] = coerce(v, float, f"{s}.client_resources.{k}")
        require(res["num_cpus"] > 0 and res["num_gpus"] >= 0, f"{s}.client_resources", self.client_resources,
                 "num_cpus must be > 0 and num_gpus >= 0")
        self.client_resources = res
        if self.address is not None:
            host, _, port = self.address.rpartition(":")
            require(self.address != "auto", f"{s}.address", self.address,
                     "give the head node's host:port explicitly ('auto' would join whichever cluster "
                     "the machine's shared Ray files point to)")
            require(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"{s}.address", self.address,
                     "expected host:port, e.g. 10.0.0.1:6379")
        if self.backend != "ray":
            require(self.state == "driver", f"{s}.state", self.state, "state: cluster needs backend: ray")
            require(self.address is None, f"{s}.address", self.address, "an address needs backend: ray")


@dataclass
class OutputConfig:
    dir: str = "runs"
    name: Optional[str] = None  # run folder name; null = derived from the config
    checkpoint_every: int = 10  # rounds; 0 = only at the end
    progress: bool = True  # a bar on a terminal / in a notebook, else plain log lines
    log_every: int = 1  # without a terminal: one log line every N rounds (and the last)
    save_model: bool = True
    trackers: list[str] = field(default_factory=list)  # tensorboard, mlflow (optional extras)
    tracking_uri: Optional[str] = None  # MLflow; null = SQLite store <dir>/mlflow.db
    experiment: str = "protofl"  # MLflow experiment name

    def validate(self, s: str) -> None:
        require(self.checkpoint_every >= 0, f"{s}.checkpoint_every", self.checkpoint_every, "must be >= 0")
        require(self.log_every >= 1, f"{s}.log_every", self.log_every, "must be >= 1")
        from .trackers import TRACKERS

        for i, t in enumerate(self.trackers):
            require(t in TRACKERS, f"{s}.trackers[{i}]", t, f"unknown tracker; known: {', '.join(TRACKERS)}")


NAMED_SECTIONS = {"data": DataConfig, "partition": PartitionConfig, "model": ModelConfig,
                  "algorithm": AlgorithmConfig, "features": FeaturesConfig}
PLAIN_SECTIONS = {"training": TrainingConfig, "participation": ParticipationConfig,
                  "eval": EvalConfig, "execution": ExecutionConfig, "output": OutputConfig}


@dataclass
class Config:
    seed: int = 0
    rounds: int = 10
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    participation: ParticipationConfig = field(default_factory=ParticipationConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # -- (de)serialization ------------------------------------------------------------
    def to_dict(self) -> dict:
        """The flat YAML form: a named component's params sit next to its name."""
        out: dict[str, Any] = {"seed": self.seed, "rounds": self.rounds}
        for sec in ("data", "partition", "features", "model", "training", "participation", "algorithm",
                    "eval", "execution", "output"):
            obj = getattr(self, sec)
            if sec == "features" and obj.name == "none":
                continue  # the default; left out so that label-skew configs keep their fingerprints
            d = dataclasses.asdict(obj)
            params = d.pop("params", None)
            if params:
                d.update(params)
            if sec == "model" and not d.get("per_client"):
                d.pop("per_client", None)
            if sec == "data":  # unset: left out, so that the fingerprints of older configs stay
                for k in ("root", "train_size"):
                    if d.get(k) is None:
                        d.pop(k)
            out[sec] = d
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self, ignore: tuple[str, ...] = ("output", "execution", "rounds")) -> str:
        """A short hash of everything that determines the results (not where/how it runs)."""
        d = self.to_dict()
        for k in ignore:
            d.pop(k, None)
        d["data"].pop("root", None)  # where the files live does not change the results
        if "execution" in ignore and self.execution.precision != "fp32":
            d["precision"] = self.execution.precision  # the one execution setting that changes them
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]

    def replace(self, **overrides: Any) -> "Config":
        """A validated copy with dotted overrides applied, e.g. ``replace(**{"algorithm.name": "fedprox"})``.

        Changing a named component (``algorithm.name``, ``model.name``, ...) drops the
        resolved parameters of the old one; parameters given in ``overrides`` apply.
        """
        return from_dict(apply_overrides(switch_components(self.to_dict(), overrides), overrides))


def from_dict(raw: dict) -> Config:
    """Validate a raw (YAML) mapping into a :class:`Config`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("<root>", raw, "expected a mapping")
    known = {"seed", "rounds", *NAMED_SECTIONS, *PLAIN_SECTIONS}
    for k in raw:
        if k not in known:
            raise ConfigError(k, raw[k], f"unknown section; allowed: {', '.join(sorted(known))}")
    seed = coerce(raw.get("seed", 0), int, "seed")
    rounds = coerce(raw.get("rounds", 10), int, "rounds")
    require(rounds >= 1, "rounds", rounds, "must be >= 1")
    kwargs: dict[str, Any] = {"seed": seed, "rounds": rounds}
    for sec, cls in PLAIN_SECTIONS.items():
        val = raw.get(sec) or {}
        if not isinstance(val, dict):
            raise ConfigError(sec, val, "expected a mapping")
        kwargs[sec] = check_dataclass(cls, val, sec)
    for sec, cls in NAMED_SECTIONS.items():
        val = dict(raw.get(sec) or {})
        if not isinstance(val, dict):
            raise ConfigError(sec, val, "expected a mapping")
        own = {f.name for f in dataclasses.fields(cls)} - {"params"}
        fixed = {k: val.pop(k) for k in list(val) if k in own}
        fixed["params"] = val
        kwargs[sec] = check_dataclass(cls, fixed, sec)
    cfg = Config(**kwargs)
    validate_components(cfg)
    return cfg


def validate_components(cfg: Config) -> None:
    """Check names against the registries and params against each component's signature."""
    from .algorithms import ALGORITHMS
    from .data.datasets import DATASETS
    from .data.features import FEATURES, check_scenario
    from .data.partition import PARTITIONERS
    from .models import MODELS
    from .registry import UnknownNameError

    def get(reg, name, key):
        try:
            return reg.get(name)
        except UnknownNameError as e:
            raise ConfigError(key, name, str(e)) from None

    from .engine.executor import EXECUTORS

    get(EXECUTORS, cfg.execution.backend, "execution.backend")
    if cfg.execution.backend == "ray":
        from .engine.executor import require_ray

        require_ray()
    loader = get(DATASETS, cfg.data.name, "data.name")
    cfg.data.params = check_kwargs(loader, cfg.data.params, "data", skip=2)
    part = get(PARTITIONERS, cfg.partition.name, "partition.name")
    require(cfg.partition.num_clients >= 1, "partition.num_clients", cfg.partition.num_clients, "must be >= 1")
    skip = [p.name for p in inspect.signature(part).parameters.values()].index("seed") + 1
    cfg.partition.params = check_kwargs(part, cfg.partition.params, "partition", skip=skip,
                                        provided=("users",))
    feats = get(FEATURES, cfg.features.name, "features.name")
    cfg.features.params = check_kwargs(feats, cfg.features.params, "features")
    try:
        check_scenario(cfg)
    except ValueError as e:
        raise ConfigError(f"features ({cfg.features.name})", cfg.features.params, str(e)) from None
    builder = get(MODELS, cfg.model.name, "model.name")
    cfg.model.params = check_kwargs(builder, cfg.model.params, "model", skip=2)
    for k, values in cfg.model.per_client.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"model.per_client.{k}", values, "expected a non-empty list of values")
        for i, v in enumerate(values):  # every client's value, not only the first
            check_kwargs(builder, {k: v}, f"model.per_client[{i}]", skip=2)
        n = cfg.partition.num_clients
        require(len(values) <= n, f"model.per_client.{k}", values,
                 f"at most one value per client ({n} clients)")
    algo = get(ALGORITHMS, cfg.algorithm.name, "algorithm.name")
    hp = check_dataclass(algo.Hyper, cfg.algorithm.params, "algorithm")
    cfg.algorithm.params = _plain(dataclasses.asdict(hp))  # resolved: defaults included
    if cfg.model.per_client and not algo.heterogeneous_models:
        raise ConfigError("model.per_client", cfg.model.per_client,
                          f"algorithm {algo.name!r} aggregates model weights, so all clients must share "
                          "one architecture (heterogeneous models need a method that exchanges no weights)")


def hyper(cfg: Config) -> Any:
    """The algorithm's hyper-parameter dataclass for this config."""
    from .algorithms import ALGORITHMS

    algo = ALGORITHMS.get(cfg.algorithm.name)
    return check_dataclass(algo.Hyper, cfg.algorithm.params, "algorithm")


# ---------------------------------------------------------------------------------------
# YAML + dotted overrides
# ---------------------------------------------------------------------------------------
def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(item, None, "overrides are key=value, e.g. training.lr=0.05")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(item, None, "empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key, value


def switch_components(raw: dict, overrides: dict[str, Any]) -> dict:
    """Drop the old component's own parameters where ``overrides`` changes ``<section>.name``.

    ``partition.name=iid`` on a Dirichlet config must not keep ``beta``; parameters for the
    new component given in the same ``overrides`` are applied afterwards by
    :func:`apply_overrides`. The section's fixed keys (``num_clients``, ``per_client``,
    ``root``) stay.
    """
    raw = dict(raw)
    for sec, cls in NAMED_SECTIONS.items():
        new = overrides.get(f"{sec}.name")
        old = raw.get(sec)
        if new is not None and isinstance(old, dict) and new != old.get("name"):
            own = {f.name for f in dataclasses.fields(cls)} - {"params"}
            raw[sec] = {k: v for k, v in old.items() if k in own}
    return raw


def available_devices() -> list[str]:
    """The torch devices of this machine: ``cpu`` and ``cuda:N`` for each visible GPU."""
    import torch

    return ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0))]


def check_here(cfg: "Config") -> None:
    """What a config needs from the machine that runs it: its device, its trackers' packages."""
    from .trackers import check_trackers

    check_device(cfg)
    check_trackers(list(cfg.output.trackers))


def check_device(cfg: "Config") -> None:
    """``execution.device`` must exist on this machine (checked where a run is configured,
    not in :func:`from_dict`: a Flower server reads configs whose device is a node's)."""
    import torch

    dev = cfg.execution.device
    avail = available_devices()
    if dev.startswith("cuda") and not torch.cuda.is_available():
        build = torch.__version__ + ("" if torch.version.cuda else ", a CPU-only build")
        require(False, "execution.device", dev, f"CUDA is not available to this torch ({build}); available: "
                f"{', '.join(avail)}; on a machine with an NVIDIA GPU install a CUDA wheel (make install-cuda)")
    if dev == "cuda" and len(avail) > 1:
        return
    require(dev in avail, "execution.device", dev, f"not available on this machine; available: {', '.join(avail)}")


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    raw = json.loads(json.dumps(raw, default=list))  # deep copy, tuples -> lists
    for key, value in overrides.items():
        parts = key.split(".")
        node = raw
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                if p in node and node[p] is not None:
                    raise ConfigError(key, value, f"{p} is not a section")
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    return raw


def yaml_problem(e: "yaml.YAMLError") -> str:
    """YAML's multi-line message as one line: 'line L, column C: problem'."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    return where + " ".join(str(problem).split())


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """YAML file (or the bare name of a packaged config, e.g. ``"digits"``) + dotted overrides."""
    raw: dict = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError("CONFIG", str(path), f"not valid YAML: {yaml_problem(e)}") from None
        except UnicodeDecodeError:
            raise ConfigError("CONFIG", str(path), "not a text file (a YAML config was expected)") from None
        except OSError as e:  # a folder, a file without read permission
            raise ConfigError("CONFIG", str(path), f"cannot be read: {e.strerror or e}") from None
    ov = dict(parse_override(o) for o in (overrides or []))
    if not isinstance(raw, dict):
        raise ConfigError("CONFIG", str(path), "expected a mapping at the top level")
    cfg = from_dict(apply_overrides(switch_components(raw, ov), ov))
    check_here(cfg)
    return cfg


def config_from_args(args: Any) -> Config:
    """The config of a command line: ``args.config`` + ``args.overrides``, plus the
    shortcut flags ``--data-dir``, ``--quiet`` and ``--workers`` where the command has them
    (shared by ``protofl`` and ``protofl flower``)."""
    overrides = list(getattr(args, "overrides", None) or [])
    if getattr(args, "data_dir", None):
        overrides.append(f"data.root={args.data_dir}")
    if getattr(args, "quiet", False):
        overrides.append("output.progress=false")
    if getattr(args, "workers", None) is not None:
        overrides.append(f"execution.workers={args.workers}")
    return load_config(args.config, overrides)


def ceil_fraction(fraction: float, n: int) -> int:
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


# ---------------------------------------------------------------------------------------
# example configs shipped inside the package (src/protofl/configs/*.yaml)
# ---------------------------------------------------------------------------------------
PACKAGED_CONFIGS = Path(__file__).resolve().parent / "configs"


def packaged_configs() -> dict[str, Path]:
    """Name (file stem) -> path of every example config shipped with the package."""
    return {p.stem: p for p in sorted(PACKAGED_CONFIGS.glob("*.yaml"))}


def config_description(path: Path) -> str:
    """A config file's first comment line (its one-line summary), '' if it has none."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def packaged_config(name: str) -> Path:
    """The packaged config called ``name`` (``digits`` or ``digits.yaml``)."""
    configs = packaged_configs()
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem not in configs:
        raise ConfigError("CONFIG", name, "no packaged config of that name; packaged: "
                          + ", ".join(configs))
    return configs[stem]


def resolve_config_path(path: str | Path) -> Path:
    """An existing file wins; otherwise a bare name (no folder) names a packaged config."""
    p = Path(path)
    if p.is_file():
        return p
    if len(p.parts) == 1 and p.suffix in ("", ".yaml"):
        try:
            return packaged_config(p.name)
        except ConfigError:
            pass
    raise ConfigError("CONFIG", str(path), "file not found, and not the name of a packaged config "
                      "(`protofl configs` lists them)")


def defaults_yaml(width: int = 92) -> str:
    """The resolved default config (every component's parameters included) as YAML.

    One line per section (flow style, wrapped at ``width``), values aligned, so that it
    reads as a table, e.g. in the README; ``yaml.safe_load`` gives back ``to_dict()``.
    """
    d = load_config().to_dict()

    def flow(v: Any) -> str:
        return yaml.safe_dump(v, default_flow_style=True, width=math.inf).strip().removesuffix("\n...")

    pad = max(len(k) for k in d) + 2
    lines = []
    for key, value in d.items():
        head = f"{key}:".ljust(pad)
        if not isinstance(value, dict):
            lines.append(head + flow(value))
            continue
        items = [f"{k}: {flow(v)}" for k, v in value.items()]
        line = head + "{"
        for i, item in enumerate(items):
            piece = item + ("}" if i == len(items) - 1 else ",")
            if len(line) + 1 + len(piece) > width and not line.endswith("{"):
                lines.append(line)
                line = " " * (pad + 1) + piece
            else:
                line += ("" if line.endswith("{") else " ") + piece
        lines.append(line)
    return "\n".join(lines) + "\n"
