"""Framework overhead of the foundation workload: protofl rounds vs the bare-loop floor.

Workload: FedAvg, 100 clients, Dirichlet(0.3), 10 % per round, 5 local epochs, batch
64, SGD lr 0.01, 5 rounds (medians of rounds 2-5); MNIST with `mlp_mnist` and
Fashion-MNIST with `cnn_fmnist`. Seconds per round in each execution mode next to the
floor of the same rounds (benchmarks/harness.py), with evaluation off (overhead = what
the framework adds) and with protofl's default evaluation (what a run costs).

    python benchmarks/overhead.py --data-dir ../shared/data --out benchmarks/results/overhead.md
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header, measure  # noqa: E402

from protofl.config import from_dict  # noqa: E402

SETTINGS = {
    "MNIST, mlp_mnist": {"data": "mnist", "model": "mlp_mnist"},
    "Fashion-MNIST, cnn_fmnist": {"data": "fmnist", "model": "cnn_fmnist"},
}


def workload(data: str, model: str, data_dir: str, rounds: int, workers: int, threads: int, eval_on: bool,
             out: str):
    return from_dict({
        "seed": 0, "rounds": rounds,
        "data": {"name": data, "root": data_dir},
        "partition": {"name": "dirichlet", "num_clients": 100, "beta": 0.3, "min_size": 10},
        "model": {"name": model},
        "training": {"lr": 0.01, "epochs": 5, "batch_size": 64},
        "participation": {"fraction": 0.1},
        "algorithm": {"name": "fedavg"},
        "eval": {"every": 1 if eval_on else 10_000, "personal": eval_on},
        "execution": {"workers": workers, "threads": threads},
        "output": {"dir": out, "checkpoint_every": 0, "progress": False, "save_model": False},
    })


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", default="0,2", help="0 = sequential (2 threads); N = N worker processes")
    p.add_argument("--tmp", default="/tmp/protofl-overhead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name, spec in SETTINGS.items():
        for workers in (int(w) for w in args.modes.split(",")):
            for eval_on in (False, True):
                cfg = workload(spec["data"], spec["model"], args.data_dir, args.rounds, workers,
                               0 if workers else 2, eval_on, args.tmp)
                label = f"{spec['model']}-w{workers}-{'eval' if eval_on else 'noeval'}"
                m = measure(label, cfg, Path(args.tmp) / label, log=lambda s: print(s, file=sys.stderr, flush=True))
                rows.append((name, eval_on, m))
    lines = [header(f"{args.rounds} rounds per setting, medians of rounds 2-{args.rounds}."), "",
             "| setting | mode | evaluation | s/round protofl | s/round floor | samples/s | overhead vs floor |",
             "|---|---|---|---|---|---|---|"]
    for name, eval_on, m in rows:
        lines.append(f"| {name} | {m.mode} | {'default' if eval_on else 'off'} | {m.median_s():.2f} | "
                     f"{m.median_floor_s():.2f} | {m.samples_per_s():,.0f} | {100 * m.overhead():+.1f} % |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
