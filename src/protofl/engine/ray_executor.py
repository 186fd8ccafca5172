"""The Ray execution backend: a round's client tasks run on actors of a Ray cluster.

``execution.backend: ray``. The driver (the process running :class:`Simulation`) keeps
the round loop, sampling, aggregation, evaluation, metrics and checkpoints; only the
clients' turns (``ClientRuntime.run``) go to the cluster. Outputs come back in task order,
so aggregation -- and therefore every float -- is the same as a sequential run:

* one actor per ``client_resources`` share of the cluster's CPUs (``actors: auto``),
  spread over the nodes, each with ``execution.threads`` intra-op threads (default 1,
  as the process pool: the numbers do not depend on the core count);
* the federated data goes once through the object store (``data: ship``; actors on one
  node map the same copy, as the process pool maps shared memory), or every node loads it
  from its own disk (``data: node``: ``$PROTOFL_DATA`` of the node's ``ray start``, else
  ``data.root``); the partition is deterministic, and each actor checks that its copy
  gives the driver's partition;
* a tensor shared by many clients' messages (FedAvg's global weights) is put in the
  object store once per round and fetched once per node; tasks are submitted longest
  first to whichever actor is idle;
* per-client state is sent with the task and comes back with the reply (``state:
  driver``), or stays in the cluster (``state: cluster``, :class:`~.store.ClusterStore`).

Faults: a task whose actor or node died is submitted again to another live actor, up to
``retries`` times; every random stream of a client turn is rebuilt from (seed, purpose,
round, client), so the retry gives the same bits. After that the reply counts as lost
(the engine's dropout path) with one log line naming the client and the node. An
exception raised by the client's own code (e.g. a diverged loss) is re-raised as is.

Addresses are explicit ``host:port`` (never ``auto``): before ``ray.init`` the address
is checked to answer like a Ray head (its GCS speaks gRPC), so a wrong one fails in one
line within seconds instead of Ray's minute of retries.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections import deque
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np
import torch

from ..data.build import build_federated
from ..data.dataset import Dataset
from ..data.federated import FederatedData
from ..errors import ConfigError
from ..messages import Record
from .client import ClientOutput, ClientRuntime, ClientTask
from .executor import Executor
from .malloc import tune_malloc
from .task import Task

if TYPE_CHECKING:
    from ..algorithms.base import Algorithm, TaskInfo
    from ..config import Config
    from .simulation import Simulation

STARTUP_TIMEOUT = 180.0  # seconds for all actors to be placed and ready
CONNECT_TIMEOUT = 5.0  # seconds for the address check

# an HTTP/2 client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS)
# answers with a SETTINGS frame of its own
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_address(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise ConfigError (one line) unless ``host:port`` answers like a Ray head's GCS."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = s.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except OSError as e:
        raise ConfigError("execution.address", address,
                          f"no Ray cluster answers there ({e.strerror or type(e).__name__}); start one with "
                          "`ray start --head --port=PORT` and give its host:PORT") from None
    if len(head) < 9 or head[3] != 0x4:
        raise ConfigError("execution.address", address,
                          "something listens there, but it is not a Ray head node (its GCS port)")


def partition_digest(fed: FederatedData) -> str:
    """A short hash of the client split and the labels: nodes that load data must agree."""
    h = hashlib.sha256()
    for idx in (*fed.train_idx, *fed.test_idx):
        h.update(np.ascontiguousarray(idx, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(fed.dataset.train_labels.tobytes())
    return h.hexdigest()[:16]


def _pack(fed: FederatedData) -> dict[str, Any]:
    """FederatedData with numpy arrays for tensors: read zero-copy from the object store.
    Every field travels: the split and, under feature skew, the load-time transform and the
    feature groups (a node without them would train on other inputs than the driver's)."""
    ds = {f.name: getattr(fed.dataset, f.name) for f in fields(Dataset)}
    ds = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in ds.items()}
    return {"dataset": ds, **{f.name: getattr(fed, f.name) for f in fields(FederatedData) if f.name != "dataset"}}


def _unpack(packed: dict[str, Any]) -> FederatedData:
    with warnings.catch_warnings():  # object-store buffers are read-only; the engine never writes them
        warnings.simplefilter("ignore", UserWarning)
        ds: dict[str, Any] = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                              for k, v in packed["dataset"].items()}
    return FederatedData(Dataset(**ds), **{k: v for k, v in packed.items() if k != "dataset"})


SHARE_BYTES = 100 * 1024  # tensors this big go to the object store once per round (Ray inlines smaller args)


class _Shipped:
    """A message whose big tensors travel as object-store references (fetched by the actor):
    ``record`` holds empty tensors in their places."""

    def __init__(self, record: Record, refs: dict[str, Any]) -> None:
        self.record, self.refs = record, refs


def _ship(ray: Any, msg: Record, cache: dict[int, Any]) -> Union[_Shipped, Record]:
    """``msg`` with each big tensor replaced by a reference, put once per round per tensor.

    Every client's message holds the round's broadcast (FedAvg's global weights are the
    same tensors in every client's Record): each distinct tensor crosses to a node once.
    """
    refs: dict[str, Any] = {}

    def swap(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.numel() * t.element_size() < SHARE_BYTES:
            return t
        if id(t) not in cache:
            cache[id(t)] = (t, ray.put(t))  # the tensor is kept alive: its id stays unique
        refs[name] = cache[id(t)][1]
        return t.new_empty(0)

    skeleton = msg.map(swap)
    return _Shipped(skeleton, refs) if refs else msg


class FetchError(RuntimeError):
    """An actor could not fetch a task's inputs from the object store (its node is failing)."""


def _land(ray: Any, msg: Union[_Shipped, Record]) -> Record:
    if not isinstance(msg, _Shipped):
        return msg
    try:
        values = ray.get(list(msg.refs.values()))
    except Exception as e:  # the node's object store went away (raylet killed): not the client's fault
        raise FetchError(f"{type(e).__name__}: {e}") from None
    fetched = dict(zip(msg.refs, values))
    return msg.record.map(lambda name, t: fetched.get(name, t))


class ClientActor:
    """One per actor process: a ClientRuntime over the node's copy of the data."""

    def __init__(self, cfg: Config, data: Optional[dict[str, Any]], algorithm: Algorithm[Any], info: TaskInfo,
                 digest: str, threads: int) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.where = (ctx.get_node_id(), ray.util.get_node_ip_address(), os.getpid())
        # a set-up error, reported by node() as plain values (Ray would wrap a raised one in a traceback)
        self.error: Optional[tuple[str, Any]] = None
        try:
            self._setup(cfg, data, algorithm, info, digest, threads)
        except ConfigError as e:
            self.error = ("ConfigError", (e.key, str(e.value), e.allowed))
        except Exception as e:
            self.error = (type(e).__name__, str(e))

    def _setup(self, cfg: Config, data: Optional[dict[str, Any]], algorithm: Algorithm[Any], info: TaskInfo,
               digest: str, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        tune_malloc()
        if data is not None:
            fed = _unpack(data)
        else:  # data: node -- this node's files ($PROTOFL_DATA of its `ray start`, else data.root)

            root = os.environ.get("PROTOFL_DATA") or cfg.data.root
            fed = build_federated(cfg.replace(**{"data.root": root}))
            if partition_digest(fed) != digest:
                raise ConfigError("execution.data", "node", f"the data under {root!r} on node "
                                  f"{socket.gethostname()} gives another split than the driver's")
        self.runtime = ClientRuntime(Task(cfg, fed, algorithm, info))

    def node(self) -> tuple[tuple[str, str, int], Optional[tuple[str, Any]]]:
        """(node id, node IP, pid), and the error that stopped the actor's set-up, if any."""
        return self.where, self.error

    def run(self, cid: int, rnd: int, msg: Union[_Shipped, Record], state: Optional[Record], evaluate: bool,
            full_test: bool, noise_key: Optional[bytes] = None) -> ClientOutput:
        import ray

        return self.runtime.run(ClientTask(cid, rnd, _land(ray, msg), None, state, evaluate, full_test, noise_key))

    def run_split(self, cid: int, rnd: int, msg: Union[_Shipped, Record], state: Optional[Record], evaluate: bool,
                  full_test: bool, noise_key: Optional[bytes] = None) -> tuple[ClientOutput, Optional[Record]]:
        """(output without its state, state): the state stays in this node's object store."""
        import ray

        out = self.runtime.run(ClientTask(cid, rnd, _land(ray, msg), None, state, evaluate, full_test, noise_key))
        new_state, out.state = out.state, None
        return out, new_state


def connect(ray: Any, address: Optional[str]) -> tuple[bool, Optional[str]]:
    """Join ``address`` or start a private local Ray; returns (we called ray.init, temp dir)."""
    if ray.is_initialized():  # a Python user connected already: use that session as it is
        return False, None
    opts: dict[str, Any] = dict(logging_level=logging.ERROR, log_to_driver=False)
    with warnings.catch_warnings():  # Ray's tip about a future default of GPU visibility
        warnings.simplefilter("ignore", FutureWarning)
        if address:
            check_address(address)
            ray.init(address=address, **opts)
            return True, None
        tmp = tempfile.mkdtemp(prefix="protofl-ray-")  # a private session: never the machine's shared one
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, _temp_dir=tmp, **opts)
        return True, tmp


def resolve_actors(actors: Union[str, int], cluster_cpus: float, num_cpus: float, clients_per_round: int) -> int:
    """``auto`` -> as many actors as the cluster's CPUs hold, at most one per client of a round."""
    fit = int(cluster_cpus // num_cpus + 1e-9)
    if actors == "auto":
        return max(1, min(fit, clients_per_round))
    if int(actors) > fit:
        raise ConfigError("execution.actors", actors, f"the cluster has {cluster_cpus:g} CPUs: at most {fit} "
                          f"actors of {num_cpus:g} CPU(s) each fit")
    return int(actors)


class RayExecutor(Executor):
    def __init__(self, sim: Simulation, log: Callable[[str], None] = _stderr) -> None:
        import ray

        self.ray, self.log = ray, log
        cfg, ex = sim.cfg, sim.cfg.execution
        self.cluster_state = ex.state == "cluster"
        self.retries = ex.retries
        self.sizes = [len(ix) for ix in sim.fed.train_idx]
        t0 = time.perf_counter()
        self.actors: list[Any]  # Ray's handles of ClientActor
        self.initialized, self.tmp, self.actors = False, None, []
        self.initialized, self.tmp = connect(ray, ex.address)
        try:
            res = ex.client_resources
            n = resolve_actors(ex.actors, ray.cluster_resources().get("CPU", 0.0), res["num_cpus"],
                               sim.participation.m)
            data = ray.put(_pack(sim.fed)) if ex.data == "ship" else None
            cls = ray.remote(ClientActor).options(num_cpus=res["num_cpus"], num_gpus=res["num_gpus"],
                                                  max_restarts=0, max_task_retries=0, scheduling_strategy="SPREAD")
            self.threads = threads = ex.threads or max(1, int(res["num_cpus"]))
            self.actors = [cls.remote(cfg, data, sim.algorithm, sim.info, partition_digest(sim.fed), threads)
                           for _ in range(n)]
            try:
                ready = ray.get([a.node.remote() for a in self.actors], timeout=STARTUP_TIMEOUT)
            except ray.exceptions.GetTimeoutError:
                raise ConfigError("execution.actors", n, f"the cluster did not start {n} actors with {res} "
                                  f"each within {STARTUP_TIMEOUT:.0f} s") from None
            for (_, ip, _), error in ready:
                if error is not None:  # e.g. a node whose data gives another split
                    if error[0] == "ConfigError":
                        raise ConfigError(*error[1])
                    raise RuntimeError(f"a Ray actor on node {ip} failed to start: {error[0]}: {error[1]}")
            self.where = [where for where, _ in ready]
        except BaseException:
            self.close()
            raise
        self.n, self.live = n, list(range(n))
        self.startup_s = time.perf_counter() - t0
        self.tasks_per_node: dict[str, int] = {}
        self.lost_total = self.retried_total = 0
        self.overheads: list[float] = []  # per task: wall time at the driver minus the client's own time

    # -- description -----------------------------------------------------------------------------
    def _node(self, a: int) -> str:
        node_id, ip, _ = self.where[a]
        return f"{ip} ({node_id[:8]})"

    def describe(self) -> dict[str, Any]:
        """For the run summary: backend, actors, nodes, start-up time, where tasks ran."""
        return {"backend": "ray", "actors": self.n, "nodes": len({w[0] for w in self.where}),
                "threads": self.threads, "startup_s": round(self.startup_s, 3),
                "tasks_per_node": dict(self.tasks_per_node), "retried": self.retried_total,
                "lost": self.lost_total,
                "task_overhead_ms": round(1e3 * float(np.median(self.overheads)), 2) if self.overheads else None}

    # -- a round -----------------------------------------------------------------------------------
    def run(self, tasks: list[ClientTask]) -> list[Optional[ClientOutput]]:
        ray = self.ray
        exc = ray.exceptions
        shared: dict[int, Any] = {}  # id(tensor) -> (tensor, its ObjectRef): one put per round
        msgs = [_ship(ray, t.msg, shared) for t in tasks]

        results: list[Optional[ClientOutput]] = [None] * len(tasks)
        states = [t.state for t in tasks]
        attempts = [0] * len(tasks)
        pending = deque(sorted(range(len(tasks)), key=lambda i: -self.sizes[tasks[i].cid]))
        idle = deque(self.live)
        # ref of the output -> (task, actor, state ref, submitted at)
        inflight: dict[Any, tuple[int, int, Any, float]] = {}
        while pending or inflight:
            while pending and idle:
                i, a = pending.popleft(), idle.popleft()
                t = tasks[i]
                args = (t.cid, t.rnd, msgs[i], states[i], t.evaluate, t.full_test, t.noise_key)
                if self.cluster_state:
                    out_ref, state_ref = self.actors[a].run_split.options(num_returns=2).remote(*args)
                else:
                    out_ref, state_ref = self.actors[a].run.remote(*args), None
                inflight[out_ref] = (i, a, state_ref, time.perf_counter())
            if not inflight:  # no live actor left: the rest of the round is lost
                for i in pending:
                    self._lost(tasks[i], "no live actor is left")
                break
            ready, _ = ray.wait(list(inflight), num_returns=1)
            for ref in ready:
                i, a, state_ref, t_submit = inflight.pop(ref)
                t = tasks[i]
                try:
                    out = ray.get(ref)
                except exc.RayTaskError as e:
                    if not isinstance(e.cause, FetchError):  # the client's own code raised: as in-process
                        raise (e.cause if isinstance(e.cause, Exception) else e) from None
                    if a in self.live:  # the actor's node is failing
                        self.live.remove(a)
                    attempts[i] += 1
                    self._retry_or_lose(i, t, attempts, pending, f"inputs not fetched on node {self._node(a)}")
                    continue
                except exc.ObjectLostError as e:
                    if self.cluster_state and states[i] is not None and not isinstance(states[i], Record):
                        # its state lived on a node that died: the client starts afresh
                        self.log(f"[protofl ray] client {t.cid}, round {t.rnd}: its state was lost with the "
                                 "node that held it; the client starts from a fresh state")
                        states[i] = None
                        idle.append(a)
                    elif a in self.live:  # the reply was on a node that died
                        self.live.remove(a)
                    attempts[i] += 1
                    self._retry_or_lose(i, t, attempts, pending, f"{type(e).__name__} on node {self._node(a)}")
                    continue
                except exc.RayError as e:  # the actor or its node died
                    if a in self.live:
                        self.live.remove(a)
                    attempts[i] += 1
                    self._retry_or_lose(i, t, attempts, pending, f"{type(e).__name__} on node {self._node(a)}")
                    continue
                # what Ray adds to the client's own time: transfers, (de)serialization, scheduling
                self.overheads.append(time.perf_counter() - t_submit - out.train.get("seconds", 0.0))
                if self.cluster_state:
                    out.state = state_ref
                results[i] = out
                node = self._node(a)
                self.tasks_per_node[node] = self.tasks_per_node.get(node, 0) + 1
                idle.append(a)
        return results

    def _retry_or_lose(self, i: int, t: ClientTask, attempts: list[int], pending: deque[int], why: str) -> None:
        if attempts[i] <= self.retries and self.live:
            self.retried_total += 1
            pending.appendleft(i)
        else:
            self._lost(t, f"{why}; {attempts[i]} attempt(s)")

    def _lost(self, t: ClientTask, why: str) -> None:
        self.lost_total += 1
        self.log(f"[protofl ray] client {t.cid}, round {t.rnd}: reply lost ({why})")

    def close(self) -> None:
        """Stop this run's actors; leave the cluster (stop it if it is our private one)."""
        ray = self.ray
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already dead
                pass
        self.actors = []
        if self.initialized and ray.is_initialized():
            ray.shutdown()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
