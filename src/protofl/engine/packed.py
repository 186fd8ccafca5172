"""Many runs in one process, their clients in shared stacks (``execution.pack_runs``).

One run of the papers' settings trains 10 clients per round: however well its stack is
packed, that cannot keep a GPU busy. A grid of runs can. :func:`run_packed` keeps several
runs in flight in this process and drives them in lockstep, the way the batched executor
drives clients: each run is its :meth:`~protofl.engine.simulation.Simulation.steps`
generator, which yields a batch of client tasks (a round's) and takes their outputs;
the batches of every run in flight go to one
:meth:`~protofl.engine.batched.BatchedExecutor.run_batches` call, so 30 runs of 10
clients per round fill stacks the way one run of 300 clients would (clients of runs with
another model, method or shape go to other stacks).

Each run keeps its own server state, client states, random streams, run folder,
metrics, checkpoints and summary: it computes what it computes alone with the batched
executor. A run that fails (a diverged client with ``training.on_nonfinite: stop``, an
error in its method, a file it cannot write) stops alone, with its summary saying why;
the others go on, and the next run of the queue takes its place. Resume is per run (each
continues from its own checkpoint).
"""
from __future__ import annotations

import os
import resource
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, cast, Generator, Optional, TYPE_CHECKING

import torch

from .backends import batched_executor
from .batched import BatchedExecutor
from .client import ClientOutput, ClientTask
from .executor import Executor
from .train import DIVERGED, NonFiniteLossError

if TYPE_CHECKING:
    from .simulation import RunResult, Simulation


class PackMember(Executor):
    """The executor a packed run's Simulation holds: its tasks run in the pack (the run
    yields them), so it only describes how they ran."""

    def __init__(self, pack: "Pack") -> None:
        self.pack = pack

    def run(self, tasks: list[ClientTask]) -> list[Optional[ClientOutput]]:
        raise RuntimeError("a packed run's clients run in the pack (Simulation.steps yields them)")

    def describe(self) -> dict[str, Any]:
        return {**(self.pack.executor.describe() if self.pack.executor else {}), "packed_runs": self.pack.in_flight}


@dataclass
class _Run:
    item: Any  # what the caller queued (a sweep's run)
    sim: Simulation
    steps: Generator[list[ClientTask], Any, RunResult]  # its Simulation.steps generator
    tasks: Optional[list[ClientTask]] = None  # the batch it waits on
    t0: float = field(default_factory=time.perf_counter)


class Pack:
    """The runs in flight and the one batched executor they share."""

    def __init__(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.executor: Optional[BatchedExecutor] = None
        self.active: list[_Run] = []


def memory_budget(device: torch.device) -> int:
    """Bytes the runs in flight may take: half of the GPU's free memory, or a quarter of the RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def run_bytes(sim: Simulation) -> int:
    """A run's memory beyond the shared data and stacks: its global model and the broadcast
    (twice the model), the replies and client states of a round (each client's model, and
    as much state again) and the evaluation's copies: about (2 m + 4) models, m = the
    clients per round."""
    return (2 * sim.participation.m + 4) * sim.model_bytes


def choose_in_flight(first: Simulation, runs_left: int) -> int:
    """How many runs go at once: as many as fit in :func:`memory_budget` at :func:`run_bytes`
    each (measured on the first run), at most the runs left."""
    return max(1, min(runs_left, memory_budget(first.runtime.device) // max(1, run_bytes(first))))


def peak_memory(device: torch.device) -> str:
    """The process's peak memory so far, in words (GPU: allocated by torch; CPU: resident)."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB on {device}"
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return f"{kb / 2**20:.2f} GiB resident"


def run_packed(queue: list[Any], build: Callable[[Any, Executor], Simulation], on_start: Callable[[Any], None],
               on_end: Callable[[Any, dict[str, Any], float], None], log: Callable[[str], None] = print,
               in_flight: Optional[int] = None) -> None:
    """Run every item of ``queue`` packed: ``build(item, member)`` makes its Simulation (whose
    executor factory gives ``member``), ``on_start(item)`` and ``on_end(item, summary,
    seconds)`` frame each run. ``in_flight``: runs at once (None: :func:`choose_in_flight`).
    A run that raises ends with a summary of status ``failed`` (``diverged`` for a non-finite
    loss); Ctrl-C interrupts every run in flight (each records it) and is raised."""
    waiting = deque(queue)
    pack = Pack(in_flight or 0)

    def admit() -> None:
        while waiting and (not pack.in_flight or len(pack.active) < pack.in_flight):
            item = waiting.popleft()
            on_start(item)
            try:
                sim = build(item, PackMember(pack))
            except Exception as e:  # noqa: BLE001 - this run cannot start; the others can
                on_end(item, {"status": "failed", "error": f"{type(e).__name__}: {e}"}, 0.0)
                continue
            if pack.executor is None:
                pack.executor = batched_executor(sim)
                if not pack.in_flight:
                    pack.in_flight = choose_in_flight(sim, len(waiting) + 1)
                log(f"[pack] {pack.in_flight} runs in flight, their clients in shared stacks on {sim.runtime.device}")
            run = _Run(item, sim, sim.steps(resume=True))
            if advance(run, None):
                pack.active.append(run)

    def advance(run: _Run, answer: Any) -> bool:
        """Hand ``answer`` to the run; whether it waits on a new batch (else it ended)."""
        try:
            run.tasks = run.steps.throw(answer) if isinstance(answer, BaseException) else run.steps.send(answer)
            return True
        except StopIteration as done:
            on_end(run.item, done.value.summary, time.perf_counter() - run.t0)
        except NonFiniteLossError as e:  # the run recorded its divergence in its summary
            on_end(run.item, {"status": DIVERGED, "error": str(e)}, time.perf_counter() - run.t0)
        except Exception as e:  # noqa: BLE001 - the run recorded its failure in its summary
            on_end(run.item, {"status": "failed", "error": f"{type(e).__name__}: {e}"}, time.perf_counter() - run.t0)
        return False

    try:
        admit()
        while pack.active:
            assert pack.executor is not None  # made when the first run was admitted
            batches = [(r.sim.runtime, cast(list[ClientTask], r.tasks)) for r in pack.active]  # each waits on one
            results = pack.executor.run_batches(batches, isolate=True)
            pack.active = [r for r, res in zip(pack.active, results) if advance(r, res)]
            admit()
    except KeyboardInterrupt:
        for r in pack.active:  # each run records "interrupted" in its summary
            try:
                r.steps.throw(KeyboardInterrupt())
            except BaseException:  # noqa: BLE001 - it re-raises the interrupt
                pass
        raise
    finally:
        if pack.executor is not None:
            log(f"[pack] peak memory {peak_memory(pack.executor.runtime.device)}")
            pack.executor.close()
