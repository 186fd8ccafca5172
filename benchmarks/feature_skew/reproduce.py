"""Feature-skew reproductions: three tables, each printed and written next to this script.

``domains``      MP-FedCL (Qiao et al., 2023) Table V analogue: one client per digit
                 domain (MNIST, FEMNIST digits, sklearn digits resized to 28x28; iid
                 labels), `mlp_mnist`, the MP-FedCL MNIST recipe (SGD lr 0.01, momentum
                 0.5, lr x 0.95 per round, batch 32, 1 epoch); accuracy of each domain's
                 client on its domain's test set, and their mean.
``fedproto``     FedProto (Tan et al., 2022) Table 1 with FeSEM: MNIST n-way k-shot
                 (20 clients, all participating, n = 3 with stdev 1, k = 100), `cnn_mnist`,
                 the FedProto recipe (lr 0.01, momentum 0.5, batch 8, 1 epoch); mean ± std
                 over clients of the local-test accuracy. FedProto-mh: 18/20/22-channel
                 models. Rows of methods that are not registered are marked as pending.
``noise_rotate`` FedAvg, FedProx, FedProto, FedNH, FedGELA, MP-FedCL and FeSEM without
                 feature skew, with `noise` and with `rotate` (4 groups), sklearn digits,
                 8 iid clients (configs/digits.yaml's model and recipe).

    python benchmarks/feature_skew/reproduce.py domains --data-dir DATA
    python benchmarks/feature_skew/reproduce.py fedproto --data-dir DATA
    python benchmarks/feature_skew/reproduce.py noise_rotate
    python benchmarks/feature_skew/reproduce.py domains --data-dir DATA --smoke --out runs/feature_skew_smoke

Completed runs under --out are reused and interrupted ones resumed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "prototype_exchange"))

from _common import markdown, mean_std, pct  # noqa: E402

from protofl.algorithms import ALGORITHMS  # noqa: E402
from protofl.api import is_complete  # noqa: E402
from protofl.config import load_config, parse_override  # noqa: E402
from protofl.data.datasets import load_dataset  # noqa: E402
from protofl.data.build import build_federated  # noqa: E402
from protofl.engine.checkpoint import load_torch  # noqa: E402
from protofl.engine.simulation import CHECKPOINT, SUMMARY, Simulation  # noqa: E402
from protofl.metrics import cluster_purity  # noqa: E402

CONFIGS = REPO / "configs"


def run_one(cfg, out: Path, tag: str, make_fed=None, log=True) -> dict:
    """Run (or reuse) one config; returns its summary's final metrics plus extras.
    ``make_fed()``: builds the federated data (default ``build_federated(cfg)``); called
    only when the run is not complete already."""
    run_dir = out / f"{tag}-s{cfg.seed}-r{cfg.rounds}-{cfg.fingerprint()}"
    t0 = time.perf_counter()
    if is_complete(run_dir, cfg.rounds):
        summary = json.loads((run_dir / SUMMARY).read_text())
    else:
        fed = make_fed() if make_fed is not None else build_federated(cfg)
        summary = Simulation(cfg, run_dir=run_dir, fed=fed).run(resume=True).summary
    final = dict(summary["final"])
    final["_dir"] = str(run_dir)
    final["_s_per_round"] = summary.get("mean_round_s") or 0.0
    if log:
        print(f"[{tag} / seed {cfg.seed}] gm={pct(final.get('gm'))} pa={pct(final.get('pa'))} "
              f"({time.perf_counter() - t0:.0f} s) -> {run_dir}", file=sys.stderr, flush=True)
    return final


def make_config(path: Path, base: list[str], changes: list[str]):
    """``path`` with the ``base`` overrides, then ``changes`` applied with ``Config.replace``
    (so that a new partitioner or method drops the parameters of the one in the file)."""
    return load_config(path, base).replace(**dict(parse_override(o) for o in changes))


def cell(ms: tuple, seeds: list) -> str:
    """mean ± std over seeds in percent; the mean alone for one seed."""
    return pct(ms[0]) if len(seeds) == 1 else pct(*ms)


def base_overrides(args) -> list[str]:
    ov = [f"execution.workers={args.workers}", f"execution.threads={args.threads}", "output.progress=false",
          "output.checkpoint_every=10"]
    if args.data_dir:
        ov.append(f"data.root={args.data_dir}")
    return ov


def write(md: str, args, name: str) -> None:
    print(md)
    path = Path(args.table) if args.table else (Path(args.out) / name if args.smoke else HERE / name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(md)
    print(f"table written to {path}", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# MP-FedCL Table V analogue on `domains`
# ---------------------------------------------------------------------------------------
DOMAIN_METHODS = [("Local", "local"), ("FedAvg", "fedavg"), ("FedProx", "fedprox"), ("FedProto", "fedproto"),
                  ("SP-FedCL", "spfedcl"), ("MP-FedCL", "mpfedcl")]
PAPER_TABLE_V = {"Local": 34.20, "FedAvg": 38.87, "FedProx": 51.80, "FedProto": 62.00, "MP-FedCL": 64.86}
DOMAINS = ["mnist", "femnist", "digits"]


def table_domains(args) -> None:
    rounds = 2 if args.smoke else args.rounds or 30
    seeds = [0] if args.smoke else [int(s) for s in (args.seeds or "0,1,2").split(",")]
    out = Path(args.out) / "domains"
    rows, feds = [], {}
    for label, algo in DOMAIN_METHODS:
        if args.methods and algo not in args.methods.split(","):
            continue
        finals = []
        for seed in seeds:
            cfg = make_config(CONFIGS / "mpfedcl_mnist.yaml", base_overrides(args), [
                f"seed={seed}", f"rounds={rounds}", f"algorithm.name={algo}", "partition.name=iid",
                "partition.num_clients=3", "features.name=domains", f"eval.every={rounds}",
                "eval.personal_every=0"] + (["features.train_size=200", "features.test_size=100"]
                                            if args.smoke else []))

            def make_fed(cfg=cfg, seed=seed):  # loading the three sources dominates: once per seed
                if seed not in feds:
                    feds[seed] = build_federated(cfg)
                return feds[seed]

            finals.append(run_one(cfg, out, algo, make_fed))
        per = [mean_std(f.get(f"pa:{d}") for f in finals) for d in DOMAINS]
        avg = mean_std(np.mean([f.get(f"pa:{d}") for d in DOMAINS]) for f in finals)
        gm = mean_std(np.mean([f.get(f"gm:{d}") for d in DOMAINS]) if "gm:mnist" in f else None for f in finals)
        rows.append([label, *(cell(p, seeds) for p in per), cell(avg, seeds), cell(gm, seeds),
                     f"{PAPER_TABLE_V[label]:.2f}" if label in PAPER_TABLE_V else "–"])
    head = ["method", *(f"{d} (%)" for d in DOMAINS), "mean (%)", "global model, mean (%)",
            "paper Digit-5 mean (%)"]
    title = (f"MP-FedCL Table V analogue: `domains` (MNIST / FEMNIST digits / sklearn digits), 3 clients, "
             f"iid labels, mlp_mnist, {rounds} rounds" + (" (SMOKE)" if args.smoke else ""))
    md = (f"## {title}\n\n{markdown(head, rows)}\n"
          f"Seeds: {', '.join(map(str, seeds))} (mean ± std over seeds, last round). Per domain: the accuracy of "
          f"that domain's client (its personalized model: FedAvg/FedProx the model after its local training, "
          f"FedProto the nearest-global-prototype rule, SP-/MP-FedCL the nearest pool prototype) on the domain's "
          f"test set. \"global model\": the aggregated model on each domain's test set, averaged (methods that "
          f"have one).\n")
    write(md, args, "domains_smoke.md" if args.smoke else "domains.md")


# ---------------------------------------------------------------------------------------
# FedProto Table 1 with FeSEM
# ---------------------------------------------------------------------------------------
# (label, algorithm, config, extra overrides); FedPer / FedRep are used when registered
FEDPROTO_METHODS = [
    ("Local", "local", "fedproto_mnist.yaml", []),
    ("FeSEM", "fesem", "fedproto_mnist.yaml", []),
    ("FeSEM (trained model)", "fesem", "fedproto_mnist.yaml", ["algorithm.personal=trained"]),
    ("FedProx", "fedprox", "fedproto_mnist.yaml", []),
    ("FedPer", "fedper", "fedproto_mnist.yaml", []),
    ("FedAvg", "fedavg", "fedproto_mnist.yaml", []),
    ("FedRep", "fedrep", "fedproto_mnist.yaml", []),
    ("FedProto", "fedproto", "fedproto_mnist.yaml", []),
    ("FedProto-mh", "fedproto", "fedproto_mnist_hetero.yaml", []),
]


def mnist_test_subset(cfg, n_test: int):
    """MNIST with a seeded random subset of ``n_test`` test images (the pool the local test
    sets are drawn from, and the global test set): the last-round evaluation of 20
    personalized models on 10k images would dominate the CPU budget."""
    from dataclasses import replace

    ds = load_dataset(cfg.data.name, cfg.data.root, seed=cfg.seed)
    keep = np.sort(np.random.default_rng(np.random.SeedSequence([cfg.seed, 77])).choice(len(ds.y_test), n_test,
                                                                                        replace=False))
    return replace(ds, x_test=ds.x_test[keep].clone(), y_test=ds.y_test[keep].clone())


def table_fedproto(args) -> None:
    rounds = 2 if args.smoke else args.rounds or 20
    seeds = [0] if args.smoke else [int(s) for s in (args.seeds or "0").split(",")]
    out = Path(args.out) / "fedproto"
    rows, pending, subsets = [], [], {}
    for label, algo, conf, extra in FEDPROTO_METHODS:
        if args.methods and algo not in args.methods.split(","):
            continue
        if algo not in ALGORITHMS:
            pending.append(label)
            rows.append([label, "pending: method not in this version", "–"])
            continue
        finals = []
        for seed in seeds:
            cfg = make_config(CONFIGS / conf, base_overrides(args), extra + [
                f"seed={seed}", f"rounds={rounds}", f"algorithm.name={algo}", f"eval.every={rounds}",
                "eval.personal_every=0"] + (["partition.num_clients=6", "partition.shots=20"] if args.smoke else []))

            def make_fed(cfg=cfg, seed=seed):
                if seed not in subsets:
                    subsets[seed] = mnist_test_subset(cfg, args.n_test)
                return build_federated(cfg, dataset=subsets[seed])

            tag = label.lower().replace(" (trained model)", "-trained")
            finals.append(run_one(cfg, out, tag, make_fed))
        pa = mean_std(f.get("pa") for f in finals)
        spread = mean_std(f.get("pa_std") for f in finals)
        rows.append([label, cell(pa, seeds), pct(spread[0])])
    head = ["method", "local test accuracy (%), mean over clients", "std over clients (%)"]
    title = (f"FedProto Table 1 with FeSEM: MNIST n-way k-shot (n = 3, stdev 1, k = 100), 20 clients, "
             f"{rounds} rounds" + (" (SMOKE)" if args.smoke else ""))
    note = (f" Pending (not registered in this version; rerun the same command when they land): "
            f"{', '.join(pending)}." if pending else "")
    md = (f"## {title}\n\n{markdown(head, rows)}\n"
          f"Seeds: {', '.join(map(str, seeds))}. Accuracy: each client's personalized model on its local test "
          f"set (its own classes, as many samples as it trains on, drawn from a {args.n_test}-image subset of the "
          f"MNIST test split); FeSEM's personalized model is the client's centre, FedProto's the nearest global "
          f"prototype rule.{note}\n")
    write(md, args, "fedproto_table1_smoke.md" if args.smoke else "fedproto_table1.md")


# ---------------------------------------------------------------------------------------
# noise and rotate
# ---------------------------------------------------------------------------------------
NR_METHODS = [("FedAvg", "fedavg", []), ("FedProx", "fedprox", []), ("FedProto", "fedproto", []),
              ("FedNH", "fednh", []), ("FedGELA", "fedgela", []), ("MP-FedCL", "mpfedcl", []),
              ("FeSEM", "fesem", ["algorithm.centers=4"])]
SCENARIOS = [("none", []), ("noise", ["features.name=noise", "features.sigma=0.5"]),
             ("rotate", ["features.name=rotate", "features.groups=4"])]


def table_noise_rotate(args) -> None:
    rounds = 2 if args.smoke else args.rounds or 20
    seeds = [0] if args.smoke else [int(s) for s in (args.seeds or "0,1,2").split(",")]
    out = Path(args.out) / "noise_rotate"
    rows, purity = [], {}
    for label, algo, extra in NR_METHODS:
        if args.methods and algo not in args.methods.split(","):
            continue
        cells = []
        for scen, sov in SCENARIOS:
            finals = []
            for seed in seeds:
                cfg = make_config(CONFIGS / "digits.yaml", base_overrides(args), sov + extra + [
                    f"seed={seed}", f"rounds={rounds}", f"algorithm.name={algo}", "partition.name=iid",
                    "partition.num_clients=8", "participation.fraction=1.0", f"eval.every={rounds}",
                    "eval.personal_every=0"])
                f = run_one(cfg, out, f"{algo}-{scen}")
                finals.append(f)
                if algo == "fesem" and scen == "rotate":
                    state = load_torch(Path(f["_dir"]) / CHECKPOINT)["server_state"]
                    purity.setdefault(label, []).append(cluster_purity(state.assignment, np.arange(8) % 4))
            cells.append((mean_std(f.get("ga") for f in finals), mean_std(f.get("pa") for f in finals)))
        base = cells[0][0][0]
        row = [label]
        for i, ((ga, pa), (scen, _)) in enumerate(zip(cells, SCENARIOS)):
            row += [cell(ga, seeds), cell(pa, seeds)]
            if i > 0:
                row.append("–" if np.isnan(ga[0]) or np.isnan(base) else f"{100 * (ga[0] - base):+.1f}")
        rows.append(row)
    head = ["method", "none: GA (%)", "none: PA (%)", "noise: GA (%)", "noise: PA (%)", "noise: Δ GA (pts)",
            "rotate: GA (%)", "rotate: PA (%)", "rotate: Δ GA (pts)"]
    title = (f"Noise (sigma 0.5) and rotate (4 groups) on sklearn digits, 8 iid clients, {rounds} rounds"
             + (" (SMOKE)" if args.smoke else ""))
    pur = "; ".join(f"{k}: {', '.join(f'{p:.2f}' for p in v)}" for k, v in purity.items())
    md = (f"## {title}\n\n{markdown(head, rows)}\n"
          f"Seeds: {', '.join(map(str, seeds))} (mean ± std over seeds, last round). GA: the global model on the "
          f"global test set (clean for noise, all four rotations for rotate); for FedProto (no global model) "
          f"the mean of the clients' models on it. PA: each client's personalized model on its local test set "
          f"(noisy / rotated like its training data). Δ GA: change against no feature skew. FeSEM (4 centres) "
          f"cluster purity against the rotation groups, per seed: {pur or '–'}.\n")
    write(md, args, "noise_rotate_smoke.md" if args.smoke else "noise_rotate.md")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["domains", "fedproto", "noise_rotate"], help="the table to reproduce")
    ap.add_argument("--data-dir", default=None, help="folder holding mnist/ and femnist/ (else PROTOFL_DATA)")
    ap.add_argument("--out", default="runs/feature_skew", help="run folders")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (domains, noise_rotate: 0,1,2; fedproto: 0)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (domains 30, fedproto 20, noise_rotate 20)")
    ap.add_argument("--methods", default=None, help="comma-separated algorithm names to run (default: all)")
    ap.add_argument("--n-test", type=int, default=3000, help="fedproto: MNIST test images kept (default 3000)")
    ap.add_argument("--workers", type=int, default=0, help="client processes (0 = sequential)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads when sequential")
    ap.add_argument("--smoke", action="store_true", help="tiny check: 2 rounds, 1 seed, small data")
    ap.add_argument("--table", default=None, help="markdown output path (default: next to this script)")
    args = ap.parse_args(argv)
    {"domains": table_domains, "fedproto": table_fedproto, "noise_rotate": table_noise_rotate}[args.which](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
