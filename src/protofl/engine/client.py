"""The client side of the engine: what a client process needs besides a message.

A :class:`ClientRuntime` lives once per process (the simulator, each pool worker, each
Flower SuperNode). For one (round, client) it builds a :class:`ClientContext` -- the
client's data, its model, the training recipe and its random streams -- runs the method's
``client_update`` and evaluates the personalized model it returns.

``client_update`` is a coroutine (``algorithms/base.py``): here it is driven for one
client, each request it awaits (``ctx.fit``, ``ctx.features``) run at once by
:meth:`ClientContext.execute`; the batched executor drives many at a time.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Coroutine, Mapping, Optional, overload, Sequence, Union

import numpy as np
import torch
from torch import nn

from ..algorithms.base import (Algorithm, ClientResult, Features, Fit, Fitted, GradFn, LossFn, TrainStats,
                               cross_entropy, weights_of)
from ..messages import Record
from ..nn.privacy import NoiseStream
from ..rng import seed_for, torch_gen
from .augment import Augment, pad_value
from .evaluate import personal_metrics
from .privacy import ClientPrivacy
from .task import Task, use_channels_last
from .train import EMBED_BATCH_SIZE, NonFiniteLossError, TrainSettings, batch_coupled, batch_sizes, embed_batches, \
    fit, total_steps


@dataclass
class ClientTask:
    """One client's turn in a round: the round's broadcast ``shared`` (the same object for
    every client of the round), what the client alone receives (``own``), its stored state
    and whether its personalized model is evaluated (``full_test``: on the full test set too)."""

    cid: int
    rnd: int
    shared: Record
    own: Optional[Record]
    state: Optional[Record]
    evaluate: bool
    full_test: bool = True
    # under privacy.noise: secret, the client's noise key in a simulation (the server
    # derives it from its own); never part of a message: a Flower node keeps its own
    noise_key: Optional[bytes] = field(default=None, repr=False)

    @property
    def msg(self) -> Record:
        """The message the client receives: the broadcast with its own part."""
        return self.shared.merged(self.own)


@dataclass
class ClientOutput:
    reply: Record
    state: Optional[Record]
    eval: dict[str, float] = field(default_factory=dict)  # personalized-model metrics
    train: dict[str, float] = field(default_factory=dict)  # loss, steps, samples, seconds
    rejected: Optional[str] = None  # why the client itself withdrew its reply (on_nonfinite: drop)


@dataclass
class Transfers:
    """What the engine handed to the training device: records (messages and client states)
    and their bytes. On a GPU each of those bytes is a host-to-device copy unless the
    tensor is there already; on the CPU nothing moves, but the calls count the same."""

    records: int = 0
    bytes: int = 0
    copied: int = 0  # of those bytes, the ones that were not on the device yet


class ClientContext:
    """What ``client_update`` may use. Everything is local to this (round, client); facts
    are properties, what takes arguments or makes something is a method."""

    def __init__(self, runtime: "ClientRuntime", cid: int, rnd: int, evaluating: bool = False) -> None:
        self.runtime = runtime
        self.cid = cid
        self.rnd = rnd
        # whether the engine evaluates this client's personalized model after the update
        # (methods whose personalized model costs extra work, e.g. fine-tuning, do it only then)
        self.evaluating = evaluating
        self.info = runtime.info
        self.num_classes = runtime.info.num_classes
        self.generator = torch_gen(runtime.info.seed, "train", rnd, cid)
        self._augment_generator: Optional[torch.Generator] = None
        self.last_train: Optional[TrainStats] = None
        # privacy.* for this turn (None without privacy.mode): noise streams and what it spends
        self.privacy: Optional[ClientPrivacy] = None
        self._data: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._arch = runtime.task.arch(cid)

    # -- facts -----------------------------------------------------------------------------
    @property
    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): the client's normalized training data on the device."""
        if self._data is None:
            self._data = self.runtime.client_train_data(self.cid, self.rnd)
        return self._data

    @property
    def num_samples(self) -> int:
        """n_k, the client's training samples; under ``privacy.mode: sample`` n~_k, the sum of
        its released label counts (:attr:`class_counts`)."""
        if self.dp_sgd:
            return self.released_n
        return len(self.runtime.fed.train_idx[self.cid])

    @property
    def class_counts(self) -> torch.Tensor:
        """(C,) int64 training label counts of this client; under ``privacy.mode: sample`` its
        one private release of them (engine/privacy.py), so that a loss reading them (FedRS,
        FedLC, ...) reads what the client's ledger accounts for."""
        if self.dp_sgd:
            assert self.privacy is not None  # dp_sgd: privacy.mode is sample
            return torch.from_numpy(self.privacy.label_counts(self.runtime.counts[self.cid]).copy())
        return torch.from_numpy(self.runtime.counts[self.cid].copy())

    @property
    def dp_sgd(self) -> bool:
        """Whether this turn's training is DP-SGD (``privacy.mode: sample``)."""
        return self.privacy is not None and self.privacy.mode == "sample"

    @property
    def released_n(self) -> int:
        """Under ``privacy.mode: sample``: n~_k, the sum of the released label counts (at least
        1): DP-SGD's Poisson rate and step count read it, never n_k."""
        from .privacy import released_size

        assert self.privacy is not None  # read under DP-SGD only (dp_sgd)
        return released_size(self.privacy.label_counts(self.runtime.counts[self.cid]))

    @property
    def batch_generator(self) -> Union[torch.Generator, NoiseStream]:
        """The stream of this turn's minibatches: ``generator``, or under DP-SGD the client's
        secret Poisson-sampling stream."""
        if self.dp_sgd:
            assert self.privacy is not None  # dp_sgd: privacy.mode is sample
            return self.privacy.batch_generator()
        return self.generator

    @property
    def lr(self) -> float:
        """This round's learning rate (``training.lr`` after ``training.schedule``)."""
        return self.runtime.settings(self.rnd).lr

    @property
    def step_size(self) -> float:
        """The steady-state step of the local optimizer per unit gradient (lr / (1 - momentum)
        for SGD: heavy-ball SGD under a constant gradient g moves by lr g / (1 - momentum) per step)."""
        return self.runtime.settings(self.rnd).step_size

    @property
    def architecture(self) -> nn.Module:
        """This client's model object, whatever weights it holds (for names and shapes)."""
        return self.runtime.models.live(self._arch)[0]

    @property
    def channels_last(self) -> bool:
        return self.runtime.channels_last

    # -- things made for the method ----------------------------------------------------------
    def rng(self, *keys: object) -> np.random.Generator:
        """A numpy stream for this (round, client) and purpose (e.g. k-means restarts)."""
        return np.random.default_rng(seed_for(self.info.seed, "client", self.rnd, self.cid, *keys))

    def shared_model(self, weights: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
        """This client's one model object with ``weights`` loaded (None: the run's initial
        weights). Shared: the next call loads other weights into the same object."""
        return self.runtime.models.get(self._arch, weights)

    def like_model(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of ``weights`` as the model holds them (on its device, in its memory
        formats, e.g. channels_last): for tensors a loss combines with the parameters."""
        return weights_of(self.shared_model(weights))

    def trainable(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of ``weights`` that are trainable parameters of the model."""
        return {k: weights[k] for k, p in self.architecture.named_parameters() if p.requires_grad}

    def training_settings(self, overrides: Mapping[str, Any] = {}) -> TrainSettings:
        """The run's local-training settings for this round (lr after its schedule), with
        ``overrides`` for one call (e.g. ``epochs=1``); an unknown key is a TypeError."""
        return self.runtime.settings(self.rnd).with_overrides(overrides)

    # -- the requests a coroutine client_update awaits -----------------------------------------
    def fit(self, weights: Mapping[str, torch.Tensor], loss: LossFn = cross_entropy, *,
            extras: Optional[Mapping[str, Any]] = None, trainable: Optional[Sequence[str]] = None,
            grad: Optional[GradFn] = None,
            step_extras: Optional[Callable[[Sequence[int]], dict[str, torch.Tensor]]] = None, report: bool = True,
            **settings: Any) -> Fit:
        """``await ctx.fit(...)`` -> :class:`~protofl.algorithms.base.Fitted`: local training from
        ``weights`` on ``loss(model, x, y, extras)`` (see :class:`~protofl.algorithms.base.Fit`);
        ``settings`` override training settings for this call (``epochs=10``)."""
        self.training_settings(settings)  # unknown keys fail here, in the method's own frame
        return Fit(weights, loss, {} if extras is None else extras,
                   None if trainable is None else tuple(trainable), grad, step_extras, dict(settings), report)

    def features(self, weights: Mapping[str, torch.Tensor], part: str = "body",
                 x: Optional[torch.Tensor] = None) -> Features:
        """``await ctx.features(weights, "body")`` -> (n, d): ``model.<part>`` with ``weights``,
        in eval mode, on ``x`` (default: this client's training inputs)."""
        return Features(weights, part, x)

    # -- the sequential executor: each request run at once -------------------------------------
    def execute(self, request: object) -> Any:
        """Run one request now, for this client alone."""
        if isinstance(request, Fit):
            return self._fit(request)
        if isinstance(request, Features):
            return self.embed(getattr(self.shared_model(request.weights), request.part), request.x)
        raise not_a_request(request)

    def fit_settings(self, req: Fit) -> TrainSettings:
        """A ``Fit``'s settings as they run: under DP-SGD with the released n~_k."""
        s = self.training_settings(req.settings)
        if self.dp_sgd:
            if req.step_extras is not None:
                raise TypeError("step_extras (per-step random tensors) are not supported under privacy.mode: sample")
            assert self.privacy is not None  # dp_sgd: privacy.mode is sample
            s = replace(s, dp_n=self.released_n, dp_noise=self.privacy.sigma)  # (the server's, if calibrated)
        return s

    def _fit(self, req: Fit) -> Fitted:
        model = self.shared_model(req.weights)
        settings = self.fit_settings(req)
        x, y = self.data
        per_step = None
        if req.step_extras is not None and len(y):
            drop = batch_coupled(model)
            n_steps = total_steps(len(y), settings.batch_size, settings.epochs, settings.steps, drop)
            per_step = req.step_extras(batch_sizes(len(y), settings.batch_size, n_steps, drop))
        stats = fit(model, x, y, loss=req.loss, extras=req.extras, names=trainable_names(model, req.trainable),
                    settings=settings, generator=self.batch_generator, per_step=per_step, grad=req.grad,
                    channels_last=self.channels_last, precision=self.runtime.cfg.execution.precision,
                    augment=self.augmentation, noise=self.noise_generator() if settings.dp_noise > 0 else None)
        weights = weights_of(model)
        self.runtime.models.mark(model, weights)  # the model holds them: a predictor on them loads nothing
        return Fitted(weights, self.trained(stats, req.report, settings))

    @property
    def augmentation(self) -> Optional[tuple[Augment, torch.Generator, torch.Tensor]]:
        """(augmentation, this client's augmentation stream, padding value) for the training
        step, or None without ``data.augment``. The stream is drawn fit after fit, in order."""
        rt = self.runtime
        if not rt.augment.active:
            return None
        if self._augment_generator is None:
            self._augment_generator = torch_gen(self.info.seed, "augment", self.rnd, self.cid)
        return rt.augment, self._augment_generator, rt.pad_value

    def noise_generator(self) -> NoiseStream:
        """DP-SGD's noise stream of this turn (``privacy.mode: sample``): the client's secret
        SHAKE-256 stream, drawn on the CPU and moved to the training device."""
        assert self.privacy is not None  # asked for DP-SGD's noise only (settings.dp_noise > 0)
        return self.privacy.noise_generator()

    def trained(self, stats: TrainStats, report: bool, settings: Optional[TrainSettings] = None) -> TrainStats:
        """Check a ``ctx.fit``'s statistics (a NaN loss raises) and keep the reported ones
        (``settings``: the fit's, for DP-SGD's accounting). Under DP-SGD the loss is not
        checked: it is not private (a sample with a non-finite gradient counts as zero, and
        the server rejects non-finite weights, which are)."""
        if self.dp_sgd:  # every DP-SGD step counts, reported or not
            assert self.privacy is not None  # dp_sgd: privacy.mode is sample
            self.privacy.trained(stats.steps, settings.dp_rate if settings is not None else 1.0)
        elif not math.isfinite(stats.loss):
            raise NonFiniteLossError(self.rnd, self.cid, stats.loss)
        if report:
            self.last_train = stats
        return stats

    @torch.inference_mode()
    def embed(self, body: Callable[[torch.Tensor], torch.Tensor], x: Optional[torch.Tensor] = None,
              batch_size: Optional[int] = None) -> torch.Tensor:
        """Features ``body(x)`` in eval mode, batched (default x: this client's training data).

        Batches of ``batch_size`` (default :data:`~protofl.engine.train.EMBED_BATCH_SIZE`) cut as
        :func:`~protofl.engine.train.embed_batches` does. A constant, not ``eval.batch_size``:
        these features feed training (prototypes), so an evaluation setting must not reach them.
        """
        x = self.data[0] if x is None else x
        modules = [m for m in (body, getattr(body, "__self__", None)) if isinstance(m, nn.Module)]
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            out = []
            for i, j in embed_batches(len(x), batch_size or EMBED_BATCH_SIZE):
                xb = x[i:j]
                if self.channels_last and xb.dim() == 4:
                    xb = xb.contiguous(memory_format=torch.channels_last)
                out.append(body(xb))
            return torch.cat(out) if out else body(x)  # no samples: the part on the empty batch, (0, d)
        finally:
            for m, mode in zip(modules, modes):
                m.train(mode)


class ClientRuntime:
    """A process's client side of ``task``: the clients' data and models on ``device``
    (default ``execution.device``, ``auto`` resolved). Replies and client states go back to ``reply_device``
    (the CPU, or the device when the server half lives there too)."""

    def __init__(self, task: Task, device: Union[str, torch.device, None] = None,
                 reply_device: Union[str, torch.device] = "cpu") -> None:
        self.task = task
        self.cfg, self.fed, self.algorithm, self.info = task.cfg, task.fed, task.algorithm, task.info
        self.device = torch.device(device if device is not None else self.cfg.execution.torch_device)
        self.reply_device = torch.device(reply_device)
        self.models = task.models(self.device)
        self.counts = self.fed.class_counts()
        self.channels_last = use_channels_last(self.cfg, self.models.live(task.arch(0))[0])
        self.transfers = Transfers()
        self.augment = Augment.of(self.cfg.data.augment)
        self._pad: Optional[torch.Tensor] = None
        self._test: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # a Flower SuperNode's own noise key (privacy.noise: secret; node_state.py keeps it)
        self.node_key: Optional[bytes] = None

    @property
    def pad_value(self) -> torch.Tensor:
        """(1, C, 1, 1) on the device: the padding of ``data.augment``'s crop (a raw 0, normalized)."""
        if self._pad is None:
            ds = self.fed.dataset
            self._pad = pad_value(ds.normalize, ds.input_shape[0], ds.x_train.dtype, self.device)
        return self._pad

    def settings(self, rnd: int) -> TrainSettings:
        """Round ``rnd``'s local-training settings (``training.*``, lr after its schedule; DP-SGD's
        clip and noise under ``privacy.mode: sample``)."""
        s = TrainSettings.of_round(self.cfg.training, rnd, self.cfg.rounds)
        p = self.cfg.privacy
        return replace(s, dp_clip=p.clip, dp_noise=p.noise_multiplier) if p.mode == "sample" else s

    @overload
    def place(self, record: Record) -> Record: ...

    @overload
    def place(self, record: None) -> None: ...

    def place(self, record: Optional[Record]) -> Optional[Record]:
        """``record`` on the training device (counted in :attr:`transfers`)."""
        if record is None:
            return None
        self.transfers.records += 1
        for _, t in record.tensors():
            n = t.numel() * t.element_size()
            self.transfers.bytes += n
            self.transfers.copied += n if t.device != self.device else 0
        return record.to(self.device)

    # -- data ------------------------------------------------------------------------------
    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the dataset's ``train`` or ``test`` split on the device, raw (uint8
        stays uint8), copied there once per process; on the CPU the dataset's own tensors."""
        if name not in self._splits:
            ds = self.fed.dataset
            x, y = (ds.x_train, ds.y_train) if name == "train" else (ds.x_test, ds.y_test)
            self._splits[name] = (x.to(self.device), y.to(self.device))
        return self._splits[name]

    def _index(self, idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(idx).to(self.device)

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return self.fed.dataset.normalize(x.to(self.device))  # on the device, slice by slice

    def _client_slice(self, x: torch.Tensor, cid: int, rnd: int, split: str) -> torch.Tensor:
        out = self._prepare(x)
        if self.fed.transform is not None:  # load-time feature skew (e.g. per-client noise)
            out = self.fed.transform(out, cid, rnd, split)
        return out

    def client_train_data(self, cid: int, rnd: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.split("train")
        idx = self._index(self.fed.train_idx[cid])
        return self._client_slice(x[idx], cid, rnd, "train"), y[idx]

    def client_test_data(self, cid: int, rnd: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.split("test")
        idx = self._index(self.fed.test_idx[cid])
        return self._client_slice(x[idx], cid, rnd, "test"), y[idx]

    @property
    def test_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The global test set, normalized once and kept."""
        if self._test is None:
            x, y = self.split("test")
            self._test = (self._prepare(x), y)
        return self._test

    # -- one client's turn -----------------------------------------------------------------------
    def run(self, task: ClientTask, shared: Optional[Record] = None) -> ClientOutput:
        """One client's turn: update, then (optionally) evaluate its personalized model.
        ``shared``: the round's broadcast already on the device (an in-process executor
        places it once per round); else ``task.shared`` is placed here."""
        t0 = time.perf_counter()
        ctx, update = self.start(task, shared)
        try:
            result: ClientResult = drive(update, ctx.execute)
        except NonFiniteLossError as e:
            return self.diverged(ctx, e)
        return self.finish(ctx, result, task.evaluate, task.full_test, t0)

    def diverged(self, ctx: ClientContext, error: NonFiniteLossError) -> ClientOutput:
        """The NaN-loss policy (``training.on_nonfinite``), for both executors: ``stop``
        raises ``error`` (the run stops); ``drop`` withdraws the client's reply: no reply, its
        state as it was, and under privacy what it spent (it counts all the same)."""
        if self.cfg.training.on_nonfinite == "stop":
            raise error
        return ClientOutput(reply=Record(), state=None, rejected=str(error),
                            train={} if ctx.privacy is None else ctx.privacy.report())

    def noise_key(self, task: ClientTask) -> Optional[bytes]:
        """The client's noise key: the task's (a simulation), else the node's own
        (:attr:`node_key`, a Flower SuperNode's, kept in its node state)."""
        return task.noise_key if task.noise_key is not None else self.node_key

    def start(self, task: ClientTask,
              shared: Optional[Record] = None) -> tuple[ClientContext, Coroutine[Any, Any, ClientResult]]:
        """A client's context and its ``client_update`` coroutine, with its message (the
        broadcast and its own part) and its state on the training device."""
        torch.manual_seed(seed_for(self.info.seed, "torch", task.rnd, task.cid))  # dropout masks etc.
        ctx = ClientContext(self, task.cid, task.rnd, evaluating=task.evaluate)
        state = task.state if task.state is not None else self.algorithm.client_init(ctx)
        msg = (self.place(task.shared) if shared is None else shared).merged(self.place(task.own))
        if self.cfg.privacy.mode != "none":
            ctx.privacy = ClientPrivacy(self.cfg, task.rnd, task.cid, msg, key=self.noise_key(task))
        return ctx, self.algorithm.client_update(msg, self.place(state), ctx)

    def finish(self, ctx: ClientContext, result: ClientResult, evaluate: bool, full_test: bool,
               t0: float) -> ClientOutput:
        """A client's output from its method's result: the reply (with the client's sample
        count, n_k) on the reply device and the state on the CPU, the training statistics,
        and (optionally) its personalized model's metrics."""
        cid, rnd = ctx.cid, ctx.rnd
        reply = result.reply
        if ctx.privacy is not None and ctx.privacy.mode == "client":  # the update is clipped before it leaves
            reply = ctx.privacy.clip_reply(reply)
        reply = reply.to(self.reply_device)
        # n_k, FedAvg's weight; under privacy no exact count leaves the client: client-level
        # DP weighs every client 1, DP-SGD by n~_k (post-processing of its release)
        reply.num_samples = ctx.num_samples if ctx.privacy is None or ctx.dp_sgd else 1
        state = None if result.state is None else result.state.to("cpu")
        train = {"seconds": time.perf_counter() - t0}
        if ctx.privacy is not None:  # its loss and sample counts are not private: only the spend
            train.update(ctx.privacy.report())
        elif ctx.last_train is not None:
            train.update(loss=ctx.last_train.loss, steps=ctx.last_train.steps, samples=ctx.last_train.samples)
        ev: dict[str, float] = {}
        if evaluate and result.personal is not None:
            tx, ty = self.test_data
            lx, ly = self.client_test_data(cid, rnd)
            ev = personal_metrics(result.personal, test_x=tx, test_y=ty, local_x=lx, local_y=ly,
                                  train_counts=self.counts[cid], num_classes=self.info.num_classes,
                                  batch_size=self.cfg.eval.batch_size, channels_last=self.channels_last,
                                  full_test=full_test)
            names = self.fed.feature_group_names
            if names is not None and "pa" in ev:  # local-test accuracy by feature group (pa:rot90)
                assert self.fed.feature_groups is not None  # set with their names (data/features.py)
                ev[f"pa:{names[self.fed.feature_groups[cid]]}"] = ev["pa"]
        return ClientOutput(reply=reply, state=state, eval=ev, train=train)


def not_a_request(obj: object) -> TypeError:
    """The error for a ``client_update`` that awaited something other than a protofl request."""
    return TypeError(f"client_update awaited {type(obj).__name__}; it may await ctx.fit(...) and "
                     "ctx.features(...) only")


def trainable_names(model: nn.Module, prefixes: Optional[tuple[str, ...]] = None) -> list[str]:
    """The trainable parameters of ``model`` (those starting with one of ``prefixes``, when given)."""
    return [k for k, p in model.named_parameters() if p.requires_grad and (prefixes is None or k.startswith(prefixes))]


def drive(update: Coroutine[Any, Any, ClientResult], execute: Callable[[Any], Any]) -> ClientResult:
    """Run a ``client_update`` coroutine to its end, answering each request it awaits with
    ``execute(request)``."""
    answer = None
    try:
        while True:
            try:
                request = update.send(answer)
            except StopIteration as done:
                result: ClientResult = done.value
                return result
            answer = execute(request)
    finally:
        update.close()  # a request that raised: no half-run coroutine is left behind


def run_update(algorithm: Algorithm[Any], msg: Record, state: Optional[Record], ctx: ClientContext) -> ClientResult:
    """One client's ``client_update`` run to its end, each request executed by ``ctx`` (the
    sequential executor's way; for tests and for code that drives a client by hand)."""
    return drive(algorithm.client_update(msg, state, ctx), ctx.execute)
