"""Speed of local training with differential privacy on and off, in both executors.

For each executor (sequential, batched) and each privacy setting -- FedAvg without
privacy, FedAvg with client-level DP (clipping on the clients, noise on the server),
FedAvg with DP-SGD (Poisson batches, per-sample gradients), FedProto without privacy and
with DP-SGD and private prototypes -- a short run of the Fashion-MNIST setting
(configs/fednh_fmnist.yaml: cnn_fmnist, batch 64) is timed: training samples per second
of the clients' local training (samples / ``train_s`` of the rounds after the first, which
pays the start-up). A private run logs no sample count (it is not private): its samples
are those its method's run without privacy trains in the same rounds (the same clients:
the private runs here draw seeded noise, which costs what secret noise costs, so that
they ask the same clients; DP-SGD's Poisson batches hold that many samples in
expectation). Each setting runs ``--repeats`` times, the settings interleaved (a slow spell
of a shared machine then hits every setting alike); the table gives the median.

    python benchmarks/privacy/speed.py --data-dir DATA                      # 3 rounds of 10 clients
    python benchmarks/privacy/speed.py --data-dir DATA --rounds 2 --clients-per-round 4 --epochs 1

Writes ``speed.md`` to --results (default: this folder); run folders go to --runs.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from harness import header, shown_command  # noqa: E402

CONFIG = HERE.parents[1] / "configs" / "fednh_fmnist.yaml"

# the runs here draw seeded noise (the same clients as the runs without privacy): their
# epsilon is the accountant's for that noise multiplier, not a guarantee
EPS_HEAD = "epsilon (seeded noise: not private)"
SEEDED = "privacy.noise=seeded"  # the same clients as the run without privacy (and the same cost as secret noise)
SETTINGS = [  # label, method, overrides (a setting's reference: the first of its method, without privacy)
    ("FedAvg", "fedavg", []),
    ("FedAvg, client-level DP", "fedavg", ["privacy.mode=client", "privacy.clip=1.0", "privacy.noise_multiplier=1.0",
                                           SEEDED]),
    ("FedAvg, DP-SGD", "fedavg", ["privacy.mode=sample", "privacy.clip=1.0", "privacy.noise_multiplier=1.0", SEEDED]),
    ("FedProto", "fedproto", []),
    ("FedProto, DP-SGD + private prototypes", "fedproto",
     ["privacy.mode=sample", "privacy.clip=1.0", "privacy.feature_clip=5.0", "privacy.noise_multiplier=1.0", SEEDED]),
]


def main() -> None:
    from protofl import run
    from protofl.config import load_config
    from protofl.report.tables import markdown

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="folder holding fashion-mnist/ (default: $PROTOFL_DATA)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients-per-round", type=int, default=10)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (execution.threads)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--executors", default="sequential,batched")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", default="runs/privacy/speed")
    p.add_argument("--results", default=str(HERE))
    args = p.parse_args()
    base = [f"rounds={args.rounds}", f"participation.clients_per_round={args.clients_per_round}",
            f"training.epochs={args.epochs}", f"execution.threads={args.threads}", f"execution.device={args.device}",
            "execution.workers=0", "eval.every=1000", "eval.personal=false", "output.progress=false",
            "output.checkpoint_every=0", "output.save_model=false"]
    if args.data_dir:
        base.append(f"data.root={args.data_dir}")
    rates: dict[tuple, list[float]] = {}
    eps: dict[tuple, str] = {}
    for rep in range(args.repeats):
        for executor in args.executors.split(","):
            samples: dict[str, list[int]] = {}  # method -> its run without privacy's samples per round
            for label, method, over in SETTINGS:
                cfg = load_config(CONFIG, [*base, f"algorithm.name={method}", f"execution.executor={executor}", *over,
                                           f"output.dir={args.runs}", f"output.name={executor}-{label}-{rep}"])
                res = run(cfg)
                if not over:
                    samples[method] = [r["train_samples"] for r in res.rows]
                later = slice(1, None) if len(res.rows) > 1 else slice(None)
                rates.setdefault((executor, label), []).append(
                    sum(samples[method][later]) / sum(r["train_s"] for r in res.rows[later]))
                eps[(executor, label)] = f"{res.rows[-1]['epsilon']:.2f}" if "epsilon" in res.rows[-1] else "–"
                print(f"{executor} | {label} | {rates[(executor, label)][-1]:,.0f}", flush=True)
    rows = [[ex, label, f"{statistics.median(r):,.0f}", " / ".join(f"{x:,.0f}" for x in r), eps[(ex, label)]]
            for (ex, label), r in rates.items()]
    ran = res.summary["execution"]
    text = (f"## Local training speed with and without differential privacy\n\n"
            f"Fashion-MNIST, cnn_fmnist, batch 64, {args.clients_per_round} clients per round, {args.epochs} local "
            f"epoch(s), {args.rounds} rounds (rate over rounds 2..{args.rounds}), median of {args.repeats} "
            f"interleaved repeats; device {args.device}, "
            f"{args.threads} intra-op thread(s), torch {torch.__version__}, "
            f"{platform.processor() or platform.machine()}."
            f" Last executor's description: {ran}.\n\n"
            + header("Written by `" + shown_command("benchmarks/privacy/speed.py", sys.argv[1:],
                                                    {"--data-dir": "DATA", "--runs": "RUNS", "--results": "RESULTS"})
                     + "`.") + "\n\n"
            + markdown(["executor", "setting", "training samples/s", "each repeat", EPS_HEAD], rows))
    out = Path(args.results) / "speed.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"-> {out}")


if __name__ == "__main__":
    sys.exit(main())
