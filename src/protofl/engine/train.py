"""The one local update, stated once: what both executors compute for a client's ``ctx.fit``.

* **settings** (:class:`TrainSettings`): the run's ``training.*`` for this round (the
  learning rate after its schedule, :func:`round_lr`), with a call's overrides;
* **schedule** (:func:`batch_rows`): E epochs (or ``training.steps``) of minibatches,
  each epoch a fresh permutation of the client's samples drawn from its own stream, the
  last batch of an epoch smaller when the batch size does not divide n_k;
* **step** (:func:`optimizer_state`, :func:`optimizer_step`): SGD with momentum, weight
  decay and gradient-norm clipping, or Adam / AdamW, on *rows*: every tensor is (S, ...),
  one row per client. The sequential executor steps one client (S = 1, the live model's
  parameters viewed as rows), the batched executor a stack of them (one flat row per
  client); the arithmetic is that of ``torch.optim.SGD`` and ``clip_grad_norm_``
  tensor for tensor, so the sequential executor's numbers are theirs bit for bit;
* **DP-SGD** (``privacy.mode: sample``, :func:`sample_gradients`): Poisson-sampled
  batches (:func:`poisson_rows`: each record joins each step with probability q = B / n~,
  n~ the client's released count), the gradient of each sample by ``torch.func``, clipped
  and noised by :func:`~protofl.nn.privacy.private_gradient` before the step and divided by
  B, the expected batch size; batches and noise drawn from the client's secret streams
  (the same draws in both executors);
* **features** (:func:`embed_batches`): the inference batches of ``ctx.features``.

**One training step** (:func:`train_step`, what :class:`StepCode` says it computes): the
gradients and losses of G slots, DP-SGD's clipping and noise, the gradient transform and
the optimizer update. Both executors take it: :func:`fit` (and :func:`private_fit`), the
sequential driver, with one slot, the live model's parameters as rows and plain autograd
(:func:`live_gradients`: no ``vmap``); the batched driver (``engine/batched.py``) with a
stack of slots, vmapped, on flat rows, and compiled whole under ``execution.compile``.
``precision="bf16"`` runs the loss (the forward pass) under bfloat16 autocast; backward
and the step stay float32 (:mod:`protofl.engine.precision`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional, Sequence, TYPE_CHECKING, Union, cast

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..algorithms.base import GradFn, LossFn, TrainStats
from ..nn.privacy import NoiseStream, private_gradient
from .augment import apply, Augment, augment_plan
from .precision import autocast

if TYPE_CHECKING:
    from ..config import TrainingConfig
    from ..models.base import FLModel

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
SCHEDULES = ("exponential", "cosine", "step")


# the summary statuses of a run stopped by a NaN/inf training loss and of one stopped at its
# privacy target: results of its config (protofl/run_folder.py), where "failed" is an error
# of the machine
from ..run_folder import DIVERGED as DIVERGED, STOPPED as STOPPED  # noqa: E402,F401 (re-exported)


class NonFiniteLossError(FloatingPointError):
    """Local training produced a NaN/inf loss; carries the round and client."""

    def __init__(self, rnd: int, cid: int, value: float) -> None:
        self.rnd, self.cid, self.value = rnd, cid, value
        super().__init__(f"non-finite training loss ({value}) in round {rnd} on client {cid}")

    # survives the trip back from a worker process
    def __reduce__(self) -> tuple[type[NonFiniteLossError], tuple[int, int, float]]:
        return (type(self), (self.rnd, self.cid, self.value))


# ---------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------
def round_lr(tc: TrainingConfig, rnd: int, rounds: int) -> float:
    """The learning rate of round ``rnd`` (1-based) of ``rounds`` under ``training.schedule``,
    as torch.optim.lr_scheduler's scheduler stepped once after each round (round r runs
    at the scheduler's epoch r - 1; ``tests/test_train_schedules.py`` checks every one
    against torch):

    * ``exponential``: lr * lr_decay^(rnd - 1) (ExponentialLR; lr_decay = 1: constant);
    * ``step``: lr * lr_decay^(number of ``milestones`` <= rnd) (MultiStepLR with the
      milestones m - 1: a milestone names the first round at the lower lr), or with
      ``step_size`` k: lr * lr_decay^floor((rnd - 1) / k) (StepLR);
    * ``cosine``: min_lr + (lr - min_lr) (1 + cos(pi (rnd - 1) / rounds)) / 2 (CosineAnnealingLR
      with T_max = rounds);
    * ``warmup_rounds`` w > 0: rounds 1..w at lr (f + (1 - f) (rnd - 1) / w), f =
      ``warmup_factor`` (LinearLR), then the schedule above from its start, over the
      rounds - w rounds left (SequentialLR with the milestone w).
    """
    w = tc.warmup_rounds
    if rnd <= w:
        return tc.lr * (tc.warmup_factor + (1.0 - tc.warmup_factor) * (rnd - 1) / w)
    rnd, rounds = rnd - w, rounds - w
    if tc.schedule == "exponential":
        return tc.lr * tc.lr_decay ** (rnd - 1)
    if tc.schedule == "step":
        if tc.step_size is not None:
            return tc.lr * tc.lr_decay ** ((rnd - 1) // tc.step_size)
        return tc.lr * tc.lr_decay ** sum(1 for m in tc.milestones if m <= rnd)
    if tc.schedule == "cosine":
        return tc.min_lr + (tc.lr - tc.min_lr) * (1.0 + math.cos(math.pi * (rnd - 1) / rounds)) / 2.0
    raise ValueError(f"unknown schedule {tc.schedule!r}; expected one of {SCHEDULES}")


@dataclass(frozen=True)
class TrainSettings:
    """The settings of one ``ctx.fit``: the run's ``training.*`` for this round, ``lr`` after
    the schedule, with the call's overrides (``epochs=10``, ``clip_grad=...``)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 32
    epochs: int = 1
    steps: Optional[int] = None
    clip_grad: Optional[float] = None
    optimizer: str = "sgd"
    betas: tuple[float, ...] = (0.9, 0.999)
    eps: float = 1e-8
    alpha: float = 0.99  # rmsprop
    # DP-SGD (privacy.mode: sample): each sample's gradient clipped to dp_clip, Gaussian
    # noise of std dp_noise * dp_clip on their sum, batches Poisson-sampled at rate
    # batch_size / dp_n (dp_n: the client's released sample count n~, which also sets the
    # number of steps); the run's, never a call's
    dp_clip: Optional[float] = None
    dp_noise: float = 0.0
    dp_n: Optional[int] = None

    @classmethod
    def of_round(cls, tc: TrainingConfig, rnd: int, rounds: int) -> "TrainSettings":
        return cls(lr=round_lr(tc, rnd, rounds), momentum=tc.momentum, weight_decay=tc.weight_decay,
                   batch_size=tc.batch_size, epochs=tc.epochs, steps=tc.steps, clip_grad=tc.clip_grad,
                   optimizer=tc.optimizer, betas=tuple(tc.betas), eps=tc.eps, alpha=tc.alpha)

    def with_overrides(self, overrides: Mapping[str, Any]) -> "TrainSettings":
        """These settings with ``overrides`` (an unknown key is a TypeError naming it)."""
        unknown = set(overrides) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown training setting(s): {sorted(unknown)}")
        private = sorted(k for k in overrides if k.startswith("dp_"))
        if private:  # a method must not train outside the run's privacy guarantee
            raise TypeError(f"training setting(s) {private} are the run's (privacy.*), not a call's")
        return replace(self, **overrides) if overrides else self

    @property
    def dp_rate(self) -> float:
        """DP-SGD's Poisson rate q = B / n~ (at most 1)."""
        return min(1.0, self.batch_size / max(int(self.dp_n or 1), 1))

    def dp_steps(self) -> int:
        """DP-SGD's steps: ``steps``, or ``epochs * ceil(n~ / B)``."""
        return total_steps(int(self.dp_n or 1), self.batch_size, self.epochs, self.steps)

    @property
    def step_size(self) -> float:
        """The steady-state step per unit gradient: lr / (1 - momentum) for SGD (heavy-ball SGD
        under a constant gradient g moves by lr g / (1 - momentum) per step), lr for Adam."""
        return self.lr / (1.0 - self.momentum) if self.optimizer == "sgd" else self.lr


# ---------------------------------------------------------------------------------------
# the schedule of minibatches, and the inference batches of ctx.features
# ---------------------------------------------------------------------------------------
def batch_coupled(model: nn.Module) -> bool:
    """Whether a training batch of one sample cannot reach ``model``: BatchNorm in training
    mode needs more than one value per channel (PyTorch raises on a batch of one)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def epoch_batches(n: int, batch_size: int, drop_single: bool = False) -> list[int]:
    """The minibatch sizes of one epoch over n samples, the last smaller when
    ``batch_size`` does not divide n. ``drop_single`` (a :func:`batch_coupled` model): a
    last batch of one sample is left out, so that sample sits out that epoch (the next
    epoch's permutation leaves out another); a client of one sample then takes no step."""
    sizes = [min(batch_size, n - i) for i in range(0, n, batch_size)]
    return sizes[:-1] if drop_single and sizes and sizes[-1] == 1 else sizes


def total_steps(n: int, batch_size: int, epochs: int, steps: Optional[int], drop_single: bool = False) -> int:
    """SGD steps of a client with n samples: ``steps``, or ``epochs`` times the batches of
    an epoch (:func:`epoch_batches`; ceil(n / batch_size) unless a batch of one is left out)."""
    per_epoch = len(epoch_batches(n, batch_size, drop_single))
    if per_epoch == 0:
        return 0
    return steps if steps is not None else epochs * per_epoch


def batch_sizes(n: int, batch_size: int, total: int, drop_single: bool = False) -> list[int]:
    """The minibatch size of each of ``total`` steps: epochs cut into batches
    (:func:`epoch_batches`)."""
    per_epoch = epoch_batches(n, batch_size, drop_single)
    return [per_epoch[s % len(per_epoch)] for s in range(total)] if per_epoch else []


def batch_rows(n: int, batch_size: int, total: int, generator: torch.Generator,
               drop_single: bool = False) -> np.ndarray:
    """The client-local sample indices of each step, (total, batch_size), padded with 0
    (step s uses its first ``batch_sizes(...)[s]``): a permutation per epoch begun, drawn
    from ``generator`` on the CPU (the same order on any device); ``drop_single``: an
    epoch's last batch of one sample is left out (:func:`epoch_batches`)."""
    rows = np.zeros((total, batch_size), dtype=np.int64)
    step = 0
    while step < total:
        perm = torch.randperm(n, generator=generator).numpy()
        for i in range(0, n, batch_size):
            if step == total:
                break
            b = perm[i:i + batch_size]
            if drop_single and len(b) == 1 and n > 1:
                continue
            rows[step, :len(b)] = b
            step += 1
    return rows


def poisson_rows(n: int, q: float, total: int, generator: NoiseStream) -> np.ndarray:
    """DP-SGD's batches: (total, P) client-local sample indices, -1 where a batch is
    shorter: each of the n samples joins each step's batch independently with probability
    ``q`` (Poisson sampling, the sampling the accountant assumes), drawn from ``generator``
    (the client's secret batch stream); P is the largest batch, at least 1."""
    draws = generator.uniform((total, n)).numpy() < q
    sizes = draws.sum(1)
    rows = np.full((total, max(1, int(sizes.max(initial=0)))), -1, dtype=np.int64)
    for s in range(total):
        idx = np.flatnonzero(draws[s])
        rows[s, :len(idx)] = idx
    return rows


# Inference batches of ctx.features. Cache-sized batches are the fastest on CPU: for
# fedavg_cnn, 256 samples take about half the CPU time per sample of 1024 (whose first
# activation, 1024 x 32 x 28 x 28 floats, is 100 MB).
EMBED_BLOCK = 1024
EMBED_BATCH_SIZE = 256


def embed_batches(n: int, batch: int = EMBED_BATCH_SIZE, block: int = EMBED_BLOCK) -> list[tuple[int, int]]:
    """(start, end) of the inference batches over n samples: each ``block`` (the last may be
    short) cut into pieces of ``batch``, the remainder joining the last piece.

    CPU GEMM kernels take a different path for a handful of rows (on x86 with 1-3 rows the
    result differs in the last bits from the same rows inside a bigger batch), so a sample's
    features depend on whether its batch is tiny. Subdividing the blocks without leaving a
    piece smaller than ``batch`` keeps each sample in a batch that is tiny exactly when its
    block was (the prototypes of FedProto, FedNH, MP-FedCL and ReBaFL are those of
    block-wise inference; tests/test_speed_invariance.py).
    """
    out = []
    for start in range(0, n, block):
        b = min(block, n - start)
        k = max(1, b // batch)
        out += [(start + j * batch, start + (b if j == k - 1 else (j + 1) * batch)) for j in range(k)]
    return out


# ---------------------------------------------------------------------------------------
# the optimizer step, on rows
# ---------------------------------------------------------------------------------------
def optimizer_state(s: TrainSettings, params: Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The zero state of ``s.optimizer`` for rows of parameters (each tensor (S, ...)):
    SGD's momentum buffers (none without momentum); Adam's first and second moments and
    each row's step count ``t`` (one (S,) float64 tensor); RMSprop's average of squared
    gradients (and momentum buffers); Adagrad's sum of squared gradients. A row is zeroed
    when a client enters it (:func:`reset_rows`), which is torch's initial state: its first
    momentum step, buf = d_p, is 0 * m + d_p; RMSprop and Adagrad start from zeros."""
    if s.optimizer == "sgd":
        return {"momentum": [torch.zeros_like(p) for p in params]} if s.momentum != 0 else {}
    if s.optimizer == "rmsprop":
        return {"square_avg": [torch.zeros_like(p) for p in params],
                **({"momentum": [torch.zeros_like(p) for p in params]} if s.momentum != 0 else {})}
    if s.optimizer == "adagrad":
        return {"sum": [torch.zeros_like(p) for p in params]}
    if s.optimizer in ("adam", "adamw"):
        rows = len(params[0]) if params else 0
        device = params[0].device if params else None
        return {"exp_avg": [torch.zeros_like(p) for p in params],
                "exp_avg_sq": [torch.zeros_like(p) for p in params],
                "t": [torch.zeros(rows, dtype=torch.float64, device=device)]}
    raise ValueError(f"unknown optimizer {s.optimizer!r}; expected one of {OPTIMIZERS}")


def reset_rows(state: Mapping[str, list[torch.Tensor]], row: Union[int, slice]) -> None:
    """Zero the optimizer state of ``row`` (an index, or a slice): a new client there."""
    for tensors in state.values():
        for t in tensors:
            t[row].zero_()


def _row_norms(g: torch.Tensor) -> torch.Tensor:
    """(S,) the L2 norm of each row of ``g`` (S, ...), summed in ``g``'s memory order (as the
    norm of the tensor itself is: a reshape would reorder a channels_last tensor's sum)."""
    norms: torch.Tensor = torch.linalg.vector_norm(g.unsqueeze(1) if g.dim() == 1 else g, 2.0,
                                                   dim=tuple(range(1, max(g.dim(), 2))))
    return norms


def _rows(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(S,) -> (S, 1, ..., 1), to scale the rows of ``like``."""
    return v.view(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def optimizer_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   state: Mapping[str, list[torch.Tensor]], s: TrainSettings,
                   lr: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """One step of every row, in place: ``params[i]`` and ``grads[i]`` are (S, ...) with
    one row per client, ``state`` from :func:`optimizer_state` for the same tensors.
    ``lr``: the learning rate as a 0-d tensor instead of ``s.lr`` (a compiled step reads it
    as an input, so that a rate that changes from round to round compiles nothing again;
    the same arithmetic, the rate multiplied in rather than passed as a scalar).
    Returns each row's gradient norm before clipping, (S,), with ``clip_grad`` (else None).

    1. clipping, per row: g <- g min(1, C / (||g|| + 1e-6)), the norm over all of the
       row's tensors, computed as ``clip_grad_norm_`` does (the norm of the per-tensor norms);
    2. SGD: g <- g + lambda p; m <- beta m + g (with momentum); p <- p - lr m, as
       ``torch.optim.SGD`` (dampening 0, no Nesterov);
       Adam: g <- g + lambda p (AdamW instead: p <- p (1 - lr lambda)); m1 <- lerp(m1, g,
       1 - beta1); m2 <- beta2 m2 + (1 - beta2) g^2; p <- p - lr / (1 - beta1^t)
       m1 / (sqrt(m2) / sqrt(1 - beta2^t) + eps), each row with its own t, as ``torch.optim.Adam(W)``;
       RMSprop: g <- g + lambda p; v <- alpha v + (1 - alpha) g^2; p <- p - lr g / (sqrt(v) + eps)
       (with momentum: b <- mu b + g / (sqrt(v) + eps); p <- p - lr b), as ``torch.optim.RMSprop``
       (not centered);
       Adagrad: g <- g + lambda p; s <- s + g^2; p <- p - lr g / (sqrt(s) + eps), as
       ``torch.optim.Adagrad`` (lr_decay 0, initial accumulator 0).
    """
    total = None
    rate = s.lr if lr is None else lr
    if s.clip_grad is not None:
        norms = torch.stack([_row_norms(g) for g in grads], dim=1)  # (S, tensors)
        total = torch.linalg.vector_norm(norms, 2.0, dim=1)  # (S,)
        coef = torch.clamp(s.clip_grad / (total + 1e-6), max=1.0)  # the expression clip_grad_norm_ evaluates
        grads = [g * _rows(coef, g) for g in grads]
    if s.optimizer == "sgd":
        momenta = state.get("momentum")
        for i, (p, g) in enumerate(zip(params, grads)):
            if s.weight_decay != 0:
                g = g.add(p, alpha=s.weight_decay)
            if momenta is not None:
                g = momenta[i].mul_(s.momentum).add_(g)
            _descend(p, g, rate)
        return total
    if s.optimizer in ("rmsprop", "adagrad"):
        acc = state["square_avg" if s.optimizer == "rmsprop" else "sum"]
        momenta = state.get("momentum")
        for i, (p, g) in enumerate(zip(params, grads)):
            if s.weight_decay != 0:
                g = g.add(p, alpha=s.weight_decay)
            if s.optimizer == "rmsprop":
                acc[i].mul_(s.alpha).addcmul_(g, g, value=1.0 - s.alpha)
            else:
                acc[i].addcmul_(g, g, value=1.0)
            denom = acc[i].sqrt().add_(s.eps)
            if momenta is not None:
                momenta[i].mul_(s.momentum).addcdiv_(g, denom)
                _descend(p, momenta[i], rate)
            else:
                _descend(p, g, rate, denom)
        return total
    beta1, beta2 = s.betas
    t = state["t"][0].add_(1.0)  # (S,)
    step_size = rate / (1.0 - beta1 ** t)  # (S,) float64
    root2 = torch.sqrt(1.0 - beta2 ** t)
    for i, (p, g) in enumerate(zip(params, grads)):
        if s.weight_decay != 0:
            if s.optimizer == "adamw":
                p.mul_(1.0 - rate * s.weight_decay)
            else:
                g = g.add(p, alpha=s.weight_decay)
        m1, m2 = state["exp_avg"][i], state["exp_avg_sq"][i]
        m1.lerp_(g, 1.0 - beta1)
        m2.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (m2.sqrt() / _rows(root2, m2).to(m2.dtype)).add_(s.eps)
        p.sub_(_rows(step_size, p).to(p.dtype) * (m1 / denom))
    return total


def _descend(p: torch.Tensor, d: torch.Tensor, lr: Union[float, torch.Tensor],
             denom: Optional[torch.Tensor] = None) -> None:
    """p <- p - lr d (d / denom with a denominator), in place; ``lr`` a float (torch's
    scalar form) or a 0-d tensor (:func:`optimizer_step`'s ``lr``)."""
    if isinstance(lr, torch.Tensor):
        p.sub_((d if denom is None else d / denom) * lr)
    elif denom is None:
        p.add_(d, alpha=-lr)
    else:
        p.addcdiv_(d, denom, value=-lr)


# ---------------------------------------------------------------------------------------
# per-sample gradients (DP-SGD)
# ---------------------------------------------------------------------------------------
def as_parts(model: nn.Module) -> "FLModel":
    """The model as a loss receives it (``LossFn``): the engine builds every model as an
    ``FLModel`` (body, head); a plain module (a test's) meets only losses that read no part."""
    return cast("FLModel", model)


class Objective(nn.Module):
    """``loss(model, x, y, extras)`` as a module, so that ``functional_call`` can swap in one
    client's parameters (under vmap: every client's) for the whole loss, sub-modules included."""

    def __init__(self, model: nn.Module, loss: LossFn) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x: torch.Tensor, y: torch.Tensor, extras: Mapping[str, Any]) -> torch.Tensor:
        return self.loss(as_parts(self.model), x, y, extras)


def _one_sample(fn: Callable[..., torch.Tensor], rows: Sequence[str]) -> Callable[..., torch.Tensor]:
    """``fn`` (a batch's loss) on one sample, as a batch of one: the extras named in ``rows``
    are per-sample rows, cut to the sample's, the others shared."""

    def one(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
            extras: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ex = {k: (v.unsqueeze(0) if k in rows else v) for k, v in extras.items()}
        return fn(params, frozen, buffers, ex, x.unsqueeze(0), y.unsqueeze(0))

    return one


def _over_samples(f: Callable[..., Any], rows: Sequence[str], extras: Mapping[str, Any]) -> Callable[..., Any]:
    """``f(params, frozen, buffers, extras, x, y)`` of one sample, mapped over a batch's samples
    (the extras in ``rows`` row by row, the others and the weights shared)."""
    dims = {k: (0 if k in rows else None) for k in extras}
    return vmap(f, in_dims=(None, None, None, dims, 0, 0), randomness="different")


def per_sample(fn: Callable[..., torch.Tensor], rows: Sequence[str] = ()) -> Callable[..., Any]:
    """``fn(params, frozen, buffers, extras, x, y)`` (a batch's loss) -> the gradient and the
    loss of each sample: (b, ...) per parameter and (b,). Each sample is a batch of one;
    the extras named in ``rows`` are per-sample rows (b, ...), the others shared."""
    one = _one_sample(fn, rows)

    def batch(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
              extras: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
        return _over_samples(grad_and_value(one), rows, extras)(params, frozen, buffers, extras, x, y)

    return batch


def masked_mean(fn: Callable[..., torch.Tensor], rows: Sequence[str] = ()) -> Callable[..., Any]:
    """``fn(params, frozen, buffers, extras, x, y)``, a batch's loss that is a mean over its
    samples (a method that does not declare ``couples_samples``) -> ``f(params, frozen,
    buffers, extras, x, y, w)``: the gradient (by parameter) and the value of sum_i w_i fn(sample i), each sample a
    batch of one (``rows``: per-sample extras). With ``w`` = 1/b on b rows and 0 on the rest
    (padding), that is fn on the b rows up to float rounding: a short batch padded to the
    stack's width trains as it would alone (the batched executor's steps of one shape)."""
    one = _one_sample(fn, rows)

    def weighted(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 extras: dict[str, Any], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        losses: torch.Tensor = _over_samples(one, rows, extras)(params, frozen, buffers, extras, x, y)
        return (losses * w).sum()

    return grad_and_value(weighted)


def sample_gradients(model: nn.Module, loss: LossFn, names: Sequence[str], x: torch.Tensor, y: torch.Tensor,
                     extras: Mapping[str, Any], rows: Sequence[str] = ()) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The gradient of ``loss`` for each sample of (x, y) with respect to the parameters
    ``names`` of the live ``model`` ((b, ...) each, in ``names`` order) and each sample's
    loss (b,)."""
    objective = Objective(model, loss)
    named = dict(model.named_parameters())
    params = {k: named[k].detach() for k in names}
    frozen = {k: p.detach() for k, p in named.items() if k not in params}
    buffers = dict(model.named_buffers())

    def batch_loss(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor],
                   buffers: dict[str, torch.Tensor], extras: dict[str, Any], x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
        weights = {"model." + k: v for part in (params, frozen, buffers) for k, v in part.items()}
        value: torch.Tensor = functional_call(objective, weights, (x, y, extras))
        return value

    grads, values = per_sample(batch_loss, rows)(params, frozen, buffers, dict(extras), x, y)
    return [grads[k] for k in names], values


# ---------------------------------------------------------------------------------------
# the training step: of one client (the sequential driver) or of a stack of them (the batched one)
# ---------------------------------------------------------------------------------------
Layout = Mapping[str, tuple[int, int, tuple[int, ...]]]  # name -> (start, end, shape) in a flat row


def flat_views(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The named parameters of rows of a flat (G, n) buffer, as views."""
    return {k: flat[:, i:j].view(flat.shape[0], *shape) for k, (i, j, shape) in layout.items()}


@dataclass(frozen=True)
class StepCode:
    """What :func:`train_step` computes, the same for every step of one client's fit (the
    sequential driver) or of every stack of a signature (the batched driver, whose compiled
    step is compiled over it once):

    * ``fn(views, frozen, buffers, step_extras, xb, yb[, w])``: the gradients by name, (G, ...)
      each, and the losses, (G,), of G slots; with DP-SGD those of every sample, (G, b, ...)
      and (G, b). One client's by autograd on the live model (:func:`live_gradients`; a
      parameter the loss does not reach: None), a stack's vmapped over its slots
      (``BatchedExecutor._step_fn``; the weights ``w`` an argument when ``padded``);
    * ``grad_fn(grads, extras, views)``: the gradient transform, on (G, ...) tensors;
    * ``layout``: where each of ``names`` lies in a flat (G, n) row (a stack), or None: the
      parameters are one (1, ...) row tensor each, in ``names`` order (the live model's);
    * the optimizer's settings (under ``compile`` the learning rate is an input of the step
      instead), the precision, and the module ``fn`` runs (BatchNorm reads its training flag).
    """

    fn: Callable[..., Any]
    grad_fn: Optional[Callable[..., dict[str, torch.Tensor]]]
    names: tuple[str, ...]
    layout: Optional[Layout]
    settings: TrainSettings
    precision: str
    padded: bool
    model: nn.Module

    def views(self, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The slots' parameters by name, (G, ...) views of ``params``."""
        return dict(zip(self.names, params)) if self.layout is None else flat_views(params[0], self.layout)


def train_step(code: StepCode, params: Sequence[torch.Tensor], state: Mapping[str, list[torch.Tensor]],
               frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], extras: Mapping[str, Any],
               step_extras: Mapping[str, Any], xb: torch.Tensor, yb: torch.Tensor, valid: Optional[torch.Tensor],
               live: Optional[torch.Tensor], idle: Optional[torch.Tensor], z: Optional[torch.Tensor],
               lr: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One optimizer step of G slots, in place on their ``params`` (:attr:`StepCode.layout`),
    their optimizer ``state`` and ``buffers``, on their minibatches ``xb`` (G, b, ...) and
    ``yb`` with ``step_extras`` (their extras with the step's rows; ``extras`` without them,
    as the gradient transform reads them). Returns the slots' losses, detached ((G,); with
    DP-SGD (G, b), per sample), with padding each slot's own batch size (G,) (else None),
    and with clipping each slot's gradient norm before it (G,) (else None). (The norms are
    returned, not only used, because torch 2.13's CPU code generator fails to compile them
    fused into the in-place momentum update they scale, a KeyError in its outer-loop fusion,
    unless they are an output of the graph.) Every argument is a tensor or a tree of
    tensors, so that the step, once compiled, serves every stack and every round of its
    signature:

    1. gradients and losses of the slots (``code.fn``, under the precision's autocast); with
       padding (``valid`` (G, b): which rows are samples), each slot's loss the mean over its
       own rows (weights 1/b on its b rows, 0 on the padding; ``live`` (G,): 0 for a free slot
       of a filled step, whose weights and loss are no client's);
    2. DP-SGD (``code.settings.dp_clip``): each sample's gradient clipped, their sum noised
       (``z`` (G, n): the clients' normal draws) and divided by the expected batch size
       (``valid``: which rows are samples; None: all);
    3. the gradient transform (SCAFFOLD's correction);
    4. the optimizer update (``lr``: the rate as a tensor, or None for the settings' own). A
       parameter the loss does not reach stays where it is, weight decay and momentum
       included, as ``torch.optim`` leaves a parameter without a gradient: a flat row's
       columns ``idle`` are put back after the update; a row tensor without a gradient is
       left out of it.
    """
    s, G = code.settings, xb.shape[0]
    views = code.views(params)  # the step's values (the gradient transform reads them too)
    counts = valid.sum(1) if code.padded and valid is not None else None  # each slot's own batch size
    with autocast(code.precision, xb.device.type):
        if valid is not None and counts is not None:  # (a free slot: no row, its weights 0)
            w = valid.to(params[0].dtype) / (counts if live is None else counts.clamp(min=1)).to(
                params[0].dtype).unsqueeze(1)
            grads, value = code.fn(views, frozen, buffers, step_extras, xb, yb, w)
        else:
            grads, value = code.fn(views, frozen, buffers, step_extras, xb, yb)
    if s.dp_clip is not None:  # DP-SGD: per-sample -> private (G, ...)
        grads = dict(zip(code.names, private_gradient([grads[k] for k in code.names], s.dp_clip, s.dp_noise, z,
                                                      mask=valid, batch=s.batch_size)))
    if code.grad_fn is not None:
        grads = code.grad_fn(grads, extras, views)
    if code.layout is not None:  # one flat row per slot
        flat = torch.cat([grads[k].reshape(G, -1) for k in code.names], dim=1)  # (G, n)
        kept = _columns(params[0], state, idle)
        norms = optimizer_step(params, [flat], state, s, lr)
        _restore(params[0], state, idle, kept)
    else:  # a row tensor per parameter: those with a gradient step
        moving = [i for i, k in enumerate(code.names) if grads[k] is not None]
        norms = optimizer_step([params[i] for i in moving], [grads[code.names[i]] for i in moving],
                               {k: [v[i] for i in moving] if k != "t" else v for k, v in state.items()}, s, lr)
    return value.detach(), counts, norms


def live_gradients(model: nn.Module, loss: LossFn, names: Sequence[str]) -> Callable[..., Any]:
    """:attr:`StepCode.fn` of one client on the live ``model``: the loss of its minibatch
    (``xb`` (1, b, ...)) and the gradients of the parameters ``names`` by autograd, plain ops
    (no ``vmap``), each (1, ...), None for a parameter the loss does not reach. The backward
    pass runs outside autocast (the precision's autocast covers the forward)."""
    named = dict(model.named_parameters())
    params = [named[k] for k in names]

    def fn(views: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
           extras: Mapping[str, Any], xb: torch.Tensor, yb: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        value = loss(as_parts(model), xb[0], yb[0], extras)
        for p in params:
            p.grad = None
        if torch.is_autocast_enabled(xb.device.type):
            with torch.autocast(xb.device.type, enabled=False):
                value.backward()
        else:
            value.backward()
        grads = {k: None if p.grad is None else p.grad.unsqueeze(0) for k, p in zip(names, params)}
        return grads, value.detach().unsqueeze(0)

    return fn


def live_sample_gradients(model: nn.Module, loss: LossFn, names: Sequence[str]) -> Callable[..., Any]:
    """:attr:`StepCode.fn` of one client under DP-SGD: the gradient and the loss of each
    sample of its minibatch (``xb`` (1, b, ...)) by :func:`sample_gradients`, (1, b, ...)
    and (1, b); a step that sampled nobody (b = 0) has empty ones."""
    named = dict(model.named_parameters())

    def fn(views: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
           extras: Mapping[str, Any], xb: torch.Tensor, yb: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        if xb.shape[1] == 0:
            return ({k: torch.zeros((1, 0, *named[k].shape), dtype=named[k].dtype, device=named[k].device)
                     for k in names}, torch.zeros((1, 0), device=xb.device))
        per, value = sample_gradients(model, loss, names, xb[0], yb[0], extras)
        return {k: g.unsqueeze(0) for k, g in zip(names, per)}, value.unsqueeze(0)

    return fn


def one_client(grad: GradFn, values: dict[str, torch.Tensor]) -> Callable[..., dict[str, torch.Tensor]]:
    """A method's gradient transform of one client (``grad(grads, extras, values)`` on the
    parameters' own shapes) as :attr:`StepCode.grad_fn`, on (1, ...) rows; a parameter the
    loss does not reach comes to it as zeros. ``values``: the parameters it reads, detached
    views of the live ones (the step moves them in place: they stay current)."""

    def fn(grads: Mapping[str, Optional[torch.Tensor]], extras: Mapping[str, Any],
           views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        new = grad({k: torch.zeros_like(values[k]) if g is None else g[0] for k, g in grads.items()}, extras, values)
        return {k: new[k].unsqueeze(0) for k in grads}

    return fn


def _columns(params: torch.Tensor, state: Mapping[str, list[torch.Tensor]],
             cols: Optional[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """Copies of the columns ``cols`` of flat parameters (G, n) and their optimizer state
    (the (G, n) tensors; Adam's per-row step count is not per column), to :func:`_restore`."""
    if cols is None:
        return None
    return [t.index_select(1, cols) for t in _flat_tensors(params, state)]


def _flat_tensors(params: torch.Tensor, state: Mapping[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Flat parameters (G, n) and those of their optimizer state's tensors that are (G, n)."""
    n = params.shape[1]
    return [t for t in [params] + [s for ts in state.values() for s in ts] if t.dim() == 2 and t.shape[1] == n]


def _restore(params: torch.Tensor, state: Mapping[str, list[torch.Tensor]], cols: Optional[torch.Tensor],
             kept: Optional[list[torch.Tensor]]) -> None:
    """Put back the columns :func:`_columns` copied: those parameters did not move."""
    if cols is None:
        return
    assert kept is not None  # _columns copied them
    for t, old in zip(_flat_tensors(params, state), kept):
        t.index_copy_(1, cols, old)


# ---------------------------------------------------------------------------------------
# the sequential driver (and DP-SGD's)
# ---------------------------------------------------------------------------------------
def minibatch(x: torch.Tensor, y: torch.Tensor, rows: np.ndarray, step: int, b: int,
              plan: Optional[dict[str, np.ndarray]], augment: Optional[tuple[Augment, torch.Generator, torch.Tensor]],
              channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s minibatch: the first ``b`` of its ``rows``, augmented by ``plan`` (the
    draws of :func:`~protofl.engine.augment.augment_plan`), in channels_last if asked."""
    idx = torch.from_numpy(rows[step, :b]).to(y.device)
    xb, yb = x[idx], y[idx]
    if plan is not None:
        assert augment is not None  # a plan is drawn for an augmentation only (fit, private_fit)
        xb = apply(augment[0], xb, torch.from_numpy(plan["offsets"][step, :b]).to(x.device),
                   torch.from_numpy(plan["flips"][step, :b]).to(x.device), augment[2])
    if channels_last and xb.dim() == 4:
        xb = xb.contiguous(memory_format=torch.channels_last)
    return xb, yb


def fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, loss: LossFn, extras: Mapping[str, Any],
        names: Sequence[str], settings: TrainSettings, generator: Union[torch.Generator, NoiseStream],
        per_step: Optional[Mapping[str, torch.Tensor]] = None, grad: Optional[GradFn] = None,
        channels_last: bool = False, precision: str = "fp32",
        augment: Optional[tuple[Augment, torch.Generator, torch.Tensor]] = None,
        noise: Optional[NoiseStream] = None) -> TrainStats:
    """Local training of the live ``model`` on (x, y), in place: the parameters ``names``
    move, by the schedule and the step above, on ``loss(model, xb, yb, extras)``.

    ``per_step``: tensors (steps, max batch, ...) whose row of a step, cut to its batch
    size, joins ``extras`` at that step. ``grad(grads, extras, params)``: a transform of the
    minibatch gradients by name (``params``: the parameters' current values), before
    clipping; without one, a parameter the loss does not reach has no gradient and is
    left alone for that step, as ``torch.optim`` does.
    ``augment``: (the augmentation, the client's augmentation stream, the padding value):
    each minibatch is augmented by its plan (engine/augment.py).
    DP-SGD (``settings.dp_clip``): :func:`private_fit`; ``generator`` is then the client's
    secret batch stream (a :class:`~protofl.nn.privacy.NoiseStream`).
    """
    if settings.dp_clip is not None:
        return private_fit(model, x, y, loss=loss, extras=extras, names=names, settings=settings,
                           generator=cast(NoiseStream, generator), grad=grad, channels_last=channels_last,
                           precision=precision, augment=augment, noise=noise)
    named = dict(model.named_parameters())
    params = [named[k] for k in names]
    n = len(y)
    drop = batch_coupled(model)
    total = total_steps(n, settings.batch_size, settings.epochs, settings.steps, drop)
    if total == 0 or not params:
        return TrainStats(loss=0.0, steps=0, samples=0)
    rows = batch_rows(n, settings.batch_size, total, cast(torch.Generator, generator), drop)  # no DP-SGD: torch's
    sizes = batch_sizes(n, settings.batch_size, total, drop)
    plan = augment_plan(augment[0], total, settings.batch_size, augment[1]) if augment else None
    values = {k: p.detach() for k, p in zip(names, params)}  # views: the step moves them in place
    as_rows = [v.unsqueeze(0) for v in values.values()]  # the live parameters as one row each
    code = StepCode(live_gradients(model, loss, names), None if grad is None else one_client(grad, values),
                    tuple(names), None, settings, precision, False, model)
    state = optimizer_state(settings, as_rows)
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=y.device)  # no host sync per step
    for step, b in enumerate(sizes):
        xb, yb = minibatch(x, y, rows, step, b, plan, augment, channels_last)
        ex = extras if per_step is None else {**extras, **{k: v[step, :b] for k, v in per_step.items()}}
        value, _, _ = train_step(code, as_rows, state, {}, {}, extras, ex, xb.unsqueeze(0), yb.unsqueeze(0),
                                 valid=None, live=None, idle=None, z=None, lr=None)
        loss_sum += value[0] * b
    for p in params:
        p.grad = None
    return TrainStats(loss=float(loss_sum) / sum(sizes), steps=total, samples=sum(sizes))


def private_fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, loss: LossFn, extras: Mapping[str, Any],
                names: Sequence[str], settings: TrainSettings, generator: NoiseStream,
                grad: Optional[GradFn] = None, channels_last: bool = False, precision: str = "fp32",
                augment: Optional[tuple[Augment, torch.Generator, torch.Tensor]] = None,
                noise: Optional[NoiseStream] = None) -> TrainStats:
    """DP-SGD (Abadi et al., CCS 2016, Algorithm 1) of the live ``model`` on (x, y), in place.

    ``settings.dp_steps()`` steps, each on a Poisson sample of rate ``settings.dp_rate``
    (:func:`poisson_rows` from ``generator``, the client's secret batch stream; a step may
    have no sample): each sample's gradient (:func:`sample_gradients`) clipped to
    ``dp_clip``, their sum plus N(0, (dp_noise dp_clip)^2 I) (one draw from ``noise``, the
    client's secret stream, per step) divided by the expected batch size B
    (:func:`~protofl.nn.privacy.private_gradient`), then ``grad`` (a transform of the
    private gradient: post-processing) and the run's optimizer step. A sample whose
    gradient is not finite counts as a zero gradient (its contribution stays bounded).
    """
    named = dict(model.named_parameters())
    params = [named[k] for k in names]
    total = settings.dp_steps()
    if total == 0 or not params:
        return TrainStats(loss=0.0, steps=0, samples=0)
    rows = poisson_rows(len(y), settings.dp_rate, total, generator)
    plan = augment_plan(augment[0], total, rows.shape[1], augment[1]) if augment else None
    values = {k: p.detach() for k, p in zip(names, params)}
    as_rows = [v.unsqueeze(0) for v in values.values()]
    code = StepCode(live_sample_gradients(model, loss, names), None if grad is None else one_client(grad, values),
                    tuple(names), None, settings, precision, False, model)
    state = optimizer_state(settings, as_rows)
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=y.device)
    seen = 0
    n_params = sum(p.numel() for p in params)  # the length of each step's noise draw
    for step in range(total):
        b = int((rows[step] >= 0).sum())  # nobody sampled (b = 0): the step is the noise alone
        xb, yb = minibatch(x, y, rows, step, b, plan, augment, channels_last) if b else (x[:0], y[:0])
        z = (cast(NoiseStream, noise).normal((n_params,)).to(y.device).unsqueeze(0) if settings.dp_noise > 0
             else None)
        value, _, _ = train_step(code, as_rows, state, {}, {}, extras, extras, xb.unsqueeze(0), yb.unsqueeze(0),
                                 valid=None, live=None, idle=None, z=z, lr=None)
        loss_sum += value.double().sum()
        seen += b
    return TrainStats(loss=float(loss_sum) / max(seen, 1), steps=total, samples=seen)
