"""Bounded client state: 10,000 Ditto clients (a full personal model each) vs 100.

Ditto on MNIST with `fedavg_cnn` (582k parameters: a personal model is 2.3 MB), 100
clients per round, 6 training samples per client in both runs:

* 10,000 clients: MNIST split 10,000 ways (iid), 1 % per round. After R rounds about
  100 R clients hold a personal model (the last round's summary says how many) and
  ``execution.state_memory_mb`` (default 512 MB, about 220 states) keeps at most that
  much of them in memory; the rest is in the run folder's ``client_state/``.
* 100 clients: every client every round (`nway_kshot`, 2 classes x 3 samples each, so
  the same 6 samples per client and the same work per round); 100 states, 230 MB, all
  in memory.

Each run is a fresh child process (as benchmarks/scale.py); the runs alternate (10k, 100,
10k, 100, ...). Reported: peak RSS of the run's process, median seconds per round over
rounds 2..R (time between the ends of consecutive rounds, so a checkpoint's cost is
included), the client state at the end (memory / disk), and the checkpoint's size.

    python benchmarks/scale_state.py --data-dir ../shared/data --out benchmarks/results/scale_state.md
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402

CHILD = r"""
import json, resource, sys, time
from protofl.config import from_dict
from protofl.engine.callbacks import Callback
from protofl.engine.simulation import Simulation
ends = []
class Ends(Callback):
    def on_round(self, row): ends.append(time.perf_counter())
cfg = from_dict(json.loads(sys.argv[1]))
res = Simulation(cfg, callbacks=[Ends()], run_dir=sys.argv[2]).run()
print(json.dumps({"ends": ends, "client_state": res.summary["client_state"],
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def config(data_dir: str, clients: int, rounds: int, workers: int, budget_mb) -> dict:
    partition = ({"name": "iid", "num_clients": clients} if clients == 10_000 else
                 {"name": "nway_kshot", "num_clients": clients, "ways": 2, "shots": 3, "stdev": 0.0})
    return {
        "seed": 0, "rounds": rounds,
        "data": {"name": "mnist", "root": data_dir},
        "partition": partition,
        "model": {"name": "fedavg_cnn"},
        "training": {"lr": 0.01, "epochs": 5, "batch_size": 64},
        "participation": {"clients_per_round": 100},
        "algorithm": {"name": "ditto"},
        # the global model every round, as benchmarks/scale.py; the personalized models'
        # evaluation is a cost per trained client, the same in both runs
        "eval": {"every": 1, "personal": False},
        "execution": {"workers": workers, "state_memory_mb": budget_mb},
        "output": {"checkpoint_every": 5, "progress": False, "save_model": False},
    }


def run_child(cfg: dict) -> dict:
    d = tempfile.mkdtemp(prefix="protofl-scale-state-")
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), d], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["checkpoint_bytes"] = os.path.getsize(Path(d) / "checkpoint.pt")
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs (10k, 100), alternating")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--budget-mb", type=float, default=None, help="execution.state_memory_mb (default: its default)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from protofl.config import ExecutionConfig

    budget = args.budget_mb if args.budget_mb is not None else ExecutionConfig().state_memory_mb
    results: dict[int, list[dict]] = {10_000: [], 100: []}
    for rep in range(args.repeats):
        for clients in (10_000, 100):
            r = run_child(config(args.data_dir, clients, args.rounds, args.workers, budget))
            results[clients].append(r)
            print(clients, rep, json.dumps({k: v for k, v in r.items() if k != "ends"}), file=sys.stderr)
    rows, per_round = [], {}
    for clients, runs in results.items():
        gaps = [b - a for r in runs for a, b in zip(r["ends"], r["ends"][1:])]  # rounds 2..R
        per_round[clients] = statistics.median(gaps)
        u = runs[-1]["client_state"]
        rss = max(r["maxrss_kb"] for r in runs) * 1024
        rows.append(f"| {clients:,} | {rss / 2**30:.2f} GB | {per_round[clients]:.2f} | {u['clients']:,} | "
                    f"{mb(u['memory_bytes'])} ({u['memory_clients']:,}) | {mb(u['disk_bytes'])} "
                    f"({u['disk_clients']:,}) | {u['spill_writes']:,} / {u['spill_reads']:,} | "
                    f"{mb(runs[-1]['checkpoint_bytes'])} |")
    mode = "sequential" if not args.workers else f"{args.workers} worker processes"
    lines = [header(f"Ditto, fedavg_cnn, 100 clients per round (6 samples each), 5 local epochs, batch 64, "
                    f"{args.rounds} rounds, {mode}, execution.state_memory_mb={budget:g}, checkpoint every "
                    f"5 rounds; {args.repeats} alternating runs of each."), "",
             "| clients | peak RSS (max over runs) | s/round (median, rounds 2..R) | clients with state "
             "| in memory | on disk | files written / read | checkpoint.pt |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
             f"s/round, 10,000 clients / 100 clients: {per_round[10_000] / per_round[100]:.3f}"]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
