"""``protofl demo``: FedAvg vs ReBaFL under heavy client dropout, three seeds, no download.

ReBaFL's central claim (Xu et al. 2023, "Stabilizing and Improving Federated Learning
with Non-IID Data and Client Dropout") is that it keeps the global model stable when
most clients' updates do not arrive. The demo shows it on scikit-learn's bundled 8x8
digits: 20 clients with a pathological split (2 classes each), every client asked each
round but its update arriving with probability p = 0.1 (about 2 of 20 per round, a
different pair each time), 5 local epochs, 40 rounds, seeds 0, 1, 2.

What it prints is computed from the runs it just made: the table (mean of the last 10
rounds' GM, mean ± std over seeds), and per method how far the global model moves from
one round to the next and its worst and best round over the last 10. In our runs
(2-core CPU, torch 2.13) FedAvg's GM jumps by 7-14 points per round and its worst of
the last 10 rounds is 34-62 %, ReBaFL's moves by about 1 point and never drops below
81 %; ReBaFL leads on the mean of the last 10 rounds for every seed, while FedAvg's
single best rounds come close to or beat ReBaFL's (it is not a weaker model, it is an
unstable one). It writes ``<out>/report.html`` (everything, one file) and
``<out>/demo.png`` (the curves). About 30 s of CPU time, on one core.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import cast, Optional

import numpy as np
import torch

from .api import compare, parse_methods
from .config import Config, from_dict
from .engine.checkpoint import load_torch
from .engine.server import ServerContext
from .engine.task import Task
from .models.base import FLModel
from .report import tables
from .report.plots import curves

DEMO_CONFIG = {
    "seed": 0,
    "rounds": 40,
    "data": {"name": "digits"},
    "partition": {"name": "pathological", "num_clients": 20, "classes_per_client": 2},
    "model": {"name": "mlp", "hidden": [128], "feature_dim": 64},
    "training": {"lr": 0.05, "momentum": 0.5, "epochs": 5, "batch_size": 16},
    # every client is asked; its update arrives with probability p, redrawn every round
    "participation": {"fraction": 1.0, "p": 0.1, "period": 1},
    "algorithm": {"name": "fedavg"},
    "eval": {"every": 1, "personal_every": 10},
    "execution": {"workers": 0, "threads": 1},  # tiny MLP: one process is fastest
    "output": {"checkpoint_every": 0, "progress": False},
}
DEMO_METHODS = "fedavg,rebafl"
DEMO_SEEDS = (0, 1, 2)
SELECT = "last:10"
WINDOW = tables.STABILITY_WINDOW  # rounds at the end over which stability is measured
# the shaded band of demo.png: the same as in every figure of the report (report/html.py)
BAND = "std"


def demo(out: Path, rounds: Optional[int] = None, progress: bool = True,
         seeds: tuple[int, ...] = DEMO_SEEDS) -> list[dict]:
    raw = dict(DEMO_CONFIG, rounds=rounds or DEMO_CONFIG["rounds"])
    cfg: Config = from_dict(raw)
    methods = parse_methods(DEMO_METHODS)
    p = cfg.participation
    print(f"protofl demo: {' vs '.join(methods)} on scikit-learn's digits, {cfg.partition.num_clients} clients "
          f"with 2 classes each, every update arriving with probability {p.p} (client dropout), "
          f"{cfg.training.epochs} local epochs, {cfg.rounds} rounds, seeds {', '.join(map(str, seeds))}")
    rows, out = compare(cfg, methods, list(seeds), Path(out), log=lambda m: print(m) if progress else None,
                        select=SELECT)
    groups = {label: [out / name for name in names] for label, names in _groups(out).items()}
    print()
    print(tables.to_markdown(rows, with_caption=True))
    window = min(WINDOW, cfg.rounds - 1) or 1
    print(f"Stability of the global model over the last {window} rounds (GM in %; per seed, then the mean):")
    print(f"{'':>8}  {'change per round':>18}  {'worst round':>12}  {'best round':>11}")
    for st in tables.stability_rows(groups, window):
        per = lambda k, fmt: " / ".join(format(s[k], fmt) for s in st["per_seed"])  # noqa: E731
        mean = st["mean"]
        print(f"{st['label']:>8}  {per('step', '.1f'):>18}  {per('worst', '.0f'):>12}  {per('best', '.0f'):>11}   "
              f"mean: {mean['step']:.1f} pts, worst {mean['worst']:.1f}%, best {mean['best']:.1f}%")
    print("With about 2 of 20 updates arriving per round, each a different pair of classes, FedAvg's global "
          "model follows whichever clients arrived; ReBaFL's relaxed balanced softmax and prototype feature "
          "augmentation keep its classifier calibrated to all classes (docs/methods/calibrated_softmax.md).")
    png = curves(groups, out / "demo.png", metrics=("gm", "train_loss"),
                 title=f"digits, 20 clients x 2 classes, update arrives with p = {p.p}", band=BAND)
    print(f"report: {out / 'report.html'}   tables: {out / 'compare.md'} (.tex, .csv)   curves: {png}")
    print()
    for line in next_steps(out):
        print(line)
    return rows


def next_steps(out: Path) -> list[str]:
    """What to try after the demo, and how to reach the ``protofl`` command from this
    shell: ``make demo`` runs the demo from the virtual environment without activating
    it, and ``protofl`` alone is then "command not found"."""
    bin_dir = Path(sys.executable).parent
    exe = bin_dir / ("protofl.exe" if os.name == "nt" else "protofl")
    found = shutil.which("protofl")
    lines = ["Next:"]
    if exe.exists() and (found is None or Path(found).resolve() != exe.resolve()):
        try:  # relative when under the current folder (".venv/bin" after `make demo`), else absolute
            shown = bin_dir.relative_to(Path.cwd())
        except ValueError:
            shown = bin_dir
        activate = shown / ("activate.bat" if os.name == "nt" else "activate")
        how = f"{activate}" if os.name == "nt" else f"source {activate}"
        lines.append(f"  `protofl` is in {shown}, which is not on your PATH: run `{how}` first "
                     f"(or call {shown / 'protofl'} directly)")
    lines += [f"  open {out / 'report.html'}   # the table, the stability of each method, the curves, the config",
              "  protofl list                  # methods, datasets, models, partitioners",
              "  protofl run digits rounds=5   # one run of the packaged digits config, into runs/",
              "  protofl compare digits --methods \"fedavg,fednh,rebafl\" --seeds 0,1   # a comparison of your own",
              "  protofl --help                # every command; README.md, section Quick start"]
    return lines


def _groups(out: Path) -> dict[str, list[str]]:
    return json.loads((out / "compare.json").read_text())["groups"]


def global_features(run_dir: Path, cfg: Config, max_points: int = 3000,
                    seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A finished run's global model on its test set: (features (N, 2), labels (N,),
    head rows (C, d) = the class prototype directions). At most ``max_points`` test points.
    (Used by benchmarks/fixed_heads/spiral.py.)"""
    task = Task.build(cfg)
    model = cast(FLModel, ServerContext(task).shared_model(load_torch(Path(run_dir) / "model.pt")))
    ds = task.fed.dataset
    idx = np.random.default_rng(seed).permutation(len(ds.y_test))[:max_points]
    x = ds.normalize(ds.x_test[torch.from_numpy(idx)])
    model.eval()
    with torch.inference_mode():
        h = model.body(x)
    head_rows = cast(torch.Tensor, model.head.weight)  # (C, d): a fixed head's or a linear head's
    return h.numpy(), ds.y_test[torch.from_numpy(idx)].numpy(), head_rows.detach().numpy().copy()
