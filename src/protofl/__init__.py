"""protofl: federated learning under label heterogeneity.

Prototype and fixed-head methods (FedNH, FedProto, FedGELA, MP-FedCL, ReBaFL) and their
baselines on one engine, with Flower as the network transport.

The top-level names are imported lazily, so that ``import protofl.<module>`` (a Flower
ClientApp process, a worker) does not pay for the whole library.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "Config": "config", "ConfigError": "config", "load_config": "config",
    "run": "api", "compare": "api", "parse_methods": "api",
    "sweep": "sweeps", "parse_grid": "sweeps",
    "RunResult": "engine.simulation", "Simulation": "engine.simulation",
    "Callback": "engine.callbacks", "ProgressBar": "engine.callbacks", "RoundLogger": "engine.callbacks",
    "Algorithm": "algorithms.base", "ClientResult": "algorithms.base", "TaskInfo": "algorithms.base",
    "ALGORITHMS": "algorithms", "MODELS": "models", "DATASETS": "data.datasets",
    "PARTITIONERS": "data.partition", "FLModel": "models.base", "Dataset": "data.dataset",
}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .algorithms import ALGORITHMS
    from .algorithms.base import Algorithm, ClientResult, TaskInfo
    from .api import compare, parse_methods, run
    from .config import Config, ConfigError, load_config
    from .data.dataset import Dataset
    from .data.datasets import DATASETS
    from .data.partition import PARTITIONERS
    from .engine.callbacks import Callback, ProgressBar, RoundLogger
    from .engine.simulation import RunResult, Simulation
    from .models import MODELS
    from .models.base import FLModel
    from .sweeps import parse_grid, sweep


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'protofl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
