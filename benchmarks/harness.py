"""Shared timing harness: protofl rounds and the bare-loop floor, measured alternately.

For every round r, protofl runs the whole round (messages, local training of the sampled
clients, aggregation, its default evaluation); right after, the *floor* runs the same
SGD steps (same clients, same number of epochs and batch size) with nothing around it:
one model per process, data already normalized in memory, no weight copies, no
aggregation, no evaluation. The floor uses the same execution shape as protofl's mode
(one process with T threads, or N worker processes with one thread each, largest
clients first), so the ratio isolates what the framework adds. Alternating the two
cancels the machine's slow drift (15-20 % within minutes here); we report medians of
rounds 2..R.
"""
from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Optional, Sequence

import torch

from protofl.config import Config
from protofl.engine.client import use_channels_last
from protofl.engine.malloc import tune_malloc
from protofl.engine.simulation import Simulation
from protofl.models import build_model


# ---------------------------------------------------------------------------------------
# the floor: plain SGD on one model, data pre-normalized
# ---------------------------------------------------------------------------------------
class Floor:
    def __init__(self, sim: Simulation) -> None:
        cfg = sim.cfg
        self.model = build_model(cfg.model.name, sim.info.input_shape, sim.info.num_classes, **cfg.model.params)
        self.cl = use_channels_last(cfg, self.model)
        if self.cl:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.epochs, self.batch, self.lr = cfg.training.epochs, cfg.training.batch_size, cfg.training.lr
        self.runtime = sim.runtime
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def client(self, cid: int) -> float:
        if cid not in self.data:  # preparation is not part of the floor
            self.data[cid] = self.runtime.client_train_data(cid)
        x, y = self.data[cid]
        model, n = self.model, len(y)
        opt = torch.optim.SGD(model.parameters(), lr=self.lr)
        t0 = time.perf_counter()
        for _ in range(self.epochs):
            perm = torch.randperm(n)
            xp, yp = x[perm], y[perm]
            if self.cl:
                xp = xp.contiguous(memory_format=torch.channels_last)
            for i in range(0, n, self.batch):
                loss = torch.nn.functional.cross_entropy(model(xp[i:i + self.batch]), yp[i:i + self.batch])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        return time.perf_counter() - t0


_FLOOR: Optional[Floor] = None


def _floor_init(sim_args) -> None:
    global _FLOOR
    torch.set_num_threads(1)
    tune_malloc()
    cfg, fed = sim_args
    _FLOOR = Floor(Simulation(cfg, fed=fed, run_dir=Path("/nonexistent-not-written")))


def _floor_task(cid: int) -> float:
    return _FLOOR.client(cid)


class FloorRunner:
    """Runs the floor for a list of clients in the same execution shape as protofl."""

    def __init__(self, sim: Simulation, workers: int) -> None:
        self.sizes = {c: len(ix) for c, ix in enumerate(sim.fed.train_idx)}
        self.pool = None
        if workers > 0:
            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_floor_init,
                                            initargs=((sim.cfg, sim.fed.share_memory_()),))
        else:
            self.floor = Floor(sim)

    def run(self, clients: list[int]) -> float:
        t0 = time.perf_counter()
        if self.pool is None:
            for c in clients:
                self.floor.client(c)
        else:
            order = sorted(clients, key=lambda c: -self.sizes[c])
            list(self.pool.map(_floor_task, order))
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


# ---------------------------------------------------------------------------------------
@dataclass
class Measurement:
    label: str
    mode: str
    rounds: list[float] = field(default_factory=list)  # protofl seconds per round
    floors: list[float] = field(default_factory=list)  # floor seconds per round
    samples: list[int] = field(default_factory=list)  # epochs x client sizes per round

    def median_s(self) -> float:
        return statistics.median(self.rounds[1:])

    def median_floor_s(self) -> float:
        return statistics.median(self.floors[1:])

    def samples_per_s(self) -> float:
        return statistics.median([n / t for n, t in zip(self.samples[1:], self.rounds[1:])])

    def floor_samples_per_s(self) -> float:
        return statistics.median([n / t for n, t in zip(self.samples[1:], self.floors[1:])])

    def overhead(self) -> float:
        """Median over rounds of (protofl time / floor time of the same round) - 1."""
        return statistics.median([a / b for a, b in zip(self.rounds[1:], self.floors[1:])]) - 1.0


def mode_name(cfg: Config) -> str:
    if cfg.execution.workers:
        return f"{cfg.execution.workers} workers x 1 thread"
    return f"sequential, {cfg.execution.threads or torch.get_num_threads()} threads"


def measure(label: str, cfg: Config, run_dir: Path, with_floor: bool = True, fed=None,
            log=print) -> Measurement:
    """Run ``cfg.rounds`` rounds of protofl, each followed by the floor of the same round."""
    sim = Simulation(cfg, run_dir=run_dir, fed=fed)
    if cfg.execution.threads:
        torch.set_num_threads(cfg.execution.threads)
    executor = sim.executor_factory(sim)
    floor = FloorRunner(sim, cfg.execution.workers) if with_floor else None
    state = sim.algorithm.server_init(sim.server)
    m = Measurement(label, mode_name(cfg))
    try:
        for rnd in range(1, cfg.rounds + 1):
            t0 = time.perf_counter()
            state, part = sim.run_round(rnd, state, executor)
            row = part.complete()
            m.rounds.append(time.perf_counter() - t0)
            clients = sim.participation.selected(rnd)
            m.samples.append(sum(cfg.training.epochs * len(sim.fed.train_idx[c]) for c in clients))
            if floor is not None:
                m.floors.append(floor.run(clients))
            log(f"  {label} [{m.mode}] round {rnd}: {m.rounds[-1]:.2f} s"
                + (f", floor {m.floors[-1]:.2f} s" if floor is not None else "")
                + (f", gm {row['gm']:.4f}" if "gm" in row else ""))
    finally:
        executor.close()
        if floor is not None:
            floor.close()
    return m


def emit(lines: "list[str] | str", out: Optional[str]) -> None:
    """A benchmark's markdown (lines, or the text): printed, and written to ``out`` (its
    folder created) when given."""
    text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


def header(extra: str = "") -> str:
    return (f"Measured {date.today().isoformat()} on {platform.machine()} Linux, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, Python {platform.python_version()}. {extra}")


def write_json_lines(path: Path, records: Sequence[dict]) -> None:
    """``records`` as one gzip file of JSON lines (a page's records), keys sorted and mtime
    0: the same records, the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data, mtime=0))


def read_json_lines(path: Path) -> list:
    """The lines of a file :func:`write_json_lines` wrote, each as JSON reads it."""
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]


def shown_command(script: str, argv: Sequence[str], hide: dict[str, str]) -> str:
    """``python SCRIPT ARGS`` as a page shows it, shell-quoted: the value of each flag in
    ``hide`` (``--flag value`` or ``--flag=value``; a folder of the machine it ran on) replaced
    by the flag's placeholder, e.g. {"--data-dir": "DATA"}."""
    out = []
    for i, a in enumerate(argv):
        key, eq, _ = a.partition("=")
        if eq and key in hide:
            out.append(f"{key}={hide[key]}")
        elif i and argv[i - 1] in hide:
            out.append(hide[argv[i - 1]])
        else:
            out.append(a)
    return "python " + shlex.join([script, *out])
