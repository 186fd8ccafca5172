"""The sequential executor's local training, this checkout against an earlier commit, paired.

Each workload is one client's ``ctx.fit`` as the sequential executor runs it
(``engine.train.fit``): 600 training samples of the dataset, 5 epochs of batch 64 (50
steps, the last of each epoch short), SGD with momentum 0.9, one thread.

* ``mlp``: MNIST, ``mlp_mnist`` (the step is cheap: what the engine adds around it shows most);
* ``cnn``: Fashion-MNIST, ``cnn_fmnist``, channels_last;
* ``transform``: MNIST, ``mlp_mnist`` with a gradient transform (SCAFFOLD's g - c_i + c,
  with c_i and c fixed) and gradient clipping at 1.0.

Each pair runs the two checkouts' ``fit`` in two fresh processes one after the other (the
order alternating from pair to pair), each timing the workload ``--reps`` times after one
warm-up fit; a process's figure is its median CPU time per fit (``time.process_time``).
Printed per workload: the median over pairs of (this checkout / the base) and its range,
and each checkout's median seconds per fit. The base's source comes from ``git archive``
of ``--base`` (a commit of this repository); the loss, data and settings are the same
objects in both.

    python benchmarks/sequential_paired.py --base e21418e --data-dir DATA --pairs 10

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("mlp", "cnn", "transform")


def child(data_dir: str, reps: int) -> None:
    """Time each workload with the protofl on ``sys.path``; print {workload: median seconds}."""
    import torch

    from protofl.algorithms.base import cross_entropy
    from protofl.data.datasets import load_dataset
    from protofl.engine.train import TrainSettings, fit
    from protofl.models.zoo import build_model

    torch.set_num_threads(1)
    out = {}
    for w in WORKLOADS:
        ds = load_dataset("fmnist" if w == "cnn" else "mnist", data_dir, download=False)
        x = ds.x_train[:600].float().div(255.0)
        x = x.unsqueeze(1) if x.dim() == 3 else x
        y = ds.y_train[:600]
        torch.manual_seed(0)
        model = build_model("cnn_fmnist" if w == "cnn" else "mlp_mnist", tuple(x.shape[1:]), ds.num_classes)
        if w == "cnn":
            model = model.to(memory_format=torch.channels_last)
        names = [k for k, _ in model.named_parameters()]
        start = {k: v.clone() for k, v in model.state_dict().items()}
        grad = None
        settings = TrainSettings(lr=0.01, momentum=0.9, batch_size=64, epochs=5)
        if w == "transform":
            c_i = {k: 0.01 * torch.randn_like(p) for k, p in model.named_parameters()}
            c = {k: 0.01 * torch.randn_like(p) for k, p in model.named_parameters()}

            def grad(g, extras, params, c_i=c_i, c=c):
                return {k: g[k] - c_i[k] + c[k] for k in g}
            settings = TrainSettings(lr=0.01, momentum=0.9, batch_size=64, epochs=5, clip_grad=1.0)
        times = []
        for r in range(reps + 1):
            model.load_state_dict(start)
            t0 = time.process_time()
            fit(model, x, y, loss=cross_entropy, extras={}, names=names, settings=settings,
                generator=torch.Generator().manual_seed(r), grad=grad, channels_last=(w == "cnn"))
            if r:  # the first fit warms up
                times.append(time.process_time() - t0)
        out[w] = statistics.median(times)
    print(json.dumps(out))


def run(src: Path, data_dir: str, reps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, __file__, "--child", "--data-dir", data_dir, "--reps", str(reps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the commit to compare with")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.data_dir, a.reps)
    if not a.base:
        ap.error("--base is required")
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "base.tar"
        subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), a.base, "src"], check=True)
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
        trees = {"base": Path(tmp) / "src", "now": REPO / "src"}
        rows: dict[str, list[dict[str, float]]] = {"base": [], "now": []}
        for i in range(a.pairs):
            for which in (("base", "now") if i % 2 == 0 else ("now", "base")):
                rows[which].append(run(trees[which], a.data_dir, a.reps))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"this checkout ({commit}) against {a.base}: {a.pairs} pairs, median CPU seconds per fit of "
          f"{a.reps} after a warm-up")
    print("| workload | base s/fit | now s/fit | now / base, median of pairs | range |")
    print("|---|---|---|---|---|")
    for w in WORKLOADS:
        ratios = sorted(n[w] / b[w] for n, b in zip(rows["now"], rows["base"]))
        print(f"| {w} | {statistics.median(r[w] for r in rows['base']):.4f} | "
              f"{statistics.median(r[w] for r in rows['now']):.4f} | {statistics.median(ratios):.3f} | "
              f"{ratios[0]:.3f}-{ratios[-1]:.3f} |")


if __name__ == "__main__":
    main()
