"""The client side of the engine: what a client process needs besides a message.

A :class:`ClientRuntime` lives once per process (the simulator, each pool worker, each
Flower SuperNode). For one (round, client) it builds a :class:`ClientContext` -- the
client's data, its model architecture, the training recipe and its random streams --
runs the method's ``client_update`` and evaluates the personalized model it returns.

``client_update`` is a coroutine (``algorithms/base.py``): here it is driven for one
client, each request it awaits (``ctx.fit``, ``ctx.features``) run at once by
:meth:`ClientContext.execute`; the batched executor drives many at a time.
"""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..algorithms.base import (Algorithm, ClientResult, Features, Fit, Fitted, GradFn, LossFn as FitLoss, Pending,
                               TaskInfo, cross_entropy, cross_entropy_loss, weights_of)
from ..config import Config
from ..data.federated import FederatedData
from ..messages import Record
from ..models import build_model
from ..rng import seed_for, torch_gen
from .evaluate import personal_metrics
from .train import LossFn, NonFiniteLossError, TrainStats, batch_sizes, local_train, total_steps


# Inference batches of ClientContext.embed. Cache-sized batches are the fastest on CPU: for
# fedavg_cnn, 256 samples take about half the CPU time per sample of 1024 (whose first
# activation, 1024 x 32 x 28 x 28 floats, is 100 MB). The batches subdivide blocks of 1024
# samples, never leaving a piece under 256 (see embed_batches): a sample is in a tiny batch
# exactly when its block is, which keeps the prototypes of FedProto, FedNH, MP-FedCL and
# ReBaFL bit-identical to block-wise inference (tests/test_speed_invariance.py).
EMBED_BLOCK = 1024
EMBED_BATCH_SIZE = 256


def embed_batches(n: int, batch: int, block: int = EMBED_BLOCK) -> list[tuple[int, int]]:
    """(start, end) of the inference batches over n samples: each ``block`` (the last may be
    short) cut into pieces of ``batch``, the remainder joining the last piece.

    CPU GEMM kernels take a different path for a handful of rows (on x86 with 1-3 rows the
    result differs in the last bits from the same rows inside a bigger batch), so a sample's
    features depend on whether its batch is tiny. Subdividing the blocks without leaving a
    piece smaller than ``batch`` keeps each sample in a batch that is tiny exactly when its
    block was.
    """
    out = []
    for start in range(0, n, block):
        b = min(block, n - start)
        k = max(1, b // batch)
        out += [(start + j * batch, start + (b if j == k - 1 else (j + 1) * batch)) for j in range(k)]
    return out


def arch_kwargs(cfg: Config, cid: int) -> dict:
    """Model kwargs of client ``cid``: the shared ones plus its heterogeneous overrides."""
    kw = dict(cfg.model.params)
    K = cfg.partition.num_clients
    for key, values in cfg.model.per_client.items():
        if len(values) == K:
            kw[key] = values[cid]
        else:  # contiguous equal blocks: 3 values over 20 clients -> 7, 7, 6
            kw[key] = values[min(len(values) - 1, cid * len(values) // K)]
    return kw


def use_channels_last(cfg: Config, model: nn.Module) -> bool:
    """``execution.channels_last``: auto follows the model's measured preference."""
    flag = cfg.execution.channels_last
    if flag == "auto":
        return bool(getattr(model, "channels_last", getattr(model, "is_conv", False)))
    return bool(flag)


class ModelCache:
    """One live model object per architecture; weights are copied in, never deep-copied."""

    def __init__(self, cfg: Config, algorithm: Algorithm, info: TaskInfo, device: torch.device) -> None:
        self.cfg, self.algorithm, self.info, self.device = cfg, algorithm, info, device
        self._models: dict[str, tuple[nn.Module, dict]] = {}

    def get(self, kwargs: dict, weights: Optional[dict] = None) -> nn.Module:
        model, init = self.live(kwargs)
        model.load_state_dict(weights if weights is not None else init)
        return model

    def live(self, kwargs: dict) -> tuple[nn.Module, dict]:
        """The live model of this architecture (its weights whatever was loaded last) and its
        initial weights."""
        key = repr(sorted(kwargs.items()))
        if key not in self._models:
            # every architecture starts from the run's init stream: homogeneous clients
            # and the server's global model start from identical weights
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed_for(self.info.seed, "init"))
                base = build_model(self.cfg.model.name, self.info.input_shape, self.info.num_classes,
                                   pretrained=self.cfg.model.pretrained, **kwargs)
                model = self.algorithm.adapt_model(base).to(self.device)
            if use_channels_last(self.cfg, model):
                model = model.to(memory_format=torch.channels_last)
            init = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self._models[key] = (model, init)
        return self._models[key]


@dataclass
class ClientOutput:
    reply: Record
    state: Optional[Record]
    eval: dict[str, float] = field(default_factory=dict)  # personalized-model metrics
    train: dict[str, float] = field(default_factory=dict)  # loss, steps, samples, seconds
    rejected: Optional[str] = None  # why the client itself withdrew its reply (on_nonfinite: drop)


class ClientContext:
    """What ``client_update`` may use. Everything is local to this (round, client)."""

    def __init__(self, runtime: "ClientRuntime", cid: int, rnd: int, evaluating: bool = False) -> None:
        self.runtime = runtime
        self.cid = cid
        self.round = rnd
        # whether the engine evaluates this client's personalized model after the update
        # (methods whose personalized model costs extra work, e.g. fine-tuning, do it only then)
        self.evaluating = evaluating
        self.info = runtime.info
        self.num_classes = runtime.info.num_classes
        self.generator = torch_gen(runtime.info.seed, "train", rnd, cid)
        self.last_train: Optional[TrainStats] = None
        self._data: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # -- data ------------------------------------------------------------------------------
    @property
    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): the client's normalized training data on the device."""
        if self._data is None:
            self._data = self.runtime.client_train_data(self.cid, self.round)
        return self._data

    @property
    def num_samples(self) -> int:
        return len(self.runtime.fed.train_idx[self.cid])

    @property
    def class_counts(self) -> torch.Tensor:
        """(C,) int64 training label counts of this client."""
        return torch.from_numpy(self.runtime.counts[self.cid].copy())

    def rng(self, *keys: object) -> np.random.Generator:
        """A numpy stream for this (round, client) and purpose (e.g. k-means restarts)."""
        return np.random.default_rng(seed_for(self.info.seed, "client", self.round, self.cid, *keys))

    # -- model -----------------------------------------------------------------------------
    def model(self, weights: Optional[dict] = None) -> nn.Module:
        """This client's architecture with ``weights`` loaded (None: the run's initial weights)."""
        return self.runtime.models.get(arch_kwargs(self.runtime.cfg, self.cid), weights)

    def architecture(self) -> nn.Module:
        """This client's live model object, whatever weights it holds (for names and shapes)."""
        return self.runtime.models.live(arch_kwargs(self.runtime.cfg, self.cid))[0]

    def like_model(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of ``weights`` as the model holds them (on its device, in its memory
        formats, e.g. channels_last): for tensors a loss combines with the parameters."""
        return weights_of(self.model(weights))

    def trainable(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of ``weights`` that are trainable parameters of the model."""
        return {k: weights[k] for k, p in self.architecture().named_parameters() if p.requires_grad}

    @property
    def channels_last(self) -> bool:
        return self.runtime.channels_last

    # -- training --------------------------------------------------------------------------
    def lr(self) -> float:
        tc = self.runtime.cfg.training
        return tc.lr * tc.lr_decay ** (self.round - 1)

    def step_size(self) -> float:
        """The steady-state step of the local optimizer per unit gradient: lr / (1 - momentum)
        (heavy-ball SGD under a constant gradient g moves by lr g / (1 - momentum) per step)."""
        return self.lr() / (1.0 - self.runtime.cfg.training.momentum)

    def training_settings(self, overrides: Mapping[str, Any] = {}) -> dict:
        """The run's local-training settings for this round (lr with its decay), with
        ``overrides`` for one call (e.g. ``epochs=1``); an unknown key is a TypeError."""
        tc = self.runtime.cfg.training
        settings = dict(lr=self.lr(), momentum=tc.momentum, weight_decay=tc.weight_decay,
                        batch_size=tc.batch_size, epochs=tc.epochs, steps=tc.steps, clip_grad=tc.clip_grad)
        unknown = set(overrides) - set(settings)
        if unknown:
            raise TypeError(f"unknown training setting(s): {sorted(unknown)}")
        settings.update(overrides)
        return settings

    def train(self, model: nn.Module, loss: LossFn = cross_entropy_loss,
              params: Optional[Iterable[nn.Parameter]] = None, **overrides) -> TrainStats:
        """Run the configured local training on this client's data, on a live model (the
        imperative form, for a plain-function ``client_update``; methods ``await ctx.fit``).

        ``loss(model, x, y)`` is the objective; ``params`` the parameters that move (all
        trainable ones by default). ``overrides`` replace training settings for this call
        (e.g. ``epochs=1``).
        """
        x, y = self.data
        stats = local_train(model, x, y, loss=loss, params=model.parameters() if params is None else params,
                            generator=self.generator, channels_last=self.channels_last,
                            precision=self.runtime.cfg.execution.precision, **self.training_settings(overrides))
        return self._trained(stats, report=True)

    def _trained(self, stats: TrainStats, report: bool) -> TrainStats:
        if not math.isfinite(stats.loss):
            raise NonFiniteLossError(self.round, self.cid, stats.loss)
        if report:
            self.last_train = stats
        return stats

    # -- the requests a coroutine client_update awaits -----------------------------------------
    def fit(self, weights: Mapping[str, torch.Tensor], loss: FitLoss = cross_entropy, *,
            extras: Optional[Mapping[str, Any]] = None, trainable: Optional[Sequence[str]] = None,
            grad: Optional[GradFn] = None, step_extras: Optional[Callable] = None, report: bool = True,
            **settings) -> Pending:
        """``await ctx.fit(...)`` -> :class:`~protofl.algorithms.base.Fitted`: local SGD from
        ``weights`` on ``loss(model, x, y, extras)`` (see :class:`~protofl.algorithms.base.Fit`);
        ``settings`` override training settings for this call (``epochs=10``)."""
        self.training_settings(settings)  # unknown keys fail here, in the method's own frame
        return Pending(Fit(weights, loss, {} if extras is None else extras,
                           None if trainable is None else tuple(trainable), grad, step_extras, dict(settings), report))

    def features(self, weights: Mapping[str, torch.Tensor], part: str = "body",
                 x: Optional[torch.Tensor] = None) -> Pending:
        """``await ctx.features(weights, "body")`` -> (n, d): ``model.<part>`` with ``weights``,
        in eval mode, on ``x`` (default: this client's training inputs)."""
        return Pending(Features(weights, part, x))

    def execute(self, request) -> Any:
        """Run one request now, for this client alone (the sequential executor)."""
        if isinstance(request, Fit):
            return self._fit(request)
        if isinstance(request, Features):
            model = self.model(request.weights)
            return self.embed(getattr(model, request.part), request.x)
        raise TypeError(f"client_update awaited {type(request).__name__}; it may await ctx.fit(...) and "
                        "ctx.features(...) only")

    def _fit(self, req: Fit) -> Fitted:
        model = self.model(req.weights)
        named = [(k, p) for k, p in model.named_parameters()
                 if p.requires_grad and (req.trainable is None or k.startswith(req.trainable))]
        settings = self.training_settings(req.settings)
        x, y = self.data
        extras, per_step = req.extras, None
        if req.step_extras is not None and len(y):
            n_steps = total_steps(len(y), settings["batch_size"], settings["epochs"], settings["steps"])
            per_step = req.step_extras(batch_sizes(len(y), settings["batch_size"], n_steps))

        def loss(m, xb, yb, step):
            ex = extras if per_step is None else {**extras, **{k: v[step, :len(yb)] for k, v in per_step.items()}}
            return req.loss(m, xb, yb, ex)

        grad = None
        if req.grad is not None:
            names = [k for k, _ in named]

            def grad(gs: list) -> list:
                new = req.grad(dict(zip(names, gs)), extras)
                return [new[k] for k in names]

        stats = local_train(model, x, y, loss=loss, params=[p for _, p in named], generator=self.generator,
                            channels_last=self.channels_last, precision=self.runtime.cfg.execution.precision,
                            grad=grad, step_loss=True, **settings)
        return Fitted(weights_of(model), self._trained(stats, req.report))

    @torch.inference_mode()
    def embed(self, body: Callable[[torch.Tensor], torch.Tensor], x: Optional[torch.Tensor] = None,
              batch_size: Optional[int] = None) -> torch.Tensor:
        """Features ``body(x)`` in eval mode, batched (default x: this client's training data).

        Batches of ``batch_size`` (default :data:`EMBED_BATCH_SIZE`) cut as :func:`embed_batches`
        does. A constant, not ``eval.batch_size``: these features feed training (prototypes),
        so an evaluation setting must not reach them.
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
            return torch.cat(out) if out else x.new_zeros((0,))
        finally:
            for m, mode in zip(modules, modes):
                m.train(mode)


class ClientRuntime:
    def __init__(self, cfg: Config, fed: FederatedData, algorithm: Algorithm, info: TaskInfo) -> None:
        self.cfg, self.fed, self.algorithm, self.info = cfg, fed, algorithm, info
        self.device = torch.device(cfg.execution.device)
        self.models = ModelCache(cfg, algorithm, info, self.device)
        self.counts = fed.class_counts()
        probe = self.models.get(arch_kwargs(cfg, 0))
        self.channels_last = use_channels_last(cfg, probe)
        self._test: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the dataset's ``train`` or ``test`` split on the device, raw (uint8
        stays uint8), copied there once per process; on the CPU the dataset's own tensors."""
        if name not in self._splits:
            ds = self.fed.dataset
            x, y = (ds.x_train, ds.y_train) if name == "train" else (ds.x_test, ds.y_test)
            self._splits[name] = (x.to(self.device), y.to(self.device))
        return self._splits[name]

    def _index(self, idx) -> torch.Tensor:
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

    def run(self, cid: int, rnd: int, msg: Record, state: Optional[Record], evaluate: bool,
            full_test: bool = True) -> ClientOutput:
        """One client's turn: update, then (optionally) evaluate its personalized model."""
        t0 = time.perf_counter()
        ctx, update = self.start(cid, rnd, msg, state, evaluate)
        try:
            result: ClientResult = drive(update, ctx.execute)
        except NonFiniteLossError as e:
            if self.cfg.training.on_nonfinite == "stop":
                raise
            return ClientOutput(reply=Record(), state=None, rejected=str(e))
        return self.finish(ctx, result, evaluate, full_test, t0)

    def start(self, cid: int, rnd: int, msg: Record, state: Optional[Record], evaluate: bool):
        """A client's context and its ``client_update`` call (a coroutine; or, for a method
        written as a plain function, its finished result)."""
        torch.manual_seed(seed_for(self.info.seed, "torch", rnd, cid))  # dropout masks etc.
        ctx = ClientContext(self, cid, rnd, evaluating=evaluate)
        if state is None:
            state = self.algorithm.client_init(ctx)
        if self.device.type != "cpu":  # the method computes on the device; messages stay on the CPU
            msg, state = msg.to(self.device), (None if state is None else state.to(self.device))
        return ctx, self.algorithm.client_update(msg, state, ctx)

    def finish(self, ctx: ClientContext, result: ClientResult, evaluate: bool, full_test: bool,
               t0: float) -> ClientOutput:
        """A client's output from its method's result: the reply and state on the CPU, the
        training statistics, and (optionally) its personalized model's metrics."""
        cid, rnd = ctx.cid, ctx.round
        if self.device.type != "cpu":
            result.reply = result.reply.to("cpu")
            result.state = None if result.state is None else result.state.to("cpu")
        train = {"seconds": time.perf_counter() - t0}
        if ctx.last_train is not None:
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
                ev[f"pa:{names[self.fed.feature_groups[cid]]}"] = ev["pa"]
        return ClientOutput(reply=result.reply, state=result.state, eval=ev, train=train)


def drive(update, execute: Callable[[Any], Any]) -> ClientResult:
    """Run a ``client_update`` coroutine to its end, answering each request it awaits with
    ``execute(request)``; a plain-function method's result passes through."""
    if not inspect.iscoroutine(update):
        return update
    answer = None
    try:
        while True:
            try:
                request = update.send(answer)
            except StopIteration as done:
                return done.value
            answer = execute(request)
    finally:
        update.close()  # a request that raised: no half-run coroutine is left behind


def run_update(algorithm: Algorithm, msg: Record, state: Optional[Record], ctx) -> ClientResult:
    """One client's ``client_update`` run to its end, each request executed by ``ctx`` (the
    sequential executor's way; for tests and for code that drives a client by hand)."""
    return drive(algorithm.client_update(msg, state, ctx), ctx.execute)
