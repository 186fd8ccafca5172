"""Per-round cost of Flower's deployment engine vs the in-process engine.

Workload: configs/digits.yaml with K clients (default 3), all of them every round, one
intra-op thread per process. The same config and seed run twice:

* in process: ``Simulation`` with the sequential executor (what ``protofl run`` does);
* over Flower: a SuperLink and K SuperNodes on 127.0.0.1 (``LocalDeployment``), the run
  submitted with ``flwr run``; the same ``Simulation`` runs inside the ServerApp. The
  SuperNodes run as ``protofl flower supernode`` does: ``--isolation process`` with one
  long-lived ClientApp worker each (default), or ``--isolation subprocess`` (Flower's
  default: one ``flwr-clientapp`` process per message).

Both write ``wall_s`` per round (from the server's view: configure, the clients' turns,
aggregation, evaluation). The per-round overhead is the difference of the means; the
startup is ``flwr run``'s wall time minus the rounds (ServerApp start, discovery of the
SuperNodes, teardown). The metrics of the two runs are compared too (max |difference|).

    python benchmarks/flower_overhead.py --rounds 3 --methods fedavg,fedproto,fednh \
        --out benchmarks/results/flower_overhead.md

``--out`` puts the new table at the top of the file and keeps the earlier ones below it.
On a small model the overhead is almost all fixed cost and does not grow with the model:
with ``subprocess`` isolation mostly the ClientApp process started per message (import
torch + protofl, build the data); with the worker mostly polling -- an idle SuperNode
asks the SuperLink for messages every 3 s (flwr 1.41, ``start_client_internal``), the
SuperNode sends a reply within 0.5 s of it being ready, the ServerApp pulls replies every
``poll-interval`` (0.5 s). Numbers depend on the machine's load: the table records the
load average.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from protofl.config import load_config
from protofl.engine.simulation import Simulation, read_rows
from protofl.flower.launch import LocalDeployment

REPO = Path(__file__).resolve().parents[1]
TIMING = {"train_s", "eval_s", "wall_s", "cpu_s"}


def max_diff(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for ra, rb in zip(a, b):
        for k, v in rb.items():
            if k in TIMING or k not in ra:
                continue
            va, vb = (ra[k], v) if isinstance(v, list) else ([ra[k]], [v])
            for x, y in zip(va, vb):
                if isinstance(y, float) and not (math.isnan(x) and math.isnan(y)):
                    worst = max(worst, abs(x - y))
    return worst


def measure(method: str, clients: int, rounds: int, work: Path, isolation: str = "process") -> dict:
    cfg = load_config(REPO / "configs" / "digits.yaml", [
        f"algorithm.name={method}", f"rounds={rounds}", f"partition.num_clients={clients}",
        "participation.fraction=1.0", "execution.threads=1", "output.progress=false", f"output.dir={work}"])
    t0 = time.perf_counter()
    ref = Simulation(cfg, run_dir=work / f"{method}-in-process").run()
    t_ref = time.perf_counter() - t0
    run_dir = work / f"{method}-flower"
    with LocalDeployment(work / f"{method}-deployment", clients, isolation=isolation) as dep:
        t0 = time.perf_counter()
        res = dep.submit(cfg, run_dir, timeout=3600, round_timeout=600)
        t_flower = time.perf_counter() - t0
    rows = read_rows(run_dir / "metrics.jsonl")
    if res.returncode != 0 or len(rows) != rounds:
        raise RuntimeError(f"the Flower run failed:\n{res.stdout[-3000:]}")
    in_proc = [r["wall_s"] for r in ref.rows]
    flower = [r["wall_s"] for r in rows]
    return {
        "method": method, "isolation": isolation, "clients": clients, "rounds": rounds,
        "in_process_round_s": statistics.mean(in_proc), "flower_round_s": statistics.mean(flower),
        "overhead_round_s": statistics.mean(flower) - statistics.mean(in_proc),
        "in_process_total_s": t_ref, "flower_total_s": t_flower,
        "flower_startup_s": t_flower - sum(flower),
        "max_metric_diff": max_diff(rows, ref.rows),
    }


def to_markdown(results: list[dict], load: tuple) -> str:
    lines = [
        f"## Flower deployment vs in-process engine ({date.today().isoformat()})",
        "",
        f"digits, all clients every round, 1 thread per process; {os.cpu_count()} CPU cores, "
        f"{platform.processor() or platform.machine()}; Python {platform.python_version()}; "
        f"load average before/after: {load[0]:.1f} / {load[1]:.1f}",
        "",
        "| method | isolation | clients | rounds | in-process s/round | Flower s/round | overhead s/round "
        "| Flower startup s | max metric diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['method']} | {r['isolation']} | {r['clients']} | {r['rounds']} "
                     f"| {r['in_process_round_s']:.2f} | {r['flower_round_s']:.2f} | {r['overhead_round_s']:.2f} | {r['flower_startup_s']:.1f} "
                     f"| {r['max_metric_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="fedavg", help="comma-separated (default fedavg)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isolation", default="process", help="comma-separated: process (protofl's default, one "
                    "long-lived ClientApp worker per SuperNode), subprocess (Flower's default)")
    ap.add_argument("--out", help="also write the markdown table here (on top; earlier tables are kept below)")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="protofl-flower-bench-") as tmp:
        results = [measure(m.strip(), args.clients, args.rounds, Path(tmp) / iso.strip(), iso.strip())
                   for iso in args.isolation.split(",") if iso.strip()
                   for m in args.methods.split(",") if m.strip()]
    md = to_markdown(results, (load0, os.getloadavg()[0]))
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        earlier = out.read_text() if out.exists() else ""
        out.write_text(md + ("\n" + earlier if earlier.strip() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
