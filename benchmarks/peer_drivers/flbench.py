"""Run FL-bench (KarhouTam/FL-bench, commit 06e658b) on the peers' workload, unchanged.

Executed by benchmarks/peers.py with FL-bench's own Python (its virtual environment),
never with protofl's. It imports FL-bench from the checkout given by ``--root`` and
changes none of its files: it wraps ``FedAvgServer.train_one_round`` to note the time at
which each round starts and the training samples it will process, then calls FL-bench's
own ``main()`` (hydra) with the workload's overrides. In ``parallel`` mode it also makes
``ray.cluster_resources()`` report ``GPU: 0`` when Ray lists no GPU key (FL-bench reads
that key unconditionally and stops with a KeyError on a CPU-only machine). One line per
round on stdout:

    PEER_ROUND {"round": r, "seconds": s, "samples": n}

seconds = start of round r+1 (or the end of training) - start of round r, so a round
includes FL-bench's own evaluation and logging; samples = sum over the selected
clients of local epochs x training-set size.

    python flbench.py prepare --root FLBENCH --data-dir DATA    # MNIST Dir(0.3), 100 clients
    python flbench.py run --root FLBENCH --rounds 6 --mode serial --eval default
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

from _peer import copy_mnist, parser, print_round  # importing it installs the torchvision shim


def prepare(root: Path, data_dir: Path) -> None:
    # torchvision's MNIST finds the official .gz files in <root>/MNIST/raw (md5 checked)
    # and extracts them instead of downloading
    raw = root / "data" / "mnist" / "MNIST" / "raw"
    copy_mnist(data_dir, raw)
    subprocess.run([sys.executable, "generate_data.py", "-d", "mnist", "-a", "0.3", "-cn", "100",
                    "-pd", "0", "--use_cuda", "0"], cwd=root, check=True)


def overrides(rounds: int, mode: str, workers: int, eval_on: bool, per_round: int = 10) -> list[str]:
    o = ["method=fedavg", "dataset.name=mnist", "model.name=avgcnn",
         "optimizer.name=sgd", "optimizer.lr=0.01",
         "common.local_epoch=5", "common.batch_size=64", f"common.join_ratio={per_round / 100}",
         f"common.global_epoch={rounds}", "common.use_cuda=false",
         "common.save_log=false", "common.save_learning_curve_plot=false", "common.save_metrics=false",
         f"mode={mode}"]
    if mode == "parallel":
        # a cluster of its own (never one another process started), 2 CPUs, no GPU
        o += [f"parallel.num_workers={workers}", f"parallel.num_cpus={workers}", "parallel.num_gpus=0",
              "parallel.ray_cluster_addr=local"]
    if not eval_on:
        o.append("common.client_side_evaluation=false")
    return o


def run(root: Path, rounds: int, mode: str, workers: int, eval_on: bool, per_round: int) -> None:
    os.chdir(root)
    sys.path.insert(0, str(root))
    from src.server.fedavg import FedAvgServer

    starts: list[float] = []
    samples: list[int] = []
    train_one_round, train = FedAvgServer.train_one_round, FedAvgServer.train

    def timed_round(self):
        starts.append(time.perf_counter())
        samples.append(sum(len(self.client_data_indices[c]["train"]) * self.client_local_epoches[c]
                           for c in self.selected_clients))
        return train_one_round(self)

    def timed_train(self):
        train(self)
        starts.append(time.perf_counter())

    FedAvgServer.train_one_round, FedAvgServer.train = timed_round, timed_train
    if mode == "parallel":
        # FL-bench 06e658b reads ray.cluster_resources()["GPU"], a key Ray leaves out on a
        # machine without GPUs (KeyError before the first round); report 0 GPUs there
        import ray

        cluster_resources = ray.cluster_resources
        ray.cluster_resources = lambda: {"GPU": 0.0, **cluster_resources()}
    # as a script, as FL-bench is run (hydra finds config/ beside it; its output goes to
    # FL-bench's own out/ folder, as always)
    sys.argv = ["main.py", *overrides(rounds, mode, workers, eval_on, per_round)]
    runpy.run_path("main.py", run_name="__main__")
    for r in range(len(samples)):
        print_round(r + 1, starts[r + 1] - starts[r], samples[r])


def main() -> None:
    p = parser(__doc__.splitlines()[0], "FL-bench checkout at 06e658b")
    p.add_argument("--mode", choices=["serial", "parallel"], default="serial")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    root = a.root.resolve()
    if a.command == "prepare":
        prepare(root, a.data_dir.resolve())
    else:
        run(root, a.rounds, a.mode, a.workers, a.eval == "default", a.clients_per_round)


if __name__ == "__main__":
    main()
