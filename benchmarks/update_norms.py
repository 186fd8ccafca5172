"""How far apart honest clients' update norms are, per method: the measure behind the
server's outlier-update rule (engine/validate.py ``update_outliers``, default 1000x the
round's median).

Every registered method runs on scikit-learn's digits (nothing to download) on two skewed
partitions -- Dirichlet(0.1) and two classes a client, 20 clients, all of them every round,
one local epoch (so a client's step count follows its data size) -- for 3 rounds, with the
rule switched off. For each round with at least three updates the script records the largest
update norm over the round's median (the rule's ratio); the page shows each method's worst.

    python benchmarks/update_norms.py            # writes benchmarks/update_norms.md

A method whose replies carry neither model weights nor an update group of its own (a
prototype-only exchange) has no update norm and reads "no update".
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from protofl.algorithms import ALGORITHMS  # noqa: E402
from protofl.config import load_config  # noqa: E402
from protofl.engine import simulation as sim_mod  # noqa: E402
from protofl.engine.validate import update_norm  # noqa: E402

PARTITIONS = {"Dir(0.1)": ["partition.name=dirichlet", "partition.beta=0.1", "partition.min_size=10"],
              "2 classes a client": ["partition.name=pathological", "partition.classes_per_client=2"]}
ROUNDS, CLIENTS = 3, 20


def worst_ratio(name: str, partition: list[str], tmp: Path) -> tuple[float | None, int]:
    """The largest (max norm / lower median) over the rounds with >= 3 updates; rounds counted."""
    ratios: list[float] = []

    def record(pairs, limit, group=None):
        norms = sorted(n for _, reply, sent in pairs if (n := update_norm(reply, sent, group)) is not None)
        if len(norms) >= 3:
            median = float(torch.tensor(norms, dtype=torch.float64).median())
            ratios.append(norms[-1] / median if median > 0 else float("inf"))
        return {}

    cfg = load_config(ROOT / "configs" / "digits.yaml",
                      [f"algorithm.name={name}", f"rounds={ROUNDS}", f"partition.num_clients={CLIENTS}",
                       "participation.fraction=1.0", "training.epochs=1", "output.progress=false",
                       "output.checkpoint_every=0", "eval.final_all_clients=false", f"output.dir={tmp}",
                       "training.update_ratio_limit=0", *partition])
    original = sim_mod.update_outliers
    sim_mod.update_outliers = record
    try:
        sim_mod.Simulation(cfg, run_dir=tmp / name).run()
    finally:
        sim_mod.update_outliers = original
    return (max(ratios) if ratios else None), len(ratios)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "update_norms.md"))
    ap.add_argument("--methods", nargs="*", help="default: every registered method")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.methods or ALGORITHMS.names()
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cells = []
            for label, part in PARTITIONS.items():
                r, n = worst_ratio(name, part, Path(tmp) / label.replace(" ", "_").replace("(", "").replace(")", ""))
                cells.append("no update" if r is None else f"{r:.1f}")
                worst = max(worst, r or 0.0)
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    lines = [
        "# Honest update norms: the largest over the round's median, per method",
        "",
        f"{datetime.date.today().isoformat()}, {platform.machine()} CPU, torch {torch.__version__}, "
        "`python benchmarks/update_norms.py`. The server's outlier-update rule rejects a reply whose "
        "model update's L2 norm exceeds `training.update_ratio_limit` (default 1000) times the round's "
        "median (engine/validate.py). Here the rule is off and every round with at least three updates "
        f"records max / median; each cell is a method's worst round. Digits, {CLIENTS} clients, all "
        f"every round, 1 local epoch, {ROUNDS} rounds, seed 0.",
        "",
        "| method | " + " | ".join(PARTITIONS) + " |",
        "|---|" + "---|" * len(PARTITIONS),
        *rows,
        "",
        f"Worst over every method and partition: {worst:.1f} x the median "
        f"({'under' if worst < 1000 else 'NOT under'} the default limit of 1000).",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
