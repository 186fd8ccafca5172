"""The engine's side of differential privacy (``privacy.*``, docs/privacy.md).

* :class:`ClientPrivacy` is ``ctx.privacy``: a client's privacy settings for one turn,
  its noise streams (keyed by the client's secret), its one release of its label counts
  and what it spent (DP-SGD steps, prototype releases), returned with its training
  numbers. Under ``privacy.mode: client`` it clips the reply's update before it leaves.
* :class:`ServerPrivacy` is the round loop's hook: the server's secret, the clip C_t in
  the broadcast, the private release of the round's updates (DP-FedAvg) that the method's
  aggregate receives in place of the replies, adaptive clipping, the ledgers, ``epsilon``
  in every round's row and the stop at ``privacy.target_epsilon``.
* :class:`Accountant`: epsilon at delta of a ledger of DP events, by Google's
  ``dp-accounting`` (its RDP or PLD accountant).
* :func:`check_privacy`: what a mode covers, checked before any work.

**Noise from a secret** (``privacy.noise: secret``, the default). The server draws a
32-byte key from the OS (``os.urandom``) and keeps it in its checkpoint, nowhere else
(not in config.yaml, a log, a record or a message); every client's key is derived from
it in a simulation, and over Flower each SuperNode makes its own and keeps it in its
node state (file mode 0600). Every noise draw, the client sampling under ``client`` and
the batch sampling under ``sample`` come from streams keyed by (key, purpose, round,
client) through BLAKE2b, so nobody without the key can regenerate them from the run's
seed, and a resume from the checkpoint continues them exactly. ``privacy.noise:
seeded`` keys them by the seed instead (replayable: for tests; such a run is not
private and says so wherever its epsilon is printed).

**client** (McMahan et al., ICLR 2018, "Learning Differentially Private Recurrent
Language Models", DP-FedAvg with w_k = 1 and the fixed-denominator estimator f~_f):
client k sends w_t + clip(Delta_k), Delta_k = w_k - w_t clipped to L2 norm C_t (on the
client; the server clips again, so a client that did not cannot exceed it); integer
buffers (BatchNorm's batch counter) go back as they were sent, and the reply carries the
public weight 1 instead of n_k. The server releases

    w~ = w_t + (sum_k clip(Delta_k) + N(0, (sigma_Delta C_t)^2 I)) / m

over the replies that arrived, m the expected number of sampled clients (public), and
hands the method's aggregate one reply holding w~: its server half sees nothing but the
release, so whatever it makes of it is post-processing. With adaptive clipping (Andrew
et al., NeurIPS 2021, Algorithm 1 with geometric updates) each client also sends
b_k = [||Delta_k|| <= C_t]; the server estimates b~ = (sum_k (b_k - 1/2) + N(0,
sigma_b^2)) / m + 1/2 and sets C_{t+1} = C_t exp(-eta (b~ - gamma)); sigma_Delta =
(sigma^-2 - (2 sigma_b)^-2)^-1/2 keeps the round's total noise multiplier at sigma (their
Theorem 1). Accounting per round: Poisson sampling -> the Poisson-subsampled Gaussian
(add/remove one client); fixed-size sampling of m < K -> the Gaussian sampled without
replacement (Wang, Balle & Kasiviswanathan, AISTATS 2019) under replace-one, whose
sensitivity is 2 C (multiplier sigma / 2); every client each round -> the Gaussian
mechanism (add/remove). The client sampling is drawn from the server's secret.

**sample** protects one training record of one client, whatever the client sends:

1. once per run, the client releases its label counts, n_kc + N(0, label_noise^2) per
   class (sensitivity 1), rounded and at least 0 (n~_k their sum, at least 1): its
   Poisson rate q_k = B / n~_k, its step count, its aggregation weight and any loss that
   reads its label distribution (``ctx.class_counts``) use these, never n_k;
2. every ``ctx.fit`` is DP-SGD (Abadi et al., CCS 2016) on Poisson-sampled batches: each
   record joins a step's batch independently with probability q_k (drawn from the
   client's secret), each per-sample gradient clipped to C, N(0, sigma^2 C^2) on their
   sum, divided by B (the expected batch size), as Opacus does;
3. every prototype it sends is a Gaussian release of clipped features' per-class sums
   and counts (``protofl.nn.privacy``, sensitivity sqrt(2) C) of the model step 2 trained.

A client's ledger composes all of it (adaptive composition: each step's mechanism has its
sensitivity whatever the earlier outputs were); a round's ``epsilon`` is the largest over
the clients. Only the turns a client trained in count, with no amplification by client
sampling claimed, and every turn counts: the method's declared fits and releases
(:meth:`~protofl.algorithms.base.Algorithm.private_fits`, ``prototype_releases``) plan the
budget, the spend is what the client reports, a rejected reply's included, and the
final evaluation of every client's personalized model (``eval.final_all_clients``) too.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union, cast

import numpy as np
import torch
from torch import nn

from ..algorithms.base import average, GlobalModel
from ..config import Config, ConfigError
from ..messages import Record
from ..nn.privacy import gaussian, NoiseStream
from .train import total_steps

if TYPE_CHECKING:
    from ..algorithms.base import TaskInfo
    from .client import ClientOutput, ClientTask

log = logging.getLogger("protofl")

CLIP_KEY = "privacy.clip"  # Record.config of the broadcast: this round's C_t (client mode)
SIGMA_KEY = "privacy.sigma"  # Record.config of the broadcast: a calibrated sigma (sample mode)
UNCLIPPED_KEY = "privacy.unclipped"  # Record.metrics of a reply: b_k (adaptive clipping)
# the server clips a reply again when its update exceeds C_t by more than float rounding
SERVER_SLACK = 1e-5
INSTALL = "pip install 'protofl[privacy]'"
SECRET_BYTES = 32
# what a run under privacy.noise: seeded says beside every epsilon it prints, and the key
# of its metrics rows that tells the printers so
NOT_PRIVATE = "not private: seeded noise"
SEEDED_KEY = "privacy_seeded"


def _library() -> Any:
    try:
        import dp_accounting
        from dp_accounting import pld, rdp  # noqa: F401
    except ImportError:
        raise ConfigError("privacy.mode", "(any but none)", f"needs Google's dp-accounting package: {INSTALL}") \
            from None
    return dp_accounting


# ---------------------------------------------------------------------------------------
# secrets and the streams they key
# ---------------------------------------------------------------------------------------
def new_secret() -> bytes:
    """A party's noise key: 32 bytes of OS entropy."""
    return os.urandom(SECRET_BYTES)


def derive(secret: bytes, *keys: object) -> bytes:
    """A 32-byte sub-key of ``secret`` for ``keys`` (keyed BLAKE2b): a client's key from the
    server's in a simulation. Nobody without ``secret`` can compute it."""
    return hashlib.blake2b(repr(keys).encode(), key=secret, digest_size=SECRET_BYTES).digest()


def seed_key(seed: int) -> bytes:
    """The key of a ``privacy.noise: seeded`` run: a function of its public seed (replayable)."""
    return hashlib.blake2b(f"protofl seeded noise {int(seed)}".encode(), digest_size=SECRET_BYTES).digest()


def stream(secret: Optional[bytes], seed: int, *keys: object) -> NoiseStream:
    """The noise stream for ``keys`` (:class:`~protofl.nn.privacy.NoiseStream`, SHAKE-256):
    keyed by ``secret``, or (``secret`` None: ``privacy.noise: seeded``) by the run's
    ``seed``, which anyone holding config.yaml can replay."""
    return NoiseStream(seed_key(seed) if secret is None else secret, keys)


def seeded(cfg: Config) -> bool:
    """Whether the run's noise is replayable from its seed (``privacy.noise: seeded``)."""
    return cfg.privacy.noise == "seeded"


def noisy_label_counts(counts: np.ndarray, std: float, secret: Optional[bytes], seed: int,
                       cid: int) -> np.ndarray:
    """Client ``cid``'s one release of its label counts: each count plus N(0, std^2) from the
    client's stream ("privacy", "label_counts", cid) -- the same draw every round, so every
    round reads the same release -- rounded, at least 0 (int64)."""
    z = stream(secret, seed, "privacy", "label_counts", cid).normal((len(counts),), torch.float64).numpy()
    return np.maximum(np.rint(np.asarray(counts, dtype=np.float64) + std * z), 0).astype(np.int64)


def released_size(noisy_counts: np.ndarray) -> int:
    """n~_k: the sum of the released label counts, at least 1."""
    return max(1, int(np.sum(noisy_counts)))


# ---------------------------------------------------------------------------------------
# the accountant
# ---------------------------------------------------------------------------------------
# A ledger is {event: count}. Events are plain tuples (cached, checkpointed):
#   ("gaussian", z)          the Gaussian mechanism, noise multiplier z
#   ("poisson", q, z)        ... on a Poisson sample of rate q
#   ("wor", n, m, z)         ... on a uniform sample of m of n, without replacement (replace-one)
Event = tuple[Any, ...]
Ledger = Mapping[Event, int]


class Accountant:
    """epsilon at ``delta`` of a ledger, by dp-accounting's ``RdpAccountant`` (its default
    orders, or ``orders``) or ``PLDAccountant`` (``kind``), under add/remove-one or
    (``replace_one``) replace-one."""

    def __init__(self, kind: str, delta: float, replace_one: bool = False,
                 orders: Optional[Sequence[float]] = None) -> None:
        self.dp = _library()
        self.kind, self.delta, self.orders = kind, delta, orders
        rel = self.dp.NeighboringRelation
        self.relation = rel.REPLACE_ONE if replace_one else rel.ADD_OR_REMOVE_ONE
        self._cache: dict[tuple[tuple[Event, int], ...], float] = {}

    def event(self, ev: Event) -> Any:
        E = self.dp.dp_event
        kind, *args = ev
        if kind == "gaussian":
            return E.GaussianDpEvent(args[0])
        if kind == "poisson":
            return E.PoissonSampledDpEvent(args[0], E.GaussianDpEvent(args[1]))
        if kind == "wor":
            return E.SampledWithoutReplacementDpEvent(args[0], args[1], E.GaussianDpEvent(args[2]))
        raise ValueError(f"unknown privacy event {ev!r}")

    def epsilon(self, ledger: Ledger) -> float:
        """The ledger's epsilon at delta (0 for an empty one, inf with a noise multiplier 0)."""
        key = tuple(sorted((ev, int(c)) for ev, c in ledger.items() if c > 0))
        if not key:
            return 0.0
        if key not in self._cache:
            if any(ev[-1] <= 0 for ev, _ in key):
                eps = math.inf  # no noise: no guarantee
            else:
                acc = (self.dp.rdp.RdpAccountant(self.orders, self.relation) if self.kind == "rdp"
                       else self.dp.pld.PLDAccountant(neighboring_relation=self.relation))
                quiet = logging.getLogger("absl")  # RDP orders that do not converge are dropped, with a warning each
                level = quiet.level
                quiet.setLevel(logging.ERROR)
                try:
                    for ev, count in key:
                        acc.compose(self.event(ev), count)
                    eps = float(acc.get_epsilon(self.delta))
                finally:
                    quiet.setLevel(level)
            self._cache[key] = eps
        return self._cache[key]


def add(ledger: Ledger, more: Ledger) -> dict[Event, int]:
    out = dict(ledger)
    for ev, c in more.items():
        out[ev] = out.get(ev, 0) + c
    return out


# ---------------------------------------------------------------------------------------
# the client's side
# ---------------------------------------------------------------------------------------
def clip_update(weights: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor], clip: float,
                slack: float = 0.0) -> tuple[dict[str, torch.Tensor], float]:
    """``weights`` with their update w - w_t (over the floating entries, w_t = ``sent``)
    scaled to L2 norm ``clip`` when it exceeds ``clip * (1 + slack)``, and the update's norm
    (summed in float64). Within the bound the floating entries are returned as they are;
    the other entries (integer buffers: a count of batches says how much data there was)
    are ``sent``'s."""
    keys = [k for k, v in weights.items() if v.is_floating_point()]
    sq = sum(float((weights[k].double() - sent[k].to(weights[k].device).double()).pow(2).sum()) for k in keys)
    norm = math.sqrt(sq)
    out = {k: (v if v.is_floating_point() or k not in sent else sent[k].to(v.device, v.dtype))
           for k, v in weights.items()}
    if norm <= clip * (1.0 + slack):
        return out, norm
    f = clip / norm
    for k in keys:
        base = sent[k].to(weights[k].device, weights[k].dtype)
        out[k] = base + (weights[k] - base) * f
    return out, norm


class ClientPrivacy:
    """``ctx.privacy``: one (round, client)'s privacy settings, streams and spend.

    ``mode``, ``clip`` (C_t under ``client``: the broadcast's), ``feature_clip``, ``sigma``,
    ``kmeans_steps``;
    ``key``: the client's secret (None under ``privacy.noise: seeded``). :meth:`generator`
    (a CPU stream per purpose, a fresh one at each call), :meth:`noise_generator` and
    :meth:`batch_generator` (DP-SGD's noise and Poisson sampling, one each per turn),
    :meth:`label_counts` (the one release of the label counts), :meth:`spend` (prototype
    releases), :meth:`trained` (DP-SGD steps), :meth:`clip_reply`.
    """

    def __init__(self, cfg: Config, rnd: int, cid: int, msg: Optional[Record] = None,
                 key: Optional[bytes] = None) -> None:
        p = cfg.privacy
        if key is None and not seeded(cfg):
            raise RuntimeError(f"client {cid} has no noise key: privacy.noise: secret needs each client's own key "
                               "(the engine hands it over with the client's task, a Flower node keeps its own)")
        self.mode, self.sigma, self.kmeans_steps, self.adaptive = p.mode, p.noise_multiplier, p.kmeans_steps, \
            p.adaptive_clip
        self.label_noise = p.label_noise
        self.clip = float(msg.config.get(CLIP_KEY, p.clip)) if msg is not None else p.clip
        if msg is not None and SIGMA_KEY in msg.config:  # privacy.calibrate: the server's choice
            self.sigma = float(msg.config[SIGMA_KEY])
        # the bound of one sample's features in a prototype release (privacy.feature_clip)
        self.feature_clip = p.clip if p.feature_clip is None else p.feature_clip
        self.seed, self.rnd, self.cid, self.key = cfg.seed, rnd, cid, key
        self.sent = msg.weights if msg is not None else {}
        self.releases = 0
        self.steps: dict[float, int] = {}  # DP-SGD steps by sampling rate q = B / n~_k
        self.labels_read = False
        self._labels: Optional[np.ndarray] = None
        self._draws: dict[str, int] = {}
        self._noise: Optional[NoiseStream] = None
        self._batches: Optional[NoiseStream] = None

    def _stream(self, *keys: object) -> NoiseStream:
        return stream(self.key, self.seed, "privacy", *keys)

    def generator(self, purpose: str) -> NoiseStream:
        """A CPU stream for (round, client, ``purpose``); each call of a purpose the next one."""
        i = self._draws.get(purpose, 0)
        self._draws[purpose] = i + 1
        return self._stream(purpose, self.rnd, self.cid, i)

    def noise_generator(self) -> NoiseStream:
        """DP-SGD's noise stream of this turn (one for all its ctx.fit calls; drawn on the CPU,
        moved to the training device)."""
        if self._noise is None:
            self._noise = self._stream("dpsgd", self.rnd, self.cid)
        return self._noise

    def batch_generator(self) -> NoiseStream:
        """DP-SGD's Poisson sampling stream of this turn (CPU; one for all its ctx.fit calls):
        secret like the noise, or the subsampling's amplification would not hold."""
        if self._batches is None:
            self._batches = self._stream("batches", self.rnd, self.cid)
        return self._batches

    def label_counts(self, counts: np.ndarray) -> np.ndarray:
        """(C,) the client's released label counts (:func:`noisy_label_counts`): the same
        release every round; reading it counts it (once per run) in the client's ledger."""
        if self._labels is None:
            self._labels = noisy_label_counts(counts, self.label_noise, self.key, self.seed, self.cid)
        self.labels_read = True
        return self._labels

    def spend(self, releases: int) -> None:
        """Count private releases of the client's records (prototype helpers)."""
        self.releases += int(releases)

    def trained(self, steps: int, q: float) -> None:
        """Count DP-SGD steps at Poisson rate ``q``."""
        if steps and self.mode == "sample":
            self.steps[q] = self.steps.get(q, 0) + int(steps)

    def clip_reply(self, reply: Record) -> Record:
        """Under ``client``: the reply with its update clipped to C_t (and b_k with adaptive
        clipping), its integer buffers as sent, before it leaves the client."""
        weights, norm = clip_update(reply.weights, self.sent, self.clip)
        metrics = dict(reply.metrics)
        if self.adaptive:
            metrics[UNCLIPPED_KEY] = float(norm <= self.clip)
        return Record(reply.arrays, metrics, dict(reply.config), weights, reply.num_samples)

    def report(self) -> dict[str, float]:
        """What the client spent this turn, for its training numbers (``dp_*``)."""
        out: dict[str, float] = {}
        if self.releases:
            out["dp_releases"] = float(self.releases)
        if self.steps:
            for i, (q, n) in enumerate(sorted(self.steps.items())):  # one entry per rate (fits may differ in B)
                out[f"dp_q{i}"], out[f"dp_steps{i}"] = float(q), float(n)
        if self.labels_read:
            out["dp_labels"] = 1.0
        return out


def spent_of(train: Mapping[str, float], z: float, label_noise: float) -> dict[Event, int]:
    """A client's report (:meth:`ClientPrivacy.report`) as ledger events; the label counts'
    release is ``("labels", label_noise)``, which the server counts once per client."""
    out: dict[Event, int] = {}
    if train.get("dp_releases"):
        out[("gaussian", z)] = int(train["dp_releases"])
    i = 0
    while f"dp_q{i}" in train:
        ev = ("poisson", float(train[f"dp_q{i}"]), z)
        out[ev] = out.get(ev, 0) + int(train[f"dp_steps{i}"])
        i += 1
    if train.get("dp_labels"):
        out[("labels", label_noise)] = 1
    return out


# ---------------------------------------------------------------------------------------
# what each mode covers
# ---------------------------------------------------------------------------------------
def _batch_coupled(model: nn.Module) -> Optional[str]:
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return f"{name or 'the model'} ({type(m).__name__})"
    return None


def check_privacy(cfg: Config, algorithm: Any, model: Optional[nn.Module] = None) -> None:
    """Refuse (:class:`ConfigError`, exit 2) a privacy mode the method's messages or the
    model escape: ``client`` covers methods whose server half is GlobalModel's average of
    the replies' weights and whose replies carry nothing else; ``sample`` methods whose
    replies are model weights and prototypes they release through :mod:`protofl.nn.privacy`
    (``prototype_releases``), whose loss evaluates each sample alone, with a model without
    BatchNorm (its batch statistics mix the samples a per-sample gradient must keep apart)."""
    p, name = cfg.privacy, cfg.algorithm.name
    if p.mode == "none":
        return
    _library()
    arrays = algorithm.reply_arrays
    if p.mode == "client":
        if not isinstance(algorithm, GlobalModel) or type(algorithm).aggregate is not GlobalModel.aggregate:
            raise ConfigError("privacy.mode", p.mode, f"{name}'s server does more with the replies than average "
                              "their weights, so client-level DP of that average would not cover it (it covers "
                              "FedAvg-like methods: fedavg, fedprox, moon, ditto, fedper, ...)")
        if arrays != ():
            raise ConfigError("privacy.mode", p.mode, f"{name}'s replies carry arrays besides the model weights "
                              f"({', '.join(arrays or ['undeclared'])}), which client-level DP does not cover")
    elif p.mode == "sample":
        if arrays != () and algorithm.prototype_releases(p) <= 0:
            raise ConfigError("privacy.mode", p.mode, f"{name}'s replies carry arrays besides the model weights "
                              f"({', '.join(arrays or ['undeclared'])}) that it does not release privately "
                              "(methods whose prototypes are: " + ", ".join(prototype_methods(p)) + ")")
        if algorithm.couples_samples:
            raise ConfigError("privacy.mode", p.mode, f"{name}'s local loss couples the samples of a batch, which "
                              "DP-SGD's per-sample gradients would take apart")
        coupled = _batch_coupled(model) if model is not None else None
        if coupled is not None:
            raise ConfigError("privacy.mode", p.mode, f"model {cfg.model.name!r} has batch normalization in "
                              f"{coupled}: its batch statistics mix samples, so per-sample gradients cannot "
                              "bound one sample's influence (use a model without BatchNorm, e.g. GroupNorm)")


def prototype_methods(p: Any) -> list[str]:
    """The registered methods that release prototypes privately under ``privacy.mode: sample``."""
    from ..algorithms import ALGORITHMS

    out = []
    for n in ALGORITHMS.names():
        cls = ALGORITHMS.get(n)
        try:
            algo = cls(cls.Hyper(), cast("TaskInfo", None))  # no task: a method that needs one raises
        except Exception:  # noqa: BLE001 - a method that needs its task to be made is asked no further
            continue
        if algo.prototype_releases(p) > 0:
            out.append(n)
    return out


# ---------------------------------------------------------------------------------------
# the server's side
# ---------------------------------------------------------------------------------------
class ServerPrivacy:
    """The round loop's hook (engine/simulation.py): :meth:`broadcast`, :meth:`release`,
    :meth:`account`, :meth:`stop_reason`, :meth:`client_key`; :meth:`state` /
    :meth:`restore` for checkpoints (the server's secret is in them, and only there).

    ``client_counts``: (K, C) the clients' label counts. The server never uses them as
    they are: under ``sample`` its plan of a client reads the client's own release of them
    (:func:`noisy_label_counts` with the client's key; ``plan_exact``: the counts
    themselves, for :func:`noise_for_epsilon`'s calibration before any run)."""

    def __init__(self, cfg: Config, algorithm: Any, participation: Any, client_counts: Union[Sequence[Sequence[int]], np.ndarray[Any, Any]],
                 model: Optional[nn.Module] = None, plan_exact: bool = False) -> None:
        check_privacy(cfg, algorithm, model)
        p = self.p = cfg.privacy
        self.cfg, self.algorithm, self.participation = cfg, algorithm, participation
        self.counts = [np.asarray(c, dtype=np.int64) for c in client_counts]
        self.plan_exact = plan_exact
        self.secret: Optional[bytes] = None if seeded(cfg) else new_secret()
        self.mode = p.mode
        self.m, K = participation.m, participation.K
        self.clip = p.clip  # C_t
        self.sigma_b = p.count_noise if p.count_noise is not None else self.m / 20.0
        self.fixed = cfg.participation.sampling == "fixed" and self.m < K
        if self.mode == "client" and self.fixed and p.accountant == "pld":
            raise ConfigError("privacy.accountant", p.accountant, "the PLD accountant has no sampling without "
                              "replacement: use participation.sampling: poisson, or privacy.accountant: rdp")
        self.set_sigma(p.noise_multiplier)
        self.check_count_noise()
        self.accountant = Accountant(p.accountant, p.delta, replace_one=self.mode == "client" and self.fixed)
        self.rounds = 0  # client: rounds released
        self.ledgers: dict[int, dict[Event, int]] = {}  # sample: per client
        self.last: dict[int, dict[Event, int]] = {}  # per client: its last turn's spend
        self.eps: dict[int, float] = {}  # per client: its epsilon
        self.keys: Optional[list[str]] = None  # client: the weights a reply carries
        self._noisy: dict[int, int] = {}  # n~_k of the plan
        self.keep_participation_secret()
        if p.calibrate:
            self.calibrate()
            self.check_count_noise()
        if p.target_epsilon is not None:
            e = self.predicted(1)
            if e > p.target_epsilon:
                raise ConfigError("privacy.target_epsilon", p.target_epsilon, f"round 1 alone would spend "
                                  f"epsilon {e:.4g} at delta {p.delta:g}; raise the target or the noise")

    # -- the noise multiplier ----------------------------------------------------------------
    def set_sigma(self, z: float) -> None:
        """sigma and what follows from it: the update's share under adaptive clipping
        (sigma_Delta), client-level DP's event of a round."""
        self.z = float(z)
        self.z_update = self.z
        if self.p.adaptive_clip and self.z > 0 and 2 * self.sigma_b > self.z:
            self.z_update = (self.z ** -2 - (2 * self.sigma_b) ** -2) ** -0.5
        if self.mode != "client" or self.m == self.participation.K:
            self.round_event: Event = ("gaussian", self.z)
        elif self.fixed:  # replace-one: one client's clipped update replaced by another moves the sum by 2 C
            self.round_event = ("wor", self.participation.K, self.m, self.z / 2)
        else:
            self.round_event = ("poisson", self.participation.q, self.z)

    def check_count_noise(self) -> None:
        if self.p.adaptive_clip and self.z > 0 and 2 * self.sigma_b <= self.z:
            raise ConfigError("privacy.count_noise", self.sigma_b, f"must exceed noise_multiplier / 2 = "
                              f"{self.z / 2:g}: the update's noise is (sigma^-2 - (2 count_noise)^-2)^-1/2")

    def calibrate(self) -> None:
        """``privacy.calibrate``: sigma := the smallest noise multiplier with which this run, as
        planned (its rounds, the final evaluation of every client if it makes one, each
        client's own released label counts under ``sample``), ends at
        ``privacy.target_epsilon`` (to 0.5 %; :func:`smallest_sigma`). Chosen once, at the
        start, from public and released values only, and kept in the checkpoint."""
        target = self.p.target_epsilon
        assert target is not None  # the config asks for one with privacy.calibrate

        def spent(z: float) -> float:
            self.set_sigma(z)
            return self.predicted(1, self.cfg.rounds, then_final=True)

        self.set_sigma(smallest_sigma(spent, target))

    # -- keys ------------------------------------------------------------------------------
    def keep_participation_secret(self) -> None:
        """Under ``client``, the client sampling from the server's secret: its amplification
        holds only if nobody can replay who was asked (under ``sample`` none is claimed)."""
        if self.mode == "client" and self.secret is not None:
            self.participation.secret = derive(self.secret, "participation")

    def client_key(self, cid: int) -> Optional[bytes]:
        """Client ``cid``'s noise key in a simulation (None under ``privacy.noise: seeded``)."""
        return None if self.secret is None else derive(self.secret, "client", int(cid))

    def _stream(self, *keys: object) -> NoiseStream:
        return stream(self.secret, self.cfg.seed, "privacy", *keys)

    def count_bound(self, n: int) -> int:
        """The largest sample count a reply of a client with n samples may carry: under
        ``sample`` its release n~_k, within 5 noise stds per class of n (a bound it passes
        with probability about 1 - 3e-7 per class); under ``client`` 1."""
        if self.mode == "client":
            return 1
        C = len(self.counts[0]) if self.counts else 1
        return n + math.ceil(5 * self.p.label_noise * C)

    # -- the budget ------------------------------------------------------------------------
    def epsilon(self) -> float:
        if self.mode == "client":
            return self.accountant.epsilon({self.round_event: self.rounds})
        return max(self.eps.values(), default=0.0)

    def _ledger_epsilon(self, ledger: Ledger) -> float:
        """A client's epsilon: its label counts' release (("labels", std): a Gaussian of
        multiplier std, sensitivity 1) as the Gaussian event it is."""
        merged: dict[Event, int] = {}
        for ev, c in ledger.items():
            ev = ("gaussian", ev[1]) if ev[0] == "labels" else ev
            merged[ev] = merged.get(ev, 0) + c
        return self.accountant.epsilon(merged)

    def released_size(self, cid: int) -> int:
        """n~_k as the plan reads it: the client's release (its key), or ``plan_exact``'s n_k."""
        if cid not in self._noisy:
            c = self.counts[cid]
            self._noisy[cid] = max(1, int(c.sum())) if self.plan_exact else released_size(
                noisy_label_counts(c, self.p.label_noise, self.client_key(cid), self.cfg.seed, cid))
        return self._noisy[cid]

    def planned(self, cid: int, evaluating: bool, final: bool = False,
                so_far: Optional[Ledger] = None) -> dict[Event, int]:
        """What client ``cid`` is expected to spend in a turn (``evaluating``: one whose
        personalized model is evaluated): the method's declared fits (``private_fits``) and
        prototype releases, its label counts' release if its ledger (``so_far``: with the
        turns planned before this one) does not hold it, at least what its last turn spent."""
        tc, n = self.cfg.training, self.released_size(cid)
        plan: dict[Event, int] = {}
        for o in self.algorithm.private_fits(evaluating, final):
            B = int(o.get("batch_size", tc.batch_size))
            steps = o.get("steps", tc.steps)
            q = min(1.0, B / n)
            ev = ("poisson", q, self.z)
            plan[ev] = plan.get(ev, 0) + total_steps(n, B, int(o.get("epochs", tc.epochs)), steps)
        releases = self.algorithm.prototype_releases(self.p)
        if releases:
            plan[("gaussian", self.z)] = releases
        if not any(ev[0] == "labels" for ev in (self.ledgers.get(cid, {}) if so_far is None else so_far)):
            plan[("labels", self.p.label_noise)] = 1
        last = {ev: c for ev, c in self.last.get(cid, {}).items() if ev[0] != "labels"}
        return {ev: max(plan.get(ev, 0), last.get(ev, 0)) for ev in {**plan, **last}}

    def predicted(self, rnd: int, last: Optional[int] = None, everyone: bool = False,
                  then_final: bool = False) -> float:
        """epsilon after round ``rnd`` (after rounds rnd..``last``) if it runs (they run) as
        planned; ``everyone``: the final evaluation's turn of every client instead;
        ``then_final``: and after it that final turn, if the run makes one (sample-level DP
        with ``eval.final_all_clients``)."""
        last = rnd if last is None else last
        if self.mode == "client":
            return self.accountant.epsilon({self.round_event: self.rounds + last - rnd + 1})
        ev = self.cfg.eval
        ledgers: dict[int, dict[Event, int]] = {}
        for r in range(rnd, last + 1):
            evaluating = everyone or (ev.personal and (r == self.cfg.rounds or (ev.every > 0 and r % ev.every == 0)))
            turns = range(len(self.counts)) if everyone else \
                self.participation.arriving(r, self.participation.selected(r))
            for c in turns:
                led = ledgers.get(c, self.ledgers.get(c, {}))
                ledgers[c] = add(led, self.planned(c, evaluating, everyone, led))
        if then_final and ev.personal and ev.final_all_clients:
            for c in range(len(self.counts)):
                led = ledgers.get(c, self.ledgers.get(c, {}))
                ledgers[c] = add(led, self.planned(c, True, True, led))
        return max([self.epsilon()] + [self._ledger_epsilon(led) for led in ledgers.values()])

    def stop_reason(self, rnd: int, everyone: bool = False) -> Optional[str]:
        """Why round ``rnd`` (``everyone``: the final evaluation of every client) must not run
        (it would pass ``privacy.target_epsilon``), or None."""
        t = self.p.target_epsilon
        if t is None:
            return None
        e = self.predicted(rnd, everyone=everyone)
        if e <= t:
            return None
        if everyone:
            return (f"privacy budget: the final evaluation of every client would take epsilon to {e:.4g} > "
                    f"privacy.target_epsilon {t:g} (delta {self.p.delta:g}); it was not run")
        return (f"privacy budget: round {rnd} would take epsilon to {e:.4g} > privacy.target_epsilon {t:g} "
                f"(delta {self.p.delta:g}); stopped after round {rnd - 1}")

    # -- the round -------------------------------------------------------------------------
    def broadcast(self, shared: Record) -> Record:
        """Under ``client``: the broadcast with this round's clip C_t (the clients clip to it);
        under ``sample`` with a calibrated sigma (``privacy.calibrate``), the sigma the clients
        noise with."""
        if self.mode == "client":
            extra = {CLIP_KEY: float(self.clip)}
        elif self.p.calibrate:
            extra = {SIGMA_KEY: float(self.z)}
        else:
            return shared
        return Record(shared.arrays, dict(shared.metrics), {**shared.config, **extra}, shared.weights,
                      shared.num_samples)

    def release(self, rnd: int, shared: Record, kept: list[tuple[ClientTask, ClientOutput]],
                server: Any) -> list[tuple[int, Record]]:
        """What the method's aggregate receives: the replies as they are, or under ``client``
        one reply holding the private w~ (none when nobody arrived and there is no noise)."""
        replies = [(t.cid, o.reply) for t, o in kept]
        if self.mode != "client":
            return replies
        C, m = self.clip, self.m
        clipped = [Record(weights=clip_update(r.weights, t.msg.weights, C, SERVER_SLACK)[0], num_samples=1)
                   for (t, o), (_, r) in zip(kept, replies)]
        if clipped:
            self.keys = list(clipped[0].weights)
        keys = self.keys if self.keys is not None else [
            k for k, p in server.shared_model().named_parameters() if p.requires_grad and k in shared.weights]
        n = len(clipped)
        mean = average(clipped, "uniform") if clipped else {}
        gen = self._stream("update", rnd)
        out: dict[str, torch.Tensor] = {}
        for k in keys:
            base = shared.weights[k]
            if not base.is_floating_point():
                out[k] = base  # an integer buffer (a count of batches) says how much data there was: w_t's
                continue
            v = mean.get(k, base)
            if n != m:  # the fixed denominator: sum / m, whoever arrived
                v = base + (v - base) * (n / m)
            if self.z_update > 0:
                v = v + gaussian(v.shape, self.z_update * C / m, gen, like=v)
            out[k] = v
        self.adapt(rnd, [o.reply for _, o in kept], server)
        if n == 0 and self.z_update == 0:
            return []  # nothing arrived and nothing to add: w_t stays
        return [(-1, Record(weights=out, num_samples=1))]

    def adapt(self, rnd: int, replies: list[Record], server: Any) -> None:
        """Adaptive clipping: C_{t+1} = C_t exp(-eta (b~ - gamma)), b~ the private fraction
        of the round's updates within C_t."""
        server.log("privacy_clip", self.clip)
        if not self.p.adaptive_clip:
            return
        bits = sum(float(r.metrics.get(UNCLIPPED_KEY, 0.0)) - 0.5 for r in replies)
        noise = float(gaussian((1,), self.sigma_b, self._stream("count", rnd))[0])
        b = (bits + noise) / self.m + 0.5
        server.log("privacy_unclipped", b)
        self.clip = self.clip * math.exp(-self.p.clip_lr * (b - self.p.target_quantile))

    def account(self, outputs: Sequence[tuple[int, Mapping[str, float]]], count_round: bool = True) -> float:
        """Add the spend of the clients that trained (``outputs``: (cid, its training
        numbers), a rejected reply's included) to the ledgers; under ``client`` one more
        round released (``count_round``). Returns the run's epsilon."""
        if self.mode == "client":
            self.rounds += int(count_round)
            return self.epsilon()
        for cid, train in outputs:
            spent = spent_of(train, self.z, self.p.label_noise)
            if any(ev[0] == "labels" for ev in self.ledgers.get(cid, {})):
                spent.pop(("labels", self.p.label_noise), None)  # one release per run, read every turn
            if spent:
                self.last[cid] = spent
                self.ledgers[cid] = add(self.ledgers.get(cid, {}), spent)
                self.eps[cid] = self._ledger_epsilon(self.ledgers[cid])
        return self.epsilon()

    # -- checkpoints -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"clip": self.clip, "rounds": self.rounds, "keys": self.keys, "secret": self.secret, "sigma": self.z,
                "ledgers": {c: list(led.items()) for c, led in self.ledgers.items()},
                "last": {c: list(led.items()) for c, led in self.last.items()}}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.clip, self.rounds, self.keys = state["clip"], state["rounds"], state["keys"]
        self.set_sigma(state.get("sigma", self.z))  # a calibrated sigma stays the run's
        if self.secret is not None:  # seeded: nothing to keep
            if not state.get("secret"):
                raise ConfigError("privacy.noise", self.p.noise, "the checkpoint holds no noise key (it was written "
                                  "by a seeded run or an earlier protofl): start a fresh run")
            self.secret = bytes(state["secret"])
            self._noisy.clear()
            self.keep_participation_secret()
        self.ledgers = {int(c): dict(led) for c, led in state["ledgers"].items()}
        self.last = {int(c): dict(led) for c, led in state["last"].items()}
        self.eps = {c: self._ledger_epsilon(led) for c, led in self.ledgers.items()}


def noise_for_epsilon(cfg: Config, epsilon: float, algorithm: Any, client_counts: Union[Sequence[Sequence[int]], np.ndarray[Any, Any]],
                      rel: float = 0.005) -> float:
    """The noise multiplier whose run of ``cfg`` (``cfg.rounds`` rounds as planned, and the
    final evaluation of every client if it makes one; its privacy mode, clip, delta and
    accountant) ends at ``epsilon`` (to ``rel``): a bisection
    on sigma, whose epsilon only falls as sigma grows. ``algorithm``: the run's method
    (its fits and prototype releases); ``client_counts``: the clients' label counts (K, C).
    The plan reads them as they are (a calibration before the run); the run's own ledger
    reads each client's release of them, so it ends within a few percent of ``epsilon``."""
    from .participation import Participation

    part = Participation(cfg.participation, len(client_counts), cfg.seed)

    def spent(sigma: float) -> float:
        c = cfg.replace(**{"privacy.noise_multiplier": sigma, "privacy.target_epsilon": None,
                           "privacy.adaptive_clip": False, "privacy.noise": "seeded"})
        return ServerPrivacy(c, algorithm, part, client_counts, plan_exact=True).predicted(1, cfg.rounds,
                                                                                          then_final=True)

    return smallest_sigma(spent, epsilon, rel)


def smallest_sigma(spent: Callable[[float], float], epsilon: float, rel: float = 0.005) -> float:
    """The noise multiplier at which ``spent(sigma)`` (the epsilon a mechanism spends, which
    only falls as sigma grows) reaches ``epsilon``, to ``rel``: a geometric bisection from
    [0.05, 1], the upper end doubled until it is private enough (at most 1e4)."""
    lo, hi = 0.05, 1.0
    while spent(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ConfigError("privacy.target_epsilon", epsilon, "no noise multiplier up to 1e4 reaches it")
    while hi / lo > 1 + rel:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if spent(mid) > epsilon else (lo, mid)
    return hi
