"""GPU execution: samples/s of the sequential and the batched client executor on one GPU.

Workloads (FedAvg's local update, which the batched executor runs; eval off):

* peers' workload: MNIST, 100 clients, Dirichlet(0.3), 10 and 100 clients per round,
  5 local epochs, batch 64, SGD lr 0.01, ``fedavg_cnn`` and ``lenet5``;
* FedNH's CIFAR-style setting: ``conv2cifar`` on generated 32x32x3 data (50,000 train
  images, 10 classes, made here from a seed: nothing is downloaded), 100 clients,
  Dirichlet(0.3), 10 and 100 clients per round, FedNH's recipe (5 epochs, batch 64, lr
  0.01, momentum 0.9, weight decay 1e-5, gradient clipping at 10). The local update is
  FedAvg's: FedNH's own update has no batched form yet and runs sequentially;
* 1,000 clients per round: MNIST split 1,000 ways (Dirichlet(0.3)), every client in
  every round, ``fedavg_cnn``.

Per setting and executor (interleaved: sequential, batched, ...): training samples/s
(sum over the round's clients of samples trained / the round's training wall time,
median of rounds 2..R), GPU utilization (mean of samples taken every 0.2 s while the run
trains: ``torch.cuda.utilization`` if pynvml is there, else ``nvidia-smi``), peak GPU
memory (``torch.cuda.max_memory_allocated``). Writes a markdown table headed with the
GPU's name. Needs only the repository and the MNIST files (no internet).

    python benchmarks/gpu.py --data-dir DATA --out benchmarks/results/gpu.md
    python benchmarks/gpu.py --device cpu --smoke   # a quick check of the script, any machine

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import header  # noqa: E402

from protofl.config import from_dict  # noqa: E402
from protofl.data.dataset import Dataset  # noqa: E402
from protofl.data.datasets import DATASETS  # noqa: E402
from protofl.engine.callbacks import Callback  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402

# protofl's own 2-core CPU figures for the 10-clients-per-round MNIST rows: FedAvg, 2 workers x 1
# thread, evaluation off, as here (benchmarks/timing.md section 2, 2026-11-21)
CPU_REFERENCE = {("fedavg_cnn", 10): 5269, ("lenet5", 10): 19700}


@DATASETS.register("generated32")
def generated32(root, seed: int, train: int = 50_000, test: int = 10_000) -> Dataset:
    """CIFAR-10-shaped data made from a seed: 3x32x32 uint8 images, 10 classes; each class
    is a fixed random colour pattern plus per-image noise (learnable, not trivial)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.rand(10, 3, 32, 32, generator=g) * 160 + 48

    def split(n: int):
        y = torch.randint(0, 10, (n,), generator=g)
        x = (patterns[y] + torch.randn(n, 3, 32, 32, generator=g) * 48).clamp(0, 255).to(torch.uint8)
        return x, y

    xtr, ytr = split(train)
    xte, yte = split(test)
    return Dataset("generated32", xtr, ytr, xte, yte, num_classes=10, scale=255.0,
                   mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def settings(smoke: bool) -> list[dict]:
    """(name, dataset, model, clients, per round, recipe); the smoke variant is tiny."""
    peers = {"lr": 0.01, "epochs": 5, "batch_size": 64}
    fednh = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5, "epochs": 5, "batch_size": 64, "clip_grad": 10.0}
    out = []
    for model in ("fedavg_cnn", "lenet5"):
        for m in (10, 100):
            out.append(dict(name=f"MNIST, {model}", data="mnist", model=model, clients=100, m=m, training=peers))
    for m in (10, 100):
        out.append(dict(name="generated 32x32, conv2cifar (FedNH recipe)", data="generated32", model="conv2cifar",
                        clients=100, m=m, training=fednh))
    out.append(dict(name="MNIST, fedavg_cnn", data="mnist", model="fedavg_cnn", clients=1000, m=1000, training=peers))
    if smoke:  # the same partitions, a fraction of the work: 1/25 of the clients per round, 3 steps each
        for s in out:
            s["m"] = max(2, s["m"] // 25)
            s["training"] = {**s["training"], "steps": 3}
    return out


def config(s: dict, executor: str, device: str, data_dir: str, rounds: int, out: str, smoke: bool,
           batch_clients: int) -> dict:
    data = {"name": s["data"], "root": data_dir}
    if s["data"] == "generated32" and smoke:
        data.update(train=10_000, test=1000)
    return {
        "seed": 0, "rounds": rounds, "data": data,
        "partition": {"name": "dirichlet", "num_clients": s["clients"], "beta": 0.3, "min_size": 10},
        "model": {"name": s["model"]},
        "training": s["training"],
        "participation": {"clients_per_round": s["m"]},
        "algorithm": {"name": "fedavg"},
        "eval": {"every": 10_000, "personal": False, "final_all_clients": False},
        "execution": {"device": device, "executor": executor, "workers": 0, "threads": 0,
                      "batch_clients": batch_clients},
        "output": {"dir": out, "checkpoint_every": 0, "progress": False, "save_model": False},
    }


class Rows(Callback):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_round(self, row: dict) -> None:
        self.rows.append(row)


class Utilization:
    """Mean GPU utilization (%) sampled every 0.2 s in a thread; None where unreadable."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.samples, self._stop = device, [], threading.Event()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.read = self._reader()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _reader(self):
        try:
            torch.cuda.utilization(self.index)  # needs pynvml (or amdsmi)
            return lambda: float(torch.cuda.utilization(self.index))
        except Exception:
            pass
        if shutil.which("nvidia-smi"):
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(self.index)]
            return lambda: float(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.split()[0])
        return None

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.samples.append(self.read())
            except Exception:
                return

    def __enter__(self):
        if self.read is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()

    @property
    def mean(self):
        return statistics.fmean(self.samples) if self.samples else None


def measure(cfg_dict: dict, device: str) -> dict:
    cfg = from_dict(cfg_dict)
    rows = Rows()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sim = Simulation(cfg, callbacks=[rows], run_dir=Path(cfg.output.dir) / f"{cfg.execution.executor}-{time.time_ns()}")
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    util = Utilization(dev) if cuda else None
    if util is not None:
        util.__enter__()
    try:
        res = sim.run()
    finally:
        if util is not None:
            util.__exit__()
    later = rows.rows[1:] or rows.rows  # round 1 includes warm-up (kernels, allocator, data to the device)
    rates = [r["train_samples"] / r["train_s"] for r in later if r["train_s"] > 0]
    return {
        "samples_s": statistics.median(rates) if rates else float("nan"),
        "round_s": statistics.median([r["train_s"] for r in later]),
        "samples": int(statistics.median([r["train_samples"] for r in later])),
        "util": util.mean if util is not None else None,
        "peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None,
        "executor": res.summary["execution"].get("executor", "sequential"),
    }


def fmt(v, spec=",.0f", none="n/a"):
    return none if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3, help="rounds per run; figures are medians of rounds 2..R")
    p.add_argument("--smoke", action="store_true",
                   help="tiny settings (3 local steps, 1/25 of the clients per round): checks the script")
    p.add_argument("--only", default="", help="comma-separated setting numbers (1-based) to run")
    p.add_argument("--executors", default="sequential,batched")
    p.add_argument("--batch-clients", type=int, default=0, help="execution.batch_clients (0 = all of a round)")
    p.add_argument("--out", default="benchmarks/results/gpu.md")
    args = p.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu.py: CUDA is not available to this torch ({torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    all_settings = settings(args.smoke)
    chosen = [int(i) for i in args.only.split(",") if i] or list(range(1, len(all_settings) + 1))
    executors = [e for e in args.executors.split(",") if e]
    tmp = tempfile.mkdtemp(prefix="protofl-gpu-")
    table = []
    try:
        for i in chosen:
            s = all_settings[i - 1]
            got = {}
            for ex in executors:  # interleaved per setting
                got[ex] = measure(config(s, ex, args.device, args.data_dir, args.rounds, tmp, args.smoke,
                                         args.batch_clients), args.device)
                print(f"[{i}] {s['name']}, {s['clients']} clients, {s['m']}/round, {ex}: "
                      f"{got[ex]['samples_s']:,.0f} samples/s", flush=True)
            table.append((i, s, got))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    smoke = " SMOKE settings (3 local steps, 1/25 of the clients per round): not comparable figures." if args.smoke else ""
    lines = [f"### {name} ({args.device})", "",
             header(f"{args.rounds} rounds per run, medians of rounds 2-{args.rounds}.{smoke}"),
             "", "```", "python " + " ".join(["benchmarks/gpu.py", *sys.argv[1:]]), "```", "",
             "| # | setting | clients | per round | executor | samples/s | s/round | GPU util % | peak GPU MiB "
             "| batched / sequential | vs 2-core CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s, got in table:
        base = got.get("sequential", {}).get("samples_s")
        cpu = CPU_REFERENCE.get((s["model"], s["m"])) if s["data"] == "mnist" and s["clients"] == 100 else None
        for ex, r in got.items():
            ratio = f"{r['samples_s'] / base:.2f}x" if base and ex != "sequential" else ""
            vs_cpu = f"{r['samples_s'] / cpu:.1f}x" if cpu and not args.smoke else ""
            label = ex if r["executor"] == ex else f"{ex} (ran {r['executor']})"
            lines.append(f"| {i} | {s['name']} | {s['clients']} | {s['m']} | {label} | {fmt(r['samples_s'])} "
                         f"| {fmt(r['round_s'], '.2f')} | {fmt(r['util'], '.0f')} | {fmt(r['peak_mib'])} "
                         f"| {ratio} | {vs_cpu} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
