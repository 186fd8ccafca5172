"""The batched client executor: a round's clients trained together, in one set of kernels.

On a GPU, the models of these papers are far too small to keep it busy one client at a
time. When every sampled client runs the same architecture and the method restates its
local update as a :class:`~protofl.algorithms.base.BatchPlan` (a pure per-client loss),
this executor stacks the K clients' parameters along a new leading dimension and takes
each SGD step for all of them at once with ``torch.func.vmap`` over
``functional_call``: one forward/backward per step for the whole stack (a convolution
becomes one grouped convolution, a linear layer one batched matmul).

It computes what :func:`~protofl.engine.train.local_train` computes, client by client:

* data order: client k draws its per-epoch permutations from its own stream
  (``ctx.generator``, the same one the sequential loop uses), so it sees the same batches
  in the same order;
* batch count: client k takes ``epochs * ceil(n_k / B)`` steps (or ``training.steps``); a
  client that has taken all its steps stops -- it leaves the stack, its parameters and
  momentum no longer change;
* the last batch of an epoch is smaller: at each step the active clients are grouped by
  their batch size and each group runs as one stack (so BatchNorm statistics and the
  mean of the loss are exactly those of that client's batch, no padding);
* optimizer: SGD with momentum, weight decay and gradient clipping written out as
  ``torch.optim.SGD`` and ``clip_grad_norm_`` compute them, with one momentum buffer per
  client.

Results equal the sequential executor's up to float rounding (batched kernels sum in a
different order). Models with dropout are not batched (their masks could not match the
sequential run's), nor are methods without a ``batch_plan``, heterogeneous
architectures or a round whose clients were given per-call training overrides: those
rounds run on the sequential executor, and the run log says so once.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

import numpy as np
import torch
from torch import nn

from ..algorithms.base import BatchPlan
from ..messages import Record
from .client import ClientContext, ClientOutput, ClientRuntime
from .executor import ClientTask, SequentialExecutor
from .rng import seed_for
from .train import NonFiniteLossError, TrainStats

log = logging.getLogger("protofl")

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def why_not_batched(runtime: ClientRuntime) -> Optional[str]:
    """Why this run's clients cannot be trained as one stack, or None when they can."""
    algo, cfg = runtime.algorithm, runtime.cfg
    if not algo.batchable():
        return f"method {algo.name!r} has no batched form of its local update"
    if cfg.model.per_client:
        return "clients have different architectures (model.per_client)"
    model = runtime.models.get(dict(cfg.model.params))
    if any(isinstance(m, _RANDOM) for m in model.modules()):
        return f"model {cfg.model.name!r} has dropout (its masks would differ from a sequential run)"
    return None


class BatchedExecutor:
    """Trains the clients of a round as stacks of at most ``chunk`` clients (0 = all)."""

    def __init__(self, runtime: ClientRuntime, chunk: int = 0, threads: int = 0) -> None:
        self.runtime = runtime
        self.chunk = chunk
        self.sequential = SequentialExecutor(runtime, threads)
        self.reason = why_not_batched(runtime)
        self._noted = False

    def describe(self) -> dict:
        return {"executor": "batched" if self.reason is None else "sequential",
                **({} if self.reason is None else {"executor_note": self.reason})}

    def _note(self, reason: str) -> None:
        if not self._noted:
            log.info("protofl: batched executor not used (%s); clients run one after another", reason)
            self._noted = True

    def run(self, tasks: list[ClientTask]) -> list[ClientOutput]:
        if self.reason is not None:
            self._note(self.reason)
            return self.sequential.run(tasks)
        size = self.chunk if self.chunk > 0 else max(1, len(tasks))
        out: list[ClientOutput] = []
        for i in range(0, len(tasks), size):
            out += self._run_stack(tasks[i:i + size])
        return out

    def close(self) -> None:
        self.sequential.close()

    # -- one stack of clients ------------------------------------------------------------------
    def _run_stack(self, tasks: list[ClientTask]) -> list[ClientOutput]:
        rt, algo = self.runtime, self.runtime.algorithm
        t0 = time.perf_counter()
        ctxs, plans = [], []
        for t in tasks:
            torch.manual_seed(seed_for(rt.info.seed, "torch", t.rnd, t.cid))
            ctx = ClientContext(rt, t.cid, t.rnd)
            msg = t.msg if rt.device.type == "cpu" else t.msg.to(rt.device)
            plan = algo.batch_plan(msg, ctx)
            if plan is None:  # the method declined for this client: the whole stack runs sequentially
                self._note(f"method {algo.name!r} gave no batched plan for client {t.cid}")
                return self.sequential.run(tasks)
            ctxs.append((ctx, msg))
            plans.append(plan)
        stats = train_stack(rt, [c for c, _ in ctxs], plans)
        t_each = (time.perf_counter() - t0) / max(1, len(tasks))
        outputs = []
        for t, (ctx, msg), (weights, st) in zip(tasks, ctxs, stats):
            t1 = time.perf_counter() - t_each  # each client is charged an equal share of the stack
            torch.manual_seed(seed_for(rt.info.seed, "torch", t.rnd, t.cid))
            if st.samples and not math.isfinite(st.loss):
                e = NonFiniteLossError(t.rnd, t.cid, st.loss)
                if rt.cfg.training.on_nonfinite == "stop":
                    raise e
                outputs.append(ClientOutput(reply=Record(), state=None, rejected=str(e)))
                continue
            ctx.last_train = st
            model = ctx.model(weights)
            result = algo.batch_result(msg, ctx, model)
            outputs.append(rt.finish(ctx, result, t.evaluate, t.full_test, t1))
        return outputs


def _schedule(n: int, batch: int, total: int, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Client-local row order and batch sizes of ``local_train``'s loop: ``rows`` (total, batch)
    (padded with 0) and ``sizes`` (total,), drawing the per-epoch permutations from ``gen``."""
    per_epoch = math.ceil(n / batch)
    epochs = math.ceil(total / per_epoch)
    rows = np.zeros((total, batch), dtype=np.int64)
    sizes = np.zeros(total, dtype=np.int64)
    step = 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen).numpy()
        for i in range(0, n, batch):
            if step == total:
                break
            b = perm[i:i + batch]
            rows[step, :len(b)] = b
            sizes[step] = len(b)
            step += 1
    return rows, sizes


def _stack(dicts: list[dict[str, torch.Tensor]], keys) -> dict[str, torch.Tensor]:
    return {k: torch.stack([d[k] for d in dicts]) for k in keys}


def train_stack(rt: ClientRuntime, ctxs: list[ClientContext], plans: list[BatchPlan]
                ) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
    """Train every client's plan as ``ctx.train`` would, all of them in one stack.

    Returns, per client, its final weights (a state dict) and its training statistics.
    """
    from torch.func import functional_call, grad_and_value, vmap

    tc = rt.cfg.training
    dev = rt.device
    K = len(ctxs)
    model = ctxs[0].model(plans[0].weights)
    model.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
    buffer_names = [n for n, _ in model.named_buffers()]
    weights = [p.weights for p in plans]
    P = _stack(weights, names)  # trainable (K, ...)
    frozen = _stack(weights, frozen_names)
    B_ = _stack(weights, buffer_names)
    X = _stack([p.extras for p in plans], plans[0].extras.keys())
    P = {k: v.to(dev) for k, v in P.items()}
    frozen = {k: v.to(dev) for k, v in frozen.items()}
    B_ = {k: v.to(dev).clone() for k, v in B_.items()}
    X = {k: v.to(dev) for k, v in X.items()}
    loss_fn = plans[0].loss

    # each client's data, concatenated; its batches as row indices into it
    data = [c.data for c in ctxs]
    sizes_n = [len(y) for _, y in data]
    offsets = np.concatenate([[0], np.cumsum(sizes_n)[:-1]]).astype(np.int64)
    xs = torch.cat([x for x, _ in data]) if K else None
    ys = torch.cat([y for _, y in data]) if K else None
    bs = tc.batch_size
    totals = [0 if n == 0 else (tc.steps if tc.steps is not None else tc.epochs * math.ceil(n / bs))
              for n in sizes_n]
    S = max(totals) if totals else 0
    rows = np.zeros((K, max(S, 1), bs), dtype=np.int64)
    bsz = np.zeros((K, max(S, 1)), dtype=np.int64)
    for k, (c, n) in enumerate(zip(ctxs, sizes_n)):
        if totals[k]:
            r, s = _schedule(n, bs, totals[k], c.generator)
            rows[k, :totals[k]] = r + offsets[k]
            bsz[k, :totals[k]] = s
    rows_dev = torch.from_numpy(rows).to(dev)  # one transfer per round, sliced on the device below

    # the groups of each step (active clients with the same batch size), worked out here and
    # sent to the device in one transfer: the loop below never waits on a host copy
    totals_np = np.asarray(totals, dtype=np.int64)
    plan: list[list[tuple[int, int, int, bool]]] = []  # per step: (batch size, start, end, whole)
    members: list[np.ndarray] = []
    pos = 0
    for s in range(S):
        act = np.flatnonzero(totals_np > s)
        sz = bsz[act, s]
        steps = []
        for b in np.unique(sz)[::-1]:  # the full batch size first
            group = act[sz == b]
            members.append(group)
            steps.append((int(b), pos, pos + len(group), len(group) == K))
            pos += len(group)
        plan.append(steps)
    members_dev = torch.from_numpy(np.concatenate(members) if members else np.zeros(0, np.int64)).to(dev)

    lr = ctxs[0].lr() if ctxs else 0.0
    mom, wd, clip = tc.momentum, tc.weight_decay, tc.clip_grad
    Mbuf: Optional[dict[str, torch.Tensor]] = None  # momentum buffers (K, ...), created at step 0
    loss_sum = torch.zeros(K, dtype=torch.float64, device=dev)

    def client_loss(p, frozen, buffers, extras, x, y):
        def forward(inp):
            return functional_call(model, {**p, **frozen, **buffers}, (inp,))

        return loss_fn(forward, p, x, y, extras)

    step_fn = vmap(grad_and_value(client_loss), in_dims=(0, 0, 0, 0, 0, 0))

    for s in range(S):
        for b, start, end, whole in plan[s]:
            g = members_dev[start:end]  # the group's client indices, already on the device

            def pick(d):
                return d if whole else {k: v.index_select(0, g) for k, v in d.items()}

            p, fz, bf, ex = pick(P), pick(frozen), pick(B_), pick(X)
            idx = rows_dev[g, s, :b]  # (G, b)
            xb, yb = xs[idx], ys[idx]
            grads, value = step_fn(p, fz, bf, ex, xb, yb)
            if clip is not None:  # clip_grad_norm_ per client
                norms = torch.stack([grads[k].flatten(1).norm(2, dim=1) for k in names], dim=1)
                total = norms.norm(2, dim=1)
                coef = (clip / (total + 1e-6)).clamp(max=1.0)
                grads = {k: v * coef.view(-1, *[1] * (v.dim() - 1)) for k, v in grads.items()}
            new_p, new_m = {}, {}
            for k in names:
                d_p = grads[k]
                if wd != 0:
                    d_p = d_p.add(p[k], alpha=wd)
                if mom != 0:
                    if Mbuf is None:  # first step of every client: buf = d_p (torch.optim.SGD)
                        buf = d_p.clone()
                    else:
                        buf = (Mbuf[k] if whole else Mbuf[k].index_select(0, g)).mul(mom).add(d_p)
                    new_m[k] = buf
                    d_p = buf
                new_p[k] = p[k].add(d_p, alpha=-lr)
            if whole:
                P = new_p
                B_ = bf
                if mom != 0:
                    Mbuf = new_m
            else:
                for k in names:
                    P[k].index_copy_(0, g, new_p[k])
                for k in buffer_names:
                    B_[k].index_copy_(0, g, bf[k])
                if mom != 0:
                    if Mbuf is None:
                        Mbuf = {k: torch.zeros_like(P[k]) for k in names}
                    for k in names:
                        Mbuf[k].index_copy_(0, g, new_m[k])
            loss_sum.index_add_(0, g, (value.detach() * b).to(torch.float64))
        if s == 0 and mom != 0 and Mbuf is None:  # pragma: no cover - every client steps at s=0
            Mbuf = {k: torch.zeros_like(P[k]) for k in names}

    seen = [int(bsz[k, :totals[k]].sum()) for k in range(K)]
    losses = loss_sum.cpu().tolist()
    out = []
    for k in range(K):
        w = {n: P[n][k] for n in names}
        w.update({n: frozen[n][k] for n in frozen_names})
        w.update({n: B_[n][k] for n in buffer_names})
        st = TrainStats(loss=losses[k] / seen[k] if seen[k] else 0.0, steps=totals[k], samples=seen[k])
        out.append((w, st))
    return out
