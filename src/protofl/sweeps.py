"""Sweeps: every combination of a grid of config values x seeds, as one table.

    protofl sweep configs/digits.yaml --grid training.lr=0.01,0.05 partition.beta=0.1,0.5 --seeds 0,1,2

* Any dotted key can be swept, ``algorithm.name`` included (switching a component drops
  the old one's parameters, as on the command line); ``--methods`` crosses the grid with
  methods given in ``compare``'s syntax, e.g. ``"fedavg,fedprox(mu=0.1)"``.
* Each run's folder is named by its label, seed and a fingerprint of its *whole* config
  (rounds included): a run complete there is skipped, and so is a run that diverged there
  (a NaN/inf loss: the same config diverges again in the same round; it is left out of
  the table and named), a run cut short (killed, interrupted) continues from its last
  checkpoint, and a changed config gets a new folder.
* Several runs go at once when the machine has idle cores: at most the CPU count divided
  by the cores one run keeps busy (its worker processes, or its threads). This process
  runs runs itself and worker processes take the others from the same queue, each run
  after run, so a process's start-up is paid once per worker, never per run; by default
  a worker starts only when a core is idle and the runs left outweigh its start-up, so
  the default is never slower than one run at a time (benchmarks/timing.md, "Sweep:
  runs at once").
* It ends like ``compare``: one row per grid point, mean ± std over seeds, in
  ``sweep.md`` and ``sweep.csv``.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import re
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from . import api
from .api import grid_config, run, split_top_level
from .config import ceil_fraction, Config, ConfigError, from_dict, parse_override
from .engine.callbacks import Callback, OverallProgress, short_metrics
from .engine.checkpoint import save_text
from .engine.executor import resolve_workers
from .run_folder import CHECKPOINT, COMPLETE, DIVERGED, SUCCEEDED
from .engine.trackers import prepare_trackers
from .engine.train import NonFiniteLossError

SWEEP = "sweep"


@dataclass
class SweepRun:
    label: str
    seed: int
    cfg: Config
    dir: Path


def parse_grid(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["training.lr=0.01,0.05", "algorithm.name=fedavg,fedprox"]`` -> {key: [values]}."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, _ = parse_override(item)  # checks the key=value form
        text = item.partition("=")[2]
        values = [parse_override(f"{key}={v}")[1] for v in split_top_level(text)]
        if not values:
            raise ConfigError(f"--grid {key}", text, "expected comma-separated values, e.g. training.lr=0.01,0.05")
        if key in grid:
            raise ConfigError(f"--grid {key}", text, "each key must appear once")
        grid[key] = values
    return grid


def _short_keys(keys: list[str]) -> dict[str, str]:
    """The last part of each dotted key where that is unambiguous (``lr`` for training.lr,
    ``algorithm`` for algorithm.name)."""
    last = [k.split(".")[-2] if k.endswith(".name") and "." in k else k.split(".")[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def _folder(label: str) -> str:
    return re.sub(r"[^\w.=+-]+", "_", label).strip("_") or "run"


def full_fingerprint(cfg: Config) -> str:
    """Everything that determines a finished run's results, its number of rounds included."""
    return cfg.fingerprint(ignore=("output", "execution"))


def plan(cfg: Config, grid: dict[str, list[Any]], seeds: list[int], out: Path,
         methods: Optional[dict[str, dict]] = None) -> list[SweepRun]:
    """Every (method x grid point x seed) as a validated config with its run folder."""
    keys = list(grid)
    short = _short_keys(keys)
    runs: list[SweepRun] = []
    method_items: list[tuple[Optional[str], Optional[dict]]] = list(methods.items()) if methods else [(None, None)]
    for mlabel, method in method_items:
        for combo in itertools.product(*(grid[k] for k in keys)):
            ov = dict(zip(keys, combo))
            parts = ([mlabel] if mlabel is not None else []) + [f"{short[k]}={v}" for k, v in ov.items()]
            label = " ".join(str(p) for p in parts) or cfg.algorithm.name
            try:
                point = cfg.replace(**ov)
            except ConfigError as e:
                raise ConfigError(e.key, e.value, f"{e.allowed} (grid point: {label})") from None
            for seed in seeds:
                c = grid_config(point, method, seed, label) if method is not None else point.replace(seed=seed)
                c.output.dir = str(out)
                c.output.name = f"{_folder(label)}-s{seed}-{full_fingerprint(c)}"
                runs.append(SweepRun(label, seed, c, out / c.output.name))
    names = [r.dir.name for r in runs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError("--grid", dup, "two grid points give the same config; drop the duplicate value")
    return runs


def cores_per_run(cfg: Config) -> int:
    """The cores one run keeps busy: its worker processes (``execution.workers``; auto is one
    per core, at most one per client of a round), each with one thread; without workers, its
    intra-op threads (``execution.threads``; 0 is torch's default, every core). A run on a
    GPU counts as the whole machine (one process should own the device)."""
    ex, cores = cfg.execution, os.cpu_count() or 1
    if ex.torch_device != "cpu" or ex.backend != "local":
        return cores
    p = cfg.participation
    m = p.clients_per_round or ceil_fraction(p.fraction, cfg.partition.num_clients)
    workers = resolve_workers(ex.workers, m, ex.torch_device)
    if workers > 0:
        return workers
    return cores if ex.threads == 0 else ex.threads


def default_jobs(runs: list[SweepRun]) -> int:
    """Runs at once: the CPU count divided by the cores the busiest run keeps busy (at
    least 1). Runs that use every core themselves (``workers: auto`` on a machine with as
    many clients per round as cores) therefore go one after another."""
    if not runs:
        return 1
    per_run = max(cores_per_run(r.cfg) for r in runs)
    return max(1, min(len(runs), (os.cpu_count() or 1) // per_run))


def _run_child(raw: dict, run_dir: str) -> dict:
    """One run in a worker process of the sweep (each worker process takes one run after
    another, so the start-up cost of a process is paid once per worker, not per run)."""
    return _run_here(from_dict(raw), Path(run_dir))


def _run_here(cfg: Config, run_dir: Path, callbacks: Iterable[Callback] = ()) -> dict:
    """One run of the sweep; a diverged run is reported in its summary, not raised."""
    try:
        return run(cfg, resume=True, callbacks=callbacks, run_dir=run_dir).summary
    except NonFiniteLossError as e:
        return {"status": DIVERGED, "error": str(e)}


def _outcome(summary: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in short_metrics(summary.get("final", {})).items() if k != "loss")


def sweep(cfg: Config, grid: dict[str, list[Any]], seeds: list[int], out: Path,
          methods: Optional[dict[str, dict]] = None, jobs: Optional[int] = None,
          callbacks: Iterable[Callback] = (), log: Callable[[str], None] = print) -> tuple[list[dict], Path, list[SweepRun]]:
    """Run every grid point x seed not complete in ``out``; returns (table rows, out, failed runs).

    Every grid point is resolved and checked (:func:`protofl.api.check_runs`: names, keys,
    values, and whether data, partition, model and method fit together) before the first
    run starts. Run k of the grid is logged as ``[run k/N]`` whenever it starts and as
    ``[done d/N] run k/N ...`` when it ends.

    ``jobs``: runs at once. This process runs runs itself, and up to ``jobs - 1`` worker
    processes take the others from the same queue, each run after run (without per-round
    progress, and without ``callbacks``). ``jobs=1``: all here, one after another, with
    ``callbacks``. ``jobs=None`` (default): at most :func:`default_jobs`, and a worker
    process starts only once it pays (:func:`worker_pays`): a core is idle and the runs
    left outweigh the worker's start-up, so the default is never slower than one at a
    time; with ``callbacks``, one at a time.
    """
    startup_s = startup_estimate()
    out = Path(out)
    runs = plan(cfg, grid, seeds, out, methods)
    number = {id(r): k for k, r in enumerate(runs, start=1)}
    N = len(runs)
    ended = {id(r): s for r in runs if (s := api.ended(r.dir, r.cfg.rounds)) is not None}
    todo = [r for r in runs if id(r) not in ended]
    api.check_runs((r.label, r.cfg) for r in todo)
    out.mkdir(parents=True, exist_ok=True)
    save_text(out / "sweep.yaml", cfg.to_yaml())
    progress = OverallProgress(N)
    failed: list[SweepRun] = []
    for r in runs:
        if id(r) in ended:
            summary = ended[id(r)]
            # (diverged, or stopped at its privacy target: its status and why)
            how = COMPLETE if summary.get("status") == COMPLETE else f"{summary.get('status')} ({summary.get('error')})"
            log(f"[skip {number[id(r)]}/{N}] {r.label} seed {r.seed}: {how} in {r.dir}")
            progress.finished(ran=False)
            if summary.get("status") == DIVERGED:
                failed.append(r)
    eager = jobs is not None
    if jobs is None:
        jobs = 1 if list(callbacks) else default_jobs(todo)
    jobs = min(max(1, int(jobs)), len(todo)) or 1
    queue: Optional[_SharedQueue] = None

    def started(r: SweepRun) -> str:
        how = "resume" if (r.dir / CHECKPOINT).exists() else "run"
        at_once = queue.active if queue is not None else 1
        return f"[{how} {number[id(r)]}/{N}] {r.label} seed {r.seed} -> {r.dir}{progress.eta(at_once)}"

    def finished(r: SweepRun, summary: dict, seconds: float) -> None:
        progress.finished(ran=True, seconds=seconds)
        if summary.get("status") not in SUCCEEDED:
            log(f"[{summary.get('status', 'failed')}] run {number[id(r)]}/{N} {r.label} seed {r.seed}: "
                f"{summary.get('error')}")
            failed.append(r)
        elif queue is not None:
            log(f"[done {progress.done}/{N}] run {number[id(r)]}/{N} {r.label} seed {r.seed}: "
                f"{_outcome(summary)}{progress.eta(queue.active)}")

    if todo and todo[0].cfg.execution.pack_runs:
        _packed(todo, started, finished, log)
    elif jobs <= 1:
        for r in todo:
            log(started(r))
            t0 = time.perf_counter()
            finished(r, _run_here(r.cfg, r.dir, callbacks), time.perf_counter() - t0)
    else:
        if eager:
            log(f"[sweep] {len(todo)} runs, {jobs} at a time (this process and {jobs - 1} worker "
                f"process{'es' if jobs > 2 else ''})")
        else:
            log(f"[sweep] {len(todo)} runs, up to {jobs} at a time: a worker process starts when a core is "
                "idle and the runs left outweigh its start-up")
        if todo[0].cfg.output.trackers:
            prepare_trackers(todo[0].cfg)
        cores = max(cores_per_run(r.cfg) for r in todo)
        queue = _SharedQueue(todo, jobs - 1, started, finished, log, eager=eager, cores=cores, startup_s=startup_s)
        queue.run()
    groups: dict[str, list[Path]] = {}
    bad = {r.dir for r in failed}
    for r in runs:
        if r.dir not in bad:
            groups.setdefault(r.label, []).append(r.dir)
    return api.finish_grid(groups, out, SWEEP, log=log), out, failed


def _packed(todo: list[SweepRun], started, finished, log) -> None:
    """The runs packed in this process (``execution.pack_runs``, engine/packed.py); each
    dataset loaded once for all of them."""
    from .config import check_here
    from .engine.packed import run_packed
    from .engine.simulation import Simulation

    datasets: dict = {}

    def build(r: SweepRun, member):
        cfg = from_dict(_quiet(r.cfg))
        check_here(cfg)
        return Simulation(cfg, run_dir=r.dir, task=api.check_task(cfg, datasets), executor_factory=lambda sim: member)

    run_packed(todo, build, lambda r: log(started(r)), finished, log)


def _quiet(cfg: Config) -> dict:
    raw = cfg.to_dict()
    raw["output"]["progress"] = False  # interleaved bars of parallel runs are noise
    return raw


# ---------------------------------------------------------------------------------------
# several runs at once: this process and worker processes on one queue
# ---------------------------------------------------------------------------------------
def startup_estimate() -> float:
    """What starting a worker process costs, in seconds: the CPU time this process has used
    so far (in a command: its imports and set-up, which a worker repeats), within [1, 10]."""
    return min(max(time.process_time(), 1.0), 10.0)


def worker_pays(runs_left: int, run_s: float, startup_s: float, idle_cores: float, cores: int) -> bool:
    """Whether one more worker process makes a sweep end sooner.

    The worker needs ``cores`` idle cores (at least three quarters of them idle now: it
    must not take a core from a run already going, here or in another program), and the
    work it can take over must outweigh its start-up: with one more process the
    ``runs_left * run_s`` seconds left end after about half of them plus the start-up
    instead of all of them, a gain only when the work left exceeds the start-up; twice
    the start-up is asked, for the estimate's error (``run_s`` is a lower bound taken from
    the runs so far, ``startup_s`` what starting this process cost).
    """
    return idle_cores >= 0.75 * cores and runs_left * run_s > 2 * startup_s


class IdleCores:
    """Cores left idle by every program on the machine since the last :meth:`sample`
    (``/proc/stat`` on Linux; elsewhere the CPU count minus the 1-minute load average)."""

    def __init__(self) -> None:
        self.cpus = os.cpu_count() or 1
        self.last = self._read()

    @staticmethod
    def _read() -> Optional[tuple[int, int]]:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, all but guest time

    def sample(self) -> float:
        now = self._read()
        if now is not None and self.last is not None and now[1] > self.last[1]:
            idle = (now[0] - self.last[0]) / (now[1] - self.last[1]) * self.cpus
            self.last = now
            return idle
        self.last = now
        try:
            return max(0.0, self.cpus - os.getloadavg()[0])
        except (AttributeError, OSError):  # no load average (Windows): assume the machine is ours
            return float(self.cpus)


class _SharedQueue:
    """Runs a sweep's runs in this process and in up to ``workers`` worker processes.

    This process takes runs from the queue at once (it needs no start-up). Each worker
    process is fed by a helper thread here and takes run after run, so its start-up
    (importing torch and protofl: about 2 s of CPU) is paid once per worker, not per run.
    With ``eager`` every worker starts at once (``--jobs N`` given); otherwise a monitor
    thread starts one whenever :func:`worker_pays`. An error in a worker's run stops the
    queue and is raised here once this process's current run has ended.
    """

    POLL_S = 1.0

    def __init__(self, todo: list[SweepRun], workers: int, started, finished, log, eager: bool, cores: int,
                 startup_s: float) -> None:
        self.queue, self.workers, self.log = deque(todo), workers, log
        self.started, self.finished = started, finished
        self.eager, self.cores, self.startup_s = eager, cores, startup_s
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.durations: list[float] = []
        self.current_t0: Optional[float] = None  # when this process's current run started
        self.stop = threading.Event()
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))

    @property
    def active(self) -> int:
        return 1 + len(self.threads)

    def take(self) -> Optional[SweepRun]:
        with self.lock:
            if self.errors or not self.queue:
                return None
            r = self.queue.popleft()
            self.log(self.started(r))
            return r

    def report(self, r: SweepRun, summary: dict, t0: float) -> None:
        with self.lock:
            self.durations.append(time.perf_counter() - t0)
            self.finished(r, summary, self.durations[-1])

    def helper(self) -> None:
        while (r := self.take()) is not None:
            t0 = time.perf_counter()
            try:
                summary = self.pool.submit(_run_child, _quiet(r.cfg), str(r.dir)).result()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                with self.lock:
                    self.errors.append(e)
                return
            self.report(r, summary, t0)

    def add_worker(self) -> None:
        t = threading.Thread(target=self.helper, daemon=True, name=f"sweep-worker-{len(self.threads) + 1}")
        self.threads.append(t)
        t.start()

    def monitor(self) -> None:
        """Starts a worker whenever one pays, until the queue is empty or all have started."""
        idle = IdleCores()
        while not self.stop.wait(self.POLL_S) and len(self.threads) < self.workers:
            free = idle.sample()
            with self.lock:
                left = len(self.queue)
                running = [time.perf_counter() - self.current_t0] if self.current_t0 is not None else []
                run_s = max([*running, sum(self.durations) / len(self.durations) if self.durations else 0.0])
            if not left:
                return
            if worker_pays(left, run_s, self.startup_s, free, self.cores):
                self.log(f"[sweep] worker process {len(self.threads) + 1} starts: {free:.1f} cores idle, "
                         f"{left} runs left of about {run_s:.1f} s each")
                self.add_worker()

    def run(self) -> None:
        monitor = None
        try:
            if self.eager:
                for _ in range(self.workers):
                    self.add_worker()
            else:
                monitor = threading.Thread(target=self.monitor, daemon=True, name="sweep-monitor")
                monitor.start()
            while (r := self.take()) is not None:
                t0 = self.current_t0 = time.perf_counter()
                self.report(r, _run_here(from_dict(_quiet(r.cfg)), r.dir), t0)
                self.current_t0 = None
            self.stop.set()
            for t in [*self.threads, *([monitor] if monitor else [])]:
                while t.is_alive():
                    t.join(0.2)  # a short wait keeps Ctrl-C responsive
        except BaseException:
            with self.lock:
                self.queue.clear()  # no new runs; the workers' current runs end with their own interrupt
            # Ctrl-C reaches the workers too (the terminal's process group); SIGTERM to this
            # process alone does not: pass it on as the interrupt it is
            for p in list(getattr(self.pool, "_processes", {}).values()):
                if p.is_alive():
                    os.kill(p.pid, signal.SIGINT)
            raise
        finally:
            self.stop.set()
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.errors:
            raise self.errors[0]
