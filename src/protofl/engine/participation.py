"""Who is sampled each round and whose reply arrives.

Both are pure functions of (seed, round): nothing to checkpoint, identical under
resume and in every execution backend. Under ``privacy.mode: client`` the sampling is a
function of (the server's secret, round) instead (:attr:`Participation.secret`, set by
engine/privacy.py): its amplification holds only if nobody can replay who was asked.

* sampling (``sampling: fixed``): m = ceil(fraction * K) clients (or ``clients_per_round``)
  uniformly without replacement, from stream ("sample", round); ``sampling: poisson``:
  each client independently with probability q = m / K, from the same stream (m clients
  in expectation; a round may ask nobody);
* availability: client k is available with probability p_k, redrawn every ``period``
  rounds from stream ("available", window) with window = (round - 1) // period. A
  sampled client's reply arrives iff it is available. period = 1 is dropout (each
  reply arrives with probability p); period = s > 1 is persistent straggling.
  p_k = ``group_p[group(k)]`` when given (clustered partitions), else ``p``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import numpy.typing as npt

from ..config import ConfigError, ParticipationConfig, ceil_fraction
from ..nn.privacy import NoiseStream
from ..rng import np_rng


class Participation:
    def __init__(self, cfg: ParticipationConfig, num_clients: int, seed: int,
                 groups: Optional[np.ndarray] = None) -> None:
        self.cfg, self.K, self.seed = cfg, num_clients, seed
        self.secret: Optional[bytes] = None  # the sampling's key under client-level DP
        if cfg.clients_per_round is not None:
            if cfg.clients_per_round > num_clients:
                raise ConfigError("participation.clients_per_round", cfg.clients_per_round,
                                  f"must be <= the {num_clients} clients")
            self.m = cfg.clients_per_round
        else:
            self.m = ceil_fraction(cfg.fraction, num_clients)
        if cfg.group_p is not None:
            if groups is None:
                raise ConfigError("participation.group_p", cfg.group_p,
                                  "needs a partition with groups (partition.name: clustered)")
            n_groups = int(groups.max()) + 1
            if len(cfg.group_p) != n_groups:
                raise ConfigError("participation.group_p", cfg.group_p,
                                  f"expected one value per group ({n_groups} groups)")
            self.p: npt.NDArray[np.float64] = np.asarray(cfg.group_p, dtype=np.float64)[groups]
        else:
            self.p = np.full(num_clients, cfg.p, dtype=np.float64)

    @property
    def q(self) -> float:
        """The chance that a given client is asked in a round: m / K."""
        return self.m / self.K

    def selected(self, rnd: int) -> list[int]:
        """Clients asked in round ``rnd`` (sorted ids)."""
        if self.m == self.K:
            return list(range(self.K))
        if self.secret is not None:  # client-level DP: from the server's key (SHAKE-256)
            u = NoiseStream(self.secret, ("sample", rnd)).uniform((self.K,)).numpy()
            if self.cfg.sampling == "poisson":
                return [int(c) for c in np.flatnonzero(u < self.q)]
            return sorted(int(c) for c in np.argsort(u, kind="stable")[:self.m])  # m of K, uniformly
        rng = np_rng(self.seed, "sample", rnd)
        if self.cfg.sampling == "poisson":
            return [int(c) for c in np.flatnonzero(rng.random(self.K) < self.q)]
        return sorted(int(c) for c in rng.choice(self.K, size=self.m, replace=False))

    def available(self, rnd: int) -> np.ndarray:
        """(K,) bool: whose reply can arrive in round ``rnd``."""
        if np.all(self.p >= 1.0):
            return np.ones(self.K, dtype=bool)
        window = (rnd - 1) // self.cfg.period
        u = np_rng(self.seed, "available", window).random(self.K)
        return u < self.p

    def arriving(self, rnd: int, selected: list[int]) -> list[int]:
        avail = self.available(rnd)
        return [c for c in selected if avail[c]]
