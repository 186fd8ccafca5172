"""What the two peer drivers (flbench.py, pfllib.py) share. Imported by them, in the
peer's own Python; importing it installs the torchvision shim."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
from pathlib import Path

# PyPI's torchvision next to the CPU torch (see cpu_torchvision/sitecustomize.py): for
# this process now, and through PYTHONPATH for its children (Ray's workers, generators)
SHIM = Path(__file__).resolve().parent / "cpu_torchvision"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), os.environ.get("PYTHONPATH")]))
_spec = importlib.util.spec_from_file_location("cpu_torchvision_shim", SHIM / "sitecustomize.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def copy_mnist(data_dir: Path, raw: Path) -> None:
    """The official MNIST .gz files into ``raw``, where torchvision extracts them
    instead of downloading."""
    raw.mkdir(parents=True, exist_ok=True)
    for f in MNIST_FILES:
        shutil.copy(data_dir / "mnist" / f, raw / f)


def print_round(r: int, seconds: float, samples: int) -> None:
    """The line benchmarks/peers.py reads: ``PEER_ROUND {"round", "seconds", "samples"}``."""
    print("PEER_ROUND", json.dumps({"round": r, "seconds": seconds, "samples": samples}), flush=True)


def parser(description: str, root_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("command", choices=["prepare", "run"])
    p.add_argument("--root", type=Path, required=True, help=root_help)
    p.add_argument("--data-dir", type=Path, help="folder with mnist/*.gz (prepare)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clients-per-round", type=int, default=10, help="of the 100")
    p.add_argument("--eval", choices=["default", "off"], default="default")
    p.add_argument("--epochs", type=int, default=5, help="local epochs (the workload's 5)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (PFLlib on a GPU, for benchmarks/gpu.py)")
    return p
