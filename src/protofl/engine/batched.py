"""The batched client executor: a round's clients trained together, in one stack of parameters.

On a GPU, the models of these papers are far too small to keep it busy one client at a
time. This executor drives the ``client_update`` coroutines of all of a round's clients
(``algorithms/base.py``) and runs the work they await together:

* **training** (``ctx.fit``): the requests of all clients that share a signature (the
  same loss, gradient transform, trainable parameters and settings) run as one stack of
  ``S`` slots. Each slot holds one client's parameters and momentum; one SGD step for the
  whole stack is one ``torch.func.vmap`` over ``functional_call`` of the loss (a
  convolution becomes one grouped convolution, a linear layer one batched matmul);
* **the stack stays full**: clients do not run in lockstep. When a client takes its last
  step, the next client of the round takes its slot (as inference servers do with
  requests), longest clients first; the slot count is chosen so that the stack finishes
  in about the time of its longest client (:func:`choose_slots`);
* **features** (``ctx.features``): the clients' models applied to their own data in one
  vmapped forward per chunk of rows (prototypes, eq. 3 of FedNH, ...);
* everything else a method does between its awaits (class means, k-means, its reply)
  runs client by client, as written.

Each client still computes what :func:`~protofl.engine.train.local_train` computes:

* data order: client k draws its per-epoch permutations from its own stream
  (``ctx.generator``, the same one the sequential loop uses), so it sees the same batches
  in the same order;
* batch count: ``epochs * ceil(n_k / B)`` steps (or ``training.steps``), wherever and
  whenever its slot runs them;
* the last batch of an epoch is smaller: at each step the active slots are grouped by
  their batch size and each group runs as one stack (BatchNorm statistics and the mean of
  the loss are exactly those of that client's batch, no padding);
* optimizer: SGD with momentum, weight decay and gradient clipping as ``torch.optim.SGD``
  and ``clip_grad_norm_`` compute them, on one flat (slots, parameters) buffer, so an
  update is a handful of kernels whatever the number of layers; one momentum row per
  slot, zeroed when a client enters it (torch's first step, buf = d_p, is 0 * m + d_p);
* its gradient transform (SCAFFOLD), per-step extras (FedGen's draws) and the run's
  precision (bf16 autocast).

The schedule (which client is in which slot at which step, the rows of every batch) is
worked out on the host before the stack starts and sent to the device in one transfer,
so the loop never waits on a host copy. Results equal the sequential executor's up to
float rounding (batched kernels sum in a different order). Models with dropout are not
batched (their masks could not match the sequential run's), nor heterogeneous
architectures or methods whose ``client_update`` is a plain function: those run on the
sequential executor, and the run log says so once.
"""
from __future__ import annotations

import heapq
import inspect
import logging
import math
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..algorithms.base import Features, Fitted, TrainStats
from ..messages import Record
from .client import EMBED_BATCH_SIZE, ClientContext, ClientOutput, ClientRuntime, arch_kwargs
from .executor import ClientTask, Executor, SequentialExecutor
from .precision import autocast
from .train import NonFiniteLossError, batch_sizes, total_steps

log = logging.getLogger("protofl")

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def why_not_batched(runtime: ClientRuntime) -> Optional[str]:
    """Why this run's clients cannot be trained as one stack, or None when they can."""
    algo, cfg = runtime.algorithm, runtime.cfg
    if not inspect.iscoroutinefunction(type(algo).client_update):
        return (f"method {algo.name!r} writes its client update as a plain function, not as the "
                "coroutine the batched executor drives (algorithms/base.py)")
    if cfg.model.per_client:
        return "clients have different architectures (model.per_client)"
    model = runtime.models.live(dict(cfg.model.params))[0]
    if any(isinstance(m, _RANDOM) for m in model.modules()):
        return f"model {cfg.model.name!r} has dropout (its masks would differ from a sequential run)"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        return f"model {cfg.model.name!r} mixes parameter dtypes ({sorted(map(str, dtypes))})"
    return None


# ---------------------------------------------------------------------------------------
# the slot schedule
# ---------------------------------------------------------------------------------------
def makespan(totals: list[int], slots: int) -> int:
    """Stack steps to run clients of ``totals`` steps in ``slots`` slots, longest first (each
    client takes the slot that frees first)."""
    free = [0] * max(1, slots)
    for t in sorted(totals, reverse=True):
        heapq.heapreplace(free, free[0] + t)
    return max(free)


def choose_slots(totals: list[int], cap: int, slack: float = 0.05) -> int:
    """The fewest slots (at most ``cap``) that run ``totals`` in about the time of the
    longest client (within ``slack``): more slots would not shorten the round (a client's
    steps are sequential) and would only compute on idle rows."""
    work = [t for t in totals if t > 0]
    if not work:
        return 1
    cap = max(1, min(cap, len(work)))
    target = max(work) + max(1, int(slack * max(work)))
    lo, hi = max(1, math.ceil(sum(work) / target)), cap
    if makespan(work, hi) > target:
        return hi
    while lo < hi:  # makespan is non-increasing in the slot count
        mid = (lo + hi) // 2
        if makespan(work, mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def slot_memory_cap(model: nn.Module, batch: int, device: torch.device, sample: torch.Tensor) -> int:
    """How many slots fit in memory: per slot the parameters four times over (weights,
    momentum, gradient, update) and the activations of one batch, against half of the
    free GPU memory (a quarter of the RAM on the CPU)."""
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda m, i, o: sizes.append(o.numel()) if torch.is_tensor(o) else None)
             for m in model.modules()]
    try:
        with torch.no_grad():
            was = model.training
            model.eval()
            model(sample[:1])
            model.train(was)
    finally:
        for h in hooks:
            h.remove()
    per_slot = 4 * (4 * sum(p.numel() for p in model.parameters()) + 3 * batch * sum(sizes))
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] // 2
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    return max(1, int(budget // max(per_slot, 1)))


@dataclass
class _Step:
    """One group of one stack step: ``slots`` (G,) with batch size ``b``, their clients
    ``jobs`` and local step indices ``t``; ``start``: its row offset in the index buffer."""

    b: int
    slots: list[int]
    jobs: list[int]
    t: list[int]
    start: int
    whole: bool


@dataclass
class _Plan:
    steps: list[list[_Step]]  # per stack step, its groups
    loads: list[list[tuple[int, int]]]  # per stack step, (slot, job) entering before it
    finishes: list[list[tuple[int, int]]]  # per stack step, (slot, job) done after it
    rows: np.ndarray  # (sum of G * b,) data rows of every group, in order
    busy: int  # client-steps
    slot_steps: int  # slots x stack steps


def plan_stack(totals: list[int], sizes: list[list[int]], rows: list[np.ndarray], slots: int) -> _Plan:
    """The schedule: clients enter free slots longest first; each step groups the active
    slots by batch size (largest first). ``rows[j]`` (total_j, B) are client j's data rows."""
    order = deque(sorted((j for j in range(len(totals)) if totals[j] > 0), key=lambda j: -totals[j]))
    active: dict[int, list[int]] = {}  # slot -> [job, local step]
    steps, loads, finishes, chunks = [], [], [], []
    pos = 0
    load0 = []
    for k in range(slots):
        if order:
            j = order.popleft()
            active[k] = [j, 0]
            load0.append((k, j))
    pending_loads = load0
    while active:
        by_size: dict[int, list[int]] = defaultdict(list)
        for k in sorted(active):
            j, t = active[k]
            by_size[sizes[j][t]].append(k)
        groups = []
        for b in sorted(by_size, reverse=True):
            ks = by_size[b]
            js = [active[k][0] for k in ks]
            ts = [active[k][1] for k in ks]
            chunks.append(np.stack([rows[j][t, :b] for j, t in zip(js, ts)]).reshape(-1))
            groups.append(_Step(b, ks, js, ts, pos, whole=len(ks) == slots))
            pos += len(ks) * b
        steps.append(groups)
        loads.append(pending_loads)
        pending_loads, done = [], []
        for k in sorted(active):
            active[k][1] += 1
            j, t = active[k]
            if t == totals[j]:
                done.append((k, j))
                del active[k]
                if order:
                    nj = order.popleft()
                    active[k] = [nj, 0]
                    pending_loads.append((k, nj))
        finishes.append(done)
    busy = sum(totals)
    return _Plan(steps, loads, finishes, np.concatenate(chunks) if chunks else np.zeros(0, np.int64),
                 busy, slots * len(steps))


def _schedule(n: int, batch: int, total: int, gen: torch.Generator) -> np.ndarray:
    """Client-local rows of ``local_train``'s loop, (total, batch) padded with 0, drawing the
    per-epoch permutations from ``gen`` as the loop does (one per epoch begun)."""
    rows = np.zeros((total, batch), dtype=np.int64)
    step = 0
    while step < total:
        perm = torch.randperm(n, generator=gen).numpy()
        for i in range(0, n, batch):
            if step == total:
                break
            b = perm[i:i + batch]
            rows[step, :len(b)] = b
            step += 1
    return rows


# ---------------------------------------------------------------------------------------
# the executor
# ---------------------------------------------------------------------------------------
@dataclass
class _Job:
    task: ClientTask
    ctx: ClientContext
    update: Any  # the client_update coroutine
    request: Any = None  # what it awaits now (None: finished)
    output: Optional[ClientOutput] = None
    rng: Optional[torch.Tensor] = None  # its torch RNG state between turns
    failed: Optional[BaseException] = None


class _Objective(nn.Module):
    """``loss(model, x, y, extras)`` as a module, so that ``functional_call`` can swap in one
    client's parameters (under vmap: every client's) for the whole loss, sub-modules included."""

    def __init__(self, model: nn.Module, loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x, y, extras):
        return self.loss(self.model, x, y, extras)


@dataclass
class StackStats:
    """What the stacks did: client-steps that trained (busy) and slot-steps they took."""

    busy: int = 0
    slot_steps: int = 0
    stacks: int = 0
    slots: list[int] = field(default_factory=list)

    @property
    def occupancy(self) -> Optional[float]:
        return self.busy / self.slot_steps if self.slot_steps else None


class BatchedExecutor(Executor):
    """Drives a round's ``client_update`` coroutines and runs what they await as stacks of at
    most ``slots`` clients (0: chosen from the round's clients and the memory)."""

    def __init__(self, runtime: ClientRuntime, slots: int = 0, threads: int = 0, compile: bool = False) -> None:
        self.runtime = runtime
        self.slots = slots
        self.compile = compile
        self._compiled: dict[tuple, Any] = {}
        self.sequential = SequentialExecutor(runtime, threads)
        self.reason = why_not_batched(runtime)
        self.stats = StackStats()
        self._noted = False
        self._cap: dict[tuple, int] = {}

    def describe(self) -> dict:
        if self.reason is not None:
            return {"executor": "sequential", "executor_note": self.reason}
        out: dict[str, Any] = {"executor": "batched"}
        if self.stats.stacks:
            out.update(occupancy=round(self.stats.occupancy, 4), slots=max(self.stats.slots))
        return out

    def _note(self, reason: str) -> None:
        if not self._noted:
            log.info("protofl: batched executor not used (%s); clients run one after another", reason)
            self._noted = True

    def close(self) -> None:
        self.sequential.close()

    # -- driving the coroutines ------------------------------------------------------------------
    def run(self, tasks: list[ClientTask]) -> list[ClientOutput]:
        if self.reason is not None:
            self._note(self.reason)
            return self.sequential.run(tasks)
        t0 = time.perf_counter()
        jobs = [self._start(t) for t in tasks]
        while True:
            waiting = [j for j in jobs if j.request is not None]
            if not waiting:
                break
            todo = [j for j in waiting if isinstance(j.request, Features)]
            if todo:  # features first: they are cheap and let their clients move on
                answers = self._features(todo)
            else:
                groups: dict[tuple, list[_Job]] = {}
                for j in waiting:
                    groups.setdefault(self._signature(j), []).append(j)
                todo = max(groups.values(), key=len)  # the largest group first (ties: the first)
                answers = self._fit(todo)
            for j, a in zip(todo, answers):
                self._advance(j, a)
        seconds = (time.perf_counter() - t0) / max(1, len(jobs))
        for j in jobs:  # each client is charged an equal share of the round
            if j.output is not None and j.output.train:
                j.output.train["seconds"] = seconds
        return [j.output for j in jobs]

    def _start(self, t: ClientTask) -> _Job:
        rt = self.runtime
        ctx, update = rt.start(t.cid, t.rnd, t.msg, t.state, t.evaluate)
        job = _Job(t, ctx, update, rng=None)
        job.rng = torch.get_rng_state()
        self._advance(job, None)
        return job

    def _advance(self, job: _Job, answer: Any) -> None:
        """Resume ``job`` with ``answer`` (an exception is thrown into it) until its next
        request or its end, then finish it: its reply, state and evaluation."""
        rt, t = self.runtime, job.task
        torch.set_rng_state(job.rng)  # its own torch stream, whatever other clients drew
        try:
            if isinstance(answer, BaseException):
                job.request = job.update.throw(answer)
            else:
                job.request = job.update.send(answer)
        except StopIteration as done:
            job.request = None
            job.output = rt.finish(job.ctx, done.value, t.evaluate, t.full_test, time.perf_counter())
        except NonFiniteLossError as e:
            job.request = None
            if rt.cfg.training.on_nonfinite == "stop":
                raise
            job.output = ClientOutput(reply=Record(), state=None, rejected=str(e))
        finally:
            job.rng = torch.get_rng_state()

    def _signature(self, job: _Job) -> tuple:
        req = job.request
        ctx = job.ctx
        settings = tuple(sorted(ctx.training_settings(req.settings).items()))
        extras = tuple((k, tuple(v.shape), v.dtype) for k, v in _leaves(req.extras))
        return (repr(sorted(arch_kwargs(self.runtime.cfg, ctx.cid).items())), req.loss, req.grad, req.trainable,
                settings, extras, req.step_extras is not None)

    # -- features ----------------------------------------------------------------------------
    @torch.no_grad()
    def _features(self, jobs: list[_Job]) -> list[torch.Tensor]:
        """``model.<part>`` of every job's weights on its inputs, in eval mode, stacked."""
        dev = self.runtime.device
        out: list[Optional[torch.Tensor]] = [None] * len(jobs)
        by_part: dict[str, list[int]] = defaultdict(list)
        for i, j in enumerate(jobs):
            by_part[j.request.part].append(i)
        for part, idx in by_part.items():
            module = getattr(jobs[idx[0]].ctx.architecture(), part)
            prefix = part + "."
            xs = [jobs[i].request.x if jobs[i].request.x is not None else jobs[i].ctx.data[0] for i in idx]
            for i, x in zip(idx, xs):
                if len(x) == 0:
                    out[i] = x.new_zeros((0,))
            live = [(i, x) for i, x in zip(idx, xs) if len(x)]
            if not live:
                continue
            keys = [k[len(prefix):] for k in jobs[live[0][0]].request.weights if k.startswith(prefix)]
            W = {k: torch.stack([jobs[i].request.weights[prefix + k].to(dev) for i, _ in live]) for k in keys}
            data = torch.cat([x.to(dev) for _, x in live])
            offsets = np.concatenate([[0], np.cumsum([len(x) for _, x in live])[:-1]])
            lengths = [len(x) for _, x in live]
            was = module.training
            module.eval()
            try:
                fn = vmap(lambda w, xb: functional_call(module, w, (xb,)))
                pieces: list[list[torch.Tensor]] = [[] for _ in live]
                for start in range(0, max(lengths), EMBED_BATCH_SIZE):
                    rows = np.stack([o + np.minimum(np.arange(start, start + EMBED_BATCH_SIZE), n - 1)
                                     for o, n in zip(offsets, lengths)])  # (J, b); short clients repeat a row
                    z = fn(W, data[torch.from_numpy(rows).to(dev)])  # (J, b, d)
                    for p, n in enumerate(lengths):
                        if start < n:
                            pieces[p].append(z[p, :min(EMBED_BATCH_SIZE, n - start)])
            finally:
                module.train(was)
            for p, (i, _) in enumerate(live):
                out[i] = torch.cat(pieces[p])
        return out

    # -- training ----------------------------------------------------------------------------
    def _fit(self, jobs: list[_Job]) -> list[Any]:
        """Train every job's ``Fit`` (one signature) as one stack; per job its ``Fitted``, or
        the ``NonFiniteLossError`` to throw into it."""
        rt, dev = self.runtime, self.runtime.device
        req0, ctx0 = jobs[0].request, jobs[0].ctx
        st = ctx0.training_settings(req0.settings)
        B, lr, mom, wd, clip = st["batch_size"], st["lr"], st["momentum"], st["weight_decay"], st["clip_grad"]
        model = ctx0.architecture()
        order = list(model.state_dict().keys())
        names = [k for k, p in model.named_parameters()
                 if p.requires_grad and (req0.trainable is None or k.startswith(req0.trainable))]
        frozen_names = [k for k, _ in model.named_parameters() if k not in names]
        buffer_names = [k for k, _ in model.named_buffers()]
        J = len(jobs)
        data = [j.ctx.data for j in jobs]
        ns = [len(y) for _, y in data]
        totals = [total_steps(n, B, st["epochs"], st["steps"]) if names else 0 for n in ns]
        sizes = [batch_sizes(n, B, t) for n, t in zip(ns, totals)]
        rows = [_schedule(n, B, t, j.ctx.generator) for n, t, j in zip(ns, totals, jobs)]
        offsets = np.concatenate([[0], np.cumsum(ns)[:-1]]).astype(np.int64)
        rows = [r + o for r, o in zip(rows, offsets)]
        per_step = [j.request.step_extras(s) if j.request.step_extras is not None and t else None
                    for j, s, t in zip(jobs, sizes, totals)]

        answers: list[Any] = [None] * J
        for i, j in enumerate(jobs):  # clients without a step to take keep their weights
            if totals[i] == 0:
                answers[i] = Fitted({k: v.detach().clone() for k, v in j.request.weights.items()},
                                    j.ctx._trained(TrainStats(0.0, 0, 0), j.request.report))
        if not any(totals):
            return answers

        cap_key = (repr(sorted(rt.cfg.model.params.items())), B)
        if self.slots <= 0 and cap_key not in self._cap:
            sample = next(x for x, _ in data if len(x))
            self._cap[cap_key] = slot_memory_cap(model, B, dev, sample)
        S = self.slots if self.slots > 0 else choose_slots(totals, self._cap[cap_key])
        S = max(1, min(S, sum(t > 0 for t in totals)))
        plan = plan_stack(totals, sizes, rows, S)
        self.stats.busy += plan.busy
        self.stats.slot_steps += plan.slot_steps
        self.stats.stacks += 1
        self.stats.slots.append(S)

        # the stack's state: a flat (S, n) buffer of the trainable parameters (and of momentum)
        ref = dict(model.named_parameters())
        numels = [ref[k].numel() for k in names]
        dtype = ref[names[0]].dtype
        P_flat = torch.zeros(S, sum(numels), dtype=dtype, device=dev)
        M_flat = torch.zeros_like(P_flat) if mom != 0 else None
        views = {}
        o = 0
        for k, n in zip(names, numels):
            views[k] = (o, o + n, tuple(ref[k].shape))
            o += n

        def unflat(flat: torch.Tensor) -> dict[str, torch.Tensor]:
            return {k: flat[:, a:b].view(flat.shape[0], *shape) for k, (a, b, shape) in views.items()}

        w0 = jobs[0].request.weights
        FZ = {k: torch.zeros((S, *w0[k].shape), dtype=w0[k].dtype, device=dev) for k in frozen_names}
        BF = {k: torch.zeros((S, *w0[k].shape), dtype=w0[k].dtype, device=dev) for k in buffer_names}
        EX = _stack_like(jobs[0].request.extras, S, dev)
        SE = None
        if per_step[0] is not None or any(p is not None for p in per_step):
            tmax = max(totals)
            SE = {k: torch.zeros((J, tmax, *v.shape[1:]), dtype=v.dtype, device=dev)
                  for k, v in next(p for p in per_step if p is not None).items()}
            for i, p in enumerate(per_step):
                if p is not None:
                    for k, v in p.items():
                        SE[k][i, :v.shape[0], :v.shape[1]] = v.to(dev)

        def load(k: int, i: int) -> None:
            w = jobs[i].request.weights
            P_flat[k] = torch.cat([w[n].to(dev).reshape(-1) for n in names])
            if M_flat is not None:
                M_flat[k].zero_()
            for n in frozen_names:
                FZ[n][k] = w[n]
            for n in buffer_names:
                BF[n][k] = w[n]
            _set_row(EX, jobs[i].request.extras, k)

        rows_dev = torch.from_numpy(plan.rows).to(dev)
        xs = torch.cat([x for x, _ in data]).to(dev)
        ys = torch.cat([y for _, y in data]).to(dev)
        loss_sum = torch.zeros(J, dtype=torch.float64, device=dev)
        # per group: the slots, their clients and local steps, on the device in one transfer
        flat_index = []
        for groups in plan.steps:
            for g in groups:
                flat_index += [g.slots, g.jobs, g.t]
        index_dev = torch.from_numpy(np.concatenate([np.asarray(a, np.int64) for a in flat_index])).to(dev) \
            if flat_index else None

        objective = _Objective(model, req0.loss)

        def client_loss(p, fz, bf, ex, x, y):
            params = {"model." + k: v for k, v in p.items()}
            params.update({"model." + k: v for k, v in fz.items()})
            params.update({"model." + k: v for k, v in bf.items()})
            return functional_call(objective, params, (x, y, ex))

        step_fn = vmap(grad_and_value(client_loss))
        whole_fn = self._compiled_step(jobs[0], step_fn) if self.compile else step_fn
        grad_fn = vmap(req0.grad) if req0.grad is not None else None
        precision, device_type = rt.cfg.execution.precision, dev.type
        was = model.training
        model.train()
        pos = 0
        try:
            for s, groups in enumerate(plan.steps):
                for k, i in plan.loads[s]:
                    load(k, i)
                for g in groups:
                    G = len(g.slots)
                    sl = index_dev[pos:pos + G]
                    jb = index_dev[pos + G:pos + 2 * G]
                    tt = index_dev[pos + 2 * G:pos + 3 * G]
                    pos += 3 * G
                    if g.whole:
                        p_flat, m_flat, fz, bf, ex = P_flat, M_flat, FZ, BF, EX
                    else:
                        p_flat = P_flat.index_select(0, sl)
                        m_flat = None if M_flat is None else M_flat.index_select(0, sl)
                        fz = {n: v.index_select(0, sl) for n, v in FZ.items()}
                        bf = {n: v.index_select(0, sl) for n, v in BF.items()}
                        ex = _select(EX, sl)
                    if SE is not None:
                        ex = {**ex, **{n: v[jb, tt, :g.b] for n, v in SE.items()}}
                    idx = rows_dev[g.start:g.start + G * g.b].view(G, g.b)
                    with autocast(precision, device_type):
                        fn = whole_fn if g.whole and g.b == B else step_fn
                        grads, value = fn(unflat(p_flat), fz, bf, ex, xs[idx], ys[idx])
                    if grad_fn is not None:
                        grads = grad_fn(grads, _select(EX, sl) if not g.whole else EX)
                    d_p = torch.cat([grads[n].reshape(G, -1) for n in names], dim=1)  # (G, n)
                    if clip is not None:  # clip_grad_norm_ per client
                        coef = (clip / (d_p.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
                        d_p = d_p * coef.unsqueeze(1)
                    if wd != 0:
                        d_p = d_p.add(p_flat, alpha=wd)
                    if m_flat is not None:
                        m_flat.mul_(mom).add_(d_p)
                        d_p = m_flat
                    p_flat.add_(d_p, alpha=-lr)
                    if not g.whole:
                        P_flat.index_copy_(0, sl, p_flat)
                        if M_flat is not None:
                            M_flat.index_copy_(0, sl, m_flat)
                        for n in buffer_names:
                            BF[n].index_copy_(0, sl, bf[n])
                    loss_sum.index_add_(0, jb, value.detach().to(torch.float64) * g.b)
                for k, i in plan.finishes[s]:
                    flat = P_flat[k]
                    w = {n: flat[a:b].view(shape).clone() for n, (a, b, shape) in views.items()}
                    w.update({n: FZ[n][k].clone() for n in frozen_names})
                    w.update({n: BF[n][k].clone() for n in buffer_names})
                    answers[i] = {n: w[n] for n in order}
        finally:
            model.train(was)

        losses = loss_sum.cpu().tolist()  # the stack's one wait for the device
        for i, j in enumerate(jobs):
            if totals[i] == 0:
                continue
            seen = sum(sizes[i])
            stats = TrainStats(loss=losses[i] / seen, steps=totals[i], samples=seen)
            try:
                answers[i] = Fitted(answers[i], j.ctx._trained(stats, j.request.report))
            except NonFiniteLossError as e:
                answers[i] = e
        return answers


    def _compiled_step(self, job: _Job, step_fn):
        """``step_fn`` compiled with ``torch.compile`` (with CUDA graphs on a GPU), one per
        signature; it is called only for steps of the whole stack at the full batch size, one
        fixed shape per stack, and the stack's other groups run eagerly."""
        key = self._signature(job)
        if key not in self._compiled:
            mode = "reduce-overhead" if self.runtime.device.type == "cuda" else None
            self._compiled[key] = torch.compile(step_fn, dynamic=False, mode=mode)
        return self._compiled[key]


def _leaves(tree, prefix: str = ""):
    """(path, tensor) of a nested dict of tensors, in order."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


def _stack_like(tree, S: int, dev) -> dict:
    return {k: (_stack_like(v, S, dev) if isinstance(v, dict)
                else torch.zeros((S, *v.shape), dtype=v.dtype, device=dev)) for k, v in tree.items()}


def _set_row(stacked: dict, tree, k: int) -> None:
    for n, v in tree.items():
        if isinstance(v, dict):
            _set_row(stacked[n], v, k)
        else:
            stacked[n][k] = v


def _select(stacked: dict, idx: torch.Tensor) -> dict:
    return {k: (_select(v, idx) if isinstance(v, dict) else v.index_select(0, idx)) for k, v in stacked.items()}
