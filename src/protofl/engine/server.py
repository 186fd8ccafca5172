"""The server side of the engine: what ``server_init``/``configure``/``aggregate`` may use,
and the global model's evaluation."""
from __future__ import annotations

from typing import Any, cast, Mapping, Optional, Union

import numpy as np
import torch
from torch import nn

from .. import metrics as M
from ..algorithms.base import Algorithm
from ..rng import seed_for
from .client import ClientRuntime
from .evaluate import as_named, class_correct
from .task import Task


class ServerContext:
    def __init__(self, task: Task, device: Union[str, torch.device] = "cpu") -> None:
        """``device``: where the server state and ``shared_model()`` live: the CPU, or the
        training device when the clients train in this process (the broadcast is then
        there already and the replies stay there)."""
        self.task, self.cfg, self.algorithm, self.info = task, task.cfg, task.algorithm, task.info
        self.device = torch.device(device)
        self._models = task.models(self.device)
        self._arch = dict(task.cfg.model.params)
        self.logs: dict[str, float] = {}

    def shared_model(self, weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
        """The server's one model object (the shared architecture) with ``weights`` loaded
        (None: the run's initial weights); the next call loads others into the same object."""
        return self._models.get(self._arch, weights)

    def init_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the run's initial weights, on the server's device."""
        return {k: v.detach().clone() for k, v in self._models.live(self._arch)[1].items()}

    def rng(self, rnd: int, *keys: object) -> np.random.Generator:
        """A numpy stream for server-side randomness in round ``rnd``."""
        return np.random.default_rng(seed_for(self.info.seed, "server", rnd, *keys))

    def log(self, key: str, value: float) -> None:
        """Record a per-round server metric (e.g. FedNH's head_min_dist)."""
        self.logs[key] = float(value)

    def pop_logs(self) -> dict[str, float]:
        logs, self.logs = self.logs, {}
        return logs


def global_metrics(algorithm: Algorithm[Any], state: Any, server: ServerContext,
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
            correct = count = cast(np.ndarray, 0)  # 0 + each block's per-class counts
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
