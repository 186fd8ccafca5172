"""The peers' own workload: protofl, FL-bench and PFLlib side by side, in one run.

Workload: FedAvg, real MNIST, 100 clients, Dirichlet(0.3), 10 clients per round, 5 local
epochs, batch 64, SGD lr 0.01, the FedAvg CNN of McMahan et al. (protofl `fedavg_cnn`,
FL-bench `avgcnn`, PFLlib `CNN`: the same 582,026 parameters), each library with its
default evaluation and with evaluation off. samples/s = sum over the round's clients of
epochs x client train size / the round's wall time; per run, the median over rounds
2..R (round 1 starts pools and Ray). The systems run one after another, run by run
(protofl sequential, protofl 2 workers, FL-bench serial, FL-bench Ray parallel with 2
workers, PFLlib; then again with evaluation off; ``--repeats`` times), so every ratio
compares runs minutes apart on the same machine, never figures of another day.

FL-bench (KarhouTam/FL-bench at 06e658b) and PFLlib (TsingZ0/PFLlib at d832e76) run from
their own git checkouts with their own virtual environments, through the small drivers in
benchmarks/peer_drivers/ (which import them and change none of their files); setting
them up, data included: benchmarks/peers_setup.md. Without ``--flbench``/``--pfllib``
only protofl runs.

    python benchmarks/peers.py --data-dir DATA --flbench FLBENCH --flbench-python FLBENCH_VENV/bin/python \\
        --pfllib PFLLIB --pfllib-python PFLLIB_VENV/bin/python --rounds 6 --out benchmarks/results/peers.md

``--floor`` also runs protofl's bare-loop floor after every protofl round
(benchmarks/harness.py) and reports protofl's overhead over it; ``--methods
fedavg,fedproto`` adds protofl's FedProto (FedProto vs FedAvg speed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header, measure  # noqa: E402

from protofl.config import from_dict  # noqa: E402

DRIVERS = Path(__file__).resolve().parent / "peer_drivers"
PEER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def workload(method: str, model: str, data_dir: str, rounds: int, workers: int, threads: int,
             eval_on: bool, out: str, seed: int = 0, clients_per_round: int = 10):
    algo = {"name": method}
    if method == "fedproto":
        algo["lam"] = 1.0
    return from_dict({
        "seed": seed, "rounds": rounds,
        "data": {"name": "mnist", "root": data_dir},
        "partition": {"name": "dirichlet", "num_clients": 100, "beta": 0.3, "min_size": 10},
        "model": {"name": model},
        "training": {"lr": 0.01, "epochs": 5, "batch_size": 64},
        "participation": {"clients_per_round": clients_per_round},
        "algorithm": algo,
        # final_all_clients off: the peers have no end-of-run pass over all 100 clients, and
        # it is a one-off cost after the last round, not part of a round
        "eval": {"every": 1 if eval_on else 10_000, "personal": eval_on, "final_all_clients": False},
        "execution": {"workers": workers, "threads": threads},
        "output": {"dir": out, "checkpoint_every": 0, "progress": False, "save_model": False},
    })


@dataclass
class Run:
    system: str  # e.g. "protofl, 2 workers x 1 thread"
    eval_on: bool
    rep: int
    seconds: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    floors: list[float] = field(default_factory=list)
    error: Optional[str] = None

    def sps(self) -> Optional[float]:
        per = [n / s for n, s in zip(self.samples[1:], self.seconds[1:]) if s]
        return statistics.median(per) if per else None

    def floor_sps(self) -> Optional[float]:
        per = [n / s for n, s in zip(self.samples[1:], self.floors[1:]) if s]
        return statistics.median(per) if per else None


def log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def run_protofl(method: str, workers: int, eval_on: bool, rep: int, args) -> Run:
    cfg = workload(method, "fedavg_cnn", args.data_dir, args.rounds, workers, 0 if workers else 2, eval_on, args.tmp,
                   clients_per_round=args.clients_per_round)
    mode = f"{workers} workers x 1 thread" if workers else "sequential, 2 threads"
    label = f"{method}-w{workers}-{'eval' if eval_on else 'noeval'}-{rep}"
    m = measure(label, cfg, Path(args.tmp) / label, with_floor=args.floor, log=log)
    name = f"protofl {'FedProto' if method == 'fedproto' else 'FedAvg'}, {mode}"
    return Run(name, eval_on, rep, m.rounds, m.samples, m.floors)


def run_peer(system: str, python: str, driver: str, driver_args: list[str], eval_on: bool, rep: int,
             args) -> Run:
    cmd = [python, str(DRIVERS / driver), "run", *driver_args, "--rounds", str(args.rounds),
           "--clients-per-round", str(args.clients_per_round), "--eval", "default" if eval_on else "off"]
    log(f"  {system} [{'eval' if eval_on else 'noeval'}]: {' '.join(cmd)}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PEER_ENV)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.peer_timeout)
    out = Run(system, eval_on, rep)
    for line in p.stdout.splitlines():
        if line.startswith("PEER_ROUND "):
            r = json.loads(line[len("PEER_ROUND "):])
            out.seconds.append(r["seconds"])
            out.samples.append(r["samples"])
            log(f"  {system} round {r['round']}: {r['seconds']:.2f} s, {r['samples']} samples")
    if p.returncode != 0 or len(out.seconds) < 2:
        out.error = f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        log(f"  {system} failed: {out.error}")
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
        (Path(args.tmp) / f"{driver}-{rep}-{int(eval_on)}.log").write_text(p.stdout + "\n" + p.stderr)
    return out


def fmt(v: Optional[float]) -> str:
    return "failed" if v is None else f"{v:,.0f}"


def report(runs: list[Run], args) -> str:
    systems = list(dict.fromkeys(r.system for r in runs))
    scaled = "" if args.clients_per_round == 10 else f" Scaled down: {args.clients_per_round} clients per round."
    lines = [header(f"{args.rounds} rounds per run, samples/s = median of rounds 2-{args.rounds}; "
                    f"{args.repeats} repeat(s), systems alternated run by run.{scaled}"), "",
             "| system | evaluation | samples/s (median over repeats) | per repeat | s/round |", "|---|---|---|---|---|"]
    for ev in (True, False):
        for s in systems:
            rs = [r for r in runs if r.system == s and r.eval_on == ev]
            if not rs:
                continue
            vals = [r.sps() for r in rs]
            ok = [v for v in vals if v is not None]
            if not ok:
                lines.append(f"| {s} | {'default' if ev else 'off'} | failed | "
                             f"{'; '.join(r.error or '' for r in rs)} | |")
                continue
            sec = statistics.median(statistics.median(r.seconds[1:]) for r in rs if r.sps() is not None)
            lines.append(f"| {s} | {'default' if ev else 'off'} | {fmt(statistics.median(ok))} | "
                         f"{', '.join(fmt(v) for v in vals)} | {sec:.2f} |")
    # ratios within each repeat (paired), then the median over repeats
    pairs = [("protofl FedAvg, 2 workers x 1 thread", "FL-bench, Ray parallel, 2 workers"),
             ("protofl FedAvg, sequential, 2 threads", "FL-bench, serial"),
             ("protofl FedAvg, 2 workers x 1 thread", "FL-bench, serial"),
             ("protofl FedAvg, 2 workers x 1 thread", "PFLlib"),
             ("protofl FedAvg, sequential, 2 threads", "PFLlib"),
             ("protofl FedProto, sequential, 2 threads", "protofl FedAvg, sequential, 2 threads"),
             ("protofl FedProto, 2 workers x 1 thread", "protofl FedAvg, 2 workers x 1 thread")]
    rows = []
    for ev in (True, False):
        for a, b in pairs:
            ratios = []
            for rep in range(args.repeats):
                ra = [r.sps() for r in runs if r.system == a and r.eval_on == ev and r.rep == rep]
                rb = [r.sps() for r in runs if r.system == b and r.eval_on == ev and r.rep == rep]
                if ra and rb and ra[0] and rb[0]:
                    ratios.append(ra[0] / rb[0])
            if ratios:
                rows.append(f"| {a} | {b} | {'default' if ev else 'off'} | {statistics.median(ratios):.2f}x | "
                            f"{', '.join(f'{x:.2f}' for x in ratios)} |")
    if rows:
        lines += ["", "Ratios A / B of samples/s, each from runs of the same repeat (minutes apart):", "",
                  "| A | B | evaluation | A / B (median) | per repeat |", "|---|---|---|---|---|", *rows]
    if args.floor:
        lines += ["", "protofl against its bare-loop floor (the same SGD steps with nothing around them, run "
                      "after each round):", "", "| system | evaluation | samples/s | floor samples/s | overhead |",
                  "|---|---|---|---|---|"]
        for r in runs:
            if r.floors and r.sps():
                lines.append(f"| {r.system} | {'default' if r.eval_on else 'off'} | {fmt(r.sps())} | "
                             f"{fmt(r.floor_sps())} | {100 * (r.floor_sps() / r.sps() - 1):+.1f} % |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--clients-per-round", type=int, default=10, help="10 is the workload; fewer for a quick check")
    p.add_argument("--methods", default="fedavg", help="protofl methods (the peers run FedAvg)")
    p.add_argument("--modes", default="0,2", help="protofl: 0 = sequential (2 threads); N = N worker processes")
    p.add_argument("--evals", default="default,off")
    p.add_argument("--flbench", help="FL-bench checkout (06e658b), prepared as in benchmarks/peers_setup.md")
    p.add_argument("--flbench-python", help="the Python of FL-bench's virtual environment")
    p.add_argument("--flbench-modes", default="serial,parallel")
    p.add_argument("--pfllib", help="PFLlib checkout (d832e76), prepared as in benchmarks/peers_setup.md")
    p.add_argument("--pfllib-python", help="the Python of PFLlib's virtual environment")
    p.add_argument("--floor", action="store_true", help="also measure protofl's bare-loop floor")
    p.add_argument("--peer-timeout", type=int, default=1800)
    p.add_argument("--tmp", default="/tmp/protofl-peers")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for name in ("flbench", "pfllib"):
        if getattr(args, name) and not getattr(args, f"{name}_python"):
            p.error(f"--{name} needs --{name}-python (the Python of its virtual environment)")

    jobs = []  # one repeat: every system once per evaluation setting
    for ev in (e == "default" for e in args.evals.split(",")):
        for method in args.methods.split(","):
            for w in (int(x) for x in args.modes.split(",")):
                jobs.append(lambda rep, ev=ev, method=method, w=w: run_protofl(method, w, ev, rep, args))
        if args.flbench:
            for mode in args.flbench_modes.split(","):
                name = "FL-bench, serial" if mode == "serial" else "FL-bench, Ray parallel, 2 workers"
                jobs.append(lambda rep, ev=ev, mode=mode, name=name: run_peer(
                    name, args.flbench_python, "flbench.py",
                    ["--root", args.flbench, "--mode", mode, "--workers", "2"],
                    ev, rep, args))
        if args.pfllib:
            jobs.append(lambda rep, ev=ev: run_peer("PFLlib", args.pfllib_python, "pfllib.py",
                                                    ["--root", args.pfllib], ev, rep, args))
    runs = [job(rep) for rep in range(args.repeats) for job in jobs]
    emit(report(runs, args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
