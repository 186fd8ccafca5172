"""GPU execution: samples/s of the sequential and the batched client executor on one GPU.

Workloads (FedAvg's local update unless ``--methods`` names others; eval off):

* peers' workload: MNIST, 100 clients, Dirichlet(0.3), 10 and 100 clients per round,
  5 local epochs, batch 64, SGD lr 0.01, ``fedavg_cnn`` and ``lenet5``;
* FedNH's CIFAR-style setting: ``conv2cifar`` on generated 32x32x3 data (50,000 train
  images, 10 classes, made here from a seed: nothing is downloaded), 100 clients,
  Dirichlet(0.3), 10 and 100 clients per round, FedNH's recipe (5 epochs, batch 64, lr
  0.01, momentum 0.9, weight decay 1e-5, gradient clipping at 10);
* 1,000 clients per round: MNIST split 1,000 ways (Dirichlet(0.3)), every client in
  every round, ``fedavg_cnn``.

Per setting, method and executor (interleaved: sequential, batched, ...): training
samples/s (sum over the round's clients of samples trained / the round's training wall
time, median of rounds 2..R), GPU utilization (mean of samples taken every 0.2 s while
the run trains: ``torch.cuda.utilization`` if pynvml is there, else ``nvidia-smi``), peak
GPU memory (``torch.cuda.max_memory_allocated``), and, from a second run of two rounds
whose second round trains under ``torch.profiler``:

* **stack occupancy** (batched executor): busy client-steps / slot-steps of its stacks
  (1.0: no slot ever idle; lockstep stacks of clients of unequal sizes waste the rest);
* **launches per training sample**: the operators the executor's ``run`` dispatched that
  do work (ATen operators with no ATen operator below them, less views and bare
  allocations, :func:`count_launches`), per sample trained. On a GPU each launches at
  least one kernel; on a CPU the figure counts the same dispatches.

``--pfllib PFLLIB`` also runs PFLlib's FedAvg (benchmarks/peer_drivers/pfllib.py, with
``--pfllib-python``, on the same device) for the MNIST ``fedavg_cnn`` settings, in the same
invocation, and reports protofl / PFLlib per row (benchmarks/peers_setup.md, section 5).
Writes a markdown table headed with the device's name. Needs only the repository and
the MNIST files (no internet).

    python benchmarks/gpu.py --data-dir DATA --out benchmarks/results/gpu.md
    python benchmarks/gpu.py --data-dir DATA --methods fedavg,fednh,fedgela,fedproto,mpfedcl,rebafl
    python benchmarks/gpu.py --device cpu --smoke   # any machine: the CPU figures of occupancy and launches
    python benchmarks/gpu.py --data-dir DATA --pfllib PFLLIB --pfllib-python python3 \\
        --methods fedavg,fednh,fedgela,fedproto,mpfedcl,rebafl --sequential-at 1 --no-launches
        # the whole table in one invocation, the sequential executor at 10 a round only: under
        # 8.7 minutes of an H200 (the five invocations of 2026-11-26, which also ran FedAvg's
        # sequential executor at 100 a round, took 8.7)

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402

from protofl.config import from_dict  # noqa: E402
from protofl.data.dataset import Dataset  # noqa: E402
from protofl.data.datasets import DATASETS  # noqa: E402
from protofl.engine.callbacks import Callback  # noqa: E402
from protofl.engine.backends import EXECUTORS  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402

DRIVERS = Path(__file__).resolve().parent / "peer_drivers"

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
    """(name, dataset, model, clients, per round, recipe); the smoke variant is small."""
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
    if smoke:  # the same partitions (clients of their real, unequal sizes), 1/10 of the clients, 1 epoch
        for s in out:
            s["m"] = max(4, s["m"] // 10)
            s["training"] = {**s["training"], "epochs": 1}
    return out


def config(s: dict, executor: str, device: str, data_dir: str, rounds: int, out: str, smoke: bool,
           batch_clients: int, method: str = "fedavg", compile_step: bool = False, pad: str = "auto",
           stack_kernels: str = "off") -> dict:
    data = {"name": s["data"], "root": data_dir}
    if s["data"] == "generated32" and smoke:
        data.update(train=10_000, test=1000)
    return {
        "seed": 0, "rounds": rounds, "data": data,
        "partition": {"name": "dirichlet", "num_clients": s["clients"], "beta": 0.3, "min_size": 10},
        "model": {"name": s["model"]},
        "training": s["training"],
        "participation": {"clients_per_round": s["m"]},
        "algorithm": {"name": method},
        "eval": {"every": 10_000, "personal": False, "final_all_clients": False},
        "execution": {"device": device, "executor": executor, "workers": 0, "threads": 0,
                      "batch_clients": batch_clients, "compile": compile_step and executor == "batched",
                      "pad_batches": {"auto": "auto", "on": True, "off": False}[pad],
                      "conv_as_matmul": {"off": False, "one_channel": "one_channel", "all": True}[stack_kernels]},
        "output": {"dir": out, "checkpoint_every": 0, "progress": False, "save_model": False},
    }


# ATen operators that dispatch no work of their own: views and reshapes, bare allocations,
# and the no-op conversions (a leaf `to`/`contiguous` found its tensor already as asked)
NO_WORK = {"aten::view", "aten::_unsafe_view", "aten::_reshape_alias", "aten::reshape", "aten::as_strided",
           "aten::as_strided_", "aten::slice", "aten::select", "aten::t", "aten::transpose", "aten::permute",
           "aten::expand", "aten::expand_as", "aten::view_as", "aten::unsqueeze", "aten::squeeze", "aten::unsqueeze_",
           "aten::squeeze_", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh", "aten::unbind",
           "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::flatten",
           "aten::unflatten", "aten::movedim", "aten::numpy_T", "aten::resolve_conj", "aten::resolve_neg",
           "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::to", "aten::contiguous",
           "aten::requires_grad_", "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::size",
           "aten::stride", "aten::_has_compatible_shallow_copy_type", "aten::_local_scalar_dense_noop"}


def count_launches(prof, outside_compiled: bool = False) -> int:
    """Operators that do work in a profile: ATen operators with no ATen operator below them
    (what actually runs; a composite op is counted through its parts), less ``NO_WORK``; and
    the kernels that ``torch.compile`` generated for the CPU, when it records them
    (``torch._inductor.config.cpp.enable_kernel_profile``: events ``graph_<n>_cpp_fused_...``),
    each of which a GPU would launch as one kernel of its own. ``outside_compiled``: only
    those outside a compiled region (what a CUDA graph of the compiled step would not
    replay), each compiled region counted as one."""
    n = 0
    for e in prof.events():
        if outside_compiled and _compiled_region(e):
            n += e.name.startswith("Torch-Compiled Region")
            continue
        if "_cpp_fused_" in e.name:
            n += 1
            continue
        if not e.name.startswith("aten::") or e.name in NO_WORK:
            continue
        if any(c.name.startswith("aten::") for c in e.cpu_children):
            continue
        n += 1
    return n


def _compiled_region(e) -> bool:
    """Whether profiler event ``e`` is a compiled region or runs inside one."""
    while e is not None:
        if e.name.startswith("Torch-Compiled Region"):
            return True
        e = e.cpu_parent
    return False


class Profiled:
    """An executor that runs its ``run`` of round ``at`` under ``torch.profiler`` (CPU activity;
    with ``cuda`` CUDA activity too, the device synchronized around it) and keeps the
    profile, its wall time and the samples trained."""

    def __init__(self, inner, at: int, cuda: bool = False) -> None:
        self.inner, self.at, self.cuda, self.calls = inner, at, cuda, 0
        self.prof = None
        self.wall = self.samples = 0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, tasks):
        self.calls += 1
        if self.calls != self.at:
            return self.inner.run(tasks)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            outs = self.inner.run(tasks)
            self._sync()
        self.wall = time.perf_counter() - t0
        self.prof = prof
        self.samples = sum(o.train.get("samples", 0) for o in outs if o is not None)
        return outs

    def __getattr__(self, name):
        return getattr(self.inner, name)


def profiled_round(cfg_dict: dict, at: int = 2, cuda: bool = False) -> Profiled:
    """A run of ``at`` rounds of ``cfg_dict`` whose last round trains under the profiler."""
    cfg = from_dict({**cfg_dict, "rounds": at})
    box: dict = {}

    def factory(sim):
        box["ex"] = Profiled(EXECUTORS.get(cfg.execution.backend)(sim), at, cuda)
        return box["ex"]

    Simulation(cfg, run_dir=Path(cfg.output.dir) / f"profiled-{time.time_ns()}", executor_factory=factory).run()
    return box["ex"]


def launches_per_sample(cfg_dict: dict) -> float:
    """Operator launches per training sample in the second round of a 2-round run."""
    ex = profiled_round(cfg_dict)
    return count_launches(ex.prof) / ex.samples if ex.samples else float("nan")


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


def measure(cfg_dict: dict, device: str, launches: bool) -> dict:
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
    mode = res.summary["execution"]
    return {
        "samples_s": statistics.median(rates) if rates else float("nan"),
        "round_s": statistics.median([r["train_s"] for r in later]),
        "first_s": rows.rows[0]["train_s"] if rows.rows else float("nan"),  # compilations and warm-up in it
        "samples": int(statistics.median([r["train_samples"] for r in later])),
        "util": util.mean if util is not None else None,
        "peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None,
        "executor": mode.get("executor", "sequential"),
        "occupancy": mode.get("occupancy"),
        "slots": mode.get("slots"),
        "padded": mode.get("padded"),
        "launches": launches_per_sample(cfg_dict) if launches else None,
    }


def run_pfllib(args, s: dict) -> Optional[float]:
    """PFLlib's FedAvg on this setting's MNIST workload (its own Dir(0.3) split of 100 clients,
    the setting's clients per round and epochs), on ``--device``: samples/s, median of rounds 2..R."""
    cmd = [args.pfllib_python, str(DRIVERS / "pfllib.py"), "run", "--root", args.pfllib, "--rounds", str(args.rounds),
           "--clients-per-round", str(s["m"]), "--epochs", str(s["training"]["epochs"]), "--eval", "off",
           "--device", args.device]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    rounds = [json.loads(line[len("PEER_ROUND "):]) for line in p.stdout.splitlines() if line.startswith("PEER_ROUND ")]
    rates = [r["samples"] / r["seconds"] for r in rounds[1:] if r["seconds"] > 0]
    if p.returncode != 0 or not rates:
        print(f"PFLlib failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or ['no output'])[-1][:300]}",
              file=sys.stderr)
        return None
    return statistics.median(rates)


def measure_packed(cfg_dict: dict, runs: int) -> dict:
    """``runs`` runs of ``cfg_dict`` (seeds 0..runs-1) packed (``execution.pack_runs``: their
    clients in shared stacks of one batched executor): the training samples of all their
    rounds over the wall time of the whole packed run (round 1 and evaluation included)."""
    from protofl.engine.packed import run_packed

    counted: list[Rows] = []

    def build(seed, member):
        cfg = from_dict({**cfg_dict, "seed": seed})
        counted.append(Rows())
        return Simulation(cfg, callbacks=[counted[-1]], run_dir=Path(cfg.output.dir) / f"packed-{seed}-{time.time_ns()}",
                          executor_factory=lambda sim: member)

    ended: list[str] = []
    t0 = time.perf_counter()
    run_packed(list(range(runs)), build, lambda seed: None, lambda seed, summary, s: ended.append(summary["status"]),
               log=lambda line: print(line, flush=True))
    wall = time.perf_counter() - t0
    samples = sum(r["train_samples"] for c in counted for r in c.rows)
    return {"runs": runs, "complete": ended.count("complete"), "samples_s": samples / wall, "wall_s": wall}


def fmt(v, spec=",.0f", none="n/a"):
    return none if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3, help="rounds per run; figures are medians of rounds 2..R")
    p.add_argument("--smoke", action="store_true",
                   help="small settings (1 local epoch, 1/10 of the clients per round): the CPU figures of "
                        "occupancy and launches, and a check of the script")
    p.add_argument("--only", default="", help="comma-separated setting numbers (1-based) to run")
    p.add_argument("--methods", default="fedavg", help="comma-separated protofl methods, e.g. fedavg,fednh,rebafl")
    p.add_argument("--executors", default="sequential,batched")
    p.add_argument("--sequential-at", default="",
                   help="comma-separated setting numbers where the sequential executor runs too (default: every "
                        "setting; its rounds at 100 clients a round or more take minutes on a GPU)")
    p.add_argument("--batch-clients", type=int, default=0, help="execution.batch_clients (0 = chosen per round)")
    p.add_argument("--compile", action="store_true", help="execution.compile for the batched rows (torch.compile "
                                                          "of the stack's step; CUDA graphs on a GPU)")
    p.add_argument("--pad", choices=("auto", "on", "off"), default="auto",
                   help="execution.pad_batches for the batched rows (auto: on a GPU)")
    p.add_argument("--conv-as-matmul", default="off",
                   help="execution.conv_as_matmul for the batched rows, comma-separated: a batched row for each "
                        "of off (false), one_channel, all (true)")
    p.add_argument("--no-launches", action="store_true", help="skip the profiled run (occupancy stays)")
    p.add_argument("--pfllib", help="PFLlib checkout prepared as in benchmarks/peers_setup.md (MNIST fedavg_cnn rows)")
    p.add_argument("--pfllib-python", default=sys.executable, help="the Python that runs PFLlib")
    p.add_argument("--packed", type=int, default=0, help="also N runs of each 10-a-round setting packed "
                                                         "(execution.pack_runs; seeds 0..N-1; FedAvg)")
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
    sequential_at = {int(i) for i in args.sequential_at.split(",") if i} or set(chosen)
    methods = [m for m in args.methods.split(",") if m]
    kernels = [k for k in args.conv_as_matmul.split(",") if k]
    variants = [(ex, k) for ex in executors for k in (kernels if ex == "batched" else ["off"])]
    tmp = tempfile.mkdtemp(prefix="protofl-gpu-")
    table, packed = [], []
    try:
        for i in chosen:
            s = all_settings[i - 1]
            peer = None
            if args.pfllib and s["data"] == "mnist" and s["model"] == "fedavg_cnn" and s["clients"] == 100:
                peer = run_pfllib(args, s)
                print(f"[{i}] PFLlib FedAvg, {s['m']}/round: {fmt(peer)} samples/s", flush=True)
            for method in methods:
                got = {}
                for ex, k in variants:  # interleaved per setting
                    if ex == "sequential" and i not in sequential_at:
                        continue
                    key = ex if k == "off" else f"{ex}, conv as matmul: {k}"
                    got[key] = measure(config(s, ex, args.device, args.data_dir, args.rounds, tmp, args.smoke,
                                              args.batch_clients, method, args.compile, args.pad, k), args.device,
                                       not args.no_launches)
                    r = got[key]
                    print(f"[{i}] {s['name']}, {s['clients']} clients, {s['m']}/round, {method}, {key}: "
                          f"{r['samples_s']:,.0f} samples/s, occupancy {fmt(r['occupancy'], '.2f')}, "
                          f"launches/sample {fmt(r['launches'], '.3f')}", flush=True)
                table.append((i, s, method, got, peer))
            if args.packed and settings(False)[i - 1]["m"] == 10:  # the 10-a-round settings (smoke: fewer)
                cfg = config(s, "batched", args.device, args.data_dir, args.rounds, tmp, args.smoke, args.batch_clients,
                             "fedavg", args.compile, args.pad)
                cfg["execution"]["pack_runs"] = True
                packed.append((i, s, measure_packed(cfg, args.packed)))
                print(f"[{i}] {args.packed} runs packed: {packed[-1][2]['samples_s']:,.0f} samples/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    smoke = (" SMOKE settings (1 local epoch, 1/10 of the clients per round): for occupancy and launches, not "
             "for samples/s." if args.smoke else "")
    lines = [f"### {name} ({args.device})", "",
             header(f"{args.rounds} rounds per run, medians of rounds 2-{args.rounds}; occupancy over the run, "
                    f"launches per sample in the second round of a separate profiled run.{smoke}"),
             "", "```", "python " + " ".join(["benchmarks/gpu.py", *sys.argv[1:]]), "```", "",
             "| # | setting | clients | per round | method | executor | samples/s | s/round | round 1 s | occupancy "
             "| slots | launches / sample | GPU util % | peak GPU MiB | batched / sequential | vs PFLlib "
             "| vs 2-core CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s, method, got, peer in table:
        base = got.get("sequential", {}).get("samples_s")
        cpu = CPU_REFERENCE.get((s["model"], s["m"])) if s["data"] == "mnist" and s["clients"] == 100 else None
        for ex, r in got.items():
            ratio = f"{r['samples_s'] / base:.2f}x" if base and ex != "sequential" else ""
            vs_cpu = f"{r['samples_s'] / cpu:.1f}x" if cpu and not args.smoke and method == "fedavg" else ""
            vs_peer = f"{r['samples_s'] / peer:.1f}x" if peer and method == "fedavg" else ""
            label = ex if r["executor"] == ex.split(",")[0] else f"{ex} (ran {r['executor']})"
            label += ", padded" if r["padded"] else ""
            lines.append(f"| {i} | {s['name']} | {s['clients']} | {s['m']} | {method} | {label} | "
                         f"{fmt(r['samples_s'])} | {fmt(r['round_s'], '.2f')} | {fmt(r['first_s'], '.2f')} | "
                         f"{fmt(r['occupancy'], '.2f', '')} | "
                         f"{fmt(r['slots'], 'd', '')} | {fmt(r['launches'], '.3f')} | {fmt(r['util'], '.0f')} | "
                         f"{fmt(r['peak_mib'])} | {ratio} | {vs_peer} | {vs_cpu} |")
    peers = [(i, s, peer) for i, s, method, _, peer in table if peer and method == methods[0]]
    if peers:
        lines += ["", "PFLlib (FedAvg, its own MNIST Dir(0.3) split of 100 clients, evaluation off, same device):", "",
                  "| # | per round | PFLlib samples/s |", "|---|---|---|"]
        lines += [f"| {i} | {s['m']} | {fmt(peer)} |" for i, s, peer in peers]
    if packed:
        lines += ["", f"Runs packed (`execution.pack_runs`; FedAvg, seeds 0-{args.packed - 1}, {args.rounds} rounds each): "
                  "training samples of all their rounds over the packed run's wall time, round 1 and the "
                  "final evaluation included:", "",
                  "| # | per round (each run) | runs | complete | samples/s | wall s |", "|---|---|---|---|---|---|"]
        lines += [f"| {i} | {s['m']} | {r['runs']} | {r['complete']} | {fmt(r['samples_s'])} | {r['wall_s']:.1f} |"
                  for i, s, r in packed]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
