"""The server side of the engine: what ``server_init``/``configure``/``aggregate`` may use,
and the global model's evaluation."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from .. import metrics as M
from ..algorithms.base import Algorithm, TaskInfo
from ..config import Config
from ..rng import seed_for
from .client import ClientRuntime, ModelCache
from .evaluate import as_named, class_correct


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


def global_metrics(algorithm: Algorithm, state: Any, server: ServerContext,
                   runtime: ClientRuntime) -> dict[str, Any]:
    """GM of the server state on the global test set: ``gm``, ``gm_per_class``, ``gm@name``
    for extra predictors and ``gm:group`` per feature-skew test block; {} without a global model.

    The same function runs in the driver and, with ``execution.overlap_eval``, in a pool
    worker (with the worker's own :class:`ServerContext`): the same numbers either way.
    """
    predictors = algorithm.global_predictor(state, server)
    if predictors is None:
        return {}
    tx, ty = runtime.test_data
    C, bs, cl = runtime.info.num_classes, runtime.cfg.eval.batch_size, runtime.channels_last
    out: dict[str, Any] = {}
    groups = runtime.fed.test_groups
    for i, (name, predict) in enumerate(as_named(predictors).items()):
        sfx = f"@{name}" if i > 0 else ""
        if groups and i == 0:  # feature groups: the primary predictor per test block (gm:rot90)
            correct = count = 0
            for g, idx in groups.items():
                t = torch.from_numpy(idx)
                c, n = class_correct(predict, tx[t], ty[t], C, bs, cl)
                out[f"gm:{g}"] = M.accuracy(c, n)
                correct, count = correct + c, count + n
        else:
            correct, count = class_correct(predict, tx, ty, C, bs, cl)
        out["gm" + sfx] = M.accuracy(correct, count)
        if i == 0:
            out["gm_per_class"] = M.per_class_accuracy(correct, count)
    return out
