"""Where a round's time goes on the GPU: one round of a ``benchmarks/gpu.py`` setting under
``torch.profiler`` (CPU and CUDA activity), after a warm-up round (``gpu.py``'s ``profiled_round``).

Reports the round's wall time, the summed time of its device kernels (one stream: their
sum over the wall time is the share of the round the GPU was computing), the number of
kernels, and the operators that take the most device time and the most host time. A
round whose kernels fill a small share of its wall time is bound by the host: by the
Python and dispatch cost of launching them, not by the GPU's arithmetic.

    python benchmarks/gpu_profile.py --data-dir DATA --setting 1 --method fedavg --out prof.md
    python benchmarks/gpu_profile.py --device cpu --smoke --setting 1   # a check of the script

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # noqa: E402  (its settings and configs; registers the generated 32x32 data)
from harness import emit, header  # noqa: E402


def device_us(e) -> float:
    attr = "self_device_time_total" if hasattr(e, "self_device_time_total") else "self_cuda_time_total"
    return float(getattr(e, attr, 0.0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--setting", type=int, default=1, help="gpu.py's setting number (1-based)")
    p.add_argument("--method", default="fedavg")
    p.add_argument("--executor", default="batched")
    p.add_argument("--compile", action="store_true", help="execution.compile; the profiled round is then the third "
                                                           "(a second round with more slots compiles again)")
    p.add_argument("--conv-as-matmul", default="off", help="execution.conv_as_matmul: off (false), one_channel, all (true)")
    p.add_argument("--smoke", action="store_true", help="gpu.py's small settings")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    cuda = torch.device(args.device).type == "cuda"
    at = 3 if args.compile else 2
    s = gpu.settings(args.smoke)[args.setting - 1]
    with tempfile.TemporaryDirectory(prefix="protofl-prof-") as tmp:
        ex = gpu.profiled_round(gpu.config(s, args.executor, args.device, args.data_dir, 2, tmp, args.smoke, 0,
                                           args.method, args.compile, stack_kernels=args.conv_as_matmul), at=at, cuda=cuda)
    ka = ex.prof.key_averages()
    kernels = [e for e in ex.prof.events() if device_us(e) > 0 and e.device_type != torch.autograd.DeviceType.CPU]
    busy = sum(device_us(e) for e in kernels) / 1e6
    name = torch.cuda.get_device_name() if cuda else "CPU"
    kernels_note = ("" if args.conv_as_matmul == "off" else f", conv as matmul: {args.conv_as_matmul}") \
        + (", compiled" if args.compile else "")
    lines = [f"#### {name}: setting {args.setting} ({s['name']}, {s['m']}/round), {args.method}, {args.executor}"
             f"{kernels_note}", "",
             header(f"One round (the {'third' if args.compile else 'second'}) under torch.profiler (CPU + CUDA "
                    "activity); the profiler's own cost inflates the wall time."), "", "```",
             "python " + " ".join(["benchmarks/gpu_profile.py", *sys.argv[1:]]), "```", "",
             f"round wall {ex.wall:.2f} s, {ex.samples:,} samples ({ex.samples / ex.wall:,.0f} samples/s under the "
             f"profiler); device kernels {len(kernels):,}, summed {busy:.2f} s = "
             f"{100 * busy / ex.wall:.0f} % of the wall time" if cuda else
             f"round wall {ex.wall:.2f} s, {ex.samples:,} samples", ""]
    for title, key, fn in (("device time", "self device ms", device_us),
                           ("host time", "self CPU ms", lambda e: float(e.self_cpu_time_total))):
        rows = sorted((e for e in ka if fn(e) > 0), key=fn, reverse=True)[:args.top]
        if not rows:
            continue
        lines += [f"Top operators by {title}:", "", f"| operator | calls | {key} |", "|---|---|---|"]
        lines += [f"| `{e.key[:80]}` | {e.count:,} | {fn(e) / 1e3:,.1f} |" for e in rows]
        lines.append("")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
