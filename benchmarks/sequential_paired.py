"""The sequential executor's local training, this checkout against an earlier commit, paired.

Each workload is one client's ``ctx.fit`` as the sequential executor runs it
(``engine.train.fit``): 600 training samples of the dataset, 5 epochs of batch 64 (50
steps, the last of each epoch short), SGD with momentum 0.9, one thread.

* ``mlp``: MNIST, ``mlp_mnist`` (the step is cheap: what the engine adds around it shows most);
* ``cnn``: Fashion-MNIST, ``cnn_fmnist``, channels_last;
* ``transform``: MNIST, ``mlp_mnist`` with a gradient transform (SCAFFOLD's g - c_i + c,
  with c_i and c fixed) and gradient clipping at 1.0.

The two ``fit`` functions run in one process, one fit of each after the other (the order
alternating), ``--pairs`` times per workload after a warm-up fit of each: the base's is its
``engine/train.py`` (from ``git archive`` of ``--base``, a commit of this repository)
loaded beside this checkout's, over this checkout's other modules, so that only the
training driver and its step differ. Each fit is timed in CPU seconds
(``time.process_time``). Printed per workload: each driver's median seconds per fit, and
the median over pairs of (this checkout / the base) with the 10th-90th percentile of the
pairs' ratios. Both drivers must leave the same weights (checked after every pair).

    python benchmarks/sequential_paired.py --base e21418e --data-dir DATA --pairs 200

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("mlp", "cnn", "transform")


def base_fit(base: str):
    """The ``fit`` of commit ``base``'s ``engine/train.py``, as a module of this checkout's package."""
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{base}:src/protofl/engine/train.py"],
                          capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("protofl.engine._base_train", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "protofl.engine"
    sys.modules[spec.name] = module
    exec(compile(text, f"{base}:engine/train.py", "exec"), module.__dict__)
    return module.fit


def workload(w: str, data_dir: str):
    """(model, x, y, settings, grad, channels_last) of workload ``w``."""
    import torch

    from protofl.data.datasets import load_dataset
    from protofl.engine.train import TrainSettings
    from protofl.models.zoo import build_model

    ds = load_dataset("fmnist" if w == "cnn" else "mnist", data_dir, download=False)
    x = ds.x_train[:600].float().div(255.0)
    x = x.unsqueeze(1) if x.dim() == 3 else x
    torch.manual_seed(0)
    model = build_model("cnn_fmnist" if w == "cnn" else "mlp_mnist", tuple(x.shape[1:]), ds.num_classes)
    if w == "cnn":
        model = model.to(memory_format=torch.channels_last)
    grad = None
    settings = TrainSettings(lr=0.01, momentum=0.9, batch_size=64, epochs=5)
    if w == "transform":
        c_i = {k: 0.01 * torch.randn_like(p) for k, p in model.named_parameters()}
        c = {k: 0.01 * torch.randn_like(p) for k, p in model.named_parameters()}

        def grad(g, extras, params):
            return {k: g[k] - c_i[k] + c[k] for k in g}
        settings = TrainSettings(lr=0.01, momentum=0.9, batch_size=64, epochs=5, clip_grad=1.0)
    return model, x, ds.y_train[:600], settings, grad, w == "cnn"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--pairs", type=int, default=200)
    a = ap.parse_args()
    import torch

    from protofl.algorithms.base import cross_entropy
    from protofl.engine.train import fit

    torch.set_num_threads(1)
    fits = {"base": base_fit(a.base), "now": fit}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"this checkout ({commit}) against {a.base}: {a.pairs} pairs of fits per workload, CPU seconds per fit")
    print("| workload | base s/fit | now s/fit | now / base, median of pairs | 10th-90th percentile |")
    print("|---|---|---|---|---|")
    for w in WORKLOADS:
        model, x, y, settings, grad, channels_last = workload(w, a.data_dir)
        names = [k for k, _ in model.named_parameters()]
        start = {k: v.clone() for k, v in model.state_dict().items()}
        times: dict[str, list[float]] = {"base": [], "now": []}
        for i in range(a.pairs + 1):
            ends = {}
            for which in (("base", "now") if i % 2 == 0 else ("now", "base")):
                model.load_state_dict(start)
                t0 = time.process_time()
                fits[which](model, x, y, loss=cross_entropy, extras={}, names=names, settings=settings,
                            generator=torch.Generator().manual_seed(i), grad=grad, channels_last=channels_last)
                if i:  # the first pair warms up
                    times[which].append(time.process_time() - t0)
                ends[which] = [p.detach().clone() for p in model.parameters()]
            if not all(torch.equal(p, q) for p, q in zip(ends["base"], ends["now"])):
                raise SystemExit(f"{w}: the two drivers' weights differ after pair {i}")
        ratios = sorted(n / b for n, b in zip(times["now"], times["base"]))
        lo, hi = ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]
        print(f"| {w} | {statistics.median(times['base']):.4f} | {statistics.median(times['now']):.4f} | "
              f"{statistics.median(ratios):.3f} | {lo:.3f}-{hi:.3f} |")


if __name__ == "__main__":
    main()
