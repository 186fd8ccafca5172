"""What default evaluation costs, with and without ``execution.overlap_eval``.

The peers' workload (benchmarks/peers.py: FedAvg, real MNIST, 100 clients, Dir(0.3), 10
clients per round, 5 local epochs, batch 64, ``fedavg_cnn``) with N worker processes,
three variants run one after another and repeated in alternating order (A B C, C B A,
...): evaluation off; default evaluation with the overlap (the default); default
evaluation without it. Each is a whole ``Simulation.run`` (the real code path). A round's
time is the interval between the starts of its client tasks and the next round's, so the
window rounds 2..R-1 counts everything a round does, an overlapped evaluation included,
and leaves out start-up and the last round (never overlapped; it also evaluates every
client once). samples/s = epochs x train size of the window's clients / window seconds.

Part two (``--batch``): the global evaluation alone (10,000 test images, one thread), by
evaluation batch size and memory layout, to pick the fastest.

    python benchmarks/eval_overlap.py --data-dir ../shared/data --rounds 6 --repeats 2 --out benchmarks/results/eval_overlap.md
    python benchmarks/eval_overlap.py --data-dir ../shared/data --batch
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402
from peers import workload  # noqa: E402

import torch  # noqa: E402

from protofl.data.build import build_federated  # noqa: E402
from protofl.engine.backends import local_executor  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402

VARIANTS = ("eval off", "default eval, overlap on", "default eval, overlap off")


def config(variant: str, args):
    cfg = workload("fedavg", args.model, args.data_dir, args.rounds, args.workers, 0,
                   variant != "eval off", args.tmp)
    # every client's final evaluation (after the last round, outside the window) is left out
    return cfg.replace(**{"execution.overlap_eval": variant.endswith("overlap on"),
                          "eval.final_all_clients": False})


def timed_run(cfg, fed, run_dir: Path) -> tuple[float, float]:
    """(samples/s over rounds 2..R-1, GM of the last round) of one whole run."""
    starts: dict[int, float] = {}

    def factory(sim):
        ex = local_executor(sim)
        run = ex.run

        def stamped(tasks):
            if tasks and tasks[0].rnd not in starts:
                starts[tasks[0].rnd] = time.perf_counter()
            return run(tasks)

        ex.run = stamped
        return ex

    sim = Simulation(cfg, run_dir=run_dir, fed=fed, executor_factory=factory)
    res = sim.run()
    R, E = cfg.rounds, cfg.training.epochs
    samples = sum(E * len(sim.fed.train_idx[c]) for r in range(2, R) for c in sim.participation.selected(r))
    return samples / (starts[R] - starts[2]), res.rows[-1].get("gm", float("nan"))


def eval_batches(args) -> list[str]:
    """The global evaluation alone, by batch size and layout (one thread, best of 3)."""
    torch.set_num_threads(1)
    cfg = workload("fedavg", args.model, args.data_dir, 1, 0, 1, True, args.tmp)
    sim = Simulation(cfg, run_dir=Path(args.tmp) / "batch")
    state = sim.algorithm.server_init(sim.server)
    lines = ["| eval batch | channels_last | seconds (10,000 images) | images/s |", "|---|---|---|---|"]
    for cl in (True, False):
        for bs in (64, 128, 256, 512, 1024, 2048):
            c = cfg.replace(**{"eval.batch_size": bs, "execution.channels_last": cl})
            sim.cfg = sim.runtime.cfg = c
            sim.runtime.channels_last = cl
            sim.server = type(sim.server)(c, sim.algorithm, sim.info)
            sim.evaluate_global(state)  # warm-up
            best = min(_seconds(sim, state) for _ in range(3))
            lines.append(f"| {bs} | {'on' if cl else 'off'} | {best:.3f} | {10000 / best:,.0f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def _seconds(sim, state) -> float:
    t = time.perf_counter()
    sim.evaluate_global(state)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--reverse", action="store_true", help="start with the reversed order (C B A)")
    p.add_argument("--batch", action="store_true", help="only the eval batch-size/layout table")
    p.add_argument("--tmp", default="/tmp/protofl-eval-overlap")
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args()
    if args.batch:
        emit(eval_batches(args), args.out)
        return 0
    fed = build_federated(config(VARIANTS[0], args))
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for v in (VARIANTS if (rep + args.reverse) % 2 == 0 else VARIANTS[::-1]):
            sps, gm = timed_run(config(v, args), fed, Path(args.tmp) / f"{rep}-{v.replace(' ', '_')}")
            results[v].append(sps)
            print(f"repeat {rep} {v}: {sps:,.0f} samples/s (gm {gm:.4f})", file=sys.stderr, flush=True)
    off = statistics.median(results[VARIANTS[0]])
    lines = [header(f"{args.workers} workers x 1 thread, {args.model}, {args.rounds} rounds per run "
                    f"(window: rounds 2-{args.rounds - 1}), {args.repeats} runs per variant, alternating."),
             "", "| variant | samples/s per run | median | vs eval off |", "|---|---|---|---|"]
    for v in VARIANTS:
        med = statistics.median(results[v])
        runs = ", ".join(f"{x:,.0f}" for x in results[v])
        lines.append(f"| {v} | {runs} | {med:,.0f} | {100 * (med / off - 1):+.1f} % |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
