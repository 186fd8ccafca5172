"""Per-purpose, per-(round, client) random streams derived from the run seed.

Every random decision (client sampling, availability, batch order, dropout masks,
k-means restarts) draws from a stream keyed by what it is for, so the result of a run
does not depend on the order in which clients execute, on how many processes run them,
or on whether the run was resumed from a checkpoint.
"""
from __future__ import annotations

import zlib
from typing import cast, SupportsInt

import numpy as np
import torch


def _tag(key: object) -> int:
    if isinstance(key, str):
        return zlib.crc32(key.encode())
    return int(cast(SupportsInt, key)) + 1  # ints (rounds, client ids, -1 for "none") -> non-negative


def seed_for(seed: int, *keys: object) -> int:
    """A 63-bit seed for ``keys`` under the run ``seed`` (e.g. ``seed_for(s, "train", rnd, cid)``)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *(_tag(k) for k in keys)])
    return int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def np_rng(seed: int, *keys: object) -> np.random.Generator:
    return np.random.default_rng(seed_for(seed, *keys))


def torch_gen(seed: int, *keys: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed_for(seed, *keys))
    return g
