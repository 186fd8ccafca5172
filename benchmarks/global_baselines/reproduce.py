"""Global-model baselines (SCAFFOLD, FedDyn, MOON, CReFF, FedGen) beside FedAvg.

    python benchmarks/global_baselines/reproduce.py fmnist --rounds R --data-dir DATA
    python benchmarks/global_baselines/reproduce.py rebafl --rounds R --data-dir DATA

* fmnist: Fashion-MNIST, 100 clients, Dirichlet(0.3), 10% per round, cnn_fmnist, E = 5
  (configs/fednh_fmnist.yaml, the table of the other FMNIST baselines): FedAvg and the five.
  No paper reports this setting; orderings only.                              -> fmnist.md
* rebafl: the ReBaFL paper's Table 1 setting (configs/rebafl_pathological.yaml: FMNIST,
  pathological 2 classes x 1,000 samples, m = 20, p = 0.5): FedAvg, SCAFFOLD, FedDyn and
  MOON, the methods of the five that Table 1 lists, paper numbers beside.    -> rebafl_table1.md

Every method runs with its module's defaults (the papers'). Runs go to --runs (default
runs/global_baselines); a finished run is reused, an interrupted one resumes. The run
bookkeeping and the GM statistics are those of benchmarks/calibrated_softmax/reproduce.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

_spec = importlib.util.spec_from_file_location("calibrated_softmax_reproduce",
                                               HERE.parent / "calibrated_softmax" / "reproduce.py")
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)

FIVE = {"SCAFFOLD": ("scaffold", "scaffold"), "FedDyn": ("feddyn", "feddyn"), "MOON": ("moon", "moon"),
        "CReFF": ("creff", "creff"), "FedGen": ("fedgen", "fedgen")}
FMNIST = {"FedAvg": ("fedavg", "fedavg"), **FIVE}
# ReBaFL paper (Xu et al. 2023, arXiv:2303.06314), Table 1, FMNIST, m = 20, p = 0.5, GM in %
PAPER = {"FedAvg": 75.27, "SCAFFOLD": 63.48, "FedDyn": 77.98, "MOON": 65.35}
REBAFL = {"FedAvg": ("fedavg", "fedavg"), "SCAFFOLD": FIVE["SCAFFOLD"], "FedDyn": FIVE["FedDyn"],
          "MOON": FIVE["MOON"]}


def config(path: Path, args):
    from protofl.config import load_config

    overrides = [f"rounds={args.rounds}", f"execution.workers={args.workers}", "output.progress=false",
                 *(["execution.threads=1"] if args.workers == 0 else []), *args.set]
    if args.data_dir:
        overrides.append(f"data.root={args.data_dir}")
    return load_config(path, overrides)


def ordering(rows: dict, paper: dict | None) -> str:
    ours = sorted(rows, key=lambda k: -rows[k]["final"][0])
    text = f"Ranking by final GM, ours: {' > '.join(ours)}"
    if paper:
        text += f"; paper: {' > '.join(sorted(paper, key=lambda k: -paper[k]))}"
    return text + ".\n"


def settings(cfg) -> str:
    pp, tc = cfg.partition.params, cfg.training
    part = (f"Dirichlet({pp.get('beta')})" if cfg.partition.name == "dirichlet"
            else f"pathological {pp.get('classes_per_client')} classes x {pp.get('samples_per_client')} samples")
    return (f"Fashion-MNIST, {cfg.partition.num_clients} clients, {part}, participation fraction "
            f"{cfg.participation.fraction}, p = {cfg.participation.p}, E = {tc.epochs}, B = {tc.batch_size}, "
            f"lr {tc.lr}, momentum {tc.momentum}, weight decay {tc.weight_decay}, {cfg.model.name}, seed(s) "
            f"{cfg.seed}, **{cfg.rounds} rounds**, GM evaluated every {cfg.eval.every} round(s). "
            f"final = last round, last {cs.LAST} = mean over the last {cs.LAST} evaluations.\n")


def table(args, seeds, runs: Path, out: Path, what: str) -> None:
    path, spec, paper, name, title = {
        "fmnist": (REPO / "configs" / "fednh_fmnist.yaml", FMNIST, None, "fmnist.md",
                   "FMNIST, 100 clients, Dirichlet(0.3), 10% per round"),
        "rebafl": (REPO / "configs" / "rebafl_pathological.yaml", REBAFL, PAPER, "rebafl_table1.md",
                   "ReBaFL Table 1 setting (FMNIST, pathological 2 classes, m = 20, p = 0.5)"),
    }[what]
    if args.only:
        keep = {x.strip() for x in args.only.split(",")}
        spec = {label: v for label, v in spec.items() if label in keep or v[0] in keep}
    cfg = config(path, args)
    rows = {label: cs.stats(d) for label, d in cs.run_grid(cfg, spec, seeds, runs).items()}
    text = f"#### {title}\n\n" + settings(cfg) + "\n" + cs.markdown(rows, paper) + "\n" + ordering(rows, paper)
    (out / name).write_text(text)
    print(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["fmnist", "rebafl", "all"])
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--workers", type=int, default=0, help="execution.workers (0 = in-process)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--data-dir", help="data root holding fashion-mnist/ (default: $PROTOFL_DATA)")
    ap.add_argument("--runs", default="runs/global_baselines", help="folder for the run folders")
    ap.add_argument("--results-dir", default=str(HERE), help="where the markdown tables go")
    ap.add_argument("--only", help="comma-separated rows to run (labels or registry names), e.g. scaffold,moon")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.workers < 0:
        ap.error("--rounds must be >= 1 and --workers >= 0")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    for what in (["fmnist", "rebafl"] if args.what == "all" else [args.what]):
        table(args, seeds, Path(args.runs), out, what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
