"""What a run builds once, before its first round: the federated data, the method, the task
facts and the model objects (:class:`Task`).

``protofl.run`` builds it while checking the config (``api.check_task``) and hands it to
the :class:`~protofl.engine.simulation.Simulation`; worker processes, Ray actors and
Flower nodes build their own from the parts they are sent. Model objects live in one
:class:`ModelCache` per device: the server and the clients of a process share it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TYPE_CHECKING, Union

import torch
from torch import nn

from ..algorithms.base import Algorithm, TaskInfo
from ..config import Config, ConfigError, method
from ..errors import one_line
from ..data.build import build_federated
from ..data.federated import FederatedData
from ..models import MODELS, build_model
from ..rng import seed_for

if TYPE_CHECKING:
    from ..data.dataset import Dataset
    from ..models import FLModel


def arch_kwargs(cfg: Config, cid: int) -> dict[str, Any]:
    """Model kwargs of client ``cid``: the shared ones plus its heterogeneous overrides."""
    kw = dict(cfg.model.params)
    K = cfg.partition.num_clients
    for key, values in cfg.model.per_client.items():
        if len(values) == K:
            kw[key] = values[cid]
        else:  # contiguous equal blocks: 3 values over 20 clients -> 7, 7, 6
            kw[key] = values[min(len(values) - 1, cid * len(values) // K)]
    return kw


def use_channels_last(cfg: Config, model: nn.Module) -> bool:
    """``execution.channels_last``: auto follows the model's measured preference."""
    flag = cfg.execution.channels_last
    if flag == "auto":
        return bool(getattr(model, "channels_last", getattr(model, "is_conv", False)))
    return bool(flag)


def _versions(tensors: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """The in-place version counters of ``tensors``: any write to one of them changes it."""
    return tuple(t._version for t in tensors.values())


class ModelCache:
    """One live model object per architecture on one device; weights are copied in, never
    deep-copied, and only when the model does not hold them already."""

    def __init__(self, cfg: Config, algorithm: Algorithm[Any], info: TaskInfo,
                 device: Union[str, torch.device]) -> None:
        self.cfg, self.algorithm, self.info, self.device = cfg, algorithm, info, torch.device(device)
        self._models: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}
        # id(model) -> (weights it holds, their versions, the model's own versions)
        self._holds: dict[int, tuple[Mapping[str, torch.Tensor], tuple[int, ...], tuple[int, ...]]] = {}

    def get(self, kwargs: dict[str, Any], weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
        """The live model of this architecture holding ``weights`` (None: the initial ones)."""
        model, init = self.live(kwargs)
        weights = init if weights is None else weights
        if not self.holds(model, weights):
            model.load_state_dict(weights)
            self.mark(model, weights)
        return model

    def mark(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """``model``'s tensors now hold exactly ``weights`` (loaded, or copied out after training)."""
        self._holds[id(model)] = (weights, _versions(weights), _versions(model.state_dict()))

    def holds(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``model`` holds ``weights``: the same dict marked, and neither written since."""
        held = self._holds.get(id(model))
        return (held is not None and held[0] is weights and held[1] == _versions(weights)
                and held[2] == _versions(model.state_dict()))

    def live(self, kwargs: dict[str, Any]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """The live model of this architecture (its weights whatever was loaded last) and its
        initial weights."""
        key = repr(sorted(kwargs.items()))
        if key not in self._models:
            # every architecture starts from the run's init stream: homogeneous clients
            # and the server's global model start from identical weights
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed_for(self.info.seed, "init"))
                base = build_model(self.cfg.model.name, self.info.input_shape, self.info.num_classes,
                                   pretrained=self.cfg.model.pretrained, **kwargs)
                model = self.algorithm.adapt_model(base).to(self.device)
            if use_channels_last(self.cfg, model):
                model = model.to(  # type: ignore[call-overload]  # torch's Module.to overloads omit memory_format
                    memory_format=torch.channels_last)
            init = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self._models[key] = (model, init)
        return self._models[key]


@dataclass
class Task:
    """The parts every process of a run needs: ``cfg``, the federated data ``fed``, the method
    object ``algorithm`` and the task facts ``info``; model objects per device (:meth:`models`)."""

    cfg: Config
    fed: FederatedData
    algorithm: Algorithm[Any]
    info: TaskInfo
    # the server state before round 1, when a check built it already (api.check_task);
    # a fresh run takes it instead of building it again
    initial_state: Optional[Any] = field(default=None, repr=False)
    _caches: dict[str, ModelCache] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cfg: Config, fed: Optional[FederatedData] = None) -> "Task":
        """The task of ``cfg``: its data (``fed``, or loaded and partitioned), the method built
        with its hyper-parameters, the facts it may use."""
        fed = fed if fed is not None else build_federated(cfg)
        if len(fed.train_idx) != cfg.partition.num_clients:
            raise ValueError(f"partition produced {len(fed.train_idx)} clients, "
                             f"config asks for {cfg.partition.num_clients}")
        ds = fed.dataset
        if cfg.data.augment and (ds.kind != "image" or len(ds.input_shape) != 3):
            raise ConfigError("data.augment", cfg.data.augment, f"crops and flips images; {ds.name} has {ds.kind} "
                              f"inputs of shape {tuple(ds.input_shape)}")
        with torch.random.fork_rng(devices=[]):  # probing the model leaves the global stream alone
            probe = build_probe(cfg, ds, arch_kwargs(cfg, 0))
        info = TaskInfo(num_classes=ds.num_classes, num_clients=fed.num_clients, feature_dim=probe.feature_dim,
                        input_shape=tuple(ds.input_shape), seed=cfg.seed, rounds=cfg.rounds)
        algo_cls, hp = method(cfg)
        return cls(cfg, fed, algo_cls(hp, info), info)

    def take_initial_state(self) -> Optional[Any]:
        """The server state a check built (once; None when there is none)."""
        state, self.initial_state = self.initial_state, None
        return state

    def models(self, device: Union[str, torch.device]) -> ModelCache:
        """The model objects of this process on ``device`` (one cache per device)."""
        device = torch.device(device)
        if str(device) not in self._caches:
            self._caches[str(device)] = ModelCache(self.cfg, self.algorithm, self.info, device)
        return self._caches[str(device)]

    def arch(self, cid: int) -> dict[str, Any]:
        """Client ``cid``'s model kwargs."""
        return arch_kwargs(self.cfg, cid)


def build_probe(cfg: Config, ds: Dataset, kwargs: dict[str, Any]) -> FLModel:
    """The configured model for dataset ``ds``'s inputs; a model that cannot be built for
    them (an image model on 8x8 digits, an LSTM on images) is a :class:`ConfigError` that
    names the registered models that can take them."""
    try:
        return build_model(cfg.model.name, ds.input_shape, ds.num_classes, pretrained=cfg.model.pretrained, **kwargs)
    except (ValueError, RuntimeError) as e:  # a shape check, or torch refusing a layer's size
        if isinstance(e, ConfigError):
            raise
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            # a size setting beyond any machine: not a mismatch with the data
            sizes = {k: v for k, v in kwargs.items() if isinstance(v, (int, list, tuple)) and not isinstance(v, bool)}
            raise ConfigError("model", sizes, "the model at these sizes needs more memory than this machine can "
                                              f"allocate ({one_line(str(e), 160)})") from None
        raise model_mismatch(cfg, ds, str(e), kwargs) from e


def model_mismatch(cfg: Config, ds: Dataset, why: str, kwargs: dict[str, Any]) -> ConfigError:
    """The error for a model that cannot take ``ds``'s inputs, with the models that can."""
    inputs = f"{ds.name}: {ds.kind} inputs of shape {tuple(ds.input_shape)}"
    own = {k: v for k, v in kwargs.items() if k in cfg.model.per_client}
    if own and cfg.model.per_client:  # the model fits; one client's own values do not
        return ConfigError("model.per_client", cfg.model.per_client,
                           f"the architecture of a client with {own}: {why} ({inputs})")
    fits = [n for n in models_for(ds) if n != cfg.model.name]
    return ConfigError("model.name", cfg.model.name,
                       f"{why} ({inputs}); models that take them: {', '.join(fits) or 'none registered'}")


def models_for(ds: Dataset) -> list[str]:
    """The registered models that build for ``ds``'s inputs with their default parameters
    and compute class scores from two of its samples (used on the error path only)."""
    x = ds.normalize(ds.x_train[:2])
    fits = []
    with torch.random.fork_rng(devices=[]), torch.inference_mode():  # probes leave the global stream alone
        for name in MODELS.names():
            try:
                model = build_model(name, ds.input_shape, ds.num_classes).eval()
                ok = tuple(model(x).shape) == (len(x), ds.num_classes)
            except Exception:  # noqa: BLE001 - any failure means "does not fit"
                ok = False
            if ok:
                fits.append(name)
    return fits
