"""Accuracy against epsilon: weights vs prototypes under differential privacy.

Setting (configs/fednh_fmnist.yaml, protofl's Fashion-MNIST benchmark setting):
100 clients with Dirichlet(0.3) label skew, 10 % of them per round, 5 local epochs, batch
64, SGD lr 0.01 momentum 0.9, cnn_fmnist. Mechanisms (docs/privacy.md):

* FedAvg, client-level DP (DP-FedAvg): each update clipped to norm 1, Gaussian noise on
  the server, Poisson client sampling (q = 0.1); protects one client's participation;
* FedAvg, DP-SGD (``privacy.mode: sample``): Poisson-sampled batches, per-sample gradients
  clipped to norm 1, noise on every step; protects one training sample;
* FedProto, DP-SGD + private prototypes (``privacy.mode: sample``): its local model trained
  by DP-SGD (clip 1), its prototypes released from features clipped to norm
  ``PROTO_CLIP`` (``privacy.feature_clip``; noisy class sums and counts); protects one
  training sample of all it sends;
* FedNH, DP-SGD + private prototypes: the same, its unit-norm features (clip 1): its
  weights and its prototypes are protected together.

Every row under privacy has secret noise (``privacy.noise: secret``, the default).

For every target epsilon (``--epsilons``, at delta 1e-5, by the end of the run) the run
calibrates its noise multiplier at its start (``privacy.calibrate``: the run's own
accountant on its planned participation and its clients' released label counts), so every
point spends its target; the rows without privacy are the reference. Per point and seed one ``protofl run``; runs
already complete are reused. The table gives GA (GM for methods with a global model;
FedProto has none: the mean accuracy of its clients' models on the global test set) and PA
at the last evaluation, mean ± std over seeds, and the epsilon spent; the figure plots GA
against epsilon.

Scales (``--scale``; seeds and epsilons fixed here, before any run):

* ``full``: the config's 200 rounds on all 60,000 training images; seeds 0, 1, 2; epsilon
  1, 2, 4, 8. About 40-50 hours on 2 CPU cores (README.md).
* ``cpu``: the scale of protofl's comparison page (benchmarks/comparison/family.py): 20
  rounds, a seeded 20,000 of the training images (200 a client on average), evaluation
  after rounds 10 and 20; seeds 0, 1, 2; epsilon 1, 2, 4, 8.
* ``smoke``: 3 rounds, 20 clients, 1 epoch, seed 0, epsilon 8: checks that the script works.

    python benchmarks/privacy/accuracy_epsilon.py --data-dir DATA --scale cpu --jobs 2 \
        execution.workers=0 execution.threads=1                                  # 2 runs at once
    python benchmarks/privacy/accuracy_epsilon.py --data-dir DATA --scale smoke   # minutes

Results: ``accuracy_epsilon.md`` / ``.png`` (scale full) or ``accuracy_epsilon_cpu.md`` /
``.png`` in --results (default this folder; scale smoke: <runs>/smoke). Runs go to
<runs>/<scale>. ``--records FILE`` also writes what the page reads of every run (its
config without machine paths, and per round GA, PA, epsilon, the replies and the wall
time) to one gzip file of JSON lines; ``--no-run --records FILE`` makes the page from that
file alone, and a test rebuilds the committed page from its committed records:

    python benchmarks/privacy/accuracy_epsilon.py --scale cpu --no-run \
        --records benchmarks/privacy/records/accuracy_epsilon_cpu.jsonl.gz
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness import header, read_json_lines, shown_command, write_json_lines  # noqa: E402

CONFIG = HERE.parents[1] / "configs" / "fednh_fmnist.yaml"
CHANCE_MARGIN = 0.02  # GA within 2 points of chance (1/C): the run's model learned nothing
PROTO_CLIP = 5.0  # FedProto's raw cnn_fmnist features (ReLU, 128-d): the norm bound of one sample's

MECHANISMS = {  # label: (method, privacy overrides; None: the reference without privacy)
    "FedAvg": ("fedavg", None),
    "FedAvg, client-level DP": ("fedavg", ["privacy.mode=client", "privacy.clip=1.0",
                                           "participation.sampling=poisson"]),
    "FedAvg, DP-SGD": ("fedavg", ["privacy.mode=sample", "privacy.clip=1.0"]),
    "FedProto": ("fedproto", None),
    "FedProto, DP-SGD + private prototypes": ("fedproto", ["privacy.mode=sample", "privacy.clip=1.0",
                                                                 f"privacy.feature_clip={PROTO_CLIP}"]),
    "FedNH": ("fednh", None),
    "FedNH, DP-SGD + private prototypes": ("fednh", ["privacy.mode=sample", "privacy.clip=1.0"]),
}
SCALES = {  # scale: (seeds, epsilons, overrides)
    "full": ([0, 1, 2], [1.0, 2.0, 4.0, 8.0], []),
    "cpu": ([0, 1, 2], [1.0, 2.0, 4.0, 8.0], ["rounds=20", "data.train_size=20000", "eval.every=10",
                                              "eval.personal_every=20", "eval.final_all_clients=false"]),
    "smoke": ([0], [8.0], ["rounds=3", "partition.num_clients=20", "participation.fraction=0.2",
                           "training.epochs=1", "eval.every=1"]),
}


# what the page reads of a run's rows
ROW_KEYS = ("round", "ga", "pa", "epsilon", "privacy_sigma", "arrived", "rejected", "wall_s")


def record_of(folder: Path, name: str) -> dict:
    """A run's record: its name, its config without machine paths, and per round the keys
    the page reads."""
    from protofl.engine.simulation import read_rows

    cfg = yaml.safe_load((folder / name / "config.yaml").read_text())
    cfg.get("data", {}).pop("root", None)
    cfg.get("output", {}).pop("dir", None)
    rows = [{k: r[k] for k in ROW_KEYS if k in r} for r in read_rows(folder / name / "metrics.jsonl")]
    return {"name": name, "config": cfg, "rows": rows}


def read_records(path: Path) -> dict[str, dict]:
    return {r["name"]: r for r in read_json_lines(path)}


def final(rows: list[dict], key: str) -> float:
    v = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return float(v[-1]) if v else float("nan")


def one_run(over: list[str], eps: float | None, out: Path, name: str) -> None:
    """One point of the page, unless complete in ``out/name``: the run, its sigma calibrated
    to ``eps`` at its start (``eps`` None: no privacy)."""
    from protofl import run
    from protofl.api import is_complete
    from protofl.config import load_config

    cfg = load_config(CONFIG, over)
    if is_complete(out / name, cfg.rounds):
        return
    if eps is not None:
        over = [*over, "privacy.calibrate=true", f"privacy.target_epsilon={eps:g}"]
    print(f"[run] {name}", flush=True)
    run(load_config(CONFIG, [*over, f"output.dir={out}", f"output.name={name}"]), resume=True)


def main() -> None:
    from protofl.config import load_config
    from protofl.report.plots import _save, accuracy_epsilon_figure
    from protofl.report.tables import markdown, pct
    from protofl.reproduce import stats

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="folder holding fashion-mnist/ (default: $PROTOFL_DATA)")
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--seeds", help="comma-separated (default: the scale's)")
    p.add_argument("--epsilons", help="comma-separated (default: the scale's)")
    p.add_argument("--rounds", type=int, help="default: the scale's")
    p.add_argument("--mechanisms", default=";".join(MECHANISMS), help="labels, separated by ';'")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process (default 1)")
    p.add_argument("--runs", default="runs/privacy/accuracy_epsilon")
    p.add_argument("--results", help="default: this folder (scale smoke: <runs>/smoke)")
    p.add_argument("--records", help="gzip JSON lines of what the page reads of each run: written after the runs, "
                                     "or read with --no-run")
    p.add_argument("--no-run", action="store_true", help="make the page from --records alone (no run, no data)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. execution.workers=2")
    args = p.parse_args()
    scale_seeds, scale_eps, scale_over = SCALES[args.scale]
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else scale_seeds
    epsilons = [float(e) for e in args.epsilons.split(",")] if args.epsilons else scale_eps
    base = [*scale_over, *(["data.root=" + args.data_dir] if args.data_dir else []),
            *([f"rounds={args.rounds}"] if args.rounds else []),
            "output.progress=false",
            # a client whose model the noise sent to NaN loses its reply
            # (an honest outcome of strong noise), not the whole run
            "training.on_nonfinite=drop", *args.overrides]
    out = Path(args.runs) / args.scale
    results = Path(args.results) if args.results else (out if args.scale == "smoke" else HERE)
    stem = "accuracy_epsilon" + ("" if args.scale == "full" else f"_{args.scale}")
    labels = [m.strip() for m in args.mechanisms.split(";")]
    t0 = time.perf_counter()
    points_of = []  # (label, eps or None, [(seed, run name)])
    jobs = []
    for label in labels:
        method, privacy = MECHANISMS[label]
        for eps in ([None] if privacy is None else epsilons):
            slug = label.lower().replace(", ", "-").replace(" ", "_")
            names = [(seed, f"{slug}-s{seed}" if privacy is None else f"{slug}-eps{eps:g}-s{seed}") for seed in seeds]
            points_of.append((label, eps, names))
            jobs += [([*base, f"seed={seed}", f"algorithm.name={method}", *(privacy or [])], eps, out, name)
                     for seed, name in names]
    if args.no_run:
        if not args.records:
            p.error("--no-run needs --records")
        records = read_records(Path(args.records))
    else:
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
                for f in [pool.submit(one_run, *j) for j in jobs]:
                    f.result()
        else:
            for j in jobs:
                one_run(*j)
        records = {name: record_of(out, name) for _, _, names in points_of for _, name in names}
        if args.records:
            write_json_lines(Path(args.records), [records[n] for n in records])
    points: dict[str, list] = {}
    references: dict[str, float] = {}
    at: dict[str, dict[float, dict[str, dict[int, float]]]] = {"GA": {}, "PA": {}}  # metric -> eps -> mech -> seed
    table = []
    run_seconds = 0.0  # the rounds' wall time over every run, however many sittings they took
    max_dev = None  # the largest |epsilon spent / target - 1| of a run
    from protofl.data.datasets import FMNIST_CLASSES

    chance = 1.0 / len(FMNIST_CLASSES)  # a model that learned nothing: GA at 1/C
    at_chance_rule = chance + CHANCE_MARGIN
    for label, eps, names in points_of:
        privacy = MECHANISMS[label][1]
        per_seed = []
        rejected = replies = 0  # replies the server rejected (non-finite weights: the noise), over the seeds
        logged = True  # client-level DP logs no rejections (the server judged the updates before their noise)
        for seed, name in names:
            rows, cfg = records[name]["rows"], records[name]["config"]
            run_seconds += sum(r.get("wall_s", 0.0) for r in rows)
            logged = logged and all("rejected" in r for r in rows)
            rejected += sum(r.get("rejected", 0) for r in rows)
            replies += sum(r.get("arrived", 0) + r.get("rejected", 0) for r in rows)
            sigma = final(rows, "privacy_sigma")  # the run's choice (privacy.calibrate); else its config's
            per_seed.append((final(rows, "ga"), final(rows, "pa"), final(rows, "epsilon"),
                             sigma if sigma == sigma else (cfg.get("privacy") or {}).get("noise_multiplier", 0.0)))
            if privacy is not None:
                for k, metric in enumerate(("GA", "PA")):
                    at[metric].setdefault(eps, {}).setdefault(label, {})[seed] = 100 * per_seed[-1][k]
        ga, pa, spent, sigma = (np.array(v, dtype=np.float64) for v in zip(*per_seed))
        at_chance = int(np.sum(ga <= at_chance_rule))  # runs whose model ended at chance level
        if privacy is not None:
            dev = float(np.max(np.abs(spent / eps - 1)))
            max_dev = dev if max_dev is None else max(max_dev, dev)
        sd = (lambda v: float(v.std(ddof=1)) if len(v) > 1 else float("nan"))
        table.append([label, "–" if privacy is None else f"{eps:g}",
                      "–" if privacy is None else f"{np.mean(spent):.2f}",
                      "–" if privacy is None else f"{np.mean(sigma):.3g}",
                      pct(float(ga.mean()), sd(ga)), pct(float(pa.mean()), sd(pa)),
                      f"{100 * rejected / replies:.1f}" if replies and logged else "–",
                      f"{at_chance} of {len(seeds)}" if at_chance else "–", str(len(seeds))])
        if privacy is not None:
            points.setdefault(label, []).append((float(np.mean(spent)), float(ga.mean()), sd(ga)))
        else:
            references[label] = float(ga.mean())
    cfg = load_config(CONFIG, base)
    head = ["mechanism", "target ε", "ε spent", "noise σ", "GA (%)", "PA (%)", "replies rejected (%)",
            "runs at chance", "seeds"]
    # at each epsilon: the mechanism with the most GA / PA, tested against each of the others
    # (paired over seeds); a mechanism without the metric (PA under client-level DP) is left out
    leaders, tests = [], []
    for eps in epsilons:
        cells = [f"{eps:g}"]
        for metric in ("GA", "PA"):
            pool = {m: v for m, v in at[metric].get(eps, {}).items() if not np.all(np.isnan(list(v.values())))}
            if not pool:
                cells.append("–")
                continue
            top = max(pool, key=lambda m: np.nanmean(list(pool[m].values())))
            v = stats.best(pool[top], {m: x for m, x in pool.items() if m != top}, step=None)
            mean = np.nanmean(list(pool[top].values()))
            cells.append(f"{top} ({mean:.2f} %): **{v.verdict}**")
            tests.append(f"ε = {eps:g}, {metric}: {top}: {v.detail}")
        leaders.append(cells)
    leaders_head = ["target ε", "most GA", "most PA"]
    shown = shown_command("benchmarks/privacy/accuracy_epsilon.py", sys.argv[1:],
                          {"--data-dir": "DATA", "--runs": "RUNS", "--results": "RESULTS", "--records": "RECORDS"})
    images = f"{cfg.data.train_size:,} of the training images" if cfg.data.train_size else "all training images"
    text = (f"## Accuracy against ε: Fashion-MNIST, {cfg.partition.num_clients} clients, "
            f"Dir({cfg.partition.params['beta']}), {cfg.participation.fraction:.0%} per round, {cfg.training.epochs} "
            f"local epochs, {cfg.model.name}, {cfg.rounds} rounds, {images}, δ = {cfg.privacy.delta:g} "
            f"(scale {args.scale})\n\n"
            + header(f"Written by `{shown}`; seeds {', '.join(map(str, seeds))} and "
                     f"ε {', '.join(f'{e:g}' for e in epsilons)} "
                     + ("chosen on the command line: exploratory, not the scale's plan." if args.seeds or args.epsilons
                        else "fixed in the script for this scale before any run."))
            + "\n\n"
            + markdown(head, table)
            + "\nGA, PA at the last evaluation, mean ± sample std over seeds. ε spent: by the end of the run, "
              "by the run's own ledger (client-level: one client's participation; DP-SGD and DP-SGD + private "
              "prototypes: one training sample of the most exposed client, every fit, release and the one release "
              "of its label counts composed); noise σ: chosen by each run at its start for its target "
              "(privacy.calibrate), the mean over seeds"
            + (f"; every run's ε is within {100 * max_dev:.1f} % of its target" if max_dev is not None else "")
            + ". Every row protects all its clients send. PA under client-level DP: not logged (the "
              "clients' personalized models are trained without noise). Replies rejected: the share of the "
              "replies the server dropped for non-finite weights (the noise), over every round and seed; not logged "
              "under client-level DP (the server judges the updates before their noise). Runs at chance: the "
              f"runs whose GA ended within {100 * CHANCE_MARGIN:g} points of chance ({100 * chance:g} %, "
              f"{len(FMNIST_CLASSES)} classes): a model that learned nothing under that noise; they are this "
              f"mechanism's result at that ε (every run completed its {cfg.rounds} rounds), and their mean is the mean "
              "of chance-level models.\n\n"
            + "\nWhich mechanism keeps the most accuracy at each ε: the leader's verdict is its paired one-sided "
              "test (5 %) above each other mechanism at that ε (intersection-union; protofl.reproduce.stats).\n\n"
            + markdown(leaders_head, leaders)
            + "\n" + "".join(f"* {t}\n" for t in tests)
            + f"\nThe runs' rounds took {run_seconds / 3600:.2f} hours in all (one thread a run, as many runs at "
              f"once as --jobs); this invocation {(time.perf_counter() - t0) / 60:.1f} min (complete runs reused).\n")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.md").write_text(text)
    if points:
        _save(accuracy_epsilon_figure(points, title="GA against ε (mean ± std over seeds)", references=references),
              results / f"{stem}.png")
    print(text)
    print(f"-> {results / (stem + '.md')}")


if __name__ == "__main__":
    sys.exit(main())
