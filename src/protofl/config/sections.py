"""The config's sections: one dataclass per section, each validating its own fields.

Named components (dataset, partitioner, features, model, algorithm) keep their own
parameters next to the name (``params``); those are checked against the registries when
a :class:`~protofl.config.schema.Config` is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from ..errors import MAX_SIZE, require
from .coerce import check_path_component, coerce
from .machine import resolve_device, TRACKERS


# data.augment's keys (engine/augment.py does them)
AUGMENT_KEYS = {"crop": "padding of the random crop, in pixels (0: no crop)", "flip": "random horizontal flip"}


# a batch is allocated (its sample indices, its augmentation draws) at its size: a size
# above every dataset's would ask for memory no machine has (1e12: 14.6 TiB); any value at
# least the largest client's sample count already means one batch an epoch
MAX_BATCH = MAX_SIZE
BATCH_RULE = f"must be in [1, {MAX_BATCH:,}] (any value >= a client's sample count is one batch an epoch)"


@dataclass
class DataConfig:
    name: str = "digits"
    root: Optional[str] = None  # else PROTOFL_DATA, else the cache dir
    # a seeded uniform random subset of this many training samples, drawn before the
    # partition (MP-FedCL's Table VI trains on 2,000 MNIST images); null = the whole split
    train_size: Optional[int] = None
    # a catalog dataset whose files are missing is fetched on first use (docs/data.md);
    # false (or PROTOFL_OFFLINE=1) forbids the network: the error says how to place the files
    download: bool = True
    mirrors: list[str] = field(default_factory=list)  # base URLs laid out like the data root, tried first
    # a catalog file that is present but not the published bytes stops the run; false reads
    # it anyway (one line each time says so)
    verify: bool = True
    # per-epoch augmentation of the training images, on the device (engine/augment.py):
    # {crop: 4, flip: true} is the standard CIFAR recipe; {} (default): none
    augment: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)  # the loader's own options

    def validate(self, section: str) -> None:
        require(self.train_size is None or self.train_size >= 1, f"{section}.train_size", self.train_size,
                "must be >= 1 or null")
        for i, m in enumerate(self.mirrors):
            require(isinstance(m, str) and bool(m.strip()), f"{section}.mirrors[{i}]", m, "expected a base URL")
        for k, v in self.augment.items():
            require(k in AUGMENT_KEYS, f"{section}.augment.{k}", v, "unknown; known: " + "; ".join(
                f"{n} ({what})" for n, what in AUGMENT_KEYS.items()))
        crop = self.augment.get("crop", 0)
        require(isinstance(crop, int) and not isinstance(crop, bool) and crop >= 0, f"{section}.augment.crop", crop,
                "must be a whole number of pixels >= 0")
        require(isinstance(self.augment.get("flip", False), bool), f"{section}.augment.flip",
                self.augment.get("flip"), "must be true or false")


@dataclass
class PartitionConfig:
    name: str = "dirichlet"
    num_clients: int = 10
    params: dict = field(default_factory=dict)  # the partitioner's own parameters


@dataclass
class FeaturesConfig:
    """Feature-distribution skew (data/features.py); ``none`` leaves the data as loaded."""

    name: str = "none"
    params: dict = field(default_factory=dict)  # the scenario's own options


@dataclass
class ModelConfig:
    name: str = "mlp"
    params: dict = field(default_factory=dict)
    # heterogeneous architectures: {kwarg: [v1, v2, ...]}; a list as long as the number of
    # clients is used as is, a shorter one is assigned in contiguous equal blocks
    # (three values -> thirds), as in FedProto's 18/20/22-channel setting
    per_client: dict = field(default_factory=dict)
    # a file of weights (a state dict saved with torch.save: the whole model's or its
    # body's) loaded after the model is built and before the method adapts it
    # (protofl.models.pretrained); left out of the saved config and the fingerprint when null
    pretrained: Optional[str] = None


@dataclass
class TrainingConfig:
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    # the learning rate of round r, as torch.optim.lr_scheduler's schedulers stepped once a
    # round (engine/train.py round_lr): exponential lr * lr_decay^(r-1) (ExponentialLR); step:
    # lr * lr_decay^(number of milestones <= r) (MultiStepLR), or every step_size rounds
    # lr * lr_decay^floor((r-1) / step_size) (StepLR); cosine: from lr to min_lr over the run
    # (CosineAnnealingLR); warmup_rounds > 0 first: a linear warm-up from lr * warmup_factor
    # to lr (LinearLR), then the schedule, its rounds counted from there (SequentialLR)
    schedule: Literal["exponential", "cosine", "step"] = "exponential"
    lr_decay: float = 1.0
    milestones: list[int] = field(default_factory=list)  # step: the rounds the lr is multiplied at
    step_size: Optional[int] = None  # step: the lr is multiplied after every step_size rounds
    min_lr: float = 0.0  # cosine: the lr of the last round's end
    warmup_rounds: int = 0
    warmup_factor: float = 0.1  # the first warm-up round's lr / lr
    # the clients' local optimizer, as torch.optim's of that name with these settings:
    # sgd (momentum, weight_decay), adam and adamw (betas, eps), rmsprop (alpha, eps, momentum),
    # adagrad (eps; torch's own default eps is 1e-10)
    optimizer: Literal["sgd", "adam", "adamw", "rmsprop", "adagrad"] = "sgd"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam, adamw
    eps: float = 1e-8  # adam, adamw, rmsprop, adagrad
    alpha: float = 0.99  # rmsprop: the smoothing constant of the squared gradients' average
    epochs: int = 1
    steps: Optional[int] = None  # if set, local steps per round instead of epochs
    batch_size: int = 32
    clip_grad: Optional[float] = None  # max gradient L2 norm
    # a client whose loss turns NaN/inf: stop the run (reveals a bad lr in simulation) or
    # drop that client's reply for the round (what a deployment wants: one client cannot stop it)
    on_nonfinite: Literal["stop", "drop"] = "stop"
    # the server rejects a reply whose model update's L2 norm exceeds this many times the
    # round's median update norm (engine/validate.py update_outliers; 0 = off)
    update_ratio_limit: float = 1000.0

    def validate(self, section: str) -> None:
        require(self.lr > 0, f"{section}.lr", self.lr, "must be > 0")
        require(0 <= self.momentum < 1, f"{section}.momentum", self.momentum, "must be in [0, 1)")
        require(self.weight_decay >= 0, f"{section}.weight_decay", self.weight_decay, "must be >= 0")
        require(0 < self.lr_decay <= 1, f"{section}.lr_decay", self.lr_decay, "must be in (0, 1]")
        require(all(isinstance(m, int) and m >= 1 for m in self.milestones), f"{section}.milestones", self.milestones,
                "must be rounds >= 1")
        require(self.schedule != "step" or bool(self.milestones) != (self.step_size is not None),
                f"{section}.milestones", self.milestones,
                "schedule: step needs milestone rounds or a step_size, one of the two")
        require(self.step_size is None or (isinstance(self.step_size, int) and self.step_size >= 1),
                f"{section}.step_size", self.step_size, "must be a number of rounds >= 1 or null")
        require(self.warmup_rounds >= 0, f"{section}.warmup_rounds", self.warmup_rounds, "must be >= 0")
        require(0 < self.warmup_factor <= 1, f"{section}.warmup_factor", self.warmup_factor, "must be in (0, 1]")
        require(0 <= self.alpha < 1, f"{section}.alpha", self.alpha, "must be in [0, 1)")
        require(0 <= self.min_lr <= self.lr, f"{section}.min_lr", self.min_lr, "must be in [0, training.lr]")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{section}.betas", self.betas,
                "must be two numbers in [0, 1)")
        require(self.eps > 0, f"{section}.eps", self.eps, "must be > 0")
        require(self.optimizer in ("sgd", "rmsprop") or self.momentum == 0, f"{section}.momentum", self.momentum,
                f"is SGD's and RMSprop's; {self.optimizer} has none (set training.momentum=0)")
        require(self.epochs >= 1, f"{section}.epochs", self.epochs, "must be >= 1")
        require(self.steps is None or self.steps >= 1, f"{section}.steps", self.steps, "must be >= 1 or null")
        require(1 <= self.batch_size <= MAX_BATCH, f"{section}.batch_size", self.batch_size, BATCH_RULE)
        require(self.clip_grad is None or self.clip_grad > 0, f"{section}.clip_grad", self.clip_grad,
                 "must be > 0 or null")
        require(self.update_ratio_limit == 0 or self.update_ratio_limit > 1, f"{section}.update_ratio_limit",
                self.update_ratio_limit, "must be > 1, or 0 (off)")


@dataclass
class ParticipationConfig:
    """Who is asked and whose reply arrives.

    ceil(fraction * K) clients are sampled per round (or ``clients_per_round``). A
    sampled client's reply arrives only if it is *available*: client k is available with
    probability p_k (``p``, or ``group_p[group of k]`` for clustered partitions), drawn
    afresh every ``period`` rounds. period = 1 is independent dropout each round;
    period = s > 1 is persistent straggling (the active set is redrawn every s rounds).
    """

    fraction: float = 1.0
    clients_per_round: Optional[int] = None
    # fixed: exactly m clients, uniformly without replacement; poisson: each client
    # independently with probability q = m / K (the sampling DP-FedAvg's accountant assumes
    # for add/remove-one privacy; a round may then ask nobody)
    sampling: Literal["fixed", "poisson"] = "fixed"
    p: float = 1.0
    group_p: Optional[list[float]] = None
    period: int = 1

    def validate(self, section: str) -> None:
        require(0 < self.fraction <= 1, f"{section}.fraction", self.fraction, "must be in (0, 1]")
        require(self.clients_per_round is None or self.clients_per_round >= 1,
                 f"{section}.clients_per_round", self.clients_per_round, "must be >= 1 or null")
        require(0 <= self.p <= 1, f"{section}.p", self.p, "must be in [0, 1]")
        for i, q in enumerate(self.group_p or []):
            require(0 <= q <= 1, f"{section}.group_p[{i}]", q, "must be in [0, 1]")
        require(self.period >= 1, f"{section}.period", self.period, "must be >= 1")


@dataclass
class PrivacyConfig:
    """Differential privacy (docs/privacy.md): what is made private, and the accountant.

    ``mode``: none; ``client``: DP-FedAvg (McMahan et al., ICLR 2018), each client's update
    clipped to L2 norm ``clip``, Gaussian noise of std ``noise_multiplier * clip`` on their
    sum on the server (adjacency: one client); ``sample``: DP-SGD (Abadi et al., CCS 2016)
    on Poisson-sampled batches for every local fit, every per-sample gradient clipped to
    ``clip``, noise ``noise_multiplier * clip`` on their sum, and every prototype a client
    sends released by the Gaussian mechanism on clipped features (adjacency: one sample).
    ``prototype`` (private prototypes from a model trained without privacy) is refused:
    its sensitivity had no bound. ``noise``: ``secret`` (each party's noise from a key of
    OS entropy kept in its own checkpoint) or ``seeded`` (replayable from the run's seed:
    for tests; not private). Every round logs ``epsilon`` at ``delta``.
    """

    mode: Literal["none", "client", "prototype", "sample"] = "none"
    clip: float = 1.0  # C (.inf: no clipping, with noise_multiplier 0 only)
    noise_multiplier: float = 1.0  # sigma = noise std / C
    delta: float = 1e-5
    # stop before a round that would take epsilon past it (refuse to start if round 1 would)
    target_epsilon: Optional[float] = None
    # choose noise_multiplier at the start of the run: the smallest with which the run, as
    # planned (its own released counts included), ends at target_epsilon
    calibrate: bool = False
    accountant: Literal["rdp", "pld"] = "rdp"  # dp-accounting's Renyi DP or privacy loss distributions
    # client: the clip follows a private estimate of the target_quantile of the update
    # norms (Andrew et al., NeurIPS 2021), geometric steps of rate clip_lr; the noise of
    # the unclipped count has std count_noise (null: expected clients per round / 20)
    adaptive_clip: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise: Optional[float] = None
    kmeans_steps: int = 3  # sample: Lloyd steps of the private k-means (MP-FedCL), each one release
    # sample: the L2 bound of one sample's features in a prototype release (null: clip, the
    # bound of one sample's gradient)
    feature_clip: Optional[float] = None
    # secret: noise (and, under client, the client sampling; under sample, the batch sampling)
    # drawn from keys of OS entropy that only their party holds; seeded: from the run's seed,
    # replayable by anyone holding config.yaml, so no guarantee holds (tests, debugging)
    noise: Literal["secret", "seeded"] = "secret"
    # sample: the std of the Gaussian noise on each of a client's label counts, released once
    # per run (sensitivity 1): what its Poisson rate, its step count, its aggregation weight
    # and a loss that reads the label distribution (FedRS, FedLC, ...) use instead of n_k
    label_noise: float = 10.0

    def validate(self, section: str) -> None:
        require(self.clip > 0, f"{section}.clip", self.clip, "must be > 0 (.inf: no clipping)")
        require(math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0, f"{section}.noise_multiplier",
                self.noise_multiplier, "must be a number >= 0")
        require(math.isfinite(self.clip) or self.noise_multiplier == 0 or self.mode == "none",
                f"{section}.clip", self.clip, "an infinite clip bounds nothing: it needs noise_multiplier 0")
        require(0 < self.delta < 1, f"{section}.delta", self.delta, "must be in (0, 1)")
        require(self.target_epsilon is None or self.target_epsilon > 0, f"{section}.target_epsilon",
                self.target_epsilon, "must be > 0 or null")
        require(not self.calibrate or self.target_epsilon is not None, f"{section}.calibrate", self.calibrate,
                "chooses the noise for privacy.target_epsilon: set one")
        require(not self.adaptive_clip or self.mode == "client", f"{section}.adaptive_clip", self.adaptive_clip,
                "adapts the clip of client updates: it needs privacy.mode: client")
        require(0 <= self.target_quantile <= 1, f"{section}.target_quantile", self.target_quantile,
                "must be in [0, 1]")
        require(self.clip_lr >= 0, f"{section}.clip_lr", self.clip_lr, "must be >= 0")
        require(self.count_noise is None or self.count_noise > 0, f"{section}.count_noise", self.count_noise,
                "must be > 0 or null")
        require(self.kmeans_steps >= 1, f"{section}.kmeans_steps", self.kmeans_steps, "must be >= 1")
        require(self.feature_clip is None or self.feature_clip > 0, f"{section}.feature_clip", self.feature_clip,
                "must be > 0 or null (.inf: no clipping, with noise_multiplier 0 only)")
        require(self.feature_clip is None or math.isfinite(self.feature_clip) or self.noise_multiplier == 0
                or self.mode == "none", f"{section}.feature_clip", self.feature_clip,
                "an infinite clip bounds nothing: it needs noise_multiplier 0")
        require(math.isfinite(self.label_noise) and self.label_noise > 0, f"{section}.label_noise",
                self.label_noise, "must be a number > 0")
        require(self.mode != "prototype", f"{section}.mode", self.mode,
                "is no longer offered: it released prototypes of a model trained without privacy on the same "
                "records, whose sensitivity nothing bounds; privacy.mode: sample trains with DP-SGD and releases "
                "the prototypes privately (docs/privacy.md)")


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)  # validated against the method's Hyper


@dataclass
class EvalConfig:
    every: int = 1  # global model (GM) and PA every k rounds; the last round always
    personal: bool = True  # evaluate the personalized models of the clients that trained
    # PM(V)/PM(L)/acc need a pass of every personalized model over the full test set: every
    # k rounds and the last (0 = on every evaluation round). PA (local test sets) is cheap
    # and comes with every evaluation round.
    personal_every: int = 10
    batch_size: int = 256  # measured fastest for inference on CPU (cache-sized batches)
    local_test_fraction: Optional[float] = None  # client test size / train size; null = |test|/|train|
    # after the last round, every client's personalized model (a local update from the final
    # server state, nothing aggregated) on the full and local test sets: keys all_* (docs/metrics.md)
    final_all_clients: bool = True

    def validate(self, section: str) -> None:
        require(self.every >= 1, f"{section}.every", self.every, "must be >= 1")
        require(self.personal_every >= 0, f"{section}.personal_every", self.personal_every, "must be >= 0")
        require(1 <= self.batch_size <= MAX_BATCH, f"{section}.batch_size", self.batch_size, BATCH_RULE)
        require(self.local_test_fraction is None or self.local_test_fraction > 0,
                 f"{section}.local_test_fraction", self.local_test_fraction, "must be > 0 or null")


@dataclass
class ExecutionConfig:
    # auto: one process per CPU core (at most one per client of a round), each with one
    # intra-op thread; 0 = sequential in this process; N = N worker processes
    workers: Union[int, Literal["auto"]] = "auto"
    # intra-op threads of the sequential executor (workers always use 1). With 1 the
    # numbers are the same in every mode and on any number of cores; 0 = torch's default
    threads: int = 1
    channels_last: Union[bool, Literal["auto"]] = "auto"  # auto: the model's measured preference
    # arithmetic of the clients' local training: bf16 = bfloat16 autocast for the forward
    # pass, fp32 weights, messages and aggregation (engine/precision.py); changes the results
    precision: Literal["fp32", "bf16"] = "fp32"
    # auto: a CUDA GPU when torch sees one, else the CPU (torch_device); cpu, cuda, cuda:N
    device: str = "auto"
    # with worker processes: evaluate round t's global model as a pool task while round t+1
    # trains (same numbers; its row comes when that is done). Not on checkpoint rounds, the
    # last round, or with a callback that must see each row at once (docs/metrics.md)
    overlap_eval: bool = True
    # where client tasks run (engine/backends.py EXECUTORS): local = this machine (the
    # ``workers`` above); ray = actors on a Ray cluster (docs/scale.md). The options below
    # apply to ray only.
    backend: str = "local"
    address: Optional[str] = None  # "host:port" of a running cluster's head; null = a private local Ray
    actors: Union[int, Literal["auto"]] = "auto"  # auto: cluster CPUs / client_resources.num_cpus
    client_resources: dict = field(default_factory=lambda: {"num_cpus": 1.0, "num_gpus": 0.0})
    retries: int = 2  # a task whose actor or node died runs again on another actor this often
    state: Literal["driver", "cluster"] = "driver"  # where per-client state lives between rounds
    data: Literal["ship", "node"] = "ship"  # ship: once through the object store; node: each node loads it
    # how a round's clients train on one device (docs/gpu.md): sequential = one after another;
    # batched = the sampled clients stacked and trained in one set of kernels (methods that
    # support it, else sequential with a note); auto = batched on a GPU, sequential on the CPU
    executor: Literal["auto", "sequential", "batched"] = "auto"
    batch_clients: int = 0  # batched: at most this many clients at a time (slots); 0 = chosen per stack
    # batched: compile the stack's whole step (forward, backward, clipping, the optimizer's
    # update) with torch.compile (on a GPU with CUDA graphs), once per run signature (the
    # learning rate an input), for stacks whose step has one fixed shape (with pad_batches,
    # every step: the last ones step free slots on padding); results within float rounding
    compile: bool = False
    # batched: pad a client's short batch (an epoch's last) with masked rows, so that a stack
    # steps all its slots at one batch size instead of once per size: for methods whose loss
    # is a mean over its samples (not Algorithm.couples_samples) on models without BatchNorm;
    # results within float rounding. auto: on a GPU (fewer, larger steps), off on the CPU
    pad_batches: Union[bool, Literal["auto"]] = "auto"
    # batched: a stack step's convolutions as matrix products of weights and patches
    # (engine/stack_kernels.py): true = every one, one_channel = those with one input channel
    # (PyTorch's depthwise kernels under vmap); results within float rounding. false until
    # a GPU shows where it repays (benchmarks/gpu.py --conv-as-matmul)
    conv_as_matmul: Union[bool, Literal["one_channel"]] = False
    # sweep / reproduce: the grid's runs in this process, their clients in shared stacks of the
    # batched executor (engine/packed.py; on a GPU, many runs fill it as one run cannot)
    pack_runs: bool = False
    # per-client state (personal models, heads, control variates) kept in memory on the
    # driver; beyond it, the least recently used states go to <run folder>/client_state/ and
    # are read back when their client is sampled. null = no limit (state: driver only)
    state_memory_mb: Optional[float] = 512

    @property
    def torch_device(self) -> str:
        """The device the run trains on: ``device`` with ``auto`` resolved on this machine."""
        return resolve_device(self.device)

    @property
    def pads(self) -> bool:
        """``pad_batches`` with ``auto`` resolved: on a GPU, not on the CPU."""
        return self.pad_batches is True or (self.pad_batches == "auto" and self.torch_device != "cpu")

    @property
    def stack_kernels(self) -> Literal["off", "one_channel", "all"]:
        """``conv_as_matmul`` as :class:`~protofl.engine.stack_kernels.StackKernels` names it."""
        if self.conv_as_matmul is True:
            return "all"
        return "one_channel" if self.conv_as_matmul == "one_channel" else "off"

    def validate(self, section: str) -> None:
        require(self.batch_clients >= 0, f"{section}.batch_clients", self.batch_clients, "must be >= 0")
        require(self.workers == "auto" or self.workers >= 0, f"{section}.workers", self.workers, "must be >= 0 or auto")
        require(self.threads >= 0, f"{section}.threads", self.threads, "must be >= 0")
        require(self.device in ("auto", "cpu") or self.device.startswith("cuda"), f"{section}.device", self.device,
                "expected auto, cpu or cuda[:N]")
        require(self.actors == "auto" or self.actors >= 1, f"{section}.actors", self.actors, "must be >= 1 or auto")
        require(self.retries >= 0, f"{section}.retries", self.retries, "must be >= 0")
        if self.state_memory_mb is not None:
            self.state_memory_mb = coerce(self.state_memory_mb, float, f"{section}.state_memory_mb")
            require(math.isfinite(self.state_memory_mb) and self.state_memory_mb >= 0, f"{section}.state_memory_mb",
                    self.state_memory_mb, "must be >= 0 (MB), or null for no limit")
        unknown = set(self.client_resources) - {"num_cpus", "num_gpus"}
        require(not unknown, f"{section}.client_resources", self.client_resources, "allowed keys: num_cpus, num_gpus")
        res = {"num_cpus": 1.0, "num_gpus": 0.0}
        for k, v in self.client_resources.items():
            res[k] = coerce(v, float, f"{section}.client_resources.{k}")
        require(res["num_cpus"] > 0 and res["num_gpus"] >= 0, f"{section}.client_resources", self.client_resources,
                 "num_cpus must be > 0 and num_gpus >= 0")
        self.client_resources = res
        if self.address is not None:
            host, _, port = self.address.rpartition(":")
            require(self.address != "auto", f"{section}.address", self.address,
                     "give the head node's host:port explicitly ('auto' would join whichever cluster "
                     "the machine's shared Ray files point to)")
            require(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"{section}.address", self.address,
                     "expected host:port, e.g. 10.0.0.1:6379")
        if self.backend != "ray":
            require(self.state == "driver", f"{section}.state", self.state, "state: cluster needs backend: ray")
            require(self.address is None, f"{section}.address", self.address, "an address needs backend: ray")


@dataclass
class OutputConfig:
    dir: str = "runs"
    name: Optional[str] = None  # run folder name; null = derived from the config
    checkpoint_every: int = 10  # rounds; 0 = only at the end
    progress: bool = True  # a bar on a terminal / in a notebook, else plain log lines
    log_every: int = 1  # without a terminal: one log line every N rounds (and the last)
    save_model: bool = True
    trackers: list[str] = field(default_factory=list)  # tensorboard, mlflow, wandb (optional extras)
    tracking_uri: Optional[str] = None  # MLflow; null = SQLite store <dir>/mlflow.db
    experiment: str = "protofl"  # MLflow experiment name; W&B project

    def validate(self, section: str) -> None:
        require(self.checkpoint_every >= 0, f"{section}.checkpoint_every", self.checkpoint_every, "must be >= 0")
        require(self.log_every >= 1, f"{section}.log_every", self.log_every, "must be >= 1")
        if self.name is not None:  # joined to output.dir: it must stay inside it
            check_path_component(f"{section}.name", self.name)
        for i, t in enumerate(self.trackers):
            require(t in TRACKERS, f"{section}.trackers[{i}]", t, f"unknown tracker; known: {', '.join(TRACKERS)}")


def ceil_fraction(fraction: float, n: int) -> int:
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))
