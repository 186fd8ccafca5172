"""Peak memory of the batched executor's features pass (``ctx.features``: the prototypes of
FedNH, FedProto, MP-FedCL, ReBaFL), by how many rows it forwards at once
(``protofl.engine.batched.FEATURE_ROWS``).

One pass of ``BatchedExecutor._part_features`` over the bodies of ``--clients`` clients
(``--model``, random weights, MNIST-shaped random inputs of Dirichlet(0.3) sizes summing to
60,000 when ``--clients`` is 100), each limit in a fresh process: on the CPU its peak
resident memory over the process's resident memory before the pass; on a GPU
``torch.cuda.max_memory_allocated`` over the memory allocated before it. A limit of 0
forwards every client's batch at once (the pass before the limit existed).

    python benchmarks/features_memory.py --rows 0,4096 --out mem.md
    python benchmarks/features_memory.py --device cuda --rows 0,4096

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, header  # noqa: E402


def rss_mib() -> float:
    """This process's resident memory now (Linux /proc), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def one(model: str, clients: int, rows: int, device: str) -> dict:
    """The pass in this process with FEATURE_ROWS = ``rows`` (0: no limit): peak memory over
    the memory before it, MiB, and its seconds."""
    import protofl.engine.batched as batched
    from protofl.models import build_model

    batched.FEATURE_ROWS = rows or 10**12
    dev = torch.device(device)
    torch.manual_seed(0)
    net = build_model(model, (1, 28, 28), 10).to(dev).eval()
    rng = np.random.default_rng(0)
    sizes = np.maximum(10, (rng.dirichlet([0.3] * clients) * 600 * clients).astype(int))
    jobs = []
    for n in sizes:
        w = {k: v.detach().clone() for k, v in net.state_dict().items()}
        x = torch.randn(int(n), 1, 28, 28, device=dev)
        jobs.append(SimpleNamespace(features=SimpleNamespace(x=x, weights=w), ctx=SimpleNamespace(data=(x, None))))
    fake = SimpleNamespace(runtime=SimpleNamespace(device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev) / 2**20
    else:
        before = rss_mib()
    t0 = time.perf_counter()
    with torch.no_grad():
        batched.BatchedExecutor._part_features(fake, net.body, "body.", jobs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return {"rows": rows, "extra_mib": peak - before, "seconds": time.perf_counter() - t0,
            "samples": int(sizes.sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rows", default="0,4096", help="comma-separated FEATURE_ROWS limits (0: none)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process's limit
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.clients, args.one, args.device)))
        return 0
    got = []
    for rows in [int(r) for r in args.rows.split(",") if r]:
        cmd = [sys.executable, __file__, "--model", args.model, "--clients", str(args.clients), "--device",
               args.device, "--one", str(rows)]
        got.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
        print(got[-1], flush=True)
    where = "GPU memory allocated" if args.device.startswith("cuda") else "resident memory (CPU)"
    lines = [f"### The features pass's peak memory ({args.device})", "",
             header(f"One pass over {args.clients} clients' bodies ({args.model}, {got[0]['samples']:,} MNIST-shaped "
                    f"samples); peak {where} over that before the pass, each limit in a fresh process."), "",
             "```", "python " + " ".join(["benchmarks/features_memory.py", *sys.argv[1:]]), "```", "",
             "| rows forwarded at once (FEATURE_ROWS) | peak extra memory, MiB | seconds |", "|---|---|---|"]
    for r in got:
        lines.append(f"| {r['rows'] if r['rows'] else 'all clients at once (no limit)'} | {r['extra_mib']:,.0f} | "
                     f"{r['seconds']:.2f} |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
