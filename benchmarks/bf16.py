"""execution.precision: fp32 vs bf16 side by side -- training speed and final accuracy.

Two settings, each run with the same seed in fp32 and in bf16, the runs alternating
(fp32, bf16, fp32, bf16, ... for the seeds given), sequential with one thread:

* ``peers``: the peers' workload (benchmarks/peers.py: MNIST, ``fedavg_cnn``, 100 clients,
  Dirichlet(0.3), 10 clients per round, batch 64, lr 0.01), scaled down to
  ``--epochs`` local epochs and ``--rounds`` rounds;
* ``rebafl``: the ReBaFL Table 1 setting (configs/rebafl_pathological.yaml: FMNIST,
  ``cnn_fmnist``, 20 clients x 2 classes, p = 0.5), scaled down the same way.

Training samples/s = trained samples / training seconds over all rounds; accuracy = the
global model on the full test set after the last round (evaluation only there). A third
table times inference alone (the global model on ``--eval-n`` test images, fp32 against
bf16 autocast), which decides whether evaluation should use bf16.

    python benchmarks/bf16.py --data-dir DATA --out benchmarks/results/bf16.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit  # noqa: E402
from peers import workload  # noqa: E402

from protofl.config import load_config  # noqa: E402
from protofl.engine.evaluate import class_correct  # noqa: E402
from protofl.engine.precision import autocast, cpu_has_bf16  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402
from protofl.report.tables import markdown  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def setting(name: str, data_dir: str, rounds: int, epochs: int, seed: int):
    common = {"execution.workers": 0, "execution.threads": 1, "eval.every": rounds, "eval.personal": False,
              "eval.final_all_clients": False, "output.checkpoint_every": 0, "output.save_model": False,
              "output.progress": False, "training.epochs": epochs, "rounds": rounds, "seed": seed}
    if name == "peers":
        cfg = workload("fedavg", "fedavg_cnn", data_dir, rounds, 0, 1, False, "runs")
    else:
        cfg = load_config(REPO / "configs" / "rebafl_pathological.yaml", [f"data.root={data_dir}"])
    return cfg.replace(**common)


def one_run(cfg, precision: str, eval_n: int) -> dict:
    cfg = cfg.replace(**{"execution.precision": precision})
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, run_dir=Path(tmp) / "run")
        res = sim.run()
        sps = sum(r["train_samples"] for r in res.rows) / sum(r["train_s"] for r in res.rows)
        inference = time_inference(sim, res.server_state.weights, eval_n) if cfg.seed == 0 else None
    return {"sps": sps, "ga": res.rows[-1]["ga"], "loss": res.rows[-1]["train_loss"], "inference": inference}


def time_inference(sim, weights, n: int) -> dict:
    """Seconds per 1,000 test images of the global model, fp32 and bf16 autocast, alternated."""
    model = sim.server.shared_model(weights)
    x, y = sim.runtime.test_data
    x, y = x[:n], y[:n]
    times = {"fp32": [], "bf16": []}
    acc = {}
    for _ in range(2):
        for prec in times:
            t0 = time.perf_counter()
            with autocast(prec, "cpu"):
                c, k = class_correct(model, x, y, sim.info.num_classes, sim.cfg.eval.batch_size,
                                     sim.runtime.channels_last)
            times[prec].append((time.perf_counter() - t0) / len(y) * 1000)
            acc[prec] = c.sum() / k.sum()
    return {p: (min(t), acc[p]) for p, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    ap.add_argument("--settings", default="peers,rebafl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1, help="local epochs (peers' workload: 5, ReBaFL: 5)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--eval-n", type=int, default=2000, help="test images for the inference timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = [f"CPU with native bf16 (AVX512-BF16 or AMX): {cpu_has_bf16()}. torch {torch.__version__}, "
             f"sequential, 1 thread; {args.rounds} rounds, {args.epochs} local epoch(s).", ""]
    speed_rows, inf_rows = [], []
    for name in args.settings.split(","):
        per = {"fp32": [], "bf16": []}
        for seed in seeds:
            cfg = setting(name, args.data_dir, args.rounds, args.epochs, seed)
            for prec in per:  # alternate fp32, bf16
                r = one_run(cfg, prec, args.eval_n)
                per[prec].append(r)
                print(f"[{name} seed {seed} {prec}] {r}", file=sys.stderr, flush=True)
                if r["inference"]:
                    for p, (ms, acc) in r["inference"].items():
                        inf_rows.append([name, f"model trained in {prec}", p, f"{ms:.2f}", f"{100 * acc:.2f}"])
        f, b = (statistics.median(x["sps"] for x in per[p]) for p in ("fp32", "bf16"))
        ga = {p: [100 * x["ga"] for x in per[p]] for p in per}
        spread = (f"{max(ga['fp32']) - min(ga['fp32']):.2f}" if len(seeds) > 1 else "n/a (1 seed)")
        speed_rows.append([name, f"{f:,.0f}", f"{b:,.0f}", f"{b / f:.2f}x",
                           " / ".join(f"{a:.2f}" for a in ga["fp32"]), " / ".join(f"{a:.2f}" for a in ga["bf16"]),
                           spread])
    load = os.getloadavg()
    lines += [markdown(["setting", "fp32 train samples/s", "bf16 train samples/s", "bf16 / fp32",
                        "fp32 accuracy (%) per seed", "bf16 accuracy (%) per seed", "fp32 seed spread (pts)"],
                       speed_rows), "",
              "Inference alone (global model after the run, seed 0; seconds per 1,000 test images, best of 2):", "",
              markdown(["setting", "model", "evaluated in", "s / 1,000 images", "accuracy (%)"], inf_rows), "",
              f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}."]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
