"""The engine's side of differential privacy (``privacy.*``, docs/privacy.md).

* :class:`ClientPrivacy` is ``ctx.privacy``: a client's privacy settings for one turn,
  its noise streams (one per (seed, round, client, purpose)) and what it spent (private
  prototype releases, DP-SGD steps, returned with its training numbers). Under
  ``privacy.mode: client`` it clips the reply's update before the reply leaves the client.
* :class:`ServerPrivacy` is the round loop's hook: the clip C_t in the broadcast, the
  private release of the round's updates (DP-FedAvg) that the method's aggregate
  receives in place of the replies, adaptive clipping, ``epsilon`` in every round's row,
  and the stop at ``privacy.target_epsilon``.
* :class:`Accountant`: epsilon at delta of a ledger of DP events, by Google's
  ``dp-accounting`` (its RDP or PLD accountant).
* :func:`check_privacy`: what a mode covers, checked before any work.

**client** (McMahan et al., ICLR 2018, "Learning Differentially Private Recurrent
Language Models", DP-FedAvg with w_k = 1 and the fixed-denominator estimator f~_f):
client k sends w_t + clip(Delta_k), Delta_k = w_k - w_t clipped to L2 norm C_t (on the
client; the server clips again, so a client that did not cannot exceed it); the server
releases

    w~ = w_t + (sum_k clip(Delta_k) + N(0, (sigma_Delta C_t)^2 I)) / m

over the replies that arrived, m the expected number of sampled clients (public), and
hands the method's aggregate one reply holding w~: its server half sees nothing but the
release, so whatever it makes of it is post-processing. With adaptive clipping (Andrew
et al., NeurIPS 2021, "Differentially Private Learning with Adaptive Clipping",
Algorithm 1 with geometric updates) each client also sends b_k = [||Delta_k|| <= C_t];
the server estimates b~ = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m + 1/2 and sets
C_{t+1} = C_t exp(-eta (b~ - gamma)); sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^-1/2 keeps
the round's total noise multiplier at sigma (their Theorem 1). Accounting per round:
Poisson sampling -> the Poisson-subsampled Gaussian (add/remove one client); fixed-size
sampling of m < K -> the Gaussian sampled without replacement (Wang, Balle &
Kasiviswanathan, AISTATS 2019) under replace-one, whose sensitivity is 2 C (multiplier
sigma / 2); every client each round -> the Gaussian mechanism (add/remove).

**prototype** and **sample** protect one record (a training sample) of one client:
each client's ledger holds its releases (Gaussian, multiplier sigma) or its DP-SGD
steps (Poisson-subsampled Gaussian with q = B / n_k, the usual accounting of shuffled
minibatches); a round's ``epsilon`` is the largest over the clients. Only the rounds a
client trained in count (no amplification by client sampling is claimed).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..algorithms.base import average, GlobalModel
from ..config import Config, ConfigError
from ..messages import Record
from ..nn.privacy import gaussian
from ..rng import seed_for, torch_gen
from .train import total_steps

log = logging.getLogger("protofl")

CLIP_KEY = "privacy.clip"  # Record.config of the broadcast: this round's C_t (client mode)
UNCLIPPED_KEY = "privacy.unclipped"  # Record.metrics of a reply: b_k (adaptive clipping)
# the server clips a reply again when its update exceeds C_t by more than float rounding
SERVER_SLACK = 1e-5
INSTALL = "pip install 'protofl[privacy]'"
_WARNED: set[str] = set()  # methods whose unprotected weights were pointed out


def _library():
    try:
        import dp_accounting
        from dp_accounting import pld, rdp  # noqa: F401
    except ImportError:
        raise ConfigError("privacy.mode", "(any but none)", f"needs Google's dp-accounting package: {INSTALL}") \
            from None
    return dp_accounting


# ---------------------------------------------------------------------------------------
# the accountant
# ---------------------------------------------------------------------------------------
# A ledger is {event: count}. Events are plain tuples (cached, checkpointed):
#   ("gaussian", z)          the Gaussian mechanism, noise multiplier z
#   ("poisson", q, z)        ... on a Poisson sample of rate q
#   ("wor", n, m, z)         ... on a uniform sample of m of n, without replacement (replace-one)
Ledger = Mapping[tuple, int]


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
        self._cache: dict[tuple, float] = {}

    def event(self, ev: tuple):
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


def add(ledger: Ledger, more: Ledger) -> dict:
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
    (summed in float64). Within the bound they are returned as they are."""
    keys = [k for k, v in weights.items() if v.is_floating_point()]
    sq = sum(float((weights[k].double() - sent[k].to(weights[k].device).double()).pow(2).sum()) for k in keys)
    norm = math.sqrt(sq)
    if norm <= clip * (1.0 + slack):
        return dict(weights), norm
    f = clip / norm
    out = dict(weights)
    for k in keys:
        base = sent[k].to(weights[k].device, weights[k].dtype)
        out[k] = base + (weights[k] - base) * f
    return out, norm


class ClientPrivacy:
    """``ctx.privacy``: one (round, client)'s privacy settings, noise streams and spend.

    ``mode``, ``clip`` (C_t under ``client``: the broadcast's), ``sigma``, ``kmeans_steps``;
    :meth:`generator` (a CPU stream per purpose, a fresh one at each call), :meth:`spend`
    (prototype releases), :meth:`trained` (DP-SGD steps), :meth:`clip_reply`.
    """

    def __init__(self, cfg: Config, rnd: int, cid: int, msg: Optional[Record] = None) -> None:
        p = cfg.privacy
        self.mode, self.sigma, self.kmeans_steps, self.adaptive = p.mode, p.noise_multiplier, p.kmeans_steps, \
            p.adaptive_clip
        self.clip = float(msg.config.get(CLIP_KEY, p.clip)) if msg is not None else p.clip
        self.seed, self.rnd, self.cid = cfg.seed, rnd, cid
        self.sent = msg.weights if msg is not None else {}
        self.releases = 0
        self.steps: dict[float, int] = {}  # DP-SGD steps by sampling rate q = B / n_k
        self._draws: dict[str, int] = {}
        self._noise: Optional[torch.Generator] = None

    def generator(self, purpose: str) -> torch.Generator:
        """A CPU stream for (seed, round, client, ``purpose``); each call of a purpose the next one."""
        i = self._draws.get(purpose, 0)
        self._draws[purpose] = i + 1
        return torch_gen(self.seed, "privacy", purpose, self.rnd, self.cid, i)

    def noise_generator(self, device: torch.device) -> torch.Generator:
        """DP-SGD's noise stream of this turn, on the training device (one for all its ctx.fit calls)."""
        if self._noise is None:
            self._noise = torch.Generator(device=device)
            self._noise.manual_seed(seed_for(self.seed, "privacy", "dpsgd", self.rnd, self.cid))
        return self._noise

    def spend(self, releases: int) -> None:
        """Count private releases of the client's records (prototype helpers)."""
        self.releases += int(releases)

    def trained(self, steps: int, n: int, batch_size: int) -> None:
        """Count DP-SGD steps of batch size B on the client's n samples (q = B / n)."""
        if steps and self.mode == "sample":
            q = min(1.0, batch_size / max(n, 1))
            self.steps[q] = self.steps.get(q, 0) + int(steps)

    def clip_reply(self, reply: Record) -> Record:
        """Under ``client``: the reply with its update clipped to C_t (and b_k with adaptive
        clipping), before it leaves the client."""
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
        if self.steps:  # one rate per client in practice; the largest is the conservative one
            out["dp_steps"] = float(sum(self.steps.values()))
            out["dp_q"] = max(self.steps)
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
    the replies' weights and whose replies carry nothing else; ``prototype`` the methods
    that release their prototypes through :mod:`protofl.nn.privacy`; ``sample`` methods
    whose replies are model weights only, with a model without BatchNorm (its batch
    statistics mix the samples a per-sample gradient must keep apart)."""
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
    elif p.mode == "prototype":
        if algorithm.prototype_releases(p) <= 0:
            raise ConfigError("privacy.mode", p.mode, f"{name} sends no prototypes protofl makes private (methods "
                              "that do: fedproto, fedtgp, fedgh, fedpcl, fednh, mpfedcl, spfedcl, fpl, rebafl, "
                              "feddistill, fedfa)")
    elif p.mode == "sample":
        if arrays != ():
            raise ConfigError("privacy.mode", p.mode, f"{name}'s replies carry arrays besides the model weights "
                              f"({', '.join(arrays or ['undeclared'])}), which DP-SGD does not make private")
        if algorithm.couples_samples:
            raise ConfigError("privacy.mode", p.mode, f"{name}'s local loss couples the samples of a batch, which "
                              "DP-SGD's per-sample gradients would take apart")
        coupled = _batch_coupled(model) if model is not None else None
        if coupled is not None:
            raise ConfigError("privacy.mode", p.mode, f"model {cfg.model.name!r} has batch normalization in "
                              f"{coupled}: its batch statistics mix samples, so per-sample gradients cannot "
                              "bound one sample's influence (use a model without BatchNorm, e.g. GroupNorm)")


# ---------------------------------------------------------------------------------------
# the server's side
# ---------------------------------------------------------------------------------------
class ServerPrivacy:
    """The round loop's hook (engine/simulation.py): :meth:`broadcast`, :meth:`release`,
    :meth:`account`, :meth:`stop_reason`; :meth:`state` / :meth:`restore` for checkpoints."""

    def __init__(self, cfg: Config, algorithm: Any, participation: Any, client_sizes: Sequence[int],
                 model: Optional[nn.Module] = None) -> None:
        check_privacy(cfg, algorithm, model)
        p = self.p = cfg.privacy
        self.cfg, self.algorithm, self.participation = cfg, algorithm, participation
        self.sizes = list(client_sizes)
        self.mode, self.z = p.mode, p.noise_multiplier
        self.m, K = participation.m, participation.K
        self.clip = p.clip  # C_t
        self.sigma_b = p.count_noise if p.count_noise is not None else self.m / 20.0
        self.z_update = self.z
        if p.adaptive_clip and self.z > 0:
            if 2 * self.sigma_b <= self.z:
                raise ConfigError("privacy.count_noise", self.sigma_b, f"must exceed noise_multiplier / 2 = "
                                  f"{self.z / 2:g}: the update's noise is (sigma^-2 - (2 count_noise)^-2)^-1/2")
            self.z_update = (self.z ** -2 - (2 * self.sigma_b) ** -2) ** -0.5
        fixed = cfg.participation.sampling == "fixed" and self.m < K
        if self.mode != "client" or self.m == K:
            self.round_event: tuple = ("gaussian", self.z)
        elif fixed:  # replace-one: one client's clipped update replaced by another moves the sum by 2 C
            self.round_event = ("wor", K, self.m, self.z / 2)
            if p.accountant == "pld":
                raise ConfigError("privacy.accountant", p.accountant, "the PLD accountant has no sampling without "
                                  "replacement: use participation.sampling: poisson, or privacy.accountant: rdp")
        else:
            self.round_event = ("poisson", participation.q, self.z)
        self.accountant = Accountant(p.accountant, p.delta, replace_one=self.mode == "client" and fixed)
        self.rounds = 0  # client: rounds released
        self.ledgers: dict[int, dict] = {}  # prototype / sample: per client
        self.last: dict[int, dict] = {}  # per client: its last round's spend
        self.eps: dict[int, float] = {}  # per client: its epsilon
        self.keys: Optional[list[str]] = None  # client: the weights a reply carries
        if self.mode == "prototype" and algorithm.has_global_model and cfg.algorithm.name not in _WARNED:
            _WARNED.add(cfg.algorithm.name)  # once per process
            log.warning("privacy.mode: prototype protects %s's prototypes only; its model weights travel without "
                        "protection (docs/privacy.md)", cfg.algorithm.name)
        if p.target_epsilon is not None:
            e = self.predicted(1)
            if e > p.target_epsilon:
                raise ConfigError("privacy.target_epsilon", p.target_epsilon, f"round 1 alone would spend "
                                  f"epsilon {e:.4g} at delta {p.delta:g}; raise the target or the noise")

    # -- the budget ------------------------------------------------------------------------
    def epsilon(self) -> float:
        if self.mode == "client":
            return self.accountant.epsilon({self.round_event: self.rounds})
        return max(self.eps.values(), default=0.0)

    def planned(self, cid: int) -> dict:
        """What client ``cid`` is expected to spend in a round: its last round's spend, at
        least one ``ctx.fit`` of the run's settings (sample) or the method's releases."""
        if self.mode == "prototype":
            plan = {("gaussian", self.z): self.algorithm.prototype_releases(self.p)}
        else:
            n, tc = self.sizes[cid], self.cfg.training
            plan = {("poisson", min(1.0, tc.batch_size / max(n, 1)), self.z):
                    total_steps(n, tc.batch_size, tc.epochs, tc.steps)}
        last = self.last.get(cid, {})
        return {ev: max(plan.get(ev, 0), last.get(ev, 0)) for ev in {**plan, **last}}

    def predicted(self, rnd: int, last: Optional[int] = None) -> float:
        """epsilon after round ``rnd`` (after rounds rnd..``last``) if it runs (they run) as planned."""
        last = rnd if last is None else last
        if self.mode == "client":
            return self.accountant.epsilon({self.round_event: self.rounds + last - rnd + 1})
        ledgers: dict[int, dict] = {}
        for r in range(rnd, last + 1):
            for c in self.participation.arriving(r, self.participation.selected(r)):
                ledgers[c] = add(ledgers.get(c, self.ledgers.get(c, {})), self.planned(c))
        return max([self.epsilon()] + [self.accountant.epsilon(l) for l in ledgers.values()])

    def stop_reason(self, rnd: int) -> Optional[str]:
        """Why round ``rnd`` must not run (it would pass ``privacy.target_epsilon``), or None."""
        t = self.p.target_epsilon
        if t is None:
            return None
        e = self.predicted(rnd)
        if e <= t:
            return None
        return (f"privacy budget: round {rnd} would take epsilon to {e:.4g} > privacy.target_epsilon {t:g} "
                f"(delta {self.p.delta:g}); stopped after round {rnd - 1}")

    # -- the round -------------------------------------------------------------------------
    def broadcast(self, shared: Record) -> Record:
        """Under ``client``: the broadcast with this round's clip C_t (the clients clip to it)."""
        if self.mode != "client":
            return shared
        return Record(shared.arrays, dict(shared.metrics), {**shared.config, CLIP_KEY: float(self.clip)},
                      shared.weights, shared.num_samples)

    def release(self, rnd: int, shared: Record, kept: list, server: Any) -> list[tuple[int, Record]]:
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
        gen = torch_gen(self.cfg.seed, "privacy", "update", rnd)
        out: dict[str, torch.Tensor] = {}
        for k in keys:
            base = shared.weights[k]
            v = mean.get(k, base)
            if v.is_floating_point():
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
        noise = float(gaussian((1,), self.sigma_b, torch_gen(self.cfg.seed, "privacy", "count", rnd))[0])
        b = (bits + noise) / self.m + 0.5
        server.log("privacy_unclipped", b)
        self.clip = self.clip * math.exp(-self.p.clip_lr * (b - self.p.target_quantile))

    def account(self, rnd: int, kept: list, server: Any) -> None:
        """Add the round's spend to the ledgers and log ``epsilon``."""
        if self.mode == "client":
            self.rounds += 1
        else:
            for t, o in kept:
                spent: dict = {}
                if o.train.get("dp_releases"):
                    spent[("gaussian", self.z)] = int(o.train["dp_releases"])
                if o.train.get("dp_steps"):
                    spent[("poisson", float(o.train["dp_q"]), self.z)] = int(o.train["dp_steps"])
                if spent:
                    self.last[t.cid] = spent
                    self.ledgers[t.cid] = add(self.ledgers.get(t.cid, {}), spent)
                    self.eps[t.cid] = self.accountant.epsilon(self.ledgers[t.cid])
        server.log("epsilon", self.epsilon())

    # -- checkpoints -----------------------------------------------------------------------
    def state(self) -> dict:
        return {"clip": self.clip, "rounds": self.rounds, "keys": self.keys,
                "ledgers": {c: list(l.items()) for c, l in self.ledgers.items()},
                "last": {c: list(l.items()) for c, l in self.last.items()}}

    def restore(self, state: dict) -> None:
        self.clip, self.rounds, self.keys = state["clip"], state["rounds"], state["keys"]
        self.ledgers = {int(c): dict(l) for c, l in state["ledgers"].items()}
        self.last = {int(c): dict(l) for c, l in state["last"].items()}
        self.eps = {c: self.accountant.epsilon(l) for c, l in self.ledgers.items()}


def noise_for_epsilon(cfg: Config, epsilon: float, algorithm: Any, client_sizes: Sequence[int],
                      rel: float = 0.005) -> float:
    """The noise multiplier whose run of ``cfg`` (``cfg.rounds`` rounds as planned, its
    privacy mode, clip, delta and accountant) ends at ``epsilon`` (to ``rel``): a bisection
    on sigma, whose epsilon only falls as sigma grows. ``algorithm``: the run's method
    (its prototype releases); ``client_sizes``: the clients' training-set sizes."""
    from .participation import Participation

    part = Participation(cfg.participation, len(client_sizes), cfg.seed)

    def spent(sigma: float) -> float:
        c = cfg.replace(**{"privacy.noise_multiplier": sigma, "privacy.target_epsilon": None,
                           "privacy.adaptive_clip": False})
        return ServerPrivacy(c, algorithm, part, client_sizes).predicted(1, cfg.rounds)

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
