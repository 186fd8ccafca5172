"""The batched executor's CPU proxies of its GPU cost: stack steps per round and operators per
stack step, with short batches grouped by size (``execution.pad_batches: false``) and padded
(``true``), side by side.

On a GPU a stack step costs its host time, about the same whatever its batch: the Python,
``vmap`` and dispatch of each operator (benchmarks/timing.md, "GPU execution": 63 us of host
time per kernel against 9 us on the device). What a round costs there is then about
(stack steps) x (operators per step), and both can be counted on any machine:

* **stack steps**: the steps the round's stacks ran; a stack step whose slots hold batches of
  different sizes runs once per size when grouped, once when padded
  (``BatchedExecutor.stats.steps``; slot-steps and client-steps beside it);
* **operators**: the ATen operators that do work, dispatched while the round trains
  (``gpu.count_launches``: operators with no ATen operator below them, less views and bare
  allocations), per stack step; on a GPU each launches at least one kernel;
* **seconds**: the round's training time on this machine without the profiler (median of
  rounds 2..R of a separate run), for the CPU's own rule (``pad_batches: auto``);
* **compiled** (``--compiled-ops``): the same counts with ``execution.compile`` (a third
  row per setting): the operators are then those dispatched outside the compiled step, the
  ATen kernels it calls (convolutions, matrix products) and the kernels ``torch.compile``
  generated (recorded by ``torch._inductor.config.cpp.enable_kernel_profile``); the round
  profiled is then the third of three, in every row, and one in which a graph was compiled
  stops the script (the slot count, which a compiled signature keeps at its most so far,
  may grow in round 2 and compile the step again; the tracing's operators would count);
  beside them, the operators outside the compiled step with each call of it counted as one
  (what remains for the host when a CUDA graph replays the step: a floor of the GPU's
  launches, not a measurement);
* **compilations** (``--compile-rounds N``): graphs ``torch.compile`` compiled in a run of N
  rounds with ``execution.compile`` (torch._dynamo's ``unique_graphs``), that run's time, and
  its stack steps that took the compiled step (steps of every slot at the full batch size:
  ``BatchedExecutor.stats.whole``; the others run eagerly). ``--compile-lr-decay X`` runs
  it with ``training.lr_decay`` X; ``--compile-identity`` with ``torch.compile`` as the
  identity (the steps counted, nothing compiled: quick at full size); ``--compile-no-fill``
  with ``plan_stack``'s ``fill`` off, the plan before padded stacks filled their last steps.

The round profiled is the second of a 2-round run (the first warms up; with ``--compiled-ops`` the third of 3), on
``benchmarks/gpu.py``'s settings: setting 1 is MNIST ``fedavg_cnn``, 100 clients, 10 per
round, 5 epochs of batch 64; ``--smoke`` takes 1 epoch and a tenth of the clients per round.

    python benchmarks/stack_steps.py --data-dir DATA --only 1,2 --methods fedavg,fednh --out steps.md

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # noqa: E402  (its settings, configs, profiler wrapper and operator count)
from harness import emit, header  # noqa: E402


class Counted(gpu.Profiled):
    """gpu.Profiled that also keeps the executor's step counts of the profiled round."""

    def run(self, tasks):
        from torch._dynamo.utils import counters

        stats = self.inner.stats
        before = (stats.steps, stats.slot_steps, stats.busy, counters["stats"]["unique_graphs"])
        out = super().run(tasks)
        if self.calls == self.at:
            self.steps, self.slot_steps, self.busy = (stats.steps - before[0], stats.slot_steps - before[1],
                                                      stats.busy - before[2])
            # a graph compiled in the profiled round would count its tracing's operators too
            self.compiled_here = counters["stats"]["unique_graphs"] - before[3]
        return out


def profiled(cfg_dict: dict, rounds: int = 2) -> Counted:
    """A run of ``rounds`` rounds of ``cfg_dict`` whose last round trains under the profiler."""
    cfg = gpu.from_dict({**cfg_dict, "rounds": rounds})
    box: dict = {}

    def factory(sim):
        box["ex"] = Counted(gpu.EXECUTORS.get(cfg.execution.backend)(sim), rounds)
        return box["ex"]

    gpu.Simulation(cfg, run_dir=Path(cfg.output.dir) / f"steps-{time.time_ns()}",
                   executor_factory=factory).run()
    return box["ex"]


def compiled(cfg_dict: dict, identity: bool = False, fill: bool = True) -> dict:
    """Graphs compiled in a run of ``cfg_dict`` (with ``execution.compile``), its seconds and
    its steps that took the compiled step; ``identity``: ``torch.compile`` returns the step
    as it is; ``fill=False``: ``plan_stack`` never fills a step's free slots."""
    from unittest import mock

    from torch._dynamo.utils import counters

    import protofl.engine.batched as batched
    from protofl.engine.backends import batched_executor

    plan = batched.plan_stack
    box = {}

    def factory(sim):
        box["ex"] = batched_executor(sim)
        return box["ex"]

    with contextlib.ExitStack() as patches:
        if identity:
            patches.enter_context(mock.patch.object(torch, "compile", lambda fn, **kw: fn))
        if not fill:
            patches.enter_context(mock.patch.object(batched, "plan_stack",
                                                    lambda *a, fill=False, **kw: plan(*a, fill=False, **kw)))
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        gpu.Simulation(gpu.from_dict(cfg_dict), run_dir=Path(cfg_dict["output"]["dir"]) / f"compiled-{time.time_ns()}",
                       executor_factory=factory).run()
    stats = box["ex"].stats
    return {"compilations": counters["stats"]["unique_graphs"] - before, "compiled_s": time.perf_counter() - t0,
            "compiled_steps": f"{stats.whole:,} of {stats.steps:,}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("PROTOFL_DATA", "../shared/data"))
    p.add_argument("--only", default="1,2", help="gpu.py setting numbers (1-based)")
    p.add_argument("--methods", default="fedavg")
    p.add_argument("--smoke", action="store_true", help="gpu.py's small settings")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the timed run (medians of rounds 2..R)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-time", action="store_true", help="counts only: no timed run (they do not depend on the "
                                                          "machine's load; the seconds do)")
    p.add_argument("--compile-rounds", type=int, default=0, help="also count compilations in a run of this many "
                                                                 "rounds with execution.compile (0: not)")
    p.add_argument("--compile-lr-decay", type=float, default=1.0, help="training.lr_decay of the compiled run")
    p.add_argument("--compile-identity", action="store_true", help="torch.compile as the identity in the compiled "
                                                                   "run (counts its steps, compiles nothing)")
    p.add_argument("--compile-no-fill", action="store_true", help="the compiled run without plan_stack's fill")
    p.add_argument("--compiled-ops", action="store_true", help="also count the operators of the padded stacks "
                                                               "with execution.compile (a third row)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = gpu.settings(args.smoke)
    rows = []
    tmp = tempfile.mkdtemp(prefix="protofl-steps-")
    try:
        for i in [int(x) for x in args.only.split(",") if x]:
            s = settings[i - 1]
            for method in [m for m in args.methods.split(",") if m]:
                got = {}
                for pad in ("off", "on") + (("compiled",) if args.compiled_ops else ()):  # the same clients, batches
                    cfg = gpu.config(s, "batched", "cpu", args.data_dir, args.rounds, tmp, args.smoke, 0, method,
                                     pad="on" if pad == "compiled" else pad, compile_step=pad == "compiled")
                    with torch._inductor.config.patch({"cpp.enable_kernel_profile": pad == "compiled"}):
                        ex = profiled(cfg, 3 if args.compiled_ops else 2)
                    if ex.compiled_here:  # its count would hold the tracing's operators: not a step's
                        raise SystemExit(f"[{i}] {method}, pad {pad}: {ex.compiled_here} graph(s) compiled in the "
                                         "profiled round")
                    timed = None if args.no_time else gpu.measure(cfg, "cpu", launches=False)
                    ops = gpu.count_launches(ex.prof)
                    outside = gpu.count_launches(ex.prof, outside_compiled=True) if pad == "compiled" else None
                    got[pad] = dict(steps=ex.steps, slot_steps=ex.slot_steps, busy=ex.busy, ops=ops, outside=outside,
                                    per_step=ops / max(ex.steps, 1), padded=ex.inner.stats.padded > 0,
                                    seconds=None if timed is None else timed["round_s"])
                    if args.compile_rounds and pad != "compiled":
                        cc = gpu.config(s, "batched", "cpu", args.data_dir, args.compile_rounds, tmp, args.smoke, 0,
                                        method, True, pad)
                        cc["training"] = {**cc["training"], "lr_decay": args.compile_lr_decay}
                        got[pad].update(compiled(cc, args.compile_identity, not args.compile_no_fill))
                    r = got[pad]
                    print(f"[{i}] {method}, pad {pad}: {r['steps']} stack steps, {r['ops']:,} operators "
                          f"({r['per_step']:.0f} a step"
                          + (f"; outside the compiled step {r['outside'] / max(r['steps'], 1):.1f}" if r["outside"]
                             is not None else "") + f"), {gpu.fmt(r['seconds'], '.2f', 'not timed')} s a round"
                          + (f"; compiled run: {r['compilations']} compilations, {r['compiled_steps']} steps compiled"
                             if "compilations" in r else ""), flush=True)
                rows.append((i, s, method, got))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    smoke = " SMOKE settings (1 local epoch, a tenth of the clients per round)." if args.smoke else ""
    lines = ["### Stack steps and operators per round, grouped and padded (CPU)", "",
             header(("The third round of a 3-round run" if args.compiled_ops else "The second round of a 2-round run")
                    + " under torch.profiler (counts); seconds: "
                    + ("not timed (--no-time)." if args.no_time else
                       f"median of rounds 2-{args.rounds} of a separate run without the profiler, on this machine.")
                    + smoke), "",
             "```", "python " + " ".join(["benchmarks/stack_steps.py", *sys.argv[1:]]), "```", "",
             "| # | setting | per round | method | short batches | client-steps | slot-steps | stack steps "
             "| operators | operators / stack step | outside the compiled step / stack step "
             "| operators, padded / grouped | s / round (CPU) | compilations in a run (its s) "
             "| steps compiled in that run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s, method, got in rows:
        for pad, r in got.items():
            how = ("padded" if r["padded"] else "grouped (not padded: BatchNorm or a coupled loss)") \
                if pad != "off" else "grouped"
            how += ", compiled" if pad == "compiled" else ""
            ratio = f"{r['ops'] / got['off']['ops']:.2f}" if pad != "off" and got["off"]["ops"] else ""
            lines.append(f"| {i} | {s['name']} | {s['m']} | {method} | {how} | {r['busy']:,} | {r['slot_steps']:,} | "
                         f"{r['steps']:,} | {r['ops']:,} | {r['per_step']:.0f} | "
                         f"{'' if r['outside'] is None else format(r['outside'] / max(r['steps'], 1), '.1f')} | {ratio} | "
                         f"{gpu.fmt(r['seconds'], '.2f', 'not timed')} | "
                         + (f"{r['compilations']} ({r['compiled_s']:.0f} s) | {r['compiled_steps']} |"
                            if "compilations" in r else "not run | |"))
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
