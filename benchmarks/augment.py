"""Augmentation and data loading must not slow training down.

1. Training samples/s with ``data.augment`` on ({crop: 4, flip: true}) and off, on
   CIFAR-shaped data (3x32x32, generated from a seed as in benchmarks/gpu.py: nothing is
   downloaded), with ``conv2cifar`` and ``resnet18``, for the sequential and the batched
   executor. Runs of the same model and executor alternate on and off, in one process;
   the figure is the median over rounds 2..R of (samples trained / the round's training
   time). Target: on costs at most 10 % of off.
2. Reading CIFAR-10 from the data root into memory: a full-size ``cifar-10-python.tar.gz``
   in the published format (5 training batches and the test batch of 10,000 images each,
   pickled dicts as Python 2 wrote them; random pixels that compress like real ones, 180 MB)
   is written to a temporary data root, then
   ``load_dataset("cifar10", root)`` is timed, best of 3. Target: under 2 s.

    python benchmarks/augment.py --out benchmarks/results/augment.md
    python benchmarks/augment.py --device cuda        # on a GPU

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import io
import pickle
import statistics
import struct
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402
from gpu import generated32  # noqa: E402,F401 - registers the generated32 dataset

from protofl.config import from_dict  # noqa: E402
from protofl.data.datasets import load_dataset  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402


def config(model: str, executor: str, augment: bool, device: str, train: int, rounds: int, out: str) -> dict:
    return {
        "seed": 0, "rounds": rounds,
        "data": {"name": "generated32", "train": train, "test": 1000,
                 **({"augment": {"crop": 4, "flip": True}} if augment else {})},
        "partition": {"name": "dirichlet", "num_clients": 10, "beta": 0.3},
        "model": {"name": model},
        "training": {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5, "epochs": 1, "batch_size": 64},
        "participation": {"fraction": 1.0},
        "algorithm": {"name": "fedavg"},
        "eval": {"every": 1000, "personal": False, "final_all_clients": False},
        "execution": {"device": device, "executor": executor, "workers": 0, "threads": 0},
        "output": {"dir": out, "progress": False, "checkpoint_every": 0, "save_model": False},
    }


def samples_per_s(cfg: dict) -> float:
    rows = Simulation(from_dict(cfg), run_dir=Path(cfg["output"]["dir"]) / f"r{time.time_ns()}").run().rows
    rates = [r["train_samples"] / r["train_s"] for r in rows[1:]]
    return statistics.median(rates)


class Python2Pickler(pickle._Pickler):
    """Protocol 2 as Python 2 wrote CIFAR's batches: a bytes value is a BINSTRING (raw
    bytes), not Python 3's ``_codecs.encode`` of a latin-1 string, which is twice the size
    and far slower to read, so it would time a file no user has."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj: bytes) -> None:
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256 else pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def cifar_tarball(root: Path) -> Path:
    """A full-size cifar-10-python.tar.gz in the published layout (random pixels that
    compress about as much as the real ones, pickled the way Python 2 did)."""
    rng = np.random.default_rng(0)
    path = root / "cifar10" / "cifar-10-python.tar.gz"
    path.parent.mkdir(parents=True)
    with tarfile.open(path, "w:gz") as tf:
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        for name in files:
            # pixels ~ N(120, 60) clipped: deflate must Huffman-decode them, as in the real
            # tarball (163 MB for 178 MB of pickles), where uniform bytes would be stored raw
            pixels = np.clip(rng.normal(120, 60, (10000, 3072)), 0, 255).astype(np.uint8)
            data = {b"data": pixels,
                    b"labels": rng.integers(0, 10, 10000).tolist()}
            buf = io.BytesIO()
            Python2Pickler(buf, protocol=2).dump(data)
            raw = buf.getvalue()
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--train", type=int, default=4000, help="training images (CIFAR has 50,000; fewer on a CPU)")
    p.add_argument("--models", default="conv2cifar,resnet18")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="protofl-augment-")
    lines = [header(f"Device {args.device}; {args.train} generated 3x32x32 images over 10 clients (Dir(0.3)), all "
                    f"of them each round, 1 epoch, batch 64, FedAvg; median of rounds 2..{args.rounds}; "
                    "augmentation {crop: 4, flip: true}."), "",
             "| model | executor | samples/s, augmentation off | on | on / off |", "|---|---|---|---|---|"]
    for model in args.models.split(","):
        for executor in ("sequential", "batched"):
            got = {}
            for augment in (False, True, False, True):  # alternated: the machine's drift shows in both
                got.setdefault(augment, []).append(samples_per_s(config(model, executor, augment, args.device,
                                                                        args.train, args.rounds, tmp)))
            off, on = max(got[False]), max(got[True])
            lines.append(f"| {model} | {executor} | {off:,.0f} | {on:,.0f} | {on / off:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    root = Path(tempfile.mkdtemp(prefix="protofl-cifar-"))
    cifar_tarball(root)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        ds = load_dataset("cifar10", root, seed=0)
        times.append(time.perf_counter() - t0)
    assert len(ds.y_train) == 50000 and len(ds.y_test) == 10000
    lines += ["", f"Reading CIFAR-10 (a full-size `cifar-10-python.tar.gz`, 50,000 + 10,000 images) into memory: "
                  f"{min(times):.2f} s (best of 3; {', '.join(f'{t:.2f}' for t in times)})."]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
