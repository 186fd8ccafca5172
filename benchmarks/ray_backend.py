"""The Ray backend against this machine's executors: seconds per round, side by side.

Workload: the peers' (benchmarks/peers.py): FedAvg, fedavg_cnn, real MNIST, 100 clients
with Dirichlet(0.3) label skew, 10 clients per round, 5 local epochs, batch 64, default
evaluation. Three modes on the same 2 cores:

* ``workers=0``: sequential in this process, 2 intra-op threads;
* ``workers=2``: two worker processes, one thread each;
* Ray: a 2-node cluster on 127.0.0.1 (``ray start``, 1 CPU per node), two actors with one
  thread each, the data shipped once through the object store.

All three are set up first; start-up (pool spawn; cluster start; actors ready, data
shipped) is reported apart. Then every round runs in each mode in turn, in a rotating
order, so the machine's drift hits all modes alike; the table gives medians of rounds
2..R. The workers=2 and Ray rows must be identical (both one thread per client turn):
the script checks it.

    nice -n 10 python benchmarks/ray_backend.py --data-dir ../shared/data --rounds 4 \\
        --out benchmarks/results/ray_backend.md
    # on a busy machine: --epochs 1 --rounds 3 --seq-threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402
from peers import workload  # noqa: E402

from protofl.testing.ray_cluster import LocalRayCluster, ray_env  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402

TIMING = {"train_s", "eval_s", "wall_s"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--method", default="fedavg")
    p.add_argument("--epochs", type=int, default=5, help="local epochs (the peers' workload: 5)")
    p.add_argument("--seq-threads", type=int, default=2, help="intra-op threads of the workers=0 mode")
    p.add_argument("--tmp", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.update({k: v for k, v in ray_env().items() if k in ("RAY_USAGE_STATS_ENABLED",)})
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="pf-raybench-"))
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    cluster = LocalRayCluster(tmp / "c", nodes=2, cpus=1, fast_failure_detection=False)
    log("starting the 2-node Ray cluster ...")
    cluster.start()
    modes = {}
    try:
        specs = [(f"workers=0 (sequential, {args.seq_threads} thread{'s' if args.seq_threads > 1 else ''})",
                  {"workers": 0, "threads": args.seq_threads}),
                 ("workers=2 (2 processes x 1 thread)", {"workers": 2, "threads": 1}),
                 ("Ray, 2 nodes x 1 CPU (2 actors x 1 thread)",
                  {"backend": "ray", "address": cluster.address, "threads": 1})]
        for label, ex in specs:
            cfg = workload(args.method, args.model, args.data_dir, args.rounds, 0, 1, True, str(tmp / "runs"))
            cfg = cfg.replace(**{"training.epochs": args.epochs}, **{f"execution.{k}": v for k, v in ex.items()})
            sim = Simulation(cfg, run_dir=tmp / "runs" / label.split(" ")[0].replace("=", ""))
            t0 = time.perf_counter()
            executor = sim.executor_factory(sim)
            modes[label] = dict(sim=sim, ex=executor, startup=time.perf_counter() - t0,
                                state=sim.algorithm.server_init(sim.server), rounds=[], rows=[])
            log(f"{label}: ready in {modes[label]['startup']:.1f} s")
        labels = list(modes)
        for rnd in range(1, args.rounds + 1):
            order = labels[rnd % 3:] + labels[:rnd % 3]
            for label in order:
                m = modes[label]
                t0 = time.perf_counter()
                m["state"], part = m["sim"].run_round(rnd, m["state"], m["ex"])
                row = part.complete()
                m["rounds"].append(time.perf_counter() - t0)
                m["rows"].append({k: v for k, v in row.items() if k not in TIMING})
                log(f"round {rnd} {label}: {m['rounds'][-1]:.2f} s, gm {row.get('gm', float('nan')):.4f}")
        ray_info = modes[labels[2]]["ex"].describe()
        identical = modes[labels[1]]["rows"] == modes[labels[2]]["rows"]
        row0 = modes[labels[2]]["rows"][-1]
    finally:
        for m in modes.values():
            m["ex"].close()
        cluster.stop()

    base = statistics.median(modes[labels[1]]["rounds"][1:])
    lines = [header(f"Background load: other jobs shared the 2 cores. {args.rounds} rounds per mode "
                    f"(scaled down for the shared CPU), medians of rounds 2-{args.rounds}, "
                    "rounds interleaved across modes."), "",
             f"Workload: {args.method}, {args.model}, MNIST, 100 clients Dir(0.3), 10 per round, "
             f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}, "
             "batch 64, default evaluation.", "",
             "| mode | start-up s | round 1 s | s/round (median, rounds 2+) | vs workers=2 |",
             "|---|---|---|---|---|"]
    for label, m in modes.items():
        s = statistics.median(m["rounds"][1:])
        startup = m["startup"] + (cluster.startup_s if label.startswith("Ray") else 0.0)
        extra = f" (cluster {cluster.startup_s:.1f} + actors {m['startup']:.1f})" if label.startswith("Ray") else ""
        lines.append(f"| {label} | {startup:.1f}{extra} | {m['rounds'][0]:.2f} | {s:.2f} | "
                     f"{100 * (s / base - 1):+.1f} % |")
    lines += ["", "Start-up: the pool spawns its processes on first use (inside round 1); the Ray figure is "
              "the cluster's `ray start` plus connecting, shipping the data and starting the actors.",
              "", f"Ray: {ray_info['actors']} actors on {ray_info['nodes']} nodes, tasks per node "
              f"{ray_info['tasks_per_node']}, median per-task overhead (driver wall time minus the client's "
              f"own time) {ray_info['task_overhead_ms']} ms; bytes per task: "
              f"{row0['bytes_down'] / row0['selected']:,.0f} down, {row0['bytes_up'] / max(1, row0['arrived']):,.0f} up.",
              f"workers=2 and Ray metrics identical in every round: {identical}."]
    emit(lines, args.out)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
