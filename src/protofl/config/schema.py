"""A :class:`Config`: the sections, built from a raw (YAML) mapping and dotted overrides,
and checked against the registries (methods, datasets, partitioners, feature skews,
models) and against what cannot work together (a method and a model, a partition and a
dataset, per-client architectures). The registries are looked up here and nowhere else
in the config; what the machine must offer is checked by :func:`check_here`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..algorithms import ALGORITHMS
from ..algorithms.base import Algorithm
from ..algorithms.serveropt import SERVER_OPT_DEFAULTS
from ..data.datasets import DATASETS, HF_PREFIX
from ..data.features import FEATURES, check_scenario
from ..data.partition import PARTITIONERS
from ..models import MODELS
from ..registry import UnknownNameError
from ..errors import ConfigError, one_line, require
from .coerce import check_dataclass, check_kwargs, coerce, load_yaml, plain, YAMLAliasError
from .machine import check_device, check_trackers, require_ray
from .sections import (AlgorithmConfig, DataConfig, EvalConfig, ExecutionConfig, FeaturesConfig, ModelConfig,
                       OutputConfig, ParticipationConfig, PartitionConfig, PrivacyConfig, TrainingConfig)

BACKENDS = ("local", "ray")  # execution.backend; the engine's EXECUTORS registers these
NAMED_SECTIONS = {"data": DataConfig, "partition": PartitionConfig, "model": ModelConfig,
                  "algorithm": AlgorithmConfig, "features": FeaturesConfig}
PLAIN_SECTIONS = {"training": TrainingConfig, "participation": ParticipationConfig,
                  "eval": EvalConfig, "execution": ExecutionConfig, "output": OutputConfig, "privacy": PrivacyConfig}


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
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    # -- (de)serialization ------------------------------------------------------------
    def to_dict(self, complete: bool = False) -> dict:
        """The flat YAML form: a named component's params sit next to its name.

        Settings added after runs were recorded are left out at their default values, so
        that older configs keep their fingerprints; ``complete``: every key of every
        section (the reference ``protofl config defaults`` prints)."""
        out: dict[str, Any] = {"seed": self.seed, "rounds": self.rounds}
        for sec in ("data", "partition", "features", "model", "training", "participation", "algorithm",
                    "eval", "execution", "output", "privacy"):
            obj = getattr(self, sec)
            d = dataclasses.asdict(obj)
            params = d.pop("params", None)
            if params:
                d.update(params)
            if complete:
                out[sec] = d
                continue
            if sec == "features" and obj.name == "none":
                continue  # the default; left out so that label-skew configs keep their fingerprints
            if sec == "privacy" and obj.mode == "none":
                continue  # likewise: a run without differential privacy keeps its fingerprint
            if sec == "model":  # unset: left out, so that the fingerprints of older configs stay
                if not d.get("per_client"):
                    d.pop("per_client", None)
                if d.get("pretrained") is None:
                    d.pop("pretrained", None)
            if sec == "data":  # unset: left out, so that the fingerprints of older configs stay
                for k in ("root", "train_size"):
                    if d.get(k) is None:
                        d.pop(k)
                for k in ("download", "verify"):
                    if d.get(k) is True:
                        d.pop(k)
                if not d.get("mirrors"):
                    d.pop("mirrors", None)
                if not d.get("augment"):
                    d.pop("augment", None)
            out[sec] = d
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self, ignore: tuple[str, ...] = ("output", "execution", "rounds")) -> str:
        """A short hash of everything that determines the results (not where/how it runs)."""
        d = self.to_dict()
        for k in ignore:
            d.pop(k, None)
        for k in ("root", "download", "mirrors", "verify"):  # where the files live or come from, and whether
            # they are checked, does not change the results
            d["data"].pop(k, None)
        for section, key, default in ADDED_AT_DEFAULT:  # settings added later, at the value that
            if d.get(section, {}).get(key, default) == default:  # reproduces the earlier behaviour,
                d.get(section, {}).pop(key, None)  # do not rename the run folders written before them
        if "execution" in ignore and self.execution.precision != "fp32":
            d["precision"] = self.execution.precision  # the one execution setting that changes them
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]

    def replace(self, **overrides: Any) -> "Config":
        """A validated copy with dotted overrides applied, e.g. ``replace(**{"algorithm.name": "fedprox"})``.

        Changing a named component (``algorithm.name``, ``model.name``, ...) drops the
        resolved parameters of the old one; parameters given in ``overrides`` apply.
        """
        return from_dict(apply_overrides(switch_components(self.to_dict(), overrides), overrides))


# (section, key, value) of settings added after the first release whose value here gives
# the results of the releases before them: at that value they are left out of the
# fingerprint, so a run folder written before them keeps its name (and --resume finds it)
ADDED_AT_DEFAULT = (
    ("training", "schedule", "exponential"), ("training", "milestones", []), ("training", "min_lr", 0.0),
    ("training", "optimizer", "sgd"), ("training", "betas", [0.9, 0.999]), ("training", "eps", 1e-8),
    ("training", "step_size", None), ("training", "warmup_rounds", 0), ("training", "warmup_factor", 0.1),
    ("training", "alpha", 0.99),
    # the outlier-update rule: at 1000x the median no honest run of any method is touched
    # (benchmarks/update_norms.md), so its results are those of the releases before it
    ("training", "update_ratio_limit", 1000.0),
    ("participation", "sampling", "fixed"),
    # the server optimizer of every GlobalModel method (server_opt: none = the method's own
    # step). SCAFFOLD's own server_lr (1.0) is not server_lr's default (null), so it stays in
    # SCAFFOLD's fingerprints, as before
    *(("algorithm", key, default) for key, default in SERVER_OPT_DEFAULTS),
    ("features", "shape", None),  # domains: the sources' own image shape (Digit-5 brings them to one)
)


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
        val = raw.get(sec) or {}
        if isinstance(val, str):  # `algorithm: fednh`: the name of a component, written as the section
            raise ConfigError(sec, val, f"expected a mapping: write `{sec}: {{name: {val}}}` (or the override "
                                        f"{sec}.name={val})")
        if not isinstance(val, dict):
            raise ConfigError(sec, val, "expected a mapping")
        val = dict(val)
        own = {f.name for f in dataclasses.fields(cls)} - {"params"}
        fixed = {k: val.pop(k) for k in list(val) if k in own}
        fixed["params"] = val
        kwargs[sec] = check_dataclass(cls, fixed, sec)
    cfg = Config(**kwargs)
    validate_components(cfg)
    return cfg


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(item, None, "overrides are key=value, e.g. training.lr=0.05")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(item, None, "empty key")
    try:
        value = load_yaml(text) if text.strip() else None
    except YAMLAliasError as e:
        raise ConfigError(key, one_line(text, 60), e.problem) from None
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


def _get(reg, name, key):
    try:
        return reg.get(name)
    except UnknownNameError as e:
        raise ConfigError(key, name, str(e)) from None


def _own_keys(section: Any) -> tuple[str, ...]:
    """A section's keys besides its component's parameters (``params``)."""
    return tuple(f.name for f in dataclasses.fields(section) if f.name != "params")


def validate_components(cfg: Config) -> None:
    """Check names against the registries and params against each component's signature."""
    require(cfg.execution.backend in BACKENDS, "execution.backend", cfg.execution.backend,
            f"unknown execution backend {cfg.execution.backend!r}; known: {', '.join(BACKENDS)}")
    if cfg.execution.backend == "ray":
        require_ray()
    if cfg.data.name.startswith(HF_PREFIX):  # any Hugging Face dataset: its options are load_hf's
        from ..data.hf import load_hf as loader
    else:
        loader = _get(DATASETS, cfg.data.name, "data.name")
    cfg.data.params = check_kwargs(loader, cfg.data.params, "data", skip=2, own=_own_keys(cfg.data),
                                   component="dataset")
    part = _get(PARTITIONERS, cfg.partition.name, "partition.name")
    require(cfg.partition.num_clients >= 1, "partition.num_clients", cfg.partition.num_clients, "must be >= 1")
    skip = [p.name for p in inspect.signature(part).parameters.values()].index("seed") + 1
    cfg.partition.params = check_kwargs(part, cfg.partition.params, "partition", skip=skip,
                                        provided=("users",), own=_own_keys(cfg.partition),
                                        component="partitioner")
    feats = _get(FEATURES, cfg.features.name, "features.name")
    cfg.features.params = check_kwargs(feats, cfg.features.params, "features", own=_own_keys(cfg.features),
                                       component="scenario")
    try:
        check_scenario(cfg)
    except ValueError as e:
        raise ConfigError(f"features ({cfg.features.name})", cfg.features.params, str(e)) from None
    builder = _get(MODELS, cfg.model.name, "model.name")
    cfg.model.params = check_kwargs(builder, cfg.model.params, "model", skip=2, own=_own_keys(cfg.model),
                                    component="model")
    for k, values in cfg.model.per_client.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"model.per_client.{k}", values, "expected a non-empty list of values")
        for i, v in enumerate(values):  # every client's value, not only the first
            check_kwargs(builder, {k: v}, f"model.per_client[{i}]", skip=2)
        n = cfg.partition.num_clients
        require(len(values) <= n, f"model.per_client.{k}", values,
                 f"at most one value per client ({n} clients)")
    algo, hp = method(cfg)
    params = dataclasses.asdict(hp)  # resolved: defaults included; the method's own first,
    last = {k: params.pop(k) for k, _ in SERVER_OPT_DEFAULTS if k in params}  # the server optimizer's after
    cfg.algorithm.params = plain({**params, **last})
    if cfg.model.per_client and not algo.heterogeneous_models:
        raise ConfigError("model.per_client", cfg.model.per_client,
                          f"algorithm {algo.name!r} aggregates model weights, so all clients must share "
                          "one architecture (heterogeneous models need a method that exchanges no weights)")


def method(cfg: Config) -> tuple[type[Algorithm[Any]], Any]:
    """The algorithm class of ``cfg`` (from the registry) and its hyper-parameters."""
    algo = _get(ALGORITHMS, cfg.algorithm.name, "algorithm.name")
    return algo, check_dataclass(algo.Hyper, cfg.algorithm.params, "algorithm")


def hyper(cfg: Config) -> Any:
    """The algorithm's hyper-parameter dataclass for this config."""
    return method(cfg)[1]


def check_here(cfg: Config) -> None:
    """What a config needs from the machine that runs it: its device, its trackers' packages."""
    check_device(cfg.execution.device)
    check_trackers(list(cfg.output.trackers))
