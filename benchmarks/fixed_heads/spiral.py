"""FedNH's motivating example (Dai et al., AAAI 2023, section 3.1, Figures 1-2) on the
6-class 2-D spiral with the 5-layer MLP ``mlp2d`` (2-D features).

Part ``central`` (configs/spiral_central.yaml): centralized training (one client holding
all the data, one epoch per round) with a free linear head (``fedavg``) and with the
uniform fixed head (``feduh``: maximally separated unit prototypes, a regular hexagon),
on the balanced (3000 per class) and the imbalanced (3000/1500/750/375/187/93) spiral.
Reported: per-class accuracy on the balanced test set (the minority classes are 3, 4, 5)
and the 2-D test features with the class prototype directions.

Part ``federated`` (configs/spiral.yaml): the spiral split over 100 clients with
Dirichlet(0.3), 10% participation, FedAvg vs FedNH (and FedUH): GM, PM(V), PM(L), PA, GA
with the clients' fairness std, GM per class, and the global models' 2-D features.

    python benchmarks/fixed_heads/spiral.py                 # both parts, full settings
    python benchmarks/fixed_heads/spiral.py --part central  # or --part federated
    python benchmarks/fixed_heads/spiral.py --smoke         # a few rounds, results to <runs>/smoke

Results (markdown tables and PNGs) go to --results (default: this folder; with --smoke:
<runs>/smoke); run folders to --runs (default runs/fixed_heads). Completed runs are
reused, so an interrupted reproduction continues where it stopped.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


from protofl.api import compare, is_complete, parse_methods
from protofl.api import run as run_one
from protofl.config import load_config
from protofl.data.datasets import SPIRAL_IMBALANCED_COUNTS
from protofl.demo import global_features
from protofl.engine.simulation import METRICS, read_rows
from protofl.report.plots import curves, features_2d

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "configs"
sys.path.insert(0, str(HERE))
from _common import PAPER_NOTE_SPIRAL, fairness_table, markdown, pct  # noqa: E402

# (data, head label, algorithm)
CENTRAL = [
    ("balanced", "free head", "fedavg"),
    ("balanced", "fixed head (FedUH)", "feduh"),
    ("imbalanced", "free head", "fedavg"),
    ("imbalanced", "fixed head (FedUH)", "feduh"),
]
FEDERATED_METHODS = "fedavg,feduh,fednh"
PLOTTED = ("fedavg", "fednh")


def last_eval(rows: list[dict]) -> dict:
    return next(r for r in reversed(rows) if "gm_per_class" in r)


def central(args, results: Path) -> str:
    runs = Path(args.runs) / "central"
    table, panels = [], {}
    for data, head, algo in CENTRAL:
        over = [f"algorithm.name={algo}", f"data.imbalanced={str(data == 'imbalanced').lower()}",
                f"output.dir={runs}", "output.progress=false", f"execution.threads={args.threads}", *args.set]
        if args.rounds:
            over.append(f"rounds={args.rounds}")
        cfg = load_config(CONFIGS / "spiral_central.yaml", over)
        # the folder names the settings (--set data.noise=... must not reuse another noise's run)
        cfg.output.name = f"{data}-{algo}-{cfg.fingerprint()}"
        run_dir = runs / cfg.output.name
        t0 = time.perf_counter()
        if not is_complete(run_dir, cfg.rounds):
            run_one(cfg, resume=True, run_dir=run_dir)
        print(f"[central] {data:10s} {head:20s} {cfg.rounds} epochs  {time.perf_counter() - t0:6.1f} s",
              file=sys.stderr)
        row = last_eval(read_rows(run_dir / METRICS))
        acc = row["gm_per_class"]
        table.append([data, head, *(pct(a) for a in acc), pct(row["gm"]), pct(min(acc[3:]))])
        h, y, W = global_features(run_dir, cfg)
        panels[f"{data} / {head}\nGM {100 * row['gm']:.1f}%"] = (h, y, W)
    png = features_2d(panels, results / "spiral_central.png",
                      title="spiral, centralized: 2-D test features and prototype directions (arrows)")
    counts = " / ".join(str(c) for c in SPIRAL_IMBALANCED_COUNTS)
    text = (f"## Spiral, centralized ({cfg.rounds} epochs, mlp2d, 2-D features)\n\n"
            f"Per-class accuracy (%) on the balanced test set (3000 per class). Imbalanced training "
            f"counts per class: {counts} (classes 3-5 are the minority).\n\n"
            + markdown(["data", "head", *(f"class {c}" for c in range(6)), "all (GM)", "worst of 3-5"], table)
            + f"\nFeatures: {png.name}\n")
    return text


def federated(args, results: Path) -> str:
    over = [f"execution.threads={args.threads}", "output.progress=false", *args.set]
    if args.rounds:
        over.append(f"rounds={args.rounds}")
    cfg = load_config(CONFIGS / "spiral.yaml", over)
    methods = parse_methods(args.methods)
    out = Path(args.runs) / "federated"
    t0 = time.perf_counter()
    compare(cfg, methods, [cfg.seed], out, log=lambda m: print(m, file=sys.stderr))
    print(f"[federated] {cfg.rounds} rounds, {len(methods)} methods: {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    groups = {label: sorted(out.glob(f"{label}-s{cfg.seed}-*"))[-1:] for label in methods}
    per_class, panels = [], {}
    for label, dirs in groups.items():
        row = last_eval(read_rows(dirs[0] / METRICS))
        per_class.append([label, *(pct(a) for a in row["gm_per_class"]), pct(row["gm"])])
        if label in PLOTTED:
            c = load_config(CONFIGS / "spiral.yaml", [*over, f"algorithm.name={methods[label]['algorithm']['name']}"])
            h, y, W = global_features(dirs[0], c)
            panels[f"{label}: global model, GM {100 * row['gm']:.1f}%"] = (h, y, W)
    png = features_2d(panels, results / "spiral_federated.png",
                      title="spiral, 100 clients, Dir(0.3): global models' 2-D features and prototypes")
    cpng = curves(groups, results / "spiral_federated_curves.png", metrics=("gm", "pm_l", "pa"),
                  title="spiral, 100 clients, Dir(0.3)")
    imb = "imbalanced" if cfg.data.params.get("imbalanced") else "balanced"
    text = (f"## Spiral, federated ({imb}; 100 clients, Dir(0.3), 10% per round, {cfg.rounds} rounds)\n\n"
            + fairness_table(groups)
            + "\nGM per class (%):\n\n"
            + markdown(["method", *(f"class {c}" for c in range(6)), "all (GM)"], per_class)
            + f"\nFeatures: {png.name}; curves: {cpng.name}\n")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["central", "federated", "all"], default="all")
    p.add_argument("--smoke", action="store_true", help="3 rounds/epochs, results to <runs>/smoke")
    p.add_argument("--rounds", type=int, help="rounds (federated) / epochs (central); default: the configs'")
    p.add_argument("--methods", default=FEDERATED_METHODS, help=f"federated part (default {FEDERATED_METHODS})")
    p.add_argument("--runs", default="runs/fixed_heads", help="run folders (default runs/fixed_heads)")
    p.add_argument("--results", help="tables and plots (default: this folder)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: the MLP is tiny)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run, e.g. --set data.imbalanced=true")
    args = p.parse_args()
    if args.smoke:
        args.rounds = args.rounds or 3
        args.runs = str(Path(args.runs) / "smoke")
    results = Path(args.results) if args.results else (Path(args.runs) if args.smoke else HERE)
    results.mkdir(parents=True, exist_ok=True)
    parts = ["central", "federated"] if args.part == "all" else [args.part]
    for part in parts:
        text = (central if part == "central" else federated)(args, results) + "\n" + PAPER_NOTE_SPIRAL
        path = results / f"spiral_{part}.md"
        path.write_text(text)
        print(text)
        print(f"-> {path}\n")


if __name__ == "__main__":
    main()
