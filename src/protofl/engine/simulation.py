"""The round loop, written once.

For round r = 1..R:
  1. sample clients S_r; decide whose replies arrive (participation model)
  2. server: ``configure`` one message per sampled client
  3. clients (any backend): ``client_update``; personalized evaluation on eval rounds
  4. server: ``aggregate`` the replies that arrived, in client-id order
  5. evaluation of the global model, one metrics row, callbacks, checkpoint
With worker processes (``execution.overlap_eval``), step 5's evaluation of round t's global
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
from typing import Any, Iterable, Optional

import numpy as np
import torch

from .. import metrics as M
from ..algorithms.base import Algorithm, TaskInfo, weight_diversity
from ..config import Config, method
from ..data.build import build_federated
from ..data.federated import FederatedData
from ..errors import CheckpointError, ConfigError, InputError, OutputDirError, WriteError
from ..models import build_model, MODELS, num_params
from .backends import EXECUTORS
from .callbacks import Callback, JsonlWriter, progress_callback
from .checkpoint import load_checkpoint, save_checkpoint, save_json, save_text, save_torch
from .client import arch_kwargs, ClientRuntime
from .executor import ClientTask, resolve_workers
from .malloc import tune_malloc
from .participation import Participation
from .precision import check_precision
from .server import global_metrics, ServerContext
from .store import load_spilled, make_store, SpillStore, STATE_DIR
from .trackers import make_trackers
from .train import NonFiniteLossError
from .validate import check_reply

log = logging.getLogger("protofl")

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


def default_run_name(cfg: Config) -> str:
    feat = "" if cfg.features.name == "none" else f"-{cfg.features.name}"
    return (f"{cfg.algorithm.name}-{cfg.data.name}{feat}-{cfg.partition.name}{cfg.partition.num_clients}"
            f"-s{cfg.seed}-{cfg.fingerprint()}")


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.output.dir) / (cfg.output.name or default_run_name(cfg))


def read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():  # damaged bytes: an unreadable line
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill (or damaged): the rows before it count
                break
    return rows


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
    rows: list[dict]
    summary: dict
    server_state: Any = field(repr=False, default=None)
    # True when ``run(resume=True)`` found the run already complete and did no work
    already_complete: bool = False

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` indexed by round (needs pandas installed).

        Scalar metrics are columns; per-class lists (``gm_per_class``) stay one column of lists.
        """
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("RunResult.to_pandas() needs pandas: pip install pandas") from None
        return pd.DataFrame(self.rows).set_index("round")


def build_task(cfg: Config, fed: Optional[FederatedData] = None) -> tuple[FederatedData, Algorithm, TaskInfo]:
    """The federated data, the method object and the task facts for ``cfg``."""
    fed = fed if fed is not None else build_federated(cfg)
    ds = fed.dataset
    probe = build_probe(cfg, ds, arch_kwargs(cfg, 0))
    info = TaskInfo(num_classes=ds.num_classes, num_clients=fed.num_clients, feature_dim=probe.feature_dim,
                    input_shape=tuple(ds.input_shape), seed=cfg.seed, rounds=cfg.rounds)
    algo_cls, hp = method(cfg)
    return fed, algo_cls(hp, info), info


def build_probe(cfg: Config, ds, kwargs: dict):
    """The configured model for dataset ``ds``'s inputs; a model that cannot be built for
    them (an image model on 8x8 digits, an LSTM on images) is a :class:`ConfigError` that
    names the registered models that can take them."""
    try:
        return build_model(cfg.model.name, ds.input_shape, ds.num_classes, pretrained=cfg.model.pretrained, **kwargs)
    except (ValueError, RuntimeError) as e:  # a shape check, or torch refusing a layer's size
        if isinstance(e, ConfigError):
            raise
        raise model_mismatch(cfg, ds, str(e), kwargs) from e


def model_mismatch(cfg: Config, ds, why: str, kwargs: dict) -> ConfigError:
    """The error for a model that cannot take ``ds``'s inputs, with the models that can."""
    inputs = f"{ds.name}: {ds.kind} inputs of shape {tuple(ds.input_shape)}"
    own = {k: v for k, v in kwargs.items() if k in cfg.model.per_client}
    if own and cfg.model.per_client:  # the model fits; one client's own values do not
        return ConfigError("model.per_client", cfg.model.per_client,
                           f"the architecture of a client with {own}: {why} ({inputs})")
    fits = [n for n in models_for(ds) if n != cfg.model.name]
    return ConfigError("model.name", cfg.model.name,
                       f"{why} ({inputs}); models that take them: {', '.join(fits) or 'none registered'}")


def models_for(ds) -> list[str]:
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


@dataclass
class RoundRow:
    """A round's metrics row before its global-model evaluation is in: ``head``, then the
    GM metrics (a dict, or a pool task's handle with ``result()``), then ``tail``, then
    GA, ``final`` (the ``all_*`` metrics) and the timings."""

    head: dict[str, Any]
    gm: Any
    tail: dict[str, Any]
    final: dict[str, Any]
    do_eval: bool
    train_s: float
    eval_s: float
    wall_s: float

    def complete(self) -> dict[str, Any]:
        t = time.perf_counter()
        gm = self.gm if isinstance(self.gm, dict) else self.gm.result()
        waited = time.perf_counter() - t  # eval_s, wall_s: the driver's time, waiting included
        row = {**self.head, **gm, **self.tail}
        if self.do_eval:
            if "gm" in row:
                row["ga"] = row["gm"]
            elif "acc" in row:
                row["ga"] = row["acc"]  # no global model: mean of the local models on the test set
        row.update(self.final)
        row["train_s"] = self.train_s
        row["eval_s"] = self.eval_s + waited
        row["wall_s"] = self.wall_s + waited
        return row


class Simulation:
    def __init__(self, cfg: Config, callbacks: Iterable[Callback] = (), run_dir: Optional[Path] = None,
                 fed: Optional[FederatedData] = None, executor_factory=None, store=None) -> None:
        tune_malloc()
        check_precision(cfg.execution.precision, cfg.execution.device)  # a warning if bf16 will be slow
        self.cfg = cfg
        self.fed, self.algorithm, self.info = build_task(cfg, fed)
        if len(self.fed.train_idx) != cfg.partition.num_clients:
            raise ValueError(f"partition produced {len(self.fed.train_idx)} clients, "
                             f"config asks for {cfg.partition.num_clients}")
        self.runtime = ClientRuntime(cfg, self.fed, self.algorithm, self.info)
        self.server = ServerContext(cfg, self.algorithm, self.info)
        # the global predictor is evaluated where the test set is (execution.device)
        self.eval_server = (self.server if self.runtime.device.type == "cpu"
                            else ServerContext(cfg, self.algorithm, self.info, device=cfg.execution.device))
        self.model_bytes = sum(t.numel() * t.element_size() for t in self.server.init_weights().values())
        self.participation = Participation(cfg.participation, self.fed.num_clients, cfg.seed, self.fed.groups)
        self.user_callbacks = list(callbacks)
        self.dir = Path(run_dir) if run_dir is not None else run_dir_for(cfg)
        # per-client state between rounds: on this driver by default, within
        # execution.state_memory_mb and the rest in the run folder; injectable (a store has
        # get/put/snapshot/restore, see engine/store.py)
        self.store = store if store is not None else make_store(cfg, self.dir)
        # how client tasks run: in-process/pool by default; the Flower transport plugs in here
        self.executor_factory = executor_factory or EXECUTORS.get(cfg.execution.backend)
        self.executor_info: dict = {}  # what the executor says about itself (backend, actors, nodes)
        self.checkpointed = 0  # the round of the newest checkpoint on disk (0: none)

    # -- helpers -----------------------------------------------------------------------------
    def _is_eval(self, rnd: int, every: int) -> bool:
        return rnd == self.cfg.rounds or (every > 0 and rnd % every == 0)

    def evaluate_global(self, state: Any) -> dict[str, Any]:
        return global_metrics(self.algorithm, state, self.eval_server, self.runtime)

    def class_geometry(self, state: Any, last: bool) -> dict[str, Any]:
        """``proto_min_angle`` (degrees) of the method's class vectors, and in the last round
        their cosine matrix ``proto_cos``; nothing for methods without class vectors."""
        V = self.algorithm.class_vectors(state)
        if V is None:
            return {}
        angle, cos = M.class_geometry(V.detach().float().cpu().numpy())
        out: dict[str, Any] = {} if angle is None else {"proto_min_angle": angle}
        if last:
            out["proto_cos"] = cos
        return out

    def _checkpoint(self, rnd: int, state: Any, n_rows: int) -> None:
        save_checkpoint(self.dir / CHECKPOINT, {
            "round": rnd, "server_state": state, "client_states": self.store.snapshot(),
            "rows": n_rows, "fingerprint": self.cfg.fingerprint(), "algorithm": self.cfg.algorithm.name})
        self.checkpointed = rnd  # the round a --resume would continue from
        self.store.checkpointed()  # a SpillStore may now drop superseded state files

    def _write_static(self) -> None:
        counts = self.fed.class_counts()
        save_text(self.dir / "config.yaml", self.cfg.to_yaml())
        save_json(self.dir / "clients.json", {
            "num_clients": self.fed.num_clients, "num_classes": self.info.num_classes,
            "train_counts": counts.tolist(), "local_test_sizes": [len(t) for t in self.fed.test_idx],
            "class_names": self.fed.dataset.class_names,
            "groups": None if self.fed.groups is None else self.fed.groups.tolist(),
            **({} if self.fed.feature_groups is None else {"feature_groups": [
                self.fed.feature_group_names[g] for g in self.fed.feature_groups]})})

    # -- the loop ------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunResult:
        cfg, algo = self.cfg, self.algorithm
        prepare_run_dir(self.dir)
        ckpt_path = self.dir / CHECKPOINT
        start, rows = 1, []
        ck = load_checkpoint(ckpt_path, warn=_warn) if resume else None
        if ck is not None:
            if ck["fingerprint"] != cfg.fingerprint():
                raise CheckpointError(f"cannot resume {self.dir}: its checkpoint was written by a different "
                                 f"config (fingerprint {ck['fingerprint']} != {cfg.fingerprint()})")
            if ck["round"] > cfg.rounds:
                raise ConfigError("rounds", cfg.rounds, f"{self.dir} has already run {ck['round']} rounds; resume it "
                                  f"with rounds >= {ck['round']}, or start a fresh run without --resume")
            state = ck["server_state"]
            states = ck["client_states"]
            if not isinstance(self.store, SpillStore):  # states spilled to disk: read them back
                states = load_spilled(states, self.dir / STATE_DIR)
            self.store.restore(states)
            start = ck["round"] + 1
            self.checkpointed = ck["round"]
            rows = read_rows(self.dir / METRICS)[: ck["rows"]]
        else:
            state = algo.server_init(self.server)
            self.store.clear()  # a fresh run: no state files of an earlier one
        save_text(self.dir / METRICS, "".join(json.dumps(r) + "\n" for r in rows))
        self._write_static()

        callbacks: list[Callback] = [JsonlWriter(self.dir / METRICS)]
        progress = progress_callback(cfg.output.progress, cfg.output.log_every)
        if progress is not None:
            callbacks.append(progress)
        callbacks += make_trackers(cfg)
        callbacks += self.user_callbacks
        for cb in callbacks:
            cb.on_start({"name": self.dir.name, "rounds": cfg.rounds, "start_round": start, "dir": str(self.dir)})

        self.start_round = start  # the Flower executor tells the nodes (resume)
        executor = self.executor_factory(self)
        t_run = time.perf_counter()
        status, error = "complete", None
        pending: Optional[RoundRow] = None  # the previous round's row, its evaluation in the pool

        def emit(part: RoundRow) -> None:
            row = part.complete()
            rows.append(row)
            for cb in callbacks:
                cb.on_round(row)

        try:
            for rnd in range(start, cfg.rounds + 1):
                overlap = self.overlaps(rnd, executor, callbacks)
                state, part = self.run_round(rnd, state, executor, overlap)
                if pending is not None:
                    emit(pending)
                pending = part
                if not overlap:
                    pending = None
                    emit(part)
                    if self._is_checkpoint(rnd):
                        self._checkpoint(rnd, state, len(rows))
        except KeyboardInterrupt:  # a pending row is dropped: the checkpoint never counts it
            status, error = "interrupted", "interrupted by the user"
            raise
        except Exception as e:  # the run did not finish; say why (NonFiniteLossError says it all)
            status = "failed"
            error = str(e) if isinstance(e, NonFiniteLossError) else f"{type(e).__name__}: {e}"
            self._emit_quietly(emit, pending)  # the last finished round's row, as without overlap
            if isinstance(e, OSError) and not isinstance(e, (InputError, WriteError)):
                # a file that could not be written (a full disk): one line saying what is kept
                raise self.write_error(e, rows) from e
            raise
        finally:
            self.executor_info = executor.describe()
            executor.close()
            summary = self._summary(rows, status, error, time.perf_counter() - t_run)
            try:
                save_json(self.dir / SUMMARY, summary)
                weights = algo.model_weights(state) if status == "complete" and cfg.output.save_model else None
                if weights is not None:
                    save_torch(self.dir / "model.pt", weights)
            except OSError as e:
                if status == "complete":  # nothing else is being raised: this is the error
                    raise self.write_error(e, rows) from e
                log.warning("%s was not written: %s", e.filename, e.strerror or e)  # the run's own error matters more
            for cb in callbacks:
                cb.on_end(summary)
        return RunResult(self.dir, rows, summary, state)

    def write_error(self, e: OSError, rows: list[dict]) -> WriteError:
        """A failed read or write of the run's files (a full disk, a folder that went away) as
        one line: which file, why, and what is kept for ``--resume``."""
        what = e.filename or f"a file in {self.dir}"
        done = rows[-1]["round"] if rows else 0
        kept = (f"its checkpoint of round {self.checkpointed} is kept in {self.dir}: fix the cause and continue "
                f"with --resume" if self.checkpointed else
                f"no checkpoint was written yet: fix the cause and run it again")
        return WriteError(f"I/O error on {what}: {e.strerror or e}; the run stopped after round {done}; {kept}")

    def _is_checkpoint(self, rnd: int) -> bool:
        every = self.cfg.output.checkpoint_every
        return rnd == self.cfg.rounds or bool(every and rnd % every == 0)

    def overlaps(self, rnd: int, executor, callbacks: list[Callback]) -> bool:
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
    def _emit_quietly(emit, pending: Optional[RoundRow]) -> None:
        if pending is None:
            return
        try:
            emit(pending)
        except Exception as e:  # the pool may be gone too; the error being raised matters more
            log.warning("the row of round %s was not written: %s", pending.head.get("round"), e)

    def run_round(self, rnd: int, state: Any, executor, overlap: bool = False) -> tuple[Any, RoundRow]:
        """One round; its row is complete once ``RoundRow.complete()`` returns (with
        ``overlap``, the global model's evaluation then waits in ``executor``'s pool)."""
        cfg, algo = self.cfg, self.algorithm
        t0 = time.perf_counter()
        selected = self.participation.selected(rnd)
        arriving = set(self.participation.arriving(rnd, selected))
        msgs = {cid: algo.configure(state, rnd, cid, self.server) for cid in selected}
        do_eval = self._is_eval(rnd, cfg.eval.every)
        do_personal = cfg.eval.personal and do_eval  # PA on the local test sets
        full_test = do_personal and self._is_eval(rnd, cfg.eval.personal_every or cfg.eval.every)
        # a client whose reply will not arrive is not run: for the global model that is the
        # same as dropping its reply, and it saves the compute (its own state stays as is)
        tasks = [ClientTask(cid, rnd, msgs[cid], self.store.get(cid), do_personal, full_test)
                 for cid in selected if cid in arriving]
        results = executor.run(tasks)  # in task order; None = the reply was lost in transit
        lost = sum(out is None for out in results)
        # a reply that fails the server's checks is treated like a lost one: it never
        # reaches the aggregate and the client's persistent state does not advance
        rejected = {t.cid: self.check_reply(t, o) for t, o in zip(tasks, results) if o is not None}
        rejected = {cid: why for cid, why in rejected.items() if why}
        for cid, why in rejected.items():
            log.warning("round %d: rejected the reply of client %d: %s", rnd, cid, why)
        kept = [(t, o) for t, o in zip(tasks, results) if o is not None and t.cid not in rejected]
        tasks, outputs = [t for t, _ in kept], [o for _, o in kept]
        for t, out in zip(tasks, outputs):
            self.store.put(t.cid, out.state)
            # the store holds the new state now (in memory or on disk): drop the round's own
            # references, so states it spills leave memory and old states are freed
            t.state = out.state = None
        t_train = time.perf_counter() - t0
        replies = [(t.cid, out.reply) for t, out in zip(tasks, outputs)]
        state = algo.aggregate(state, rnd, replies, self.server)

        n = [o.train.get("samples", 0) for o in outputs]
        row: dict[str, Any] = {
            "round": rnd,
            "lr": cfg.training.lr * cfg.training.lr_decay ** (rnd - 1),
            "selected": len(selected),
            "arrived": len(replies),
            "lost": lost,
            "rejected": len(rejected),
            "train_loss": (float(np.average([o.train.get("loss", 0.0) for o in outputs], weights=n))
                           if sum(n) > 0 else float("nan")),
            "train_samples": int(sum(n)),
            "bytes_down": int(sum(m.nbytes() for m in msgs.values())),
            "bytes_up": int(sum(r.nbytes() for _, r in replies)),
        }
        if rejected:
            row["rejected_reasons"] = [f"client {cid}: {why}" for cid, why in rejected.items()]
        row.update(self.server.pop_logs())
        purity = self.cluster_purity(state)
        if purity is not None:
            row["cluster_purity"] = purity
        local = [algo.local_weights(r) for _, r in replies]  # ReBaFL eq. (24) over the local models that arrived
        if local and all(w is not None for w in local):
            row["weight_diversity"] = weight_diversity(local)
        t1 = time.perf_counter()
        gm: Any = {}
        tail: dict[str, Any] = {}
        if do_eval:
            gm = executor.evaluate_later(state) if overlap else self.evaluate_global(state)
            tail.update(self.class_geometry(state, last=rnd == cfg.rounds))
        personal = [o.eval for o in outputs if o.eval]
        if personal:
            tail.update(M.summarize_clients(personal))
            tail["evaluated_clients"] = len(personal)
        if full_test:  # the distribution of PA over clients (fairness), on the full evaluations
            tail["pa_clients"] = [[t.cid, o.eval["pa"]] for t, o in zip(tasks, outputs) if "pa" in (o.eval or {})]
        final = {}
        if rnd == cfg.rounds and cfg.eval.personal and cfg.eval.final_all_clients:
            final = self.evaluate_all_clients(state, executor)
        return state, RoundRow(row, gm, tail, final, do_eval, train_s=t_train,
                               eval_s=time.perf_counter() - t1, wall_s=time.perf_counter() - t0)

    def known_groups(self) -> Optional[np.ndarray]:
        """The client groups the scenario knows: the feature-skew group of each client
        (``rotate``, ``domains``, ``writers``), else the ``clustered`` partition's group;
        None when it knows none."""
        return self.fed.feature_groups if self.fed.feature_groups is not None else self.fed.groups

    def cluster_purity(self, state: Any) -> Optional[float]:
        """Purity of the method's client clustering (``Algorithm.cluster_assignment``)
        against :meth:`known_groups`; None when either is missing."""
        truth = self.known_groups()
        if truth is None:
            return None
        assignment = self.algorithm.cluster_assignment(state)
        return None if assignment is None else M.cluster_purity(np.asarray(assignment), np.asarray(truth))

    def check_reply(self, task: ClientTask, out) -> Optional[str]:
        """Why the server refuses this client output (engine/validate.py), or None."""
        if out.rejected:
            return out.rejected
        reason = check_reply(out.reply, task.msg, client_size=len(self.fed.train_idx[task.cid]),
                             model_bytes=self.model_bytes, patterns=self.algorithm.reply_arrays)
        return reason or self.algorithm.check_reply(out.reply, task.msg)

    def evaluate_all_clients(self, state: Any, executor) -> dict[str, Any]:
        """Every client's personalized model after the last round (``all_*`` metrics).

        Each client runs the local update of a round R + 1 from the final server state (its
        own stored state for stateful methods) and its personalized model is evaluated on
        the full and the local test sets. Nothing is aggregated or stored: the run's state
        is unchanged. Participation (dropout) does not apply: every client is evaluated.
        Clients run in chunks of one round's size, so memory stays that of a round.
        """
        rnd, algo = self.cfg.rounds + 1, self.algorithm
        cids = list(range(self.fed.num_clients))
        chunk = max(1, self.participation.m)
        personal: list[dict] = []
        for i in range(0, len(cids), chunk):
            tasks = [ClientTask(cid, rnd, algo.configure(state, rnd, cid, self.server), self.store.get(cid),
                                True, True) for cid in cids[i:i + chunk]]
            personal += [o.eval for o in executor.run(tasks) if o is not None and o.eval]
        if not personal:
            return {}
        out = {"all_" + k: v for k, v in M.summarize_clients(personal).items()}
        out["all_clients"] = len(personal)
        return out

    def execution_mode(self) -> dict:
        """How clients ran: the backend, and its workers (local) or actors and nodes (ray)."""
        if self.executor_info.get("backend", "local") != "local":
            return dict(self.executor_info)
        ex = self.cfg.execution
        if "executor" in self.executor_info:  # the batched executor (or its sequential fallback)
            return {"backend": "local", "workers": 0, "threads": ex.threads, "device": ex.device,
                    **self.executor_info}
        n = resolve_workers(ex.workers, self.participation.m, ex.device)
        out = {"backend": "local", "workers": n, "threads": 1 if n else ex.threads}
        return out if ex.device == "cpu" else {**out, "device": ex.device}

    def _summary(self, rows: list[dict], status: str, error: Optional[str], seconds: float) -> dict:
        final: dict[str, Any] = {}
        for row in rows:  # latest value of every metric
            final.update({k: v for k, v in row.items() if k not in ("round",)})
        gms = [r["gm"] for r in rows if "gm" in r]
        probe = self.runtime.models.get(arch_kwargs(self.cfg, 0))
        return {
            "status": status, "error": error,
            "rounds_completed": rows[-1]["round"] if rows else 0, "rounds": self.cfg.rounds,
            "algorithm": self.cfg.algorithm.name, "dataset": self.cfg.data.name, "seed": self.cfg.seed,
            "fingerprint": self.cfg.fingerprint(), "params": num_params(probe),
            "final": final, "best_gm": max(gms) if gms else None,
            "bytes_up_total": int(sum(r.get("bytes_up", 0) for r in rows)),
            "bytes_down_total": int(sum(r.get("bytes_down", 0) for r in rows)),
            "mean_round_s": float(np.mean([r["wall_s"] for r in rows])) if rows else None,
            "wall_s_this_session": seconds,
            "execution": self.execution_mode(),
            # per-client state held at the end: in memory, on disk (execution.state_memory_mb)
            "client_state": self.store.usage(),
            "torch": torch.__version__,
        }
