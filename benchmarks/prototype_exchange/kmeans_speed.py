"""k-means for MP-FedCL: protofl 0.1.0's torch Lloyd loop against the current
scikit-learn-based :func:`protofl.nn.clustering.kmeans`, alone and inside MP-FedCL rounds.

1. k-means alone, one thread, K-means++ with 5 restarts and at most 100 Lloyd iterations
   (MP-FedCL's defaults), on three sizes: 500 x 64 (k = 2), 6,000 x 256 (k = 2, an MNIST
   class of one client) and 3,000 x 512 (k = 5). The points are non-negative (ReLU)
   Gaussian blobs, like a ReLU body's embeddings. The two implementations alternate
   (old, new, old, new, ...); medians over the repeats, and both final inertias (the
   seeding differs, so they need not be equal; they are near each other).
2. MP-FedCL rounds: ``configs/mpfedcl_mnist.yaml`` (full MNIST training split, 5 clients,
   Dirichlet(0.05), ``mlp_mnist``, K = 2), sequential with one thread, evaluation off
   except the global model at the last round; runs of ``--rounds`` rounds alternate
   between the two k-means (the old one patched into MP-FedCL's module); medians of
   rounds 2..R of the training time per round (local training + prototypes) and of the
   time spent inside k-means.

    python benchmarks/prototype_exchange/kmeans_speed.py --data-dir DATA
    python benchmarks/prototype_exchange/kmeans_speed.py --data-dir DATA --repeats 1 --pairs 1  # quick

The old implementation below is protofl 0.1.0's ``nn/clustering.py`` k-means, kept here
verbatim as the baseline of this comparison (it is no longer part of the library).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import CONFIGS, HERE, markdown

import protofl.algorithms.mpfedcl as mpfedcl_module
from protofl.config import load_config
from protofl.engine.callbacks import Callback
from protofl.engine.simulation import Simulation
from protofl.nn.clustering import KMeansResult, kmeans


# -- protofl 0.1.0's k-means (the baseline) ---------------------------------------------------
def _sq_dists(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((x.unsqueeze(1) - c.unsqueeze(0)) ** 2).sum(-1)


def _kmeans_pp(x: torch.Tensor, k: int, rng: np.random.Generator) -> torch.Tensor:
    n = len(x)
    idx = [int(rng.integers(n))]
    d2 = _sq_dists(x, x[idx]).squeeze(1)
    for _ in range(1, k):
        p = d2.numpy()
        total = p.sum()
        nxt = int(rng.choice(n, p=p / total)) if total > 0 else next(i for i in range(n) if i not in idx)
        idx.append(nxt)
        d2 = torch.minimum(d2, _sq_dists(x, x[nxt:nxt + 1]).squeeze(1))
    return x[idx].clone()


def _lloyd(x: torch.Tensor, c: torch.Tensor, max_iter: int, tol: float) -> KMeansResult:
    for _ in range(max_iter):
        d2 = _sq_dists(x, c)
        labels = d2.argmin(1)
        err = d2.gather(1, labels[:, None]).squeeze(1)
        new = c.clone()
        for j in range(len(c)):
            members = labels == j
            if members.any():
                new[j] = x[members].mean(0)
            else:
                far = int(err.argmax())
                new[j] = x[far]
                err[far] = -1.0
        shift = float(((new - c) ** 2).sum())
        c = new
        if shift <= tol:
            break
    d2 = _sq_dists(x, c)
    labels = d2.argmin(1)
    inertia = float(d2.gather(1, labels[:, None]).sum())
    return KMeansResult(c, labels, inertia)


def kmeans_010(x: torch.Tensor, k: int, rng: np.random.Generator, n_init: int = 5,
               max_iter: int = 100, tol: float = 1e-10) -> KMeansResult:
    xd = x.detach().to("cpu", torch.float64)
    distinct = torch.unique(xd, dim=0)
    if len(distinct) <= k:
        labels = _sq_dists(xd, distinct).argmin(1)
        best = KMeansResult(distinct, labels, 0.0)
    else:
        best = None
        for _ in range(n_init):
            res = _lloyd(xd, _kmeans_pp(xd, k, rng), max_iter, tol)
            if best is None or res.inertia < best.inertia:
                best = res
    return KMeansResult(best.centroids.to(x.device, x.dtype), best.labels.to(x.device), best.inertia)


IMPLS = {"0.1.0 (torch loop)": kmeans_010, "scikit-learn KMeans": kmeans}
SIZES = [(500, 64, 2), (6000, 256, 2), (3000, 512, 5)]


def blobs(n: int, d: int, k: int, seed: int) -> torch.Tensor:
    """ReLU of k overlapping Gaussian blobs (unit noise per coordinate, centers of norm ~6):
    points like a ReLU body's embeddings of one class."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g) * (6.0 / d ** 0.5)
    assign = torch.randint(k, (n,), generator=g)
    return torch.relu(centers[assign] + torch.randn(n, d, generator=g)).float()


def bench_alone(repeats: int) -> tuple[list, list]:
    torch.set_num_threads(1)
    for fn in IMPLS.values():  # imports and first-call costs are not part of the figures
        fn(blobs(100, 8, 2, seed=0), 2, np.random.default_rng(0))
    rows = []
    for n, d, k in SIZES:
        x = blobs(n, d, k, seed=n + d + k)
        times = {name: [] for name in IMPLS}
        inertia = {}
        for rep in range(repeats):
            for name, fn in IMPLS.items():  # alternate old, new, old, new, ...
                t0 = time.perf_counter()
                res = fn(x, k, np.random.default_rng(rep))
                times[name].append(time.perf_counter() - t0)
                inertia.setdefault(name, res.inertia)
        old, new = (statistics.median(times[name]) for name in IMPLS)
        rows.append([f"{n:,} x {d}", k, f"{old * 1000:.1f}", f"{new * 1000:.1f}", f"{old / new:.1f}x",
                     f"{inertia[list(IMPLS)[0]]:.6g}", f"{inertia[list(IMPLS)[1]]:.6g}"])
        print(f"[alone] {n}x{d} k={k}: old {old * 1000:.1f} ms, new {new * 1000:.1f} ms", file=sys.stderr)
    header = ["points", "k", "0.1.0 (ms)", "scikit-learn (ms)", "speed-up", "inertia 0.1.0", "inertia scikit-learn"]
    return header, rows


class KMeansClock(Callback):
    """Wraps a k-means implementation and records the seconds spent in it per round."""

    def __init__(self, fn) -> None:
        self.fn, self.spent, self.per_round = fn, 0.0, []

    def kmeans(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.spent += time.perf_counter() - t0

    def on_round(self, row) -> None:
        self.per_round.append(self.spent)
        self.spent = 0.0


def bench_rounds(data_dir, pairs: int, rounds: int) -> tuple[list, list]:
    ov = [f"rounds={rounds}", "execution.workers=0", "execution.threads=1", "output.progress=false",
          f"eval.every={rounds}", "eval.personal=false", "eval.final_all_clients=false",
          "output.checkpoint_every=0", "output.save_model=false"]
    if data_dir:
        ov.append(f"data.root={data_dir}")
    cfg = load_config(CONFIGS / "mpfedcl_mnist.yaml", ov)
    train = {name: [] for name in IMPLS}
    in_kmeans = {name: [] for name in IMPLS}
    for p in range(pairs):
        for name, fn in IMPLS.items():  # alternate old, new, old, new, ...
            probe = KMeansClock(fn)
            mpfedcl_module.kmeans = probe.kmeans
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    res = Simulation(cfg, callbacks=[probe], run_dir=Path(tmp) / "run").run()
            finally:
                mpfedcl_module.kmeans = kmeans
            train[name] += [r["train_s"] for r in res.rows[1:]]
            in_kmeans[name] += probe.per_round[1:]
            print(f"[rounds] pair {p} {name}: train_s {[round(r['train_s'], 2) for r in res.rows]}, "
                  f"k-means {[round(s, 2) for s in probe.per_round]}", file=sys.stderr)
    rows = []
    for name in IMPLS:
        t, km = statistics.median(train[name]), statistics.median(in_kmeans[name])
        rows.append([name, f"{t:.2f}", f"{km:.2f}", f"{t - km:.2f}"])
    header = ["k-means", "train s/round (5 clients)", "of which k-means (s)", "rest (s)"]
    return header, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None, help="folder holding mnist/ (else PROTOFL_DATA)")
    ap.add_argument("--repeats", type=int, default=3, help="k-means alone: repeats per size and implementation")
    ap.add_argument("--pairs", type=int, default=2, help="MP-FedCL: (old, new) pairs of runs")
    ap.add_argument("--rounds", type=int, default=2, help="MP-FedCL: rounds per run (medians of rounds 2..R)")
    ap.add_argument("--table", default=str(HERE / "kmeans_speed.md"), help="markdown output")
    args = ap.parse_args(argv)
    h1, r1 = bench_alone(args.repeats)
    h2, r2 = bench_rounds(args.data_dir, args.pairs, args.rounds)
    load = os.getloadavg()
    md = (f"## k-means alone (one thread, n_init 5, max_iter 100; medians of {args.repeats} alternated repeats)\n\n"
          f"{markdown(h1, r1)}\n"
          f"## MP-FedCL rounds (configs/mpfedcl_mnist.yaml, full MNIST, 5 clients, sequential, 1 thread; "
          f"medians of rounds 2..{args.rounds} over {args.pairs} alternated pairs of runs)\n\n"
          f"{markdown(h2, r2)}\n"
          f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.\n")
    print(md)
    Path(args.table).write_text(md)
    print(f"table written to {args.table}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
