"""The batched client executor: a round's clients trained together, in one stack of parameters.

On a GPU, the models of these papers are far too small to keep it busy one client at a
time. This executor drives the ``client_update`` coroutines of all of a round's clients
(``algorithms/base.py``) and runs the work they await together:

* **training** (``ctx.fit``): the requests of all clients that share a signature (the
  same loss, gradient transform, trainable parameters and settings) run as one stack of
  ``S`` slots. Each slot holds one client's parameters and momentum; one SGD step for the
  whole stack is one ``torch.func.vmap`` over ``functional_call`` of the loss (a
  convolution becomes one grouped convolution, or with ``execution.conv_as_matmul`` a
  batched matmul of weights and patches (``engine/stack_kernels.py``); a linear layer one
  batched matmul);
* **the stack stays full**: clients do not run in lockstep. When a client takes its last
  step, the next client of the round takes its slot (as inference servers do with
  requests), longest clients first; the slot count is chosen so that the stack finishes
  in about the time of its longest client (:func:`choose_slots`);
* **features** (``ctx.features``): the clients' models applied to their own data in
  vmapped forwards of at most ``FEATURE_ROWS`` rows (prototypes, eq. 3 of FedNH, ...);
* everything else a method does between its awaits (class means, k-means, its reply)
  runs client by client, as written.

Each client still computes what the sequential executor computes (``engine/train.py``):

* data order: the same schedule (:func:`~protofl.engine.train.batch_rows`), each client's
  per-epoch permutations drawn from its own stream (``ctx.generator``), so it sees the
  same batches in the same order;
* batch count: ``epochs * ceil(n_k / B)`` steps (or ``training.steps``), wherever and
  whenever its slot runs them;
* the last batch of an epoch is smaller: padded (``execution.pad_batches``) to the batch
  size with masked rows, so that a stack step is one step of every slot, each slot's loss
  the weighted mean of its samples' losses (:func:`~protofl.engine.train.masked_mean`;
  weight 1/b on its b rows, 0 on the padding), for methods whose loss is a mean over its
  samples (not ``couples_samples``) on models without BatchNorm; else grouped: the
  active slots are grouped by their batch size and each group runs as one stack
  (BatchNorm statistics and the mean of the loss are exactly those of that client's batch);
* the step: the engine's one training step (:func:`~protofl.engine.train.train_step`:
  gradients, DP-SGD, the gradient transform, clipping and the optimizer update), the step
  the sequential driver takes with one slot on the live model; here with the gradients of
  every slot vmapped and the update on one flat (slots, parameters) buffer, so that an
  update is a handful of kernels whatever the number of layers (:func:`stack_step`); the
  optimizer state of a slot is zeroed when a client enters it; a parameter the loss does
  not reach (no gradient under autograd, zeros under vmap) keeps its value and state
  through the step, as ``torch.optim`` leaves it;
* its gradient transform (SCAFFOLD), per-step extras (FedGen's draws) and the run's
  precision (bf16 autocast);
* DP-SGD (``privacy.mode: sample``): each client's Poisson-sampled batches drawn from its
  own secret stream as the sequential driver draws them, padded to the stack's largest
  batch (a padded row is masked out of the sum); the gradient of every sample of every
  slot (a vmap over the samples inside the vmap over the slots), clipped and noised as the
  sequential driver does, each client's noise drawn from its own stream.

The schedule (which client is in which slot at which step, the rows of every batch) is
worked out on the host before the stack starts and sent to the device in one transfer,
so the loop never waits on a host copy. Results equal the sequential executor's up to
float rounding (batched kernels sum in a different order; clipping takes the norm of the
flat row in one pass). Models with dropout are not batched (their masks could not match
the sequential run's), nor heterogeneous architectures: those run on the sequential
executor, and the run log says so once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import logging
import math
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, cast, Coroutine, Iterable, Iterator, Mapping, Optional, TypeVar, Union

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..algorithms.base import ClientResult, Features, Fit, Fitted, LossFn, TrainStats
from ..messages import Record
from .client import ClientContext, ClientOutput, ClientRuntime, not_a_request, trainable_names
from .executor import ClientTask, Executor, SequentialExecutor, place_broadcasts
from .augment import apply, Augment, augment_plan
from .stack_kernels import StackKernels, Which
from ..nn.privacy import NoiseStream
from .train import (Layout, NonFiniteLossError, Objective, StepCode, TrainSettings, batch_coupled, batch_rows,
                    batch_sizes, embed_batches, flat_views, masked_mean, optimizer_state, per_sample, poisson_rows,
                    reset_rows, total_steps, train_step)

log = logging.getLogger("protofl")

T = TypeVar("T")
# what makes jobs train in one stack (:meth:`BatchedExecutor._signature`)
Signature = tuple[Any, ...]
# a batch's outcome in :meth:`BatchedExecutor.run_batches`: its outputs in task order, or
# (``isolate``) the exception that stopped its run
BatchResult = Union[list[Optional[ClientOutput]], BaseException]
# a client's ``ctx.augmentation``: the augmentation, its stream, the padding value
_Augmentation = tuple[Augment, torch.Generator, torch.Tensor]

# the features pass (ctx.features) forwards at most this many rows at once, whatever the number
# of clients: 16 clients' inference batches of 256 (a round of 100 clients held them all at
# once, and its activations multiplied the round's peak memory)
FEATURE_ROWS = 4096

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def why_not_batched(runtime: ClientRuntime) -> Optional[str]:
    """Why this run's clients cannot be trained as one stack, or None when they can."""
    cfg = runtime.cfg
    if cfg.model.per_client:
        return "clients have different architectures (model.per_client)"
    model = runtime.models.live(dict(cfg.model.params))[0]
    if any(isinstance(m, _RANDOM) for m in model.modules()):
        return f"model {cfg.model.name!r} has dropout (its masks would differ from a sequential run)"
    if any(isinstance(m, nn.RNNBase) for m in model.modules()):  # torch.func has no batching rule for
        # the fused recurrent kernels: it loops over the clients (training) or fails (inference)
        return f"model {cfg.model.name!r} has a recurrent layer (vmap cannot stack it)"
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


def slot_memory_cap(model: nn.Module, batch: int, device: torch.device, sample: torch.Tensor,
                    per_sample: bool = False) -> int:
    """How many slots fit in memory: per slot the parameters four times over (weights,
    momentum, gradient, update), ``batch`` times more with DP-SGD's per-sample gradients,
    and the activations of one batch, against half of the free GPU memory (a quarter of
    the RAM on the CPU)."""
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
    params = sum(p.numel() for p in model.parameters())
    per_slot = 4 * ((4 + (batch if per_sample else 0)) * params + 3 * batch * sum(sizes))
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] // 2
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    return max(1, int(budget // max(per_slot, 1)))


@dataclass
class Group:
    """The slots of one stack step that share a batch size ``b``: ``slots`` (G,), their
    clients ``jobs`` and those clients' local step indices ``t``. ``start``: the offset of
    the group's data rows in :attr:`Plan.rows`; ``at``: of its (slots, jobs, t, live) in
    :attr:`Plan.index`; ``whole``: the group is every slot of the stack; ``idle``: how many
    of them hold no client (a filled step: their rows are all padding, their ``live`` 0)."""

    b: int
    slots: list[int]
    jobs: list[int]
    t: list[int]
    start: int
    at: int
    whole: bool
    idle: int = 0


@dataclass
class Plan:
    steps: list[list[Group]]  # per stack step, its groups
    loads: list[list[tuple[int, int]]]  # per stack step, (slot, job) entering before it
    finishes: list[list[tuple[int, int]]]  # per stack step, (slot, job) done after it
    rows: np.ndarray  # (sum of G * b,) data rows of every group, in order
    index: np.ndarray  # (4 * sum of G,) every group's slots, jobs, t and live (1: a client's step), in order
    busy: int  # client-steps
    slot_steps: int  # slots x stack steps
    aug: Optional[dict[str, np.ndarray]] = None  # the augmentation draws of those rows: offsets (N, 2), flips (N,)


def plan_stack(totals: list[int], sizes: list[list[int]], rows: list[np.ndarray], slots: int,
               aug: Optional[list[dict[str, np.ndarray]]] = None, fill: bool = False) -> Plan:
    """The schedule: clients enter free slots longest first; each step groups the active
    slots by batch size (largest first). ``rows[j]`` (total_j, B) are client j's data rows;
    ``aug[j]`` its augmentation draws (engine/augment.py), gathered like its rows.
    ``fill`` (every batch padded to one size): a step with free slots (the stack's last,
    once no client waits) is still one group of every slot, the free ones stepping on
    padding alone (rows -1) for their last client (``live`` 0), so that every step of the
    stack has one shape. A free slot's weights were handed back when its client finished,
    and no client enters it again: what those steps do to it is read by no one."""
    order = deque(sorted((j for j in range(len(totals)) if totals[j] > 0), key=lambda j: -totals[j]))
    active: dict[int, list[int]] = {}  # slot -> [job, local step]
    last: dict[int, int] = {}  # slot -> the job it held last
    steps, loads, finishes, chunks, index = [], [], [], [], []
    drawn: dict[str, list[np.ndarray]] = {"offsets": [], "flips": []}
    pos = at = 0
    pending_loads = []
    for k in range(slots):
        if order:
            j = order.popleft()
            active[k] = [j, 0]
            pending_loads.append((k, j))
    while active:
        by_size: dict[int, list[int]] = defaultdict(list)
        for k in sorted(active):
            j, t = active[k]
            by_size[sizes[j][t]].append(k)
            last[k] = j
        if fill and len(active) < slots:  # one group of every slot at the one size
            (b,) = by_size
            by_size = {b: sorted(last)}
        groups = []
        for b in sorted(by_size, reverse=True):
            ks = by_size[b]
            js = [active[k][0] if k in active else last[k] for k in ks]
            ts = [active[k][1] if k in active else 0 for k in ks]
            live = [int(k in active) for k in ks]
            chunks.append(np.stack([rows[j][t, :b] if v else np.full(b, -1, np.int64)
                                    for j, t, v in zip(js, ts, live)]).reshape(-1))
            if aug is not None:
                drawn["offsets"].append(np.concatenate([aug[j]["offsets"][t, :b] for j, t in zip(js, ts)]))
                drawn["flips"].append(np.concatenate([aug[j]["flips"][t, :b] for j, t in zip(js, ts)]))
            index += [ks, js, ts, live]
            groups.append(Group(b, ks, js, ts, pos, at, whole=len(ks) == slots, idle=len(ks) - sum(live)))
            pos += len(ks) * b
            at += 4 * len(ks)
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
    empty = np.zeros(0, np.int64)
    return Plan(steps, loads, finishes, np.concatenate(chunks) if chunks else empty,
                np.concatenate([np.asarray(a, np.int64) for a in index]) if index else empty,
                sum(totals), slots * len(steps),
                {k: np.concatenate(v) for k, v in drawn.items()} if aug is not None and chunks else None)


# ---------------------------------------------------------------------------------------
# the executor
# ---------------------------------------------------------------------------------------
@dataclass
class _Job:
    task: ClientTask
    ctx: ClientContext
    update: Coroutine[Any, Any, ClientResult]  # the client_update coroutine
    batch: int = 0  # which batch of run_batches (which run, when runs are packed)
    request: Optional[Union[Fit, Features]] = None  # what it awaits now (None: finished)
    output: Optional[ClientOutput] = None
    rng: Optional[torch.Tensor] = None  # its torch RNG state between turns

    @property
    def fit(self) -> Fit:
        """The ``Fit`` it awaits (asked only of a job that awaits one)."""
        return cast(Fit, self.request)

    @property
    def features(self) -> Features:
        """The ``Features`` it awaits (asked only of a job that awaits one)."""
        return cast(Features, self.request)


@dataclass
class StackStats:
    """What the stacks did: client-steps that trained (busy), slot-steps they took, and the
    steps they ran (``steps``: a stack step whose slots' batches differ in size runs once
    per size, unless short batches are padded)."""

    busy: int = 0
    slot_steps: int = 0
    stacks: int = 0
    slots: list[int] = field(default_factory=list)
    steps: int = 0
    padded: int = 0  # stacks whose short batches were padded
    whole: int = 0  # steps of every slot at the full batch size (the compiled step's one shape)

    def add(self, plan: Plan, S: int, B: int, padded: bool) -> None:
        """Count a stack of ``S`` slots and batch size ``B`` that runs ``plan``."""
        self.busy += plan.busy
        self.slot_steps += plan.slot_steps
        self.stacks += 1
        self.slots.append(S)
        self.steps += sum(len(groups) for groups in plan.steps)
        self.whole += sum(g.whole and g.b == B for groups in plan.steps for g in groups)
        self.padded += padded

    @property
    def occupancy(self) -> Optional[float]:
        return self.busy / self.slot_steps if self.slot_steps else None


# ---------------------------------------------------------------------------------------
# the stack: S slots, each holding one client's model and optimizer state
# ---------------------------------------------------------------------------------------
@dataclass
class Slots:
    """The tensors of some of a stack's slots, one row per slot: the trainable parameters
    as one flat (G, n) buffer, the optimizer state of that buffer, the frozen parameters,
    the buffers (BatchNorm statistics) and the extras of the clients in them."""

    params: torch.Tensor  # (G, n)
    state: dict[str, list[torch.Tensor]]
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    extras: dict[str, Any]


class Stack:
    """``S`` slots of one training signature on one device. A client enters a slot
    (:meth:`load`) with the weights it starts from and its extras, trains there, and
    leaves it (:meth:`unload`) with its trained weights; the next client takes the slot."""

    def __init__(self, model: nn.Module, names: list[str], S: int, settings: TrainSettings, extras: Mapping[str, Any],
                 device: torch.device) -> None:
        params = dict(model.named_parameters())
        self.order = list(model.state_dict().keys())  # state-dict order of the weights handed back
        self.names = names  # the trainable parameters, in the flat row's order
        layout, o = {}, 0
        for k in names:
            layout[k] = (o, o + params[k].numel(), tuple(params[k].shape))
            o += params[k].numel()
        self.layout: Layout = layout  # name -> (start, end, shape) in a row
        like = model.state_dict()
        self.all = Slots(
            params=torch.zeros(S, o, dtype=params[names[0]].dtype, device=device),
            state={}, frozen={k: torch.zeros((S, *v.shape), dtype=v.dtype, device=device)
                              for k, v in params.items() if k not in self.layout},
            buffers={k: torch.zeros((S, *like[k].shape), dtype=like[k].dtype, device=device)
                     for k, _ in model.named_buffers()},
            extras=_stack_like(extras, S, device))
        self.all.state = optimizer_state(settings, [self.all.params])
        self.S = S

    def load(self, slot: int, fit: Fit) -> None:
        """Client ``fit`` enters ``slot``: its start weights and extras, a fresh optimizer state."""
        w, a = fit.weights, self.all
        a.params[slot] = torch.cat([w[k].to(a.params.device).reshape(-1) for k in self.names])
        reset_rows(a.state, slot)
        for k, t in a.frozen.items():
            t[slot] = w[k]
        for k, t in a.buffers.items():
            t[slot] = w[k]
        _set_row(a.extras, fit.extras, slot)

    def unload(self, slot: int) -> dict[str, torch.Tensor]:
        """The weights in ``slot`` (a full state dict, copies), as the client leaves it."""
        a = self.all
        w = {k: a.params[slot, i:j].view(shape).clone() for k, (i, j, shape) in self.layout.items()}
        w.update({k: t[slot].clone() for k, t in a.frozen.items()})
        w.update({k: t[slot].clone() for k, t in a.buffers.items()})
        return {k: w[k] for k in self.order}

    def select(self, slots: Optional[torch.Tensor]) -> Slots:
        """The tensors of ``slots`` (None: all of them, as views; else copies to :meth:`commit`)."""
        if slots is None:
            return self.all
        a = self.all
        return Slots(a.params.index_select(0, slots),
                     {k: [t.index_select(0, slots) for t in ts] for k, ts in a.state.items()},
                     {k: t.index_select(0, slots) for k, t in a.frozen.items()},
                     {k: t.index_select(0, slots) for k, t in a.buffers.items()}, _select(a.extras, slots))

    def commit(self, part: Slots, slots: Optional[torch.Tensor]) -> None:
        """Write back what a step changed in a selection: parameters, optimizer state, buffers."""
        if slots is None:
            return
        a = self.all
        a.params.index_copy_(0, slots, part.params)
        for k, ts in a.state.items():
            for t, new in zip(ts, part.state[k]):
                t.index_copy_(0, slots, new)
        for k, t in a.buffers.items():
            t.index_copy_(0, slots, part.buffers[k])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the stack: flat parameters, optimizer state, frozen parameters,
        buffers and extras."""
        a = self.all
        return [a.params, *(t for ts in a.state.values() for t in ts), *a.frozen.values(), *a.buffers.values(),
                *(t for _, t in _leaves(a.extras))]

    def columns(self, names: Iterable[str]) -> Optional[torch.Tensor]:
        """The flat row's indices of the parameters ``names`` (None for none)."""
        spans = [torch.arange(*self.layout[k][:2]) for k in names]
        return torch.cat(spans).to(self.all.params.device) if spans else None

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named parameters of rows of a flat (G, n) buffer, as views."""
        return flat_views(flat, self.layout)


def stack_step(code: StepCode, params: torch.Tensor, state: dict[str, list[torch.Tensor]],
               frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], extras: dict[str, Any],
               step_extras: dict[str, Any], xb: torch.Tensor, yb: torch.Tensor, valid: Optional[torch.Tensor],
               live: Optional[torch.Tensor], idle: Optional[torch.Tensor], z: Optional[torch.Tensor],
               lr: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The engine's one training step (:func:`~protofl.engine.train.train_step`) of a stack's
    G slots, their parameters flat rows ``params`` (G, n), and each slot's loss times its
    sample count, (G,) float64, to add to its client's sum (a free slot's, of no sample, 0).
    Also returns the step's gradient norms (None without clipping; see ``train_step``). The
    function ``execution.compile`` compiles, once per signature."""
    value, counts, norms = train_step(code, [params], state, frozen, buffers, extras, step_extras, xb, yb, valid, live,
                                      idle, z, lr)
    b = xb.shape[1]
    if code.settings.dp_clip is not None and valid is not None:  # per-sample losses: the sum, below
        value = torch.where(valid, value, torch.zeros_like(value)).sum(1) / b
    sums: torch.Tensor = value.to(torch.float64) * (b if counts is None else counts)
    if live is not None:  # a free slot's loss (of no sample) counts for none
        sums = torch.where(live > 0, sums, torch.zeros_like(sums))
    return sums, norms


# ---------------------------------------------------------------------------------------
# one stack's training: its clients' minibatches, drawn; its steps
# ---------------------------------------------------------------------------------------
@dataclass
class _Drawn:
    """The minibatches of a stack's clients, drawn as each client's sequential loop would:
    per client its step count, batch sizes and data rows (into the stack's concatenated
    data; -1: a DP-SGD padding row), its augmentation draws, and under DP-SGD its private
    settings (the released n~_k) and the round's sigma in ``settings``."""

    settings: TrainSettings
    totals: list[int]
    sizes: list[list[int]]  # per client, the width of each of its steps in the stack
    rows: list[np.ndarray[Any, Any]]
    private: list[TrainSettings]
    aug: Optional[list[dict[str, np.ndarray[Any, Any]]]]
    samples: list[list[int]]  # per client, the samples of each step (DP-SGD: unknown here, empty)
    padded: bool = False  # short batches padded to the batch size with masked rows (-1)

    @property
    def dp(self) -> bool:
        return self.settings.dp_clip is not None


def _draw(jobs: list[_Job], fits: list[Fit], model: nn.Module, names: list[str],
          data: list[tuple[torch.Tensor, torch.Tensor]], pad: bool = False) -> _Drawn:
    """Every client's minibatches for one stack (:class:`_Drawn`), from its own streams;
    ``pad``: a short batch padded to the batch size with masked rows (-1), so that every
    step of the stack has one width."""
    settings = jobs[0].ctx.training_settings(fits[0].settings)
    B = settings.batch_size
    ns = [len(y) for _, y in data]
    offsets = np.concatenate([[0], np.cumsum(ns)[:-1]]).astype(np.int64)
    dp = settings.dp_clip is not None
    private: list[TrainSettings] = []
    width = B
    if dp:  # DP-SGD: each client's own n~_k, Poisson batches padded to the stack's widest (-1)
        private = [j.ctx.fit_settings(f) for j, f in zip(jobs, fits)]
        settings = dataclasses.replace(settings, dp_noise=private[0].dp_noise)  # the round's sigma
        totals = [p.dp_steps() if names else 0 for p in private]
        drawn_rows = [poisson_rows(n, p.dp_rate, t, cast(NoiseStream, j.ctx.batch_generator))  # its secret stream
                      for n, p, t, j in zip(ns, private, totals, jobs)]
        width = max([r.shape[1] for r, t in zip(drawn_rows, totals) if t] or [1])
        rows = [np.pad(np.where(r >= 0, r + o, -1), ((0, 0), (0, width - r.shape[1])), constant_values=-1)
                for r, o in zip(drawn_rows, offsets)]
        sizes = [[width] * t for t in totals]
        samples: list[list[int]] = []
    else:
        drop = batch_coupled(model)  # a batch of one never reaches BatchNorm (train.epoch_batches)
        totals = [total_steps(n, B, settings.epochs, settings.steps, drop) if names else 0 for n in ns]
        samples = [batch_sizes(n, B, t, drop) for n, t in zip(ns, totals)]
        rows = [batch_rows(n, B, t, j.ctx.generator, drop) + o for n, t, j, o in zip(ns, totals, jobs, offsets)]
        if pad:  # column c of step s is no sample when c >= that step's size
            rows = [np.where(np.arange(B) < np.asarray(b, np.int64).reshape(-1, 1), r, -1) for r, b in zip(rows, samples)]
        sizes = [[B] * t for t in totals] if pad else samples
    augmentation = jobs[0].ctx.augmentation  # the same for every client of the run (of the stack)
    aug = [augment_plan(augmentation[0], t, width, cast(_Augmentation, j.ctx.augmentation)[1])
           for t, j in zip(totals, jobs)] if augmentation else None
    return _Drawn(settings, totals, sizes, rows, private, aug, samples, padded=pad and not dp)


@dataclass
class _StackRun:
    """What one stack's training steps read: the stack, its data on the device (rows and
    (slot, job, step) index of every group, augmentation draws, per-step extras), the step
    (its settings and whether it pads are the step's: ``code``), and the per-job sums the
    steps add to."""

    stack: Stack
    xs: torch.Tensor
    ys: torch.Tensor
    per_step: Optional[dict[str, torch.Tensor]]
    batch: torch.Tensor
    index: torch.Tensor
    drawn: Optional[dict[str, torch.Tensor]]
    augmentation: Optional[_Augmentation]
    code: StepCode
    compiled: Optional[Callable[..., Any]]  # stack_step compiled for the stack's whole full-size steps
    lr: Optional[torch.Tensor]  # the compiled step's learning rate (0-d)
    idle: Optional[torch.Tensor]
    noise: Optional[list[NoiseStream]]
    loss_sum: torch.Tensor
    seen: torch.Tensor

    @property
    def settings(self) -> TrainSettings:
        return self.code.settings

    @property
    def padded(self) -> bool:
        """Short batches padded with masked rows (-1), the loss a weighted mean."""
        return self.code.padded

    @property
    def dp(self) -> bool:
        return self.settings.dp_clip is not None

    def inputs(self, g: Group, part: Slots, clients: torch.Tensor,
               t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], Optional[torch.Tensor]]:
        """Group ``g``'s minibatches (G, b, ...), labels, extras and which rows are samples
        (None: all are). A padded row (-1) is DP-SGD's, or a short batch's padding: the latter
        repeats its batch's first sample (and per-step extras), a real sample of that client,
        whose loss is weighted 0; DP-SGD's reads row 0 (its batch may be empty)."""
        G, xs = len(g.slots), self.xs
        rows = self.batch[g.start:g.start + G * g.b].view(G, g.b)
        valid = rows >= 0 if self.dp or self.padded else None
        if valid is not None:
            rows = torch.where(valid, rows, rows[:, :1]) if self.padded else rows.clamp(min=0)
        extras = dict(part.extras) if self.per_step else part.extras  # a copy only to add the step's rows
        for k, v in (self.per_step or {}).items():
            e = v[clients, t, :g.b]
            if self.padded and valid is not None:
                e = torch.where(valid.view(G, g.b, *[1] * (e.dim() - 2)), e, e[:, :1])
            extras[k] = e
        xb = xs[rows]
        if self.drawn is not None and self.augmentation is not None:  # each sample as the client's own plan has it
            span = slice(g.start, g.start + G * g.b)
            xb = apply(self.augmentation[0], xb.reshape(G * g.b, *xs.shape[1:]), self.drawn["offsets"][span],
                       self.drawn["flips"][span], self.augmentation[2]).view(G, g.b, *xs.shape[1:])
        return xb, self.ys[rows], extras, valid

    def step(self, g: Group) -> None:
        """One optimizer step of group ``g``'s slots: their minibatches (:meth:`inputs`) and
        DP-SGD's noise drawn here, the step itself (:func:`stack_step`; compiled for a step
        of the whole stack at the full batch size), the loss added to each job's sum."""
        G, stack = len(g.slots), self.stack
        at = self.index[g.at:g.at + 4 * G]
        slots, clients, t = at[:G], at[G:2 * G], at[2 * G:3 * G]
        part = stack.select(None if g.whole else slots)
        xb, yb, extras, valid = self.inputs(g, part, clients, t)
        z = None
        if self.dp and valid is not None:
            z = None if self.noise is None else torch.stack(
                [self.noise[i].normal((part.params.shape[1],)) for i in g.jobs]).to(xb.device)
            self.seen.index_add_(0, clients, valid.sum(1).to(torch.float64))
        compiled = self.compiled is not None and g.whole and g.b == self.settings.batch_size
        # a free slot is masked out on a filled step; the compiled step always masks (one graph)
        live = at[3 * G:] if g.idle or compiled else None
        args = (part.params, part.state, part.frozen, part.buffers, part.extras, extras, xb, yb, valid, live,
                self.idle, z)
        if compiled:
            value, _ = cast(Callable[..., tuple[torch.Tensor, Any]], self.compiled)(*args, self.lr)
        else:
            value, _ = stack_step(self.code, *args, None)
        stack.commit(part, None if g.whole else slots)
        self.loss_sum.index_add_(0, clients, value)


class BatchedExecutor(Executor):
    """Drives a round's ``client_update`` coroutines and runs what they await as stacks of at
    most ``slots`` clients (0: chosen from the round's clients and the memory)."""

    def __init__(self, runtime: ClientRuntime, slots: int = 0, threads: int = 0, compile: bool = False,
                 pad: bool = False, stack_kernels: Which = "off") -> None:
        self.runtime = runtime
        self.threads = threads
        self.slots = slots
        self.compile = compile
        self.pad = pad
        self.stack_kernels = StackKernels(stack_kernels).which  # an unknown name fails here; each step enters its own
        self._compiled: dict[Signature, tuple[Callable[..., Any], StepCode]] = {}
        self._compiled_slots: dict[Signature, int] = {}  # per signature: the most slots chosen so far
        self._stacks: dict[Signature, Stack] = {}  # per compiled signature: its stack's tensors, kept
        self._unreached_of: dict[Signature, frozenset[str]] = {}  # per signature: parameters its loss does not reach
        self.sequential = SequentialExecutor(runtime, threads)
        self.reason = why_not_batched(runtime)
        self.stats = StackStats()
        self._noted = False
        self._cap: dict[tuple[int, int, bool], int] = {}

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": "local", "workers": 0, "threads": self.threads,
                               "device": str(self.runtime.device)}
        if self.reason is not None:
            return {**out, "executor": "sequential", "executor_note": self.reason}
        out["executor"] = "batched"
        if self.stats.stacks:
            occupancy = self.stats.occupancy
            assert occupancy is not None  # a stack takes at least one slot-step
            out.update(occupancy=round(occupancy, 4), slots=max(self.stats.slots), padded=self.stats.padded > 0)
            if self.stack_kernels != "off":
                out["conv_as_matmul"] = self.stack_kernels
        return out

    def _note(self, reason: str) -> None:
        if not self._noted:
            log.info("protofl: batched executor not used (%s); clients run one after another", reason)
            self._noted = True

    def close(self) -> None:
        self.sequential.close()

    # -- driving the coroutines ------------------------------------------------------------------
    def run(self, tasks: list[ClientTask]) -> list[Optional[ClientOutput]]:
        out = self.run_batches([(self.runtime, tasks)])[0]
        return cast(list[Optional[ClientOutput]], out)  # without isolate an exception rises, never returns

    def run_batches(self, batches: list[tuple[ClientRuntime, list[ClientTask]]],
                    isolate: bool = False) -> list[BatchResult]:
        """The tasks of several runs at once (``execution.pack_runs``): each batch is one run's
        runtime and tasks; its clients join the same stacks as every other batch's whose
        model and training request match. Per batch, its outputs in task order; with
        ``isolate``, a batch whose client raised gives that exception instead (its other
        clients stop) and the other batches go on; else the exception is raised."""
        results: list[Optional[BatchResult]] = [None] * len(batches)
        jobs: list[_Job] = []
        t0 = time.perf_counter()
        for b, (rt, tasks) in enumerate(batches):
            reason = why_not_batched(rt)
            if reason is not None:  # e.g. dropout: this batch runs one client after another
                self._note(reason)
                outputs = self._guarded(b, results, isolate, lambda: self._sequential(rt).run(tasks))
                if outputs is not None:  # None: its exception is already the batch's result
                    results[b] = outputs
                continue
            started = self._guarded(b, results, isolate, lambda: [
                self._start(t, shared, rt, b) for t, shared in zip(tasks, place_broadcasts(rt, tasks))])
            jobs += started or []
        while True:
            waiting = [j for j in jobs if j.request is not None and not isinstance(results[j.batch], BaseException)]
            if not waiting:
                break
            todo = [j for j in waiting if isinstance(j.request, Features)]
            if todo:  # features first: they are cheap and let their clients move on
                answers = self._features(todo)
            else:
                groups: dict[Signature, list[_Job]] = {}
                for j in waiting:
                    groups.setdefault(self._signature(j), []).append(j)
                todo = max(groups.values(), key=len)  # the largest group first (ties: the first)
                answers = self._fit(todo)
            for j, a in zip(todo, answers):
                self._guarded(j.batch, results, isolate, lambda: self._advance(j, a))
        seconds = (time.perf_counter() - t0) / max(1, len(jobs))
        for j in jobs:  # each client is charged an equal share of the round
            if j.output is not None and j.output.train:
                j.output.train["seconds"] = seconds
        for b in range(len(batches)):
            if results[b] is None:
                results[b] = [j.output for j in jobs if j.batch == b]
            elif isinstance(results[b], BaseException):
                for j in jobs:
                    if j.batch == b and j.request is not None:
                        j.update.close()  # the failed run's other clients stop here
        return cast(list[BatchResult], results)  # every batch has its outcome now

    @staticmethod
    def _guarded(b: int, results: list[Optional[BatchResult]], isolate: bool, fn: Callable[[], T]) -> Optional[T]:
        """``fn()``; with ``isolate``, an exception becomes batch ``b``'s result instead of rising."""
        if isinstance(results[b], BaseException):
            return None
        try:
            return fn()
        except Exception as e:
            if not isolate:
                raise
            results[b] = e
            return None

    def _sequential(self, rt: ClientRuntime) -> SequentialExecutor:
        return self.sequential if rt is self.runtime else SequentialExecutor(rt)

    def _start(self, t: ClientTask, shared: Record, rt: ClientRuntime, batch: int) -> _Job:
        ctx, update = rt.start(t, shared)
        job = _Job(t, ctx, update, batch, rng=torch.get_rng_state())
        self._advance(job, None)
        return job

    def _advance(self, job: _Job, answer: Any) -> None:
        """Resume ``job`` with ``answer`` (an exception is thrown into it) until its next
        request or its end, then finish it: its reply, state and evaluation."""
        rt, t = job.ctx.runtime, job.task
        assert job.rng is not None  # _start gives every job its state
        torch.set_rng_state(job.rng)  # its own torch stream, whatever other clients drew
        try:
            if isinstance(answer, BaseException):
                request = job.update.throw(answer)
            else:
                request = job.update.send(answer)
            if not isinstance(request, (Fit, Features)):
                job.update.close()
                raise not_a_request(request)
            job.request = request
        except StopIteration as done:
            job.request = None
            job.output = rt.finish(job.ctx, done.value, t.evaluate, t.full_test, time.perf_counter())
        except NonFiniteLossError as e:
            job.request = None
            job.output = rt.diverged(job.ctx, e)  # stop: raises; drop: the reply withdrawn
        finally:
            job.rng = torch.get_rng_state()

    def _signature(self, job: _Job, compiled: bool = False) -> Signature:
        """What jobs must share to train in one stack: the model (architecture, the method
        that adapts it, memory format, precision), the objective and the training settings,
        the augmentation with its padding value, and DP-SGD's noise multiplier (a stack runs
        one of each: packed runs that differ in them train in different stacks). Runs of
        the same method and hyper-parameters share a loss: a bound method counts by its
        function, since the method class and ``hp`` are part of the model's key.
        ``compiled``: what the compiled step depends on, the same less the settings the step
        does not read (the epochs, a step count, DP-SGD's released n~) and the learning rate,
        which it reads as a tensor, so that a rate that decays from round to round neither
        compiles the step again nor moves its slot count."""
        req, ctx = job.fit, job.ctx  # only jobs that await a Fit have a signature
        extras = tuple((k, tuple(v.shape), v.dtype) for k, v in _leaves(req.extras))
        rt = ctx.runtime
        augment = (rt.augment, tuple(rt.pad_value.flatten().tolist())) if rt.augment.active else None
        sigma = ctx.privacy.sigma if ctx.privacy is not None and ctx.dp_sgd else None  # fit_settings' dp_noise
        settings: Any = ctx.training_settings(req.settings)
        if compiled:
            settings = dataclasses.replace(settings, lr=0.0, epochs=0, steps=None, dp_n=None)
        return (model_key(rt, ctx.cid), _function(req.loss), _function(req.grad), req.trainable,
                settings, extras, req.step_extras is not None, augment, sigma)

    # -- features ----------------------------------------------------------------------------
    @torch.no_grad()
    def _features(self, jobs: list[_Job]) -> list[torch.Tensor]:
        """``model.<part>`` of every job's weights on its inputs, in eval mode, stacked: the
        clients' inference batches (:func:`~protofl.engine.train.embed_batches`) taken one
        batch index at a time, a short batch repeating its last row to the longest's size."""
        out: list[Optional[torch.Tensor]] = [None] * len(jobs)
        by_part: dict[tuple[str, tuple[Any, ...]], list[int]] = defaultdict(list)
        for i, j in enumerate(jobs):
            by_part[(j.features.part, model_key(j.ctx.runtime, j.ctx.cid))].append(i)
        for (part, _), idx in by_part.items():
            module = getattr(jobs[idx[0]].ctx.architecture, part)
            was = module.training
            module.eval()
            try:
                for i, z in zip(idx, self._part_features(module, part + ".", [jobs[i] for i in idx])):
                    out[i] = z
            finally:
                module.train(was)
        return cast(list[torch.Tensor], out)  # every job's features, each in one part's group

    def _part_features(self, module: nn.Module, prefix: str, jobs: list[_Job]) -> list[torch.Tensor]:
        """:meth:`_features` for the jobs of one part and architecture (``module`` in eval mode),
        in their order."""
        dev = self.runtime.device
        out: list[Optional[torch.Tensor]] = [None] * len(jobs)
        xs = [j.features.x if j.features.x is not None else j.ctx.data[0] for j in jobs]
        for i, (j, x) in enumerate(zip(jobs, xs)):
            if len(x) == 0:  # no samples: the part on the empty batch, (0, d) as for the others
                w = {k[len(prefix):]: v.to(dev) for k, v in j.features.weights.items() if k.startswith(prefix)}
                out[i] = functional_call(module, w, (x.to(dev),))
        # (job, index, inputs, inference batches), most batches first: the clients with a batch b are a prefix
        live = sorted(((j, i, x, embed_batches(len(x))) for i, (j, x) in enumerate(zip(jobs, xs)) if len(x)),
                      key=lambda lv: -len(lv[3]))
        if not live:
            return cast(list[torch.Tensor], out)  # no samples anywhere: each job's empty features, above
        keys = [k[len(prefix):] for k in live[0][0].features.weights if k.startswith(prefix)]
        W = {k: torch.stack([j.features.weights[prefix + k].to(dev) for j, _, _, _ in live]) for k in keys}
        data = torch.cat([x.to(dev) for _, _, x, _ in live])
        offsets = np.concatenate([[0], np.cumsum([len(x) for _, _, x, _ in live])[:-1]])
        plans = [p for _, _, _, p in live]
        fn = vmap(lambda w, xb: functional_call(module, w, (xb,)))
        pieces: list[list[torch.Tensor]] = [[] for _ in live]
        for b in range(len(plans[0])):
            have = sum(b < len(p) for p in plans)  # clients 0..have-1 have a batch b
            per = max(1, FEATURE_ROWS // max(plans[c][b][1] - plans[c][b][0] for c in range(have)))
            for lo in range(0, have, per):  # per clients a forward: at most FEATURE_ROWS rows at once
                cs = range(lo, min(lo + per, have))
                width = max(plans[c][b][1] - plans[c][b][0] for c in cs)  # a shorter batch repeats its last row
                rows = np.stack([offsets[c] + np.minimum(np.arange(plans[c][b][0], plans[c][b][0] + width),
                                                         plans[c][b][1] - 1) for c in cs])
                z = fn({k: v[cs.start:cs.stop] for k, v in W.items()}, data[torch.from_numpy(rows).to(dev)])
                for i, c in enumerate(cs):  # (len(cs), width, d)
                    pieces[c].append(z[i, :plans[c][b][1] - plans[c][b][0]])
        for c, (_, i, _, _) in enumerate(live):
            out[i] = torch.cat(pieces[c])
        return cast(list[torch.Tensor], out)  # the empty ones above, the others here

    # -- training ----------------------------------------------------------------------------
    def _fit(self, jobs: list[_Job]) -> list[Any]:
        """Train every job's ``Fit`` (one signature) as one stack; per job its ``Fitted``, or
        the ``NonFiniteLossError`` to throw into it."""
        dev = self.runtime.device
        fits: list[Fit] = [j.fit for j in jobs]
        model = jobs[0].ctx.architecture
        names = trainable_names(model, fits[0].trainable)
        data = [j.ctx.data for j in jobs]
        d = _draw(jobs, fits, model, names, data, self._pads(jobs[0], model))
        answers: list[Any] = [None] * len(jobs)
        for i, j in enumerate(jobs):  # clients without a step to take keep their weights
            if d.totals[i] == 0:
                answers[i] = Fitted({k: v.detach().clone() for k, v in fits[i].weights.items()},
                                    j.ctx.trained(TrainStats(0.0, 0, 0), fits[i].report, d.private[i] if d.dp else None))
        if not any(d.totals):
            return answers

        B = d.settings.batch_size
        compiled_key = self._signature(jobs[0], compiled=True) if self.compile else None  # what the compiled step is for
        S = self._slots(d.totals, model, B, data, compiled_key, per_sample=d.dp)
        plan = plan_stack(d.totals, d.sizes, d.rows, S, d.aug, fill=d.padded and self.compile)
        self.stats.add(plan, S, B, d.padded)

        per_step = self._per_step(fits, d.samples or d.sizes, d.totals, B)  # {name: (J, steps, B, ...)} or None
        xs = torch.cat([x for x, _ in data]).to(dev)
        ys = torch.cat([y for _, y in data]).to(dev)
        grad_fn = vmap(fits[0].grad) if fits[0].grad is not None else None
        # torch.optim's rule (the sequential driver's): a parameter the loss does not reach has no
        # gradient and is left alone, weight decay and momentum included; vmap gives it zeros
        first = next(i for i, t in enumerate(d.totals) if t)
        stack = self._stack(compiled_key, model, names, S, d.settings, fits[0].extras)
        code = StepCode(self._step_fn(model, fits[0].loss, d.settings, tuple(per_step or ()), d.padded), grad_fn,
                        tuple(stack.layout), stack.layout, d.settings, jobs[0].ctx.runtime.cfg.execution.precision,
                        d.padded, model)
        # (DP-SGD's steps run eagerly: their width, the stack's largest Poisson batch, is no fixed shape)
        compiled, built = (self._compiled_step(compiled_key, code) if compiled_key is not None and not d.dp
                           else (None, code))
        run = _StackRun(
            stack=stack, xs=xs, ys=ys, per_step=per_step,
            batch=torch.from_numpy(plan.rows).to(dev),  # every group's data rows, in one transfer
            index=torch.from_numpy(plan.index).to(dev),  # every group's (slots, jobs, steps), in one transfer
            drawn=None if plan.aug is None else {k: torch.from_numpy(v).to(dev) for k, v in plan.aug.items()},
            augmentation=jobs[0].ctx.augmentation,
            code=code, compiled=compiled,
            lr=None if compiled is None else torch.tensor(d.settings.lr, dtype=stack.all.params.dtype, device=dev),
            idle=None if d.dp or grad_fn is not None else stack.columns(
                self._unreached(jobs[0], model, fits[0], names, xs, ys, d.rows[first], per_step)),
            noise=[j.ctx.noise_generator() for j in jobs] if d.settings.dp_noise > 0 else None,  # DP-SGD
            loss_sum=torch.zeros(len(jobs), dtype=torch.float64, device=dev),
            seen=torch.zeros(len(jobs), dtype=torch.float64, device=dev))  # DP-SGD: samples drawn
        # the modules the steps run: this stack's, and the one the compiled step was built over,
        # another run's when runs are packed
        with _training(model, built.model):
            for s, groups in enumerate(plan.steps):
                for slot, i in plan.loads[s]:
                    stack.load(slot, fits[i])
                for g in groups:
                    run.step(g)
                for slot, i in plan.finishes[s]:
                    answers[i] = stack.unload(slot)

        losses = run.loss_sum.cpu().tolist()  # the stack's one wait for the device
        drawn_n = run.seen.cpu().tolist() if d.dp else []
        for i, j in enumerate(jobs):
            if d.totals[i] == 0:
                continue
            count = int(drawn_n[i]) if d.dp else sum(d.samples[i])
            try:
                stats = j.ctx.trained(TrainStats(loss=losses[i] / max(count, 1), steps=d.totals[i], samples=count),
                                      fits[i].report, d.private[i] if d.dp else None)
                answers[i] = Fitted(answers[i], stats)
            except NonFiniteLossError as e:
                answers[i] = e
        return answers

    def _stack(self, key: Optional[Signature], model: nn.Module, names: list[str], S: int, settings: TrainSettings,
               extras: Mapping[str, Any]) -> Stack:
        """A stack of ``S`` slots. With ``compile`` (``key``: the signature of the compiled step)
        a signature keeps its stack's tensors from one stack to the next of the same slot count
        (every slot is loaded before it steps, its optimizer state zeroed): a CUDA graph of the
        compiled step reads and updates them in place at fixed addresses (marked static for
        ``torch.compile``), and would be recorded again for every new address."""
        if key is None:
            return Stack(model, names, S, settings, extras, self.runtime.device)
        kept = self._stacks.get(key)
        if kept is None or kept.S != S:
            kept = self._stacks[key] = Stack(model, names, S, settings, extras, self.runtime.device)
            for t in kept.tensors():
                torch._dynamo.mark_static_address(t, guard=False)  # (no guard: a new stack is no new graph)
        return kept

    def _pads(self, job: _Job, model: nn.Module) -> bool:
        """Whether a stack pads its clients' short batches (``execution.pad_batches``): its
        method's loss is a mean over the batch's samples (not ``couples_samples``; the loss of
        a padded batch is then the weighted mean of its samples' losses, each a batch of one)
        and its model has no BatchNorm (whose statistics of a padded batch would not be the
        client's: such a stack steps once per batch size, as without padding). DP-SGD's
        batches are padded in any case (its own masked sum)."""
        return self.pad and not job.ctx.runtime.algorithm.couples_samples and not batch_coupled(model)

    def _slots(self, totals: list[int], model: nn.Module, B: int, data: list[tuple[torch.Tensor, torch.Tensor]],
               compiled_key: Optional[Signature], per_sample: bool = False) -> int:
        """The stack's slot count: ``execution.batch_clients``, else the fewest that finish in
        about the longest client's time, within what fits in memory. A compiled step serves
        one slot count, so with ``compile`` (``compiled_key``: the signature of the compiled
        step) a signature's stacks keep the most slots chosen so far, so that later rounds
        reuse it instead of compiling again for a count that moved."""
        if self.slots > 0:
            S = self.slots
        else:
            key = (id(model), B, per_sample)
            if key not in self._cap:
                sample = next(x for x, _ in data if len(x))
                self._cap[key] = slot_memory_cap(model, B, self.runtime.device, sample, per_sample)
            S = choose_slots(totals, self._cap[key])
        busy = sum(t > 0 for t in totals)  # at least 1: the caller returns early without work
        S = max(1, min(S, busy))
        if compiled_key is not None and self.slots == 0:
            self._compiled_slots[compiled_key] = S = max(S, self._compiled_slots.get(compiled_key, 0))
            S = min(S, busy)
        return S

    def _per_step(self, fits: list[Fit], sizes: list[list[int]], totals: list[int],
                  B: int) -> Optional[dict[str, torch.Tensor]]:
        """The clients' per-step extras (``step_extras``, given each step's batch size) as
        (J, steps, B, ...) tensors (zeros past a step's size)."""
        drawn = [f.step_extras(s) if f.step_extras is not None and t else None for f, s, t in zip(fits, sizes, totals)]
        first = next((d for d in drawn if d is not None), None)
        if first is None:
            return None
        dev, tmax = self.runtime.device, max(totals)
        out = {k: torch.zeros((len(fits), tmax, max(B, v.shape[1]), *v.shape[2:]), dtype=v.dtype, device=dev)
               for k, v in first.items()}
        for i, d in enumerate(drawn):
            for k, v in (d or {}).items():
                out[k][i, :v.shape[0], :v.shape[1]] = v.to(dev)
        return out

    def _step_fn(self, model: nn.Module, loss: LossFn, settings: TrainSettings, rows: tuple[str, ...] = (),
                 padded: bool = False) -> Callable[..., Any]:
        """The vmapped gradients and loss of every slot (:attr:`StepCode.fn`). With DP-SGD
        (``settings.dp_clip``) the gradients and losses of every sample of every slot,
        (G, b, ...) and (G, b) (``rows``: the per-step extras, one row per sample).
        ``padded``: each slot's loss is the weighted sum of its samples' losses
        (:func:`~protofl.engine.train.masked_mean`; the weights (G, b) an argument)."""
        objective = Objective(model, loss)

        def client_loss(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor],
                        buffers: dict[str, torch.Tensor], extras: Mapping[str, Any], x: torch.Tensor,
                        y: torch.Tensor) -> torch.Tensor:
            weights = {"model." + k: v for k, v in params.items()}
            weights.update({"model." + k: v for k, v in frozen.items()})
            weights.update({"model." + k: v for k, v in buffers.items()})
            return cast(torch.Tensor, functional_call(objective, weights, (x, y, extras)))  # the objective's loss

        if settings.dp_clip is not None:
            eager = vmap(per_sample(client_loss, rows))
        else:
            eager = vmap(masked_mean(client_loss, rows) if padded else grad_and_value(client_loss))
        return self._with_kernels(eager)

    def _with_kernels(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with its convolutions as ``execution.conv_as_matmul`` asks (:class:`StackKernels`)."""
        if self.stack_kernels == "off":
            return step_fn
        which = self.stack_kernels

        def with_kernels(*args: Any) -> Any:
            with StackKernels(which):
                return step_fn(*args)
        return with_kernels

    def _unreached(self, job: _Job, model: nn.Module, fit: Fit, names: list[str], xs: torch.Tensor,
                   ys: torch.Tensor, rows: np.ndarray, per_step: Optional[dict[str, torch.Tensor]]) -> frozenset[str]:
        """The trainable parameters this signature's loss does not reach (autograd gives them
        no gradient), found once per signature on a few rows of one client's first batch,
        with its weights and extras (a copy of the buffers: the module is not touched)."""
        key = self._signature(job)
        if key not in self._unreached_of:
            dev = self.runtime.device
            w = {k: v.to(dev) for k, v in fit.weights.items()}
            named = dict(model.named_parameters())
            params = {k: w[k].detach().clone().requires_grad_(True) for k in names}
            weights = {"model." + k: params.get(k, w[k]) for k in named}
            weights.update({"model." + k: w[k].clone() for k, _ in model.named_buffers()})
            idx = torch.from_numpy(rows[0][rows[0] >= 0][:2]).to(dev)  # (a padded row is -1)
            extras = _to(fit.extras, dev)
            if per_step is not None:
                extras.update({k: v[0, 0, :len(idx)] for k, v in per_step.items()})
            was = model.training
            model.train()
            try:
                with torch.enable_grad():
                    value = functional_call(Objective(model, fit.loss), weights, (xs[idx], ys[idx], extras))
                    grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)
            finally:
                model.train(was)
            self._unreached_of[key] = frozenset(k for k, g in zip(params, grads) if g is None)
        return self._unreached_of[key]

    def _compiled_step(self, key: Signature, code: StepCode) -> tuple[Callable[..., Any], StepCode]:
        """The whole step (:func:`stack_step`: forward, backward, the gradient transform,
        clipping and the optimizer update) compiled with ``torch.compile`` (with
        CUDA graphs on a GPU), once per signature less its learning rate, which the step reads
        as a tensor: every stack and round of the signature replays it. It is called only for
        steps of the whole stack at the full batch size, one fixed shape per stack, and the
        stack's other groups run eagerly. A padded stack's steps are all of that shape: its
        last steps, with slots no client waits for, step those slots on padding
        (``plan_stack``'s ``fill``). The first stack's ``code`` serves the later ones: their
        loss and gradient transform are the same functions of the same class and
        hyper-parameters (the signature), whose values come in through the arguments, and its
        module is put in training mode for every stack (``_fit``). Returns the compiled step
        and the code it was built over (``key``: its signature, :meth:`_signature` ``compiled``)."""
        if key not in self._compiled:
            mode = "reduce-overhead" if self.runtime.device.type == "cuda" else None
            self._compiled[key] = (torch.compile(functools.partial(stack_step, code), dynamic=False, mode=mode), code)
        return self._compiled[key]


@contextlib.contextmanager
def _training(*modules: nn.Module) -> Iterator[None]:
    """``modules`` in training mode (BatchNorm reads it), each set back as it was after."""
    modes = {id(m): (m, m.training) for m in modules}
    for m, _ in modes.values():
        m.train()
    try:
        yield
    finally:
        for m, was in modes.values():
            m.train(was)


def model_key(rt: ClientRuntime, cid: int) -> tuple[Any, ...]:
    """What makes two clients' models one architecture for a stack: the model and its kwargs,
    the task's shapes, the method that adapts it (class and hyper-parameters), the memory
    format and the training precision."""
    info = dataclasses.replace(rt.info, seed=0)
    return (rt.cfg.model.name, repr(sorted(rt.task.arch(cid).items())), info, type(rt.algorithm),
            repr(rt.algorithm.hp), rt.channels_last, rt.cfg.execution.precision)


def _function(f: object) -> object:
    """A loss or gradient transform by its function (a bound method by its ``__func__``)."""
    return getattr(f, "__func__", f)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of a nested dict of tensors, in order."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


def _to(tree: Mapping[str, Any], dev: torch.device) -> dict[str, Any]:
    """A nested dict of tensors on ``dev``."""
    return {k: (_to(v, dev) if isinstance(v, dict) else v.to(dev)) for k, v in tree.items()}


def _stack_like(tree: Mapping[str, Any], S: int, dev: torch.device) -> dict[str, Any]:
    return {k: (_stack_like(v, S, dev) if isinstance(v, dict)
                else torch.zeros((S, *v.shape), dtype=v.dtype, device=dev)) for k, v in tree.items()}


def _set_row(stacked: dict[str, Any], tree: Mapping[str, Any], k: int) -> None:
    for n, v in tree.items():
        if isinstance(v, dict):
            _set_row(stacked[n], v, k)
        else:
            stacked[n][k] = v


def _select(stacked: dict[str, Any], idx: torch.Tensor) -> dict[str, Any]:
    return {k: (_select(v, idx) if isinstance(v, dict) else v.index_select(0, idx)) for k, v in stacked.items()}
