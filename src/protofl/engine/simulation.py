"""The round loop, written once.

For round r = 1..R (:meth:`Simulation.run_round`, Flower's ``Strategy.start`` in spirit):
  1. sample: the clients S_r, and whose replies will arrive (participation model)
  2. configure: the method's broadcast, once, and what each client alone receives
  3. run: ``client_update`` on every client whose reply will arrive (any backend);
     personalized evaluation on evaluation rounds
  4. validate: the server's checks of each reply (engine/validate.py)
  5. aggregate: the replies that passed, in client-id order (under ``privacy.mode: client``
     the private release of their updates instead, engine/privacy.py)
  6. observe: the global model's evaluation and the round's metrics row (round_metrics.py),
     callbacks, checkpoint
With worker processes (``execution.overlap_eval``), the evaluation of round t's global
model runs as a pool task while round t+1 trains, and round t's row is completed (and
handed to the callbacks, in order) once it is done; see :meth:`Simulation.overlaps`.
After the last round (``eval.final_all_clients``): every client's personalized model,
evaluated once (keys ``all_*`` in the last row).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast, Generator, Iterable, Optional, TYPE_CHECKING

import numpy as np
import torch

from .. import metrics as M
from ..algorithms.base import Diagnostics
from ..config import Config
from ..config.coerce import check_path_component
from ..data.federated import FederatedData
from ..errors import CheckpointError, ConfigError, InputError, os_error_text, OutputDirError, WriteError
from ..models import num_params
from ..run_folder import CHECKPOINT, CLIENTS, COMPLETE, CONFIG, METRICS, read_rows, SUCCEEDED, SUMMARY  # noqa: F401 (read_rows re-exported)
from .backends import EXECUTORS
from .callbacks import Callback, JsonlWriter, progress_callback
from .checkpoint import load_checkpoint, save_checkpoint, save_json, save_text, save_torch
from .client import ClientOutput, ClientRuntime, ClientTask
from .malloc import tune_malloc
from .participation import Participation
from .precision import check_precision
from .privacy import SEEDED_KEY, ServerPrivacy
from .round_metrics import RoundMetrics
from .server import global_metrics, ServerContext
from .store import make_store
from .task import Task
from .trackers import make_trackers
from .train import DIVERGED, NonFiniteLossError, round_lr, STOPPED
from .validate import check_reply, check_report, update_outliers

if TYPE_CHECKING:
    from .executor import Executor
    from .store import ClientStateStore

log = logging.getLogger("protofl")

# what a checkpoint holds: 2 = Records with typed model weights and groups (earlier: "w."
# prefixes), which a resume of an earlier checkpoint could not read back
CHECKPOINT_FORMAT = 2


def default_run_name(cfg: Config) -> str:
    feat = "" if cfg.features.name == "none" else f"-{cfg.features.name}"
    return (f"{cfg.algorithm.name}-{cfg.data.name}{feat}-{cfg.partition.name}{cfg.partition.num_clients}"
            f"-s{cfg.seed}-{cfg.fingerprint()}")


def spend(out: ClientOutput) -> dict[str, float]:
    """A client output's training numbers as the privacy ledger reads them: a report the
    server cannot read (engine/validate.py check_report) counts nothing, since only its
    sender's own data is at stake."""
    return out.train if check_report(None, out.train) is None else {}


def run_dir_for(cfg: Config) -> Path:
    """``output.dir/<run name>``; a name that would leave ``output.dir`` (``../x``, set
    after validation, e.g. from a label) is a :class:`ConfigError`, never a path."""
    name = cfg.output.name or default_run_name(cfg)
    check_path_component("output.name", name)
    return Path(cfg.output.dir) / name


def drive_steps(steps: Generator[list[ClientTask], Any, RunResult],
                run_tasks: Callable[[list[ClientTask]], list[Optional[ClientOutput]]]) -> RunResult:
    """Drive a run's :meth:`Simulation.steps` to its end: each batch of tasks it yields is
    answered with ``run_tasks(tasks)``; an error there is thrown into the run (which records
    it in its summary and raises it). Returns the run's :class:`RunResult`."""
    answer: Optional[list[Optional[ClientOutput]]] = None
    error: Optional[BaseException] = None
    while True:
        try:
            tasks = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            result: RunResult = done.value
            return result
        try:
            answer, error = run_tasks(tasks), None
        except BaseException as e:  # noqa: BLE001 - handed to the run
            answer, error = None, e


def where(execution: dict[str, Any]) -> str:
    """Where a run's clients train, in words, from its executor's ``describe()``: ``cpu
    (sequential executor)``, ``cuda (NVIDIA H100 80GB HBM3, batched executor)``, ``cpu, 2 worker
    processes``, ``a Ray cluster (4 actors)``, ``Flower SuperNodes``."""
    backend = execution.get("backend", "local")
    if backend == "ray":
        return f"a Ray cluster ({execution.get('actors')} actors)"
    if backend != "local":
        return f"{backend} nodes"
    if execution.get("workers"):
        return f"cpu, {execution['workers']} worker processes"
    device = execution.get("device", "cpu")
    name = ""
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device)) + ", "
    return f"{device} ({name}{execution.get('executor', 'sequential')} executor)"


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def prepare_run_dir(path: Path) -> None:
    """Create the run folder and make sure files can be written in it (one-line error if not)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".protofl-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(f"cannot write the run folder {path}: {e.strerror or e} "
                             f"(set output.dir to a writable folder)") from None


@dataclass
class RunResult:
    """What :func:`protofl.run` returns: the run folder, one metrics row per round, the summary."""

    dir: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    server_state: Any = field(repr=False, default=None)
    # True when ``run(resume=True)`` found the run already complete and did no work
    already_complete: bool = False

    def to_pandas(self) -> Any:
        """The rows as a ``pandas.DataFrame`` indexed by round (needs pandas installed).

        Scalar metrics are columns; per-class lists (``gm_per_class``) stay one column of lists.
        """
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("RunResult.to_pandas() needs pandas: pip install pandas") from None
        return pd.DataFrame(self.rows).set_index("round")


class Simulation:
    def __init__(self, cfg: Config, callbacks: Iterable[Callback] = (), run_dir: Optional[Path] = None,
                 fed: Optional[FederatedData] = None,
                 executor_factory: Optional[Callable[[Simulation], Executor]] = None,
                 store: Optional[ClientStateStore] = None,
                 task: Optional[Task] = None) -> None:
        """``task``: what :func:`protofl.api.check_task` built for ``cfg`` (built here when not
        given, from ``fed`` if that is)."""
        tune_malloc()
        check_precision(cfg.execution.precision, cfg.execution.torch_device)  # a warning if bf16 will be slow
        self.cfg = cfg
        self.task = task if task is not None else Task.build(cfg, fed)
        self.fed, self.algorithm, self.info = self.task.fed, self.task.algorithm, self.task.info
        self.runtime = ClientRuntime(self.task)
        self.server = ServerContext(self.task)
        # the global predictor is evaluated where the test set is (the training device)
        self.eval_server = (self.server if self.runtime.device.type == "cpu"
                            else ServerContext(self.task, device=self.runtime.device))
        self.model_bytes = sum(t.numel() * t.element_size() for t in self.server.init_weights().values())
        self.participation = Participation(cfg.participation, self.fed.num_clients, cfg.seed, self.fed.groups)
        # differential privacy (privacy.*): the round loop's hook, or None
        self.privacy = None if cfg.privacy.mode == "none" else ServerPrivacy(
            cfg, self.algorithm, self.participation, self.fed.class_counts(),
            self.runtime.models.live(self.task.arch(0))[0])
        self.user_callbacks = list(callbacks)
        self.dir = Path(run_dir) if run_dir is not None else run_dir_for(cfg)
        # per-client state between rounds: on this driver by default, within
        # execution.state_memory_mb and the rest in the run folder; injectable (a store has
        # get/put/snapshot/restore, see engine/store.py)
        self.store = store if store is not None else make_store(cfg, self.dir)
        # how client tasks run: in-process/pool by default; the Flower transport plugs in here
        self.executor_factory = executor_factory or EXECUTORS.get(cfg.execution.backend)
        self.execution: dict[str, Any] = {}  # how the clients ran (the executor's describe())
        self.checkpointed = 0  # the round of the newest checkpoint on disk (0: none)

    # -- helpers -----------------------------------------------------------------------------
    @property
    def personal_eval(self) -> bool:
        """Whether the clients' personalized models are evaluated (``eval.personal``). Not
        under client-level DP: those models were trained without noise, so their metrics
        are not private (only the released global model is)."""
        return self.cfg.eval.personal and (self.privacy is None or self.privacy.mode != "client")

    def noise_key(self, cid: int) -> Optional[bytes]:
        """Client ``cid``'s noise key for its task (privacy.noise: secret), or None."""
        return None if self.privacy is None else self.privacy.client_key(cid)

    def _is_eval(self, rnd: int, every: int) -> bool:
        return rnd == self.cfg.rounds or (every > 0 and rnd % every == 0)

    def evaluate_global(self, state: Any) -> dict[str, Any]:
        return global_metrics(self.algorithm, state, self.eval_server, self.runtime)

    def diagnostics(self) -> Diagnostics[Any]:
        """The method's optional hooks (:class:`~protofl.algorithms.base.Diagnostics`), or ones
        that answer None for a method without them."""
        return self.algorithm if isinstance(self.algorithm, Diagnostics) else Diagnostics()

    def _checkpoint(self, rnd: int, state: Any, n_rows: int) -> None:
        save_checkpoint(self.dir / CHECKPOINT, {
            "round": rnd, "server_state": state, "client_states": self.store.snapshot(),
            "rows": n_rows, "fingerprint": self.cfg.fingerprint(), "algorithm": self.cfg.algorithm.name,
            "format": CHECKPOINT_FORMAT, **({} if self.privacy is None else {"privacy": self.privacy.state()})})
        self.checkpointed = rnd  # the round a --resume would continue from
        self.store.checkpointed()  # a SpillStore may now drop superseded state files

    def _write_static(self) -> None:
        counts = self.fed.class_counts()
        save_text(self.dir / CONFIG, self.cfg.to_yaml())
        save_json(self.dir / CLIENTS, {
            "num_clients": self.fed.num_clients, "num_classes": self.info.num_classes,
            "train_counts": counts.tolist(), "local_test_sizes": [len(t) for t in self.fed.test_idx],
            "class_names": self.fed.dataset.class_names,
            "groups": None if self.fed.groups is None else self.fed.groups.tolist(),
            **({} if self.fed.feature_groups is None else {"feature_groups": [  # the names come with the groups
                cast("list[str]", self.fed.feature_group_names)[g] for g in self.fed.feature_groups]})})

    def _resume(self, ck: dict[str, Any]) -> tuple[Any, int, list[dict[str, Any]]]:
        """The server state, the first round to run and the rows kept, from checkpoint ``ck``."""
        cfg = self.cfg
        if ck.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"cannot resume {self.dir}: its checkpoint was written by an earlier protofl "
                                  f"(checkpoint format {ck.get('format', 1)}, this version reads "
                                  f"{CHECKPOINT_FORMAT}); start a fresh run without --resume")
        # a checkpoint is a file someone may have edited or forged: what is read of it is checked
        bad = [k for k, kind in (("fingerprint", str), ("round", int), ("rows", int)) if not isinstance(ck.get(k), kind)
               or isinstance(ck.get(k), bool)]
        bad += [k for k in ("server_state", "client_states", *(["privacy"] if self.privacy is not None else []))
                if k not in ck]
        if bad or ck["round"] < 0 or ck["rows"] < 0:
            raise CheckpointError(f"cannot resume {self.dir}: its checkpoint has no valid "
                                  f"{', '.join(bad) or 'round or rows'} (damaged, or not written by protofl); "
                                  "start a fresh run without --resume")
        if ck["fingerprint"] != cfg.fingerprint():
            raise CheckpointError(f"cannot resume {self.dir}: its checkpoint was written by a different "
                                  f"config (fingerprint {ck['fingerprint']} != {cfg.fingerprint()})")
        if ck["round"] > cfg.rounds:
            raise ConfigError("rounds", cfg.rounds, f"{self.dir} has already run {ck['round']} rounds; resume it "
                              f"with rounds >= {ck['round']}, or start a fresh run without --resume")
        self.store.resume(ck["client_states"], self.dir)
        if self.privacy is not None:  # the adaptive clip and the clients' ledgers
            self.privacy.restore(ck["privacy"])
        self.checkpointed = ck["round"]
        return ck["server_state"], ck["round"] + 1, read_rows(self.dir / METRICS)[: ck["rows"]]

    # -- the loop ------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunResult:
        """The whole run: :meth:`steps`, each round's client tasks run by the executor."""
        return drive_steps(self.steps(resume), lambda tasks: self.executor.run(tasks))

    def steps(self, resume: bool = False) -> Generator[list[ClientTask], list[Optional[ClientOutput]], RunResult]:
        """The run as a generator: it yields each batch of client tasks (a round's, and the
        chunks of the final evaluation of every client) and takes their outputs back; its
        value is the :class:`RunResult`. :meth:`run` answers with the executor; the packed
        driver (``engine/packed.py``) answers many runs' batches in one stack."""
        cfg, algo = self.cfg, self.algorithm
        prepare_run_dir(self.dir)
        ck = load_checkpoint(self.dir / CHECKPOINT, warn=_warn) if resume else None
        if ck is not None:
            state, start, rows = self._resume(ck)
        else:
            state = self.task.take_initial_state()
            state, start, rows = (algo.server_init(self.server) if state is None else state), 1, []
            self.store.clear()  # a fresh run: no state files of an earlier one
        save_text(self.dir / METRICS, "".join(json.dumps(r) + "\n" for r in rows))
        self._write_static()

        callbacks: list[Callback] = [JsonlWriter(self.dir / METRICS)]
        progress = progress_callback(cfg.output.progress, cfg.output.log_every)
        if progress is not None:
            callbacks.append(progress)
        callbacks += make_trackers(cfg)
        callbacks += self.user_callbacks
        self.start_round = start  # the Flower executor tells the nodes (resume)
        executor = self.executor = self.executor_factory(self)
        for cb in callbacks:
            cb.on_start({"name": self.dir.name, "rounds": cfg.rounds, "start_round": start, "dir": str(self.dir),
                         "where": where(executor.describe())})
        t_run = time.perf_counter()
        status, error = COMPLETE, None
        pending: Optional[RoundMetrics] = None  # the previous round's row, its evaluation in the pool

        def emit(metrics: RoundMetrics) -> None:
            row = metrics.row()
            rows.append(row)
            for cb in callbacks:
                cb.on_round(row)

        try:
            for rnd in range(start, cfg.rounds + 1):
                stop = self.privacy.stop_reason(rnd) if self.privacy is not None else None
                if stop is not None:  # privacy.target_epsilon: the rounds so far are the run
                    status, error = STOPPED, stop
                    log.info("%s", stop)
                    if pending is not None:
                        emit(pending)
                        pending = None
                    if rows and self.checkpointed < rnd - 1:
                        self._checkpoint(rnd - 1, state, len(rows))
                    break
                overlap = self.overlaps(rnd, executor, callbacks)
                state, metrics = yield from self.run_round(rnd, state, executor, overlap)
                if pending is not None:
                    emit(pending)
                pending = metrics
                if not overlap:
                    pending = None
                    emit(metrics)
                    if self._is_checkpoint(rnd):
                        self._checkpoint(rnd, state, len(rows))
        except KeyboardInterrupt:  # a pending row is dropped: the checkpoint never counts it
            status, error = "interrupted", "interrupted by the user"
            raise
        except Exception as e:  # the run did not finish; say why (NonFiniteLossError says it all)
            status = DIVERGED if isinstance(e, NonFiniteLossError) else "failed"
            error = str(e) if isinstance(e, NonFiniteLossError) else f"{type(e).__name__}: {e}"
            self._emit_quietly(emit, pending)  # the last finished round's row, as without overlap
            if isinstance(e, OSError) and not isinstance(e, (InputError, WriteError)):
                # a file that could not be written (a full disk): one line saying what is kept
                raise self.write_error(e, rows) from e
            raise
        finally:
            self.execution = executor.describe()
            executor.close()
            summary = self._summary(rows, status, error, time.perf_counter() - t_run)
            try:
                save_json(self.dir / SUMMARY, summary)
                weights = self.diagnostics().model_weights(state) \
                    if status in SUCCEEDED and cfg.output.save_model else None
                if weights is not None:
                    save_torch(self.dir / "model.pt", weights)
            except OSError as e:
                if status in SUCCEEDED:  # nothing else is being raised: this is the error
                    raise self.write_error(e, rows) from e
                log.warning("%s was not written: %s", e.filename, e.strerror or e)  # the run's own error matters more
            for cb in callbacks:
                cb.on_end(summary)
        return RunResult(self.dir, rows, summary, state)

    def write_error(self, e: OSError, rows: list[dict[str, Any]]) -> WriteError:
        """A failed read or write of the run's files (a full disk, a folder that went away) as
        one line: which file, why (a full disk says so, with its free space), and what is
        kept for ``--resume``."""
        what = e.filename or f"a file in {self.dir}"
        done = rows[-1]["round"] if rows else 0
        kept = (f"its checkpoint of round {self.checkpointed} is kept in {self.dir}: fix the cause and continue "
                f"with --resume" if self.checkpointed else
                "no checkpoint was written yet: fix the cause and run it again")
        return WriteError(f"I/O error on {what}: {os_error_text(e)}; the run stopped after round {done}; {kept}")

    def _is_checkpoint(self, rnd: int) -> bool:
        every = self.cfg.output.checkpoint_every
        return rnd == self.cfg.rounds or bool(every and rnd % every == 0)

    def overlaps(self, rnd: int, executor: Executor, callbacks: list[Callback]) -> bool:
        """Whether round ``rnd``'s global model is evaluated in the pool while the next round
        trains (``execution.overlap_eval``). Only when nothing needs its row before the next
        round starts: not the last round, not a checkpoint round (the checkpoint waits for
        its row), and every callback has ``immediate = False`` (one that may stop the run
        sees each row at once); and only with an executor that defers evaluations
        (``defers_eval``: worker processes). The numbers are the same either way."""
        return (self.cfg.execution.overlap_eval and executor.defers_eval
                and self._is_eval(rnd, self.cfg.eval.every) and not self._is_checkpoint(rnd)
                and not any(getattr(cb, "immediate", True) for cb in callbacks))

    @staticmethod
    def _emit_quietly(emit: Callable[[RoundMetrics], None], pending: Optional[RoundMetrics]) -> None:
        if pending is None:
            return
        try:
            emit(pending)
        except Exception as e:  # the pool may be gone too; the error being raised matters more
            log.warning("the row of round %s was not written: %s", pending.rnd, e)

    def run_round(self, rnd: int, state: Any, executor: Executor, overlap: bool = False
                  ) -> Generator[list[ClientTask], list[Optional[ClientOutput]], tuple[Any, RoundMetrics]]:
        """One round, as a generator: it yields the round's client tasks and takes their
        outputs (:meth:`steps`); its value is (new state, the round's :class:`RoundMetrics`),
        whose row is complete once :meth:`RoundMetrics.row` returns (with ``overlap``, the
        global model's evaluation then waits in ``executor``'s pool)."""
        cfg, algo, server = self.cfg, self.algorithm, self.server
        t0, c0 = time.perf_counter(), time.process_time()
        evaluating = self._is_eval(rnd, cfg.eval.every)
        personal = self.personal_eval and evaluating  # PA on the local test sets
        full_test = personal and self._is_eval(rnd, cfg.eval.personal_every or cfg.eval.every)
        metrics = RoundMetrics(rnd, round_lr(cfg.training, rnd, cfg.rounds), evaluating)
        # 1. sample; a client whose reply will not arrive is not run: for the global model that
        # is the same as dropping its reply, and it saves the compute (its own state stays as is)
        selected = self.participation.selected(rnd)
        arriving = set(self.participation.arriving(rnd, selected))
        # 2. configure: the broadcast once, and what each client alone receives
        shared = algo.configure(state, rnd, server)
        if self.privacy is not None:
            shared = self.privacy.broadcast(shared)
        own = {cid: algo.configure_client(state, rnd, cid, server) for cid in selected}
        tasks = [ClientTask(cid, rnd, shared, own[cid], self.store.get(cid), personal, full_test,
                            noise_key=self.noise_key(cid))
                 for cid in selected if cid in arriving]
        # 3. run (outputs in task order; None = the reply was lost in transit)
        outputs = yield tasks
        # 4. validate: a reply that fails the server's checks is treated like a lost one: it
        # never reaches the aggregate and the client's persistent state does not advance
        lost = sum(out is None for out in outputs)
        rejected = {t.cid: why for t, o in zip(tasks, outputs) if o is not None and (why := self.check_reply(t, o))}
        if self.privacy is None and not algo.heterogeneous_models:  # an update absurd against the round's others
            rejected.update(update_outliers([(t.cid, o.reply, t.msg) for t, o in zip(tasks, outputs)
                                             if o is not None and t.cid not in rejected],
                                            cfg.training.update_ratio_limit, algo.update_group))
        for cid, why in rejected.items():
            if self.privacy is None or self.privacy.mode == "sample":  # (client-level DP: the rejection is not private)
                log.warning("round %d: rejected the reply of client %d: %s", rnd, cid, why)
        kept = [(t, o) for t, o in zip(tasks, outputs) if o is not None and t.cid not in rejected]
        for t, o in kept:
            self.store.put(t.cid, o.state)
            # the store holds the new state now (in memory or on disk): drop the round's own
            # references, so states it spills leave memory and old states are freed
            t.state = o.state = None
        metrics.train_s = time.perf_counter() - t0
        # 5. aggregate
        replies = [(t.cid, o.reply) for t, o in kept]
        state = algo.aggregate(state, rnd, replies if self.privacy is None else
                               self.privacy.release(rnd, shared, kept, server), server)
        if self.privacy is not None:  # every client that trained spent, its reply kept or not
            server.log("epsilon", self.privacy.account([(t.cid, spend(o)) for t, o in zip(tasks, outputs)
                                                        if o is not None]))
            server.log("privacy_sigma", self.privacy.z)  # the noise multiplier (privacy.calibrate's choice)
            if self.privacy.secret is None:
                server.log(SEEDED_KEY, 1.0)
        # 6. observe
        diag = self.diagnostics()
        metrics.clients(len(selected), [shared.merged(own[cid]) for cid in selected], [r for _, r in replies],
                        [o for _, o in kept], lost, rejected, private=self.privacy is not None,
                        client_level=self.privacy is not None and self.privacy.mode == "client")
        local = [r.weights for _, r in replies]  # ReBaFL eq. (24) over the local models that arrived
        # (client-level DP: the updates are not private, only their noisy sum is)
        diverse = not algo.heterogeneous_models and all(local) and \
            (self.privacy is None or self.privacy.mode == "sample")
        metrics.server(server.pop_logs(), self.cluster_purity(state, diag), local if diverse else None)
        t1 = time.perf_counter()
        if evaluating:
            metrics.global_model(executor.evaluate_later(state) if overlap else self.evaluate_global(state),
                                 diag.class_vectors(state), last=rnd == cfg.rounds)
        metrics.personal([(t.cid, o.eval) for t, o in kept], full_test)
        if rnd == cfg.rounds and self.personal_eval and cfg.eval.final_all_clients:
            metrics.final((yield from self.evaluate_all_clients(state)))
        metrics.eval_s, metrics.wall_s = time.perf_counter() - t1, time.perf_counter() - t0
        metrics.cpu_s = time.process_time() - c0
        return state, metrics

    def known_groups(self) -> Optional[np.ndarray]:
        """The client groups the scenario knows: the feature-skew group of each client
        (``rotate``, ``domains``, ``writers``), else the ``clustered`` partition's group;
        None when it knows none."""
        return self.fed.feature_groups if self.fed.feature_groups is not None else self.fed.groups

    def cluster_purity(self, state: Any, diag: Diagnostics[Any]) -> Optional[float]:
        """Purity of the method's client clustering (``cluster_assignment``) against
        :meth:`known_groups`; None when either is missing."""
        truth = self.known_groups()
        if truth is None:
            return None
        assignment = diag.cluster_assignment(state)
        return None if assignment is None else M.cluster_purity(np.asarray(assignment), np.asarray(truth))

    def check_reply(self, task: ClientTask, out: ClientOutput) -> Optional[str]:
        """Why the server refuses this client output (engine/validate.py), or None."""
        if out.rejected:
            return out.rejected
        sent = task.msg
        size = len(self.fed.train_idx[task.cid])
        if self.privacy is not None:  # the client sends its released count n~_k (sample) or 1 (client)
            size = self.privacy.count_bound(size)
        reason = check_reply(out.reply, sent, client_size=size,
                             model_bytes=self.model_bytes, patterns=self.algorithm.reply_arrays)
        return reason or check_report(out.eval, out.train, self._group(task.cid)) or self.algorithm.check_reply(out.reply, sent)

    def _group(self, cid: int) -> Optional[str]:
        """The client's feature group (its ``pa:<group>``), or None without feature groups."""
        names = self.fed.feature_group_names
        if names is None:
            return None
        assert self.fed.feature_groups is not None  # set with their names (data/features.py)
        group: str = names[self.fed.feature_groups[cid]]
        return group

    def evaluate_all_clients(self, state: Any
                             ) -> Generator[list[ClientTask], list[Optional[ClientOutput]], dict[str, Any]]:
        """Every client's personalized model after the last round (``all_*`` metrics).

        Each client runs the local update of a round R + 1 from the final server state (its
        own stored state for stateful methods) and its personalized model is evaluated on
        the full and the local test sets. Nothing is aggregated or stored: the run's state
        is unchanged. Participation (dropout) does not apply: every client is evaluated.
        Clients run in chunks of one round's size, so memory stays that of a round.
        """
        rnd, algo = self.cfg.rounds + 1, self.algorithm
        stop = self.privacy.stop_reason(rnd, everyone=True) if self.privacy is not None else None
        if stop is not None:  # privacy.target_epsilon: this turn of every client would pass it
            log.info("%s", stop)
            return {}
        shared = algo.configure(state, rnd, self.server)
        if self.privacy is not None:  # the turn's clip C_t, or the calibrated sigma its DP-SGD must use
            shared = self.privacy.broadcast(shared)
        cids = list(range(self.fed.num_clients))
        chunk = max(1, self.participation.m)
        personal: list[dict[str, float]] = []
        spent: list[tuple[int, dict[str, float]]] = []
        for i in range(0, len(cids), chunk):
            tasks = [ClientTask(cid, rnd, shared, algo.configure_client(state, rnd, cid, self.server),
                                self.store.get(cid), True, True, noise_key=self.noise_key(cid))
                     for cid in cids[i:i + chunk]]
            outputs = yield tasks
            personal += [o.eval for t, o in zip(tasks, outputs) if o is not None and o.eval
                         and check_report(o.eval, None, self._group(t.cid)) is None]
            spent += [(t.cid, spend(o)) for t, o in zip(tasks, outputs) if o is not None]
        out: dict[str, Any] = {}
        if self.privacy is not None:  # every client trained once more: its spend counts
            out["epsilon"] = self.privacy.account(spent, count_round=False)
        if not personal:
            return out
        out.update({"all_" + k: v for k, v in M.summarize_clients(personal).items()})
        out["all_clients"] = len(personal)
        return out

    def _summary(self, rows: list[dict[str, Any]], status: str, error: Optional[str],
                 seconds: float) -> dict[str, Any]:
        final: dict[str, Any] = {}
        for row in rows:  # latest value of every metric
            final.update({k: v for k, v in row.items() if k not in ("round",)})
        gms = [r["gm"] for r in rows if "gm" in r]
        return {
            "status": status, "error": error,
            "rounds_completed": rows[-1]["round"] if rows else 0, "rounds": self.cfg.rounds,
            "algorithm": self.cfg.algorithm.name, "dataset": self.cfg.data.name, "seed": self.cfg.seed,
            "fingerprint": self.cfg.fingerprint(), "params": num_params(self.runtime.models.live(self.task.arch(0))[0]),
            "final": final, "best_gm": max(gms) if gms else None,
            "bytes_up_total": int(sum(r.get("bytes_up", 0) for r in rows)),
            "bytes_down_total": int(sum(r.get("bytes_down", 0) for r in rows)),
            "mean_round_s": float(np.mean([r["wall_s"] for r in rows])) if rows else None,
            "wall_s_this_session": seconds,
            "execution": self.execution,
            # per-client state held at the end: in memory, on disk (execution.state_memory_mb)
            "client_state": self.store.usage(),
            "torch": torch.__version__,
        }
