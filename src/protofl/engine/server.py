"""The server side of the engine: what ``server_init``/``configure``/``aggregate`` may use."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from ..algorithms.base import Algorithm, TaskInfo
from ..config import Config
from .client import ModelCache
from ..rng import seed_for


class ServerContext:
    def __init__(self, cfg: Config, algorithm: Algorithm, info: TaskInfo, device: str = "cpu") -> None:
        """``device``: where ``model()`` lives. The server half runs on the CPU (its state,
        the messages and the checkpoints stay there); the simulation evaluates the global
        predictor through a second context on ``execution.device``."""
        self.cfg, self.algorithm, self.info = cfg, algorithm, info
        self.device = torch.device(device)
        self._models = ModelCache(cfg, algorithm, info, self.device)
        self.logs: dict[str, float] = {}

    def model(self, weights: Optional[dict] = None) -> nn.Module:
        """The (shared) architecture with ``weights`` loaded (None: the run's initial weights)."""
        return self._models.get(dict(self.cfg.model.params), weights)

    def init_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().cpu() for k, v in self.model().state_dict().items()}

    def rng(self, rnd: int, *keys: object) -> np.random.Generator:
        """A numpy stream for server-side randomness in round ``rnd``."""
        return np.random.default_rng(seed_for(self.info.seed, "server", rnd, *keys))

    def log(self, key: str, value: float) -> None:
        """Record a per-round server metric (e.g. ReBaFL's weight diversity)."""
        self.logs[key] = float(value)

    def pop_logs(self) -> dict[str, float]:
        logs, self.logs = self.logs, {}
        return logs
