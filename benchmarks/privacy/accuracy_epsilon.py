"""Accuracy against epsilon: weights vs prototypes under differential privacy.

Setting (configs/fednh_fmnist.yaml, the "cpu" scale of protofl's Fashion-MNIST benchmarks):
100 clients with Dirichlet(0.3) label skew, 10 % of them per round, 5 local epochs, batch
64, SGD lr 0.01 momentum 0.9, cnn_fmnist. Mechanisms (docs/privacy.md):

* FedAvg, client-level DP (DP-FedAvg): each update clipped to norm 1, Gaussian noise on
  the server, Poisson client sampling (q = 0.1); protects one client's participation;
* FedProto, private prototypes: features clipped to norm ``PROTO_CLIP``, noisy class sums
  and counts; protects one training sample; FedProto sends nothing else;
* FedNH, private prototypes: its unit-norm features (clip 1), eq. (3)'s means private;
  protects one sample *in the prototypes only* -- its model weights travel unprotected;
* FedAvg, DP-SGD: per-sample gradients clipped to norm 1, noise on every step; protects
  one training sample.

For every target epsilon (``--epsilons``, at delta 1e-5, by the end of the run) the noise
multiplier is calibrated before the run (``protofl.engine.privacy.noise_for_epsilon``, the
run's own accountant on its planned participation), so every point spends the same epsilon;
the rows without privacy are the reference. Per point and seed one ``protofl run``; runs
already complete are reused. The table gives GA (GM for methods with a global model;
FedProto has none: the mean accuracy of its clients' models on the global test set) and PA
at the last evaluation, mean ± std over seeds, and the epsilon spent; the figure plots GA
against epsilon.

    python benchmarks/privacy/accuracy_epsilon.py --data-dir DATA                 # full: 3 seeds
    python benchmarks/privacy/accuracy_epsilon.py --data-dir DATA --smoke         # minutes

Results: ``accuracy_epsilon.md`` and ``accuracy_epsilon.png`` in --results (default this
folder; with --smoke: <runs>/smoke).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parents[1] / "configs" / "fednh_fmnist.yaml"
PROTO_CLIP = 5.0  # FedProto's raw cnn_fmnist features (ReLU, 128-d): the norm bound of one sample's

MECHANISMS = {  # label: (method, privacy overrides; None: the reference without privacy)
    "FedAvg": ("fedavg", None),
    "FedAvg, client-level DP": ("fedavg", ["privacy.mode=client", "privacy.clip=1.0",
                                           "participation.sampling=poisson"]),
    "FedAvg, DP-SGD": ("fedavg", ["privacy.mode=sample", "privacy.clip=1.0"]),
    "FedProto": ("fedproto", None),
    "FedProto, private prototypes": ("fedproto", ["privacy.mode=prototype", f"privacy.clip={PROTO_CLIP}"]),
    "FedNH": ("fednh", None),
    "FedNH, private prototypes": ("fednh", ["privacy.mode=prototype", "privacy.clip=1.0"]),
}
SMOKE = ["rounds=3", "partition.num_clients=20", "participation.fraction=0.2", "training.epochs=1", "eval.every=1"]


def final(rows: list[dict], key: str) -> float:
    v = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return float(v[-1]) if v else float("nan")


def main() -> None:
    from protofl import run
    from protofl.api import check_task, is_complete
    from protofl.config import load_config
    from protofl.engine.privacy import noise_for_epsilon
    from protofl.engine.simulation import read_rows
    from protofl.report.plots import _save, accuracy_epsilon_figure
    from protofl.report.tables import markdown, pct

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="folder holding fashion-mnist/ (default: $PROTOFL_DATA)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epsilons", default="1,2,4,8")
    p.add_argument("--rounds", type=int, help="default: the config's (200)")
    p.add_argument("--mechanisms", default=";".join(MECHANISMS), help="labels, separated by ';'")
    p.add_argument("--smoke", action="store_true", help="3 rounds, 20 clients, 1 epoch, seed 0, epsilon 8")
    p.add_argument("--runs", default="runs/privacy/accuracy_epsilon")
    p.add_argument("--results", help="default: this folder (with --smoke: <runs>/smoke)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. execution.workers=2")
    args = p.parse_args()
    seeds = [int(s) for s in ("0" if args.smoke else args.seeds).split(",")]
    epsilons = [float(e) for e in ("8" if args.smoke else args.epsilons).split(",")]
    base = (SMOKE if args.smoke else []) + [*(["data.root=" + args.data_dir] if args.data_dir else []),
                                            *([f"rounds={args.rounds}"] if args.rounds else []),
                                            "output.progress=false",
                                            # a client whose model the noise sent to NaN loses its reply
                                            # (an honest outcome of strong noise), not the whole run
                                            "training.on_nonfinite=drop", *args.overrides]
    out = Path(args.runs) / ("smoke" if args.smoke else "")
    results = Path(args.results) if args.results else (out if args.smoke else HERE)
    labels = [m.strip() for m in args.mechanisms.split(";")]
    t0 = time.perf_counter()
    points: dict[str, list] = {}
    references: dict[str, float] = {}
    table = []
    for label in labels:
        method, privacy = MECHANISMS[label]
        for eps in ([None] if privacy is None else epsilons):
            per_seed = []
            for seed in seeds:
                over = [*base, f"seed={seed}", f"algorithm.name={method}", *(privacy or [])]
                slug = label.lower().replace(", ", "-").replace(" ", "_")
                name = f"{slug}-s{seed}" if privacy is None else f"{slug}-eps{eps:g}-s{seed}"
                run_dir = out / name
                if not is_complete(run_dir, load_config(CONFIG, over).rounds):
                    cfg = load_config(CONFIG, over)
                    if privacy is not None:
                        task = check_task(cfg)
                        sigma = noise_for_epsilon(cfg, eps, task.algorithm, [len(i) for i in task.fed.train_idx])
                        over.append(f"privacy.noise_multiplier={sigma:.6g}")
                    print(f"[run] {name}", flush=True)
                    run(load_config(CONFIG, [*over, f"output.dir={out}", f"output.name={name}"]), resume=True)
                rows = read_rows(run_dir / "metrics.jsonl")
                cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
                per_seed.append((final(rows, "ga"), final(rows, "pa"), final(rows, "epsilon"),
                                 (cfg.get("privacy") or {}).get("noise_multiplier", 0.0)))
            ga, pa, spent, sigma = (np.array(v, dtype=np.float64) for v in zip(*per_seed))
            sd = (lambda v: float(v.std(ddof=1)) if len(v) > 1 else float("nan"))
            table.append([label, "–" if privacy is None else f"{eps:g}",
                          "–" if privacy is None else f"{np.mean(spent):.2f}",
                          "–" if privacy is None else f"{np.mean(sigma):.3g}",
                          pct(float(ga.mean()), sd(ga)), pct(float(pa.mean()), sd(pa)), str(len(seeds))])
            if privacy is not None:
                points.setdefault(label, []).append((float(np.mean(spent)), float(ga.mean()), sd(ga)))
            else:
                references[label] = float(ga.mean())
    cfg = load_config(CONFIG, base)
    head = ["mechanism", "target ε", "ε spent", "noise σ", "GA (%)", "PA (%)", "seeds"]
    best = []
    for eps in epsilons:
        at = [(r[4], r[0]) for r in table if r[1] == f"{eps:g}"]
        if at:
            acc, who = max(at, key=lambda a: float(a[0].split(" ")[0]) if a[0] != "–" else -1)
            best.append(f"at ε = {eps:g}, {who} keeps the most accuracy (GA {acc} %)")
    text = (f"## Accuracy against ε: Fashion-MNIST, {cfg.partition.num_clients} clients, "
            f"Dir({cfg.partition.params['beta']}), {cfg.participation.fraction:.0%} per round, {cfg.training.epochs} "
            f"local epochs, {cfg.model.name}, {cfg.rounds} rounds, δ = {cfg.privacy.delta:g}\n\n"
            + markdown(head, table)
            + "\nGA, PA at the last evaluation, mean ± sample std over seeds. ε spent: by the end of the run "
              "(client-level: one client's participation; prototypes and DP-SGD: one training sample of the most "
              "exposed client); noise σ: calibrated before the run to the target. FedNH's private-prototype rows "
              "protect its prototypes only (its weights travel without protection).\n\n"
            + ("This run: " + "; ".join(best) + ".\n" if best else "")
            + f"\nWall time of this invocation: {(time.perf_counter() - t0) / 60:.1f} min (complete runs reused).\n")
    results.mkdir(parents=True, exist_ok=True)
    (results / "accuracy_epsilon.md").write_text(text)
    if points:
        _save(accuracy_epsilon_figure(points, title="GA against ε (mean ± std over seeds)", references=references),
              results / "accuracy_epsilon.png")
    print(text)
    print(f"-> {results / 'accuracy_epsilon.md'}")


if __name__ == "__main__":
    sys.exit(main())
