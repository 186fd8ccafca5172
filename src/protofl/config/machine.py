"""What a config needs from the machine that runs it: the device, the packages of the
trackers and of the Ray backend. Checked where a run is configured (``load_config``,
:func:`protofl.run`), not when a config is parsed: a Flower server reads configs whose
device is a node's.
"""
from __future__ import annotations

import importlib.util
import sys

import torch

from ..errors import ConfigError, require

# tracker name -> (module it needs, the extra that installs it); protofl.engine.trackers builds them
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
RAY_HINT = "Ray is not installed; install the extra: pip install 'protofl[ray]'"


def require_ray() -> None:
    """Fail in one line (exit 2) if Ray is not importable; does not import it."""
    try:
        found = sys.modules.get("ray", False) is not None and importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError("execution.backend", "ray", RAY_HINT)


def check_trackers(names: list[str], key: str = "output.trackers") -> None:
    """Known names whose package is installed; else a :class:`~protofl.errors.ConfigError`."""
    for i, name in enumerate(names):
        if name not in TRACKERS:
            raise ConfigError(f"{key}[{i}]", name, f"unknown tracker; known: {', '.join(TRACKERS)}")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}[{i}]", name,
                              f"needs the {module} package: pip install 'protofl[{extra}]'")


def available_devices() -> list[str]:
    """The torch devices of this machine: ``cpu`` and ``cuda:N`` for each visible GPU."""
    return ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0))]


def resolve_device(dev: str) -> str:
    """``execution.device`` on this machine: ``auto`` (the default) is ``cuda`` when torch
    sees a CUDA device, else ``cpu``; any other value is itself."""
    if dev != "auto":
        return dev
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(dev: str) -> None:
    """``execution.device`` must exist on this machine (checked where a run is configured,
    not when a config is built: a Flower server reads configs whose device is a node's)."""
    dev = resolve_device(dev)
    avail = available_devices()
    if dev.startswith("cuda") and not torch.cuda.is_available():
        build = torch.__version__ + ("" if torch.version.cuda else ", a CPU-only build")
        require(False, "execution.device", dev, f"CUDA is not available to this torch ({build}); available: "
                f"{', '.join(avail)}; on a machine with an NVIDIA GPU install a CUDA wheel (make install-cuda)")
    if dev == "cuda" and len(avail) > 1:
        return
    require(dev in avail, "execution.device", dev, f"not available on this machine; available: {', '.join(avail)}")
