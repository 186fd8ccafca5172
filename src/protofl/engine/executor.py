"""Execution backends: how a round's client tasks get run.

Every backend returns outputs in task order (``None`` for a reply lost in transit), so aggregation order -- and therefore every float --
is the same whichever backend ran the clients.

* :class:`SequentialExecutor` runs clients one after another in this process; the round's
  broadcast goes to the training device once (:func:`place_broadcasts`).
* :class:`ProcessExecutor` keeps N long-lived worker processes (spawned, one intra-op
  thread each), each holding the dataset in shared memory and its own model objects.
  Tasks and results cross as pickled bytes.
* :class:`~protofl.engine.ray_executor.RayExecutor` runs them on actors of a Ray cluster
  (``execution.backend: ray``; Ray is imported only then).

:mod:`protofl.engine.backends` maps ``execution.backend`` to a factory
``factory(simulation) -> executor``, an :class:`Executor`: ``run(tasks)`` and ``close()``,
``describe() -> dict`` (how the clients ran: the run summary's ``execution``), and, where
``defers_eval`` is set,
``evaluate_later(state) -> handle`` (the global-model evaluation as a pool task that runs
with the next round's clients, ``handle.result()`` its metrics; see
``execution.overlap_eval``).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import sys
import time
import types
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, cast, Iterator, Optional, Protocol, TYPE_CHECKING, Union

import torch

from ..messages import Record
from ..models import MODELS
from .client import ClientOutput, ClientRuntime, ClientTask as ClientTask  # re-exported (flower, batched)
from .malloc import tune_malloc
from .server import global_metrics, ServerContext
from .task import Task

if TYPE_CHECKING:
    from multiprocessing.popen_spawn_posix import Popen as SpawnPopen
    from multiprocessing.process import BaseProcess

    from ..algorithms.base import TaskInfo
    from ..config import Config
    from ..data.federated import FederatedData


def place_broadcasts(runtime: ClientRuntime, tasks: list[ClientTask]) -> list[Record]:
    """Each task's broadcast on the training device, each distinct broadcast (one per round)
    placed once."""
    placed: dict[int, Record] = {}
    for t in tasks:
        if id(t.shared) not in placed:
            placed[id(t.shared)] = runtime.place(t.shared)
    return [placed[id(t.shared)] for t in tasks]


class EvalHandle(Protocol):
    """A deferred global-model evaluation (:meth:`Executor.evaluate_later`)."""

    def result(self) -> dict[str, Any]: ...


class Executor:
    """What the round loop asks of a backend (the defaults: nothing to describe, no deferred
    evaluation, nothing to close)."""

    defers_eval: bool = False  # offers evaluate_later (execution.overlap_eval)

    def run(self, tasks: list["ClientTask"]) -> list[Optional[ClientOutput]]:
        """The clients' outputs in task order; None for a reply lost in transit."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """How the clients ran: the run summary's ``execution`` (backend, workers, ...)."""
        return {}

    def evaluate_later(self, state: Any) -> EvalHandle:
        """The global model's evaluation, deferred: a handle whose ``result()`` gives it."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class SequentialExecutor(Executor):
    def __init__(self, runtime: ClientRuntime, threads: int = 0) -> None:
        self.runtime = runtime
        self.threads = threads
        if threads > 0:
            torch.set_num_threads(threads)

    def run(self, tasks: list[ClientTask]) -> list[Optional[ClientOutput]]:
        return [self.runtime.run(t, shared) for t, shared in zip(tasks, place_broadcasts(self.runtime, tasks))]

    def describe(self) -> dict[str, Any]:
        device = self.runtime.device.type
        return {"backend": "local", "workers": 0, "threads": self.threads,
                **({} if device == "cpu" else {"device": str(self.runtime.device)})}


_WORKER: Optional[ClientRuntime] = None
_SERVER: Optional[ServerContext] = None  # built on a worker's first global evaluation
_MAIN_MODULES = ("__main__", "__mp_main__")


def _init_worker(cfg: Config, fed: FederatedData, shipped: bytes, info: TaskInfo) -> None:
    global _WORKER
    torch.set_num_threads(1)
    tune_malloc()
    algorithm, models = pickle.loads(shipped)

    for name, builder in models.items():  # model builders defined in the parent's __main__
        if name not in MODELS:
            MODELS.add(name, builder)
    _WORKER = ClientRuntime(Task(cfg, fed, algorithm, info))


def _run_task(payload: bytes) -> bytes:
    t: ClientTask = pickle.loads(payload)
    assert _WORKER is not None
    out = _WORKER.run(t)
    return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


def _evaluate_global(payload: bytes) -> bytes:
    """The global model of a pickled server state on the test set: (metrics, seconds)."""
    global _SERVER
    assert _WORKER is not None
    t0 = time.perf_counter()
    if _SERVER is None:
        _SERVER = ServerContext(_WORKER.task)
    out = global_metrics(_WORKER.algorithm, pickle.loads(payload), _SERVER, _WORKER)
    return pickle.dumps((out, time.perf_counter() - t0), protocol=pickle.HIGHEST_PROTOCOL)


class PendingEval:
    """A global-model evaluation handed to the pool (:meth:`ProcessExecutor.evaluate_later`).

    The server state is pickled at once (the next ``aggregate`` may change it in place);
    the task is submitted with the next round's client tasks, or when its result is asked
    for first.
    """

    def __init__(self, executor: "ProcessExecutor", state: Any) -> None:
        self.executor = executor
        self.payload: Optional[bytes] = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        self.future: Optional[Future[bytes]] = None

    def submit(self) -> None:
        if self.future is None:
            assert self.payload is not None  # dropped only once the future exists
            self.future = self.executor.pool.submit(_evaluate_global, self.payload)
            self.payload = None

    def result(self) -> dict[str, Any]:
        self.submit()
        assert self.future is not None  # submit() made it
        out, seconds = pickle.loads(self.future.result())
        self.executor.eval_s = seconds
        return cast(dict[str, Any], out)  # global_metrics' answer


def from_main(obj: object) -> bool:
    """Whether ``obj`` (or its class) is defined in ``__main__``: a script or a notebook cell."""
    mod = obj.__module__ if isinstance(obj, (type, types.FunctionType)) else type(obj).__module__
    return mod in _MAIN_MODULES


def ship_to_workers(runtime: ClientRuntime) -> bytes:
    """The method object and any model builder from ``__main__``, serialized for the workers.

    Workers do not re-import the parent's ``__main__`` (a script without an
    ``if __name__ == "__main__":`` guard would run again in every worker), so what is
    defined there -- a method or a model in a notebook cell or a script -- travels by
    value, with cloudpickle. Raises if that is impossible; the caller then falls back
    to running clients in this process.
    """
    builder = MODELS.get(runtime.cfg.model.name)
    models = {runtime.cfg.model.name: builder} if from_main(builder) else {}
    if not models and not from_main(runtime.algorithm):
        return pickle.dumps((runtime.algorithm, {}), protocol=pickle.HIGHEST_PROTOCOL)
    import cloudpickle  # only needed for components defined in __main__

    return cast(bytes, cloudpickle.dumps((runtime.algorithm, models), protocol=pickle.HIGHEST_PROTOCOL))


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """Start a spawned process without telling it the parent's ``__main__`` to re-import."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class _NoMainProcess(mp.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: BaseProcess) -> SpawnPopen:
        with _main_hidden():
            return mp.context.SpawnProcess._Popen(process_obj)


class _NoMainContext(mp.context.SpawnContext):
    Process = _NoMainProcess


class ProcessExecutor(Executor):
    defers_eval = True

    def __init__(self, runtime: ClientRuntime, workers: int, shipped: Optional[bytes] = None) -> None:
        self.workers = workers
        fed = runtime.fed.share_memory_()  # workers map the dataset, they do not copy it
        self.train_idx = fed.train_idx
        shipped = shipped if shipped is not None else ship_to_workers(runtime)
        self.pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=_NoMainContext(), initializer=_init_worker,
            initargs=(runtime.cfg, fed, shipped, runtime.info))
        self.queued: list[PendingEval] = []  # evaluations waiting for the next round's tasks
        # measured, for scheduling only: seconds per training sample, seconds of an evaluation
        self.sample_s: Optional[float] = None
        self.eval_s: Optional[float] = None

    def describe(self) -> dict[str, Any]:
        return {"backend": "local", "workers": self.workers, "threads": 1}

    def evaluate_later(self, state: Any) -> PendingEval:
        job = PendingEval(self, state)
        self.queued.append(job)
        return job

    def _eval_cost(self) -> float:
        """A queued evaluation's cost in training samples (first of all while unmeasured)."""
        if self.sample_s is None or self.eval_s is None:
            return float("inf")
        return self.eval_s / max(self.sample_s, 1e-12)

    def run(self, tasks: list[ClientTask]) -> list[Optional[ClientOutput]]:
        # longest tasks first (client size as the cost): idle workers pick up the short
        # ones at the end, which shortens the round when client sizes are skewed. A queued
        # evaluation of the previous round's global model takes its place in that order by
        # its measured cost, so it fills what would be idle time at the end of the round.
        sizes = [len(self.train_idx[t.cid]) for t in tasks]
        jobs: list[tuple[float, Union[int, PendingEval]]] = [(float(sizes[i]), i) for i in range(len(tasks))]
        jobs += [(self._eval_cost(), job) for job in self.queued]
        self.queued = []
        futures: dict[int, Future[bytes]] = {}
        for _, job in sorted(jobs, key=lambda j: -j[0]):
            if isinstance(job, PendingEval):
                job.submit()
            else:
                futures[job] = self.pool.submit(_run_task, pickle.dumps(tasks[job], protocol=pickle.HIGHEST_PROTOCOL))
        outs: list[Optional[ClientOutput]] = [pickle.loads(futures[i].result()) for i in range(len(tasks))]
        seconds = sum(o.train.get("seconds", 0.0) for o in outs if o is not None)
        if sum(sizes) and seconds > 0:
            self.sample_s = seconds / sum(sizes)
        return outs

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def resolve_workers(workers: Union[int, str], clients_per_round: int, device: str = "cpu") -> int:
    """``auto`` -> one worker per CPU core, at most one per client of a round; 0 if that is 1,
    and 0 on a GPU (one process owns the device and its copy of the data)."""
    if workers != "auto":
        return int(workers)
    if device != "cpu":
        return 0
    n = min(os.cpu_count() or 1, clients_per_round)
    return n if n > 1 else 0


def make_executor(runtime: ClientRuntime, workers: Union[int, str], threads: int,
                  clients_per_round: int) -> Executor:
    n = resolve_workers(workers, clients_per_round, runtime.cfg.execution.torch_device)
    if n > 0:
        try:
            shipped = ship_to_workers(runtime)
        except Exception as e:  # e.g. cloudpickle missing, or an object that cannot be pickled
            warnings.warn(f"protofl: the method or model defined in __main__ cannot be sent to worker "
                          f"processes ({type(e).__name__}: {e}); running clients in this process "
                          "instead (set execution.workers=0 to silence this)", RuntimeWarning, stacklevel=2)
            return SequentialExecutor(runtime, threads)
        return ProcessExecutor(runtime, n, shipped)
    return SequentialExecutor(runtime, threads)
