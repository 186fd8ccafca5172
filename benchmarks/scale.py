"""Scale: 10,000 clients (MNIST split 10,000 ways), 1 % per round.

Runs protofl in a fresh child process and reports
* start-up: wall time from launching the process to the start of round 1 (interpreter
  start, imports, data loading, partitioning, local test sets, model set-up);
* peak RSS of the run next to the RSS of a process that only imports torch, and the
  dataset's in-memory size;
* seconds per round.

    python benchmarks/scale.py --data-dir ../shared/data --out benchmarks/results/scale.md
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402

CHILD = r"""
import time, json, sys
T0 = time.time()
from protofl.config import from_dict
from protofl.engine.callbacks import Callback
from protofl.engine.simulation import Simulation
marks = {}
class Marks(Callback):
    def on_start(self, info): marks["round1"] = time.time()
    def on_round(self, row): marks.setdefault("rounds", []).append(row["wall_s"])
cfg = from_dict(json.loads(sys.argv[1]))
sim = Simulation(cfg, callbacks=[Marks()], run_dir=sys.argv[2])
ds = sim.fed.dataset
sim.run()
import resource
print(json.dumps({"t0": T0, **marks, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "data_bytes": sum(t.numel() * t.element_size() for t in (ds.x_train, ds.y_train, ds.x_test, ds.y_test))}))
"""


def config(data_dir: str, clients: int, fraction: float, rounds: int, model: str, workers: int) -> dict:
    return {
        "seed": 0, "rounds": rounds,
        "data": {"name": "mnist", "root": data_dir},
        "partition": {"name": "iid", "num_clients": clients},
        "model": {"name": model},
        "training": {"lr": 0.01, "epochs": 5, "batch_size": 64},
        "participation": {"fraction": fraction},
        "algorithm": {"name": "fedavg"},
        # global model every round; the personalized full-test pass of 100 clients per
        # round is a separate cost (100 passes over the test set), not start-up or memory
        "eval": {"every": 1, "personal": False},
        "execution": {"workers": workers},
        "output": {"dir": "/tmp/protofl-scale", "checkpoint_every": 0, "progress": False, "save_model": False},
    }


def run_child(cfg: dict, run_dir: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), run_dir], capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["launch"] = t
    res["children_maxrss_kb"] = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    return res


BASELINE = r"""
import resource, sys, torch
from protofl.models import build_model
m = build_model(sys.argv[1], (1, 28, 28), 10)
loss = torch.nn.functional.cross_entropy(m(torch.randn(64, 1, 28, 28)), torch.randint(0, 10, (64,)))
loss.backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def torch_baseline_kb(model: str) -> int:
    """Peak RSS of a process that imports torch and takes one training step of the model:
    the runtime's own footprint (libraries, thread pools, kernels), without data."""
    out = subprocess.run([sys.executable, "-c", BASELINE, model], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="lenet5")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = torch_baseline_kb(args.model)
    rows = []
    for workers in (0, 2):
        cfg = config(args.data_dir, args.clients, args.fraction, args.rounds, args.model, workers)
        r = run_child(cfg, f"/tmp/protofl-scale/w{workers}")
        rows.append((workers, r))
        print(workers, r, file=sys.stderr)
    mb = 1024.0
    lines = [header(f"MNIST split {args.clients:,} ways (iid), {args.fraction:.0%} per round, {args.model}, "
                    f"5 local epochs, batch 64, {args.rounds} rounds."), "",
             f"A process that imports torch and takes one training step of {args.model} (no data): "
             f"peak RSS {base / mb:.0f} MB. MNIST in memory "
             f"(uint8 images + int64 labels): {rows[0][1]['data_bytes'] / 2**20:.0f} MB.", "",
             "| mode | start-up (launch -> round 1) | peak RSS main process | peak RSS incl. workers (max) "
             "| s/round (median) |", "|---|---|---|---|---|"]
    for workers, r in rows:
        rounds = sorted(r["rounds"])
        lines.append(f"| {'sequential' if not workers else f'{workers} workers'} | {r['round1'] - r['launch']:.2f} s | "
                     f"{r['maxrss_kb'] / mb:.0f} MB | {r['children_maxrss_kb'] / mb:.0f} MB | "
                     f"{rounds[len(rounds) // 2]:.2f} |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
