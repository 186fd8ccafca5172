"""Reproduce the ReBaFL paper's Fashion-MNIST results (Xu et al. 2023, arXiv:2303.06314).

Setting (configs/rebafl_pathological.yaml): pathological label skew, 2 classes and 1,000
samples per client, m = 20 clients, each update arrives with probability p = 0.5, E = 5
local epochs, B = 50, SGD lr 0.01 (momentum 0.5, weight decay 5e-4), ``cnn_fmnist``;
metric: the global model's accuracy on the balanced test set (GM).

    python benchmarks/calibrated_softmax/reproduce.py table    --rounds R --workers W --data-dir DATA
    python benchmarks/calibrated_softmax/reproduce.py ablation --rounds R --workers W --data-dir DATA
    python benchmarks/calibrated_softmax/reproduce.py curve    --rounds R --workers W --data-dir DATA
    python benchmarks/calibrated_softmax/reproduce.py all      --rounds R --workers W --data-dir DATA

* table:    Table 1: FedAvg, FedProx, FedRS, FedLC, BSM-FedAvg, ReBaFL  -> table1.md
* ablation: R-BSM only / F-Aug only / both (+ FedAvg)                   -> ablation.md
* curve:    FedAvg and ReBaFL with p = 0.1 and p = 0.5, GM per round     -> dropout_curve.png
Every command also rewrites RESULTS.md (the tables found so far) in --results-dir.

Runs go to --runs (default runs/calibrated_softmax), one folder per (method, seed,
config); a finished run is reused, an interrupted one resumes from its checkpoint, so
the commands can be re-run and share runs (ReBaFL at p = 0.5 serves all three).
``--set key=value`` adds config overrides (e.g. for a quick smoke test).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = REPO / "configs" / "rebafl_pathological.yaml"

# Table 1 of the paper (FMNIST, m = 20, p = 0.5), GM in %
PAPER = {"FedAvg": 75.27, "FedProx": 75.36, "FedRS": 72.46, "FedLC": 68.75, "BSM-FedAvg": 68.64,
         "ReBaFL": 78.81}
# label -> (run name, method spec for protofl.api.parse_methods); FedProx mu, FedRS alpha
# and FedLC tau as in the ReBaFL authors' baselines
TABLE = {
    "FedAvg": ("fedavg", "fedavg"),
    "FedProx": ("fedprox", "fedprox(mu=0.001)"),
    "FedRS": ("fedrs", "fedrs(alpha=0.5)"),
    "FedLC": ("fedlc", "fedlc(tau=1.0)"),
    "BSM-FedAvg": ("bsmfedavg", "bsmfedavg"),
    "ReBaFL": ("rebafl", "rebafl"),
}
ABLATION = {
    "FedAvg (neither)": ("fedavg", "fedavg"),
    "R-BSM only": ("rebafl_rbsm", "rebafl(faug=false)"),
    "F-Aug only": ("rebafl_faug", "rebafl(rbsm=false)"),
    "R-BSM + F-Aug (ReBaFL)": ("rebafl", "rebafl"),
}
CURVE = {"FedAvg": ("fedavg", "fedavg"), "ReBaFL": ("rebafl", "rebafl")}
LAST = 10  # "last" = mean GM over the last LAST evaluated rounds


def base_config(args, extra=()):
    from protofl.config import load_config

    overrides = [f"rounds={args.rounds}", f"execution.workers={args.workers}", "output.progress=false",
                 *(["execution.threads=1"] if args.workers == 0 else []), *args.set, *extra]
    if args.data_dir:
        overrides.append(f"data.root={args.data_dir}")
    return load_config(CONFIG, overrides)


def run_grid(cfg, spec: dict, seeds: list[int], runs: Path) -> dict[str, list[Path]]:
    """Run (or reuse) every (method, seed); returns label -> run folders."""
    from protofl import api
    from protofl.engine.simulation import run_dir_for

    methods = api.parse_methods(",".join(f"{name}={m}" for name, m in spec.values()))
    api.compare(cfg, methods, seeds, runs, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = {}
    for label, (name, _) in spec.items():
        dirs = []
        for seed in seeds:
            c = api.grid_config(cfg, methods[name], seed, name)
            c.output.dir = str(runs)
            dirs.append(run_dir_for(c))
        out[label] = dirs
    return out


def stats(dirs: list[Path]) -> dict:
    """Final / last-LAST mean / best GM (%) as mean ± std over seeds, rounds, s/round."""
    from protofl.engine.simulation import METRICS, read_rows
    from protofl.report.tables import mean_std

    final, last, best, rounds, secs = [], [], [], [], []
    for d in dirs:
        s = json.loads((d / "summary.json").read_text())
        gms = [r["gm"] for r in read_rows(d / METRICS) if "gm" in r]
        final.append(100 * gms[-1])
        last.append(100 * float(np.mean(gms[-LAST:])))
        best.append(100 * max(gms))
        rounds.append(s["rounds_completed"])
        secs.append(s["mean_round_s"])

    return {"final": mean_std(final), "last": mean_std(last), "best": mean_std(best), "rounds": min(rounds),
            "s_per_round": float(np.mean(secs)), "seeds": len(dirs)}


def fmt(m_s) -> str:
    m, s = m_s
    return f"{m:.2f}" if s == 0 else f"{m:.2f} ± {s:.2f}"


def markdown(rows: dict[str, dict], paper: dict | None) -> str:
    from protofl.report.tables import markdown as table

    head = ["method", *(["paper GM (%)"] if paper else []), "GM final (%)", f"GM last {LAST} (%)",
            "GM best (%)", *(["final − paper"] if paper else []), "rounds", "seeds", "s/round"]
    body = []
    for label, st in rows.items():
        cells = [label]
        if paper:
            cells.append(f"{paper[label]:.2f}")
        cells += [fmt(st["final"]), fmt(st["last"]), fmt(st["best"])]
        if paper:
            cells.append(f"{st['final'][0] - paper[label]:+.2f}")
        cells += [str(st["rounds"]), str(st["seeds"]), f"{st['s_per_round']:.1f}"]
        body.append(cells)
    return table(head, body)


def comparison(rows: dict[str, dict]) -> str:
    """Facts for the sentence on how our numbers compare with the paper's."""
    ours = sorted(rows, key=lambda k: -rows[k]["final"][0])
    theirs = sorted(PAPER, key=lambda k: -PAPER[k])
    gap = rows["ReBaFL"]["final"][0] - rows["FedAvg"]["final"][0]
    return (f"Ranking by final GM, ours: {' > '.join(ours)}; paper: {' > '.join(theirs)}. "
            f"ReBaFL − FedAvg: {gap:+.2f} points (paper {PAPER['ReBaFL'] - PAPER['FedAvg']:+.2f}).\n")


def settings(cfg) -> str:
    pp = cfg.partition.params
    return (f"Fashion-MNIST, {cfg.partition.name} {pp.get('classes_per_client')} classes x "
            f"{pp.get('samples_per_client')} samples, m = {cfg.partition.num_clients}, "
            f"p = {cfg.participation.p}, E = {cfg.training.epochs}, B = {cfg.training.batch_size}, "
            f"lr {cfg.training.lr}, momentum {cfg.training.momentum}, weight decay "
            f"{cfg.training.weight_decay}, {cfg.model.name}, {cfg.rounds} rounds (paper: 200). "
            f"GM = global model accuracy on the balanced test set; final = last round, last {LAST} = "
            f"mean over the last {LAST} rounds. s/round measured with execution.workers = "
            f"{cfg.execution.workers}.\n")


# ---------------------------------------------------------------------------------------
def cmd_table(args, seeds, runs, out: Path) -> None:
    cfg = base_config(args)
    rows = {label: stats(d) for label, d in run_grid(cfg, TABLE, seeds, runs).items()}
    text = ("## Table 1 (FMNIST, m = 20, p = 0.5)\n\n" + settings(cfg) + "\n" + markdown(rows, PAPER)
            + "\n" + comparison(rows))
    (out / "table1.md").write_text(text)
    print(text)


def cmd_ablation(args, seeds, runs, out: Path) -> None:
    cfg = base_config(args)
    rows = {label: stats(d) for label, d in run_grid(cfg, ABLATION, seeds, runs).items()}
    text = ("## Ablation (FMNIST, m = 20, p = 0.5)\n\n" + settings(cfg)
            + "R-BSM only: `rebafl(faug=false)`; F-Aug only: `rebafl(rbsm=false)` (plain softmax for "
              "both loss terms). No paper numbers are listed here for this ablation.\n\n"
            + markdown(rows, None))
    (out / "ablation.md").write_text(text)
    print(text)


def cmd_curve(args, seeds, runs, out: Path) -> None:
    from protofl.report.plots import curves

    groups = {}
    for p in (0.1, 0.5):
        cfg = base_config(args, [f"participation.p={p}"])
        for label, dirs in run_grid(cfg, CURVE, seeds, runs).items():
            groups[f"{label}, p = {p}"] = dirs
    png = curves(groups, out / "dropout_curve.png", metrics=("gm",),
                 title="FMNIST, m = 20: GM under client dropout")
    print(f"plot: {png}")


def write_results(out: Path) -> None:
    parts = ["# Calibrated-softmax methods under client dropout: reproduction\n",
             "Written by `benchmarks/calibrated_softmax/reproduce.py`; see its docstring for the commands.\n"]
    for name in ("table1.md", "ablation.md"):
        if (out / name).exists():
            parts.append((out / name).read_text())
    if (out / "dropout_curve.png").exists():
        parts.append("## Dropout curve\n\n![GM per round, p = 0.1 vs 0.5](dropout_curve.png)\n")
    (out / "RESULTS.md").write_text("\n".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["table", "ablation", "curve", "all"])
    ap.add_argument("--rounds", type=int, required=True, help="communication rounds per run (paper: 200)")
    ap.add_argument("--workers", type=int, default=0, help="execution.workers: client processes (0 = in-process)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--data-dir", help="data root holding fashion-mnist/ (default: $PROTOFL_DATA)")
    ap.add_argument("--runs", default="runs/calibrated_softmax", help="folder for the run folders")
    ap.add_argument("--results-dir", default=str(HERE), help="where the markdown tables and PNG go")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.workers < 0:
        ap.error("--rounds must be >= 1 and --workers >= 0")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs, out = Path(args.runs), Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    todo = ["table", "ablation", "curve"] if args.what == "all" else [args.what]
    for what in todo:
        {"table": cmd_table, "ablation": cmd_ablation, "curve": cmd_curve}[what](args, seeds, runs, out)
        write_results(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
