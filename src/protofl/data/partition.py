"""Label partitioners: how the training split is divided among federated clients.

Every partitioner is a pure function

    partitioner(labels, num_clients, seed, *, **params) -> list[np.ndarray]

that returns one **sorted int64** index array per client into the training split; the
arrays are disjoint across clients. Parameters are keyword-only with defaults and
simple annotations, so the config layer can validate them against the signature.
Randomness comes only from ``np.random.default_rng(SeedSequence([seed, TAG]))`` with a
constant tag per partitioner: the same ``(labels, num_clients, seed, params)`` always
gives the same partition, on any machine, at any time.

Every loop is bounded (no partitioner can hang), and an impossible request raises
:class:`ValueError` saying why (too many clients, a class that runs out, ...).

Classes are the distinct label values present in ``labels`` (a label value that never
occurs is not a class here). Registered names: ``iid``, ``dirichlet``,
``pathological``, ``shards``, ``nway_kshot``, ``clustered``, ``natural``.
Helpers: :func:`partition` (dispatch by name), :func:`client_groups`,
:func:`local_test_indices`, :func:`class_counts`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..registry import Registry

PARTITIONERS: Registry = Registry("partitioner", "protofl.partitioners")

# constant per-partitioner tags mixed into the seed (never change them: they fix the
# partitions that a given seed produces)
_TAG_IID = 1
_TAG_DIRICHLET = 2
_TAG_PATHOLOGICAL = 3
_TAG_SHARDS = 4
_TAG_NWAY_KSHOT = 5
_TAG_CLUSTERED = 6
_TAG_LOCAL_TEST = 101

#: redraws of the whole Dirichlet assignment before giving up (time-independent bound)
DIRICHLET_MAX_TRIES = 1000


# --------------------------------------------------------------------------- helpers
def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), tag]))


def _check_labels(labels) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    if y.size and y.min() < 0:
        raise ValueError(f"labels must be non-negative, found {int(y.min())}")
    return y


def _check_common(labels, num_clients, seed, name: str) -> np.ndarray:
    y = _check_labels(labels)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise ValueError(f"{name}: num_clients must be an integer, got {num_clients!r}")
    if num_clients < 1:
        raise ValueError(f"{name}: num_clients must be >= 1, got {num_clients}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{name}: seed must be a non-negative integer, got {seed!r}")
    if len(y) < num_clients:
        raise ValueError(
            f"{name}: more clients than samples ({num_clients} clients, {len(y)} samples): "
            f"some clients would get no data"
        )
    return y


def _check_int(name: str, what: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: {what} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name}: {what} must be >= {lo}, got {value}")
    return int(value)


def _finish(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _class_index(y: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Distinct classes present and, per class, the (ascending) indices holding it."""
    classes = np.unique(y)
    order = np.argsort(y, kind="stable")
    bounds = np.searchsorted(y[order], classes, side="left")
    ends = np.append(bounds[1:], len(y))
    return classes, [order[b:e] for b, e in zip(bounds, ends)]


def partition(name: str, labels, num_clients: int, seed: int, **params) -> list[np.ndarray]:
    """Run the partitioner registered as ``name``."""
    fn: Callable[..., list[np.ndarray]] = PARTITIONERS.get(name)
    return fn(labels, num_clients, seed, **params)


# --------------------------------------------------------------------------- iid
@PARTITIONERS.register("iid")
def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle all samples and split them as evenly as possible (sizes differ by <= 1)."""
    y = _check_common(labels, num_clients, seed, "iid")
    perm = _rng(seed, _TAG_IID).permutation(len(y))
    return _finish(np.array_split(perm, num_clients))


# --------------------------------------------------------------------------- dirichlet
@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    beta: float = 0.5,
    min_size: int = 10,
    max_tries: int = DIRICHLET_MAX_TRIES,
) -> list[np.ndarray]:
    """Label-skew Dirichlet split as in NIID-Bench (Li et al., 2022), all data used.

    For each class in turn, proportions ``p ~ Dir(beta * 1_K)`` over the K clients are
    drawn. **Balancing step (NIID-Bench):** the proportion of every client that already
    holds ``>= N / K`` samples is set to zero and ``p`` is renormalised, so no client
    keeps growing past the mean size. The class's (shuffled) samples are then cut at
    ``floor(cumsum(p) * n_class)``. If the masked proportions are all zero (possible
    with a tiny ``beta``: all mass on full clients or underflow), the whole class goes
    to one client drawn uniformly among those still below ``N / K``; a NaN
    proportion is treated as zero. This keeps a degenerate draw from producing an
    all-zero row or a division by zero.

    The whole assignment is redrawn until every client has ``>= min_size`` samples, at
    most ``max_tries`` times (default 1000; from the second attempt on, an attempt is
    abandoned as soon as the unassigned samples can no longer lift every client to
    ``min_size``, which does not change the distribution of the accepted partition).
    Then :class:`ValueError` is raised with the numbers and the smallest client size of
    the best attempt that ran to the end (the first always does).

    Raises immediately if ``num_clients * min_size > len(labels)``.
    """
    name = "dirichlet"
    y = _check_common(labels, num_clients, seed, name)
    beta = float(beta)
    if not np.isfinite(beta) or beta <= 0:
        raise ValueError(f"{name}: beta must be a positive finite number, got {beta}")
    min_size = _check_int(name, "min_size", min_size, 0)
    max_tries = _check_int(name, "max_tries", max_tries, 1)
    n, k = len(y), int(num_clients)
    if k * min_size > n:
        raise ValueError(
            f"{name}: impossible: {k} clients x min_size {min_size} = {k * min_size} "
            f"samples needed but only {n} exist (more clients than samples allow); "
            f"lower min_size or num_clients"
        )
    classes, by_class = _class_index(y)
    sizes_c = np.array([len(ix) for ix in by_class], dtype=np.int64)
    rng = _rng(seed, _TAG_DIRICHLET)
    target = n / k  # NIID-Bench: N / n_parties
    alpha = np.full(k, beta)
    best_min = -1
    counts = np.zeros((len(classes), k), dtype=np.int64)
    success = False
    tries = 0
    for tries in range(1, max_tries + 1):
        sizes = np.zeros(k, dtype=np.int64)
        remaining = n
        ok = True
        for ci, nc in enumerate(sizes_c):
            nc = int(nc)
            p = rng.dirichlet(alpha)
            p = np.where(np.isfinite(p), p, 0.0)
            below = sizes < target
            p = p * below
            s = p.sum()
            if not s > 0:
                p = np.zeros(k)
                p[rng.choice(np.flatnonzero(below))] = 1.0
                s = 1.0
            cuts = np.clip((np.cumsum(p / s) * nc).astype(np.int64)[:-1], 0, nc)
            cnt = np.diff(cuts, prepend=0, append=nc)
            counts[ci] = cnt
            sizes += cnt
            remaining -= nc
            # abandon a hopeless attempt early (the first one always runs to the end,
            # so the error message can report a real smallest client size)
            if tries > 1 and np.maximum(min_size - sizes, 0).sum() > remaining:
                ok = False
                break
        if ok:
            best_min = max(best_min, int(sizes.min()))
            if best_min >= min_size:
                success = True
                break
    if not success:
        raise ValueError(
            f"{name}: could not give each of {k} clients >= min_size={min_size} samples "
            f"in {tries} attempts (N={n} samples, {len(classes)} classes, beta={beta}): "
            f"beta is too small for this min_size with these clients (a small beta puts "
            f"each class on few clients); smallest client size seen: {best_min} (best "
            f"completed attempt). Raise beta, or lower min_size or num_clients"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for ci, ix in enumerate(by_class):
        shuffled = rng.permutation(ix)
        for j, chunk in enumerate(np.split(shuffled, np.cumsum(counts[ci])[:-1])):
            if len(chunk):
                parts[j].append(chunk)
    return _finish(
        [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]
    )


# --------------------------------------------------------------------------- pathological core
def _assign_classes(
    rng: np.random.Generator, num_classes: int, cpc: Sequence[int], usage: np.ndarray
) -> list[np.ndarray]:
    """Balanced class assignment: each client takes its ``cpc[i]`` distinct classes
    among the least-used ones so far (ties broken at random). Class usage counts then
    differ by at most one within a run of equal ``cpc``. ``usage`` is updated in place.
    Returns class *positions* (into the sorted distinct classes), in assignment order.
    """
    out = []
    for m in cpc:
        order = np.lexsort((rng.random(num_classes), usage))
        chosen = order[:m]
        usage[chosen] += 1
        out.append(chosen)
    return out


def _draw(
    name: str,
    classes: np.ndarray,
    by_class: list[np.ndarray],
    client_classes: list[np.ndarray],
    client_demand: list[Optional[np.ndarray]],
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Give clients samples of their classes without replacement across clients.

    ``client_demand[i]`` is an array (per class of client i) of exact sample counts, or
    None: client i then shares evenly (sizes differ by <= 1, client order) with the other
    None-clients whatever is left of each of its classes after the exact demands.
    """
    nclass = len(classes)
    fixed = np.zeros(nclass, dtype=np.int64)
    sharers: list[list[int]] = [[] for _ in range(nclass)]
    for i, (cls, dem) in enumerate(zip(client_classes, client_demand)):
        if dem is None:
            for c in cls:
                sharers[c].append(i)
        else:
            np.add.at(fixed, cls, dem)
    for c in range(nclass):
        avail = len(by_class[c])
        need = int(fixed[c]) + len(sharers[c])
        if need > avail:
            extra = (
                f" ({int(fixed[c])} requested + at least 1 for each of "
                f"{len(sharers[c])} clients sharing the rest)"
                if sharers[c]
                else ""
            )
            raise ValueError(
                f"{name}: class {int(classes[c])} runs out: {need} samples needed{extra} "
                f"but only {avail} available"
            )
    pools = [rng.permutation(ix) for ix in by_class]
    ptr = np.zeros(nclass, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in client_classes]
    for i, (cls, dem) in enumerate(zip(client_classes, client_demand)):
        if dem is None:
            continue
        for c, d in zip(cls, dem):
            parts[i].append(pools[c][ptr[c] : ptr[c] + d])
            ptr[c] += d
    for c in range(nclass):
        if sharers[c]:
            rest = pools[c][ptr[c] :]
            for i, chunk in zip(sharers[c], np.array_split(rest, len(sharers[c]))):
                parts[i].append(chunk)
    return _finish(
        [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]
    )


def _per_class_demand(n: int, m: int) -> np.ndarray:
    """``n`` samples over ``m`` classes: ``n // m`` each, and one more for each of the
    first ``n % m`` classes in the client's (random) assignment order."""
    d = np.full(m, n // m, dtype=np.int64)
    d[: n % m] += 1
    return d


def _check_group(name: str, g: int, cpc, spc, num_classes: int) -> tuple[int, Optional[int]]:
    where = f"{name}: group {g}: " if g >= 0 else f"{name}: "
    cpc = _check_int(where.rstrip(": "), "classes_per_client", cpc, 1)
    if cpc > num_classes:
        raise ValueError(
            f"{where}classes_per_client={cpc} > number of classes in the labels ({num_classes})"
        )
    if spc is not None:
        spc = _check_int(where.rstrip(": "), "samples_per_client", spc, 1)
        if spc < cpc:
            raise ValueError(
                f"{where}samples_per_client={spc} < classes_per_client={cpc}: a client "
                f"could not get at least one sample of each of its classes"
            )
    return cpc, spc


# --------------------------------------------------------------------------- pathological
@PARTITIONERS.register("pathological")
def pathological(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    classes_per_client: int = 2,
    samples_per_client: int | None = None,
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` (= m) distinct classes.

    Class assignment is balanced: client by client, the m least-used classes so far are
    taken (ties at random), so how many clients hold a class differs by at most one
    between classes. If ``num_clients * m`` < number of classes, some classes are held
    by nobody and their samples are unused.

    * ``samples_per_client=n``: the client gets exactly ``n // m`` samples of each of its
      classes; the remainder ``n % m`` is spread deterministically as one extra sample
      for each of the first ``n % m`` classes in the client's assignment order (which is
      itself random). Samples are drawn without replacement across clients; a class
      whose holders need more than it has raises :class:`ValueError` naming the class,
      needed vs available. Leftover samples are unused.
    * ``samples_per_client=None``: each class's samples are split evenly (sizes differ by
      <= 1) among the clients that hold it: all data of held classes is used.
    """
    name = "pathological"
    y = _check_common(labels, num_clients, seed, name)
    classes, by_class = _class_index(y)
    m, spc = _check_group(name, -1, classes_per_client, samples_per_client, len(classes))
    rng = _rng(seed, _TAG_PATHOLOGICAL)
    usage = np.zeros(len(classes), dtype=np.int64)
    cc = _assign_classes(rng, len(classes), [m] * num_clients, usage)
    demand = [None if spc is None else _per_class_demand(spc, m) for _ in cc]
    return _draw(name, classes, by_class, cc, demand, rng)


# --------------------------------------------------------------------------- clustered
_GROUP_KEYS = {"clients", "classes_per_client", "samples_per_client"}


def _check_groups(name: str, groups) -> list[dict]:
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ValueError(f"{name}: groups must be a non-empty list of dicts, got {groups!r}")
    out = []
    for g, spec in enumerate(groups):
        if not isinstance(spec, dict):
            raise ValueError(f"{name}: group {g} must be a dict, got {spec!r}")
        unknown = set(spec) - _GROUP_KEYS
        if unknown:
            raise ValueError(
                f"{name}: group {g}: unknown keys {sorted(unknown)}; allowed: {sorted(_GROUP_KEYS)}"
            )
        if "clients" not in spec or "classes_per_client" not in spec:
            raise ValueError(f"{name}: group {g} needs 'clients' and 'classes_per_client'")
        _check_int(f"{name}: group {g}", "clients", spec["clients"], 1)
        out.append(spec)
    return out


def client_groups(groups: list[dict]) -> np.ndarray:
    """Group id (int64) of each client for a ``clustered`` layout: group 0's clients first,
    then group 1's, ... (e.g. ``[{"clients": 2, ...}, {"clients": 3, ...}]`` ->
    ``[0, 0, 1, 1, 1]``)."""
    gs = _check_groups("client_groups", groups)
    return np.repeat(np.arange(len(gs), dtype=np.int64), [int(g["clients"]) for g in gs])


@PARTITIONERS.register("clustered")
def clustered(
    labels: np.ndarray, num_clients: int, seed: int, *, groups: list[dict]
) -> list[np.ndarray]:
    """Groups of clients with different label skew, e.g.
    ``[{"clients": 4, "classes_per_client": 2}, {"clients": 4, "classes_per_client": 3,
    "samples_per_client": 300}]``.

    The clients of group g are consecutive (group 0 first; see :func:`client_groups`);
    ``num_clients`` must equal the sum of the groups' ``clients``. Each group runs the
    :func:`pathological` scheme with its own ``classes_per_client`` (and optional
    ``samples_per_client``) over one shared pool of samples, without replacement across
    all clients: class assignment is balanced over all groups together; exact demands
    (groups with ``samples_per_client``) are served first, then the rest of each class
    is split evenly among the clients of groups without ``samples_per_client`` that
    hold it. A class that runs out raises :class:`ValueError`.
    """
    name = "clustered"
    gs = _check_groups(name, groups)
    total = sum(int(g["clients"]) for g in gs)
    y = _check_common(labels, num_clients, seed, name)
    if total != num_clients:
        raise ValueError(
            f"{name}: num_clients={num_clients} but the groups hold {total} clients "
            f"({' + '.join(str(int(g['clients'])) for g in gs)}); they must be equal"
        )
    classes, by_class = _class_index(y)
    rng = _rng(seed, _TAG_CLUSTERED)
    usage = np.zeros(len(classes), dtype=np.int64)
    cc: list[np.ndarray] = []
    demand: list[Optional[np.ndarray]] = []
    for gi, g in enumerate(gs):
        m, spc = _check_group(
            name, gi, g["classes_per_client"], g.get("samples_per_client"), len(classes)
        )
        cg = _assign_classes(rng, len(classes), [m] * int(g["clients"]), usage)
        cc.extend(cg)
        demand.extend(None if spc is None else _per_class_demand(spc, m) for _ in cg)
    return _draw(name, classes, by_class, cc, demand, rng)


# --------------------------------------------------------------------------- shards
@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray, num_clients: int, seed: int, *, shards_per_client: int = 2
) -> list[np.ndarray]:
    """McMahan et al. (2017): sort by label (random order within a label), cut into
    ``num_clients * shards_per_client`` shards of equal size (when N does not divide,
    sizes differ by one: ``np.array_split``; all data is used), and give each client
    ``shards_per_client`` shards drawn at random without replacement."""
    name = "shards"
    y = _check_common(labels, num_clients, seed, name)
    s = _check_int(name, "shards_per_client", shards_per_client, 1)
    nshards = num_clients * s
    if nshards > len(y):
        raise ValueError(
            f"{name}: {num_clients} clients x {s} shards = {nshards} shards but only "
            f"{len(y)} samples: a shard would be empty"
        )
    rng = _rng(seed, _TAG_SHARDS)
    perm = rng.permutation(len(y))
    order = perm[np.argsort(y[perm], kind="stable")]
    pieces = np.array_split(order, nshards)
    assign = rng.permutation(nshards).reshape(num_clients, s)
    return _finish([np.concatenate([pieces[j] for j in row]) for row in assign])


# --------------------------------------------------------------------------- nway_kshot
@PARTITIONERS.register("nway_kshot")
def nway_kshot(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    ways: int = 3,
    shots: int = 100,
    stdev: float = 1.0,
) -> list[np.ndarray]:
    """FedProto's (Tan et al., 2022) n-way k-shot setting.

    Client i gets ``n_i = clip(round(N(ways, stdev)), 1, C)`` distinct classes chosen
    uniformly at random, and ``k_i = max(1, round(N(shots, stdev)))`` samples of each of
    them (one ``k_i`` per client, as FedProto's ``k_list``). The same ``stdev`` is used
    for ways and shots, as in FedProto's code. The paper says only "a random noise" with
    that standard deviation; the rounded normal is one reading of it. The authors' code
    draws uniform integers instead: ``n_i`` from ``max(2, ways - stdev)`` to
    ``ways + stdev`` (never a single class, where the rounded normal gives some clients
    one) and ``k_i`` in a window around ``shots`` that depends on the dataset.
    Samples are drawn without replacement across clients; if a class runs out,
    :class:`ValueError` names it, needed vs available. Unused samples stay unused.
    Rounding is half-to-even (``np.rint``).
    """
    name = "nway_kshot"
    y = _check_common(labels, num_clients, seed, name)
    classes, by_class = _class_index(y)
    nclass = len(classes)
    ways = _check_int(name, "ways", ways, 1)
    shots = _check_int(name, "shots", shots, 1)
    stdev = float(stdev)
    if not np.isfinite(stdev) or stdev < 0:
        raise ValueError(f"{name}: stdev must be a finite number >= 0, got {stdev}")
    if ways > nclass:
        raise ValueError(f"{name}: ways={ways} > number of classes in the labels ({nclass})")
    rng = _rng(seed, _TAG_NWAY_KSHOT)
    n_list = np.clip(np.rint(rng.normal(ways, stdev, num_clients)), 1, nclass).astype(np.int64)
    k_list = np.maximum(1, np.rint(rng.normal(shots, stdev, num_clients))).astype(np.int64)
    cc = [rng.choice(nclass, size=int(n), replace=False) for n in n_list]
    demand: list[Optional[np.ndarray]] = [
        np.full(len(c), k, dtype=np.int64) for c, k in zip(cc, k_list)
    ]
    return _draw(name, classes, by_class, cc, demand, rng)


# --------------------------------------------------------------------------- natural
@PARTITIONERS.register("natural")
def natural(
    labels: np.ndarray, num_clients: int, seed: int, *, users: list[np.ndarray]
) -> list[np.ndarray]:
    """LEAF's per-user split: the dataset's own user index arrays (``Dataset.users_train``).

    If ``num_clients < len(users)`` the first ``num_clients`` users in the given order
    are taken (the rest are unused); more clients than users raises :class:`ValueError`.
    ``seed`` is unused (the split is fixed by the data). Indices must be within the
    labels and disjoint across users.
    """
    name = "natural"
    y = _check_common(labels, num_clients, seed, name)
    if users is None or len(users) == 0:
        raise ValueError(f"{name}: the dataset provides no users (no natural partition)")
    if num_clients > len(users):
        raise ValueError(
            f"{name}: num_clients={num_clients} > {len(users)} users in the dataset"
        )
    out = []
    for u, ix in enumerate(users[:num_clients]):
        a = np.asarray(ix)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"{name}: user {u}: indices must be a 1-D integer array")
        a = a.astype(np.int64)
        if a.size and (a.min() < 0 or a.max() >= len(y)):
            raise ValueError(
                f"{name}: user {u}: index out of range [0, {len(y)}) of the training split"
            )
        out.append(a)
    parts = _finish(out)
    allix = np.concatenate(parts)
    if len(np.unique(allix)) != len(allix):
        raise ValueError(f"{name}: user index arrays overlap (a sample belongs to two users)")
    return parts


# --------------------------------------------------------------------------- evaluation helpers
def class_counts(parts: Sequence[np.ndarray], labels, num_classes: int) -> np.ndarray:
    """(num_clients, num_classes) int64 matrix of per-client class counts."""
    y = _check_labels(labels)
    if y.size and y.max() >= num_classes:
        raise ValueError(f"label {int(y.max())} >= num_classes={num_classes}")
    out = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, p in enumerate(parts):
        out[i] = np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=num_classes)
    return out


def local_test_indices(
    train_parts: Sequence[np.ndarray],
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    seed: int,
    fraction: float | None = None,
) -> list[np.ndarray]:
    """Each client's local test set (for personalised accuracy): a sample of the test split
    with the client's training class proportions.

    Size ``n_test_k = max(1, round(n_train_k * fraction))`` (round half up), ``fraction``
    defaulting to ``len(test) / len(train)``; a client without training data gets an
    empty test set. Per-class counts: ``n_test_k * n_train_kc / n_train_k`` rounded by
    largest remainder (the floors, then one more for the classes with the largest
    remainders, ties at random) so they sum to ``n_test_k``. Drawn without replacement
    within a client (the same test sample may appear for several clients). A class with
    fewer test samples than requested is capped at what exists (the shortfall is not
    moved to other classes, so that set is smaller). Returns sorted int64 arrays into
    the test split.
    """
    ytr = _check_labels(train_labels)
    yte = _check_labels(test_labels)
    for what, y in (("train", ytr), ("test", yte)):
        if y.size and y.max() >= num_classes:
            raise ValueError(f"{what} label {int(y.max())} >= num_classes={num_classes}")
    if len(yte) == 0:
        raise ValueError("local_test_indices: the test split is empty")
    if fraction is None:
        if len(ytr) == 0:
            raise ValueError("local_test_indices: the training split is empty")
        fraction = len(yte) / len(ytr)
    fraction = float(fraction)
    if not np.isfinite(fraction) or fraction <= 0:
        raise ValueError(f"local_test_indices: fraction must be > 0, got {fraction}")
    _, by_class_present = _class_index(yte)
    test_by_class = [np.zeros(0, dtype=np.int64) for _ in range(num_classes)]
    for c, ix in zip(np.unique(yte), by_class_present):
        test_by_class[int(c)] = ix
    avail = np.array([len(ix) for ix in test_by_class], dtype=np.int64)
    rng = _rng(seed, _TAG_LOCAL_TEST)
    out = []
    for p in train_parts:
        p = np.asarray(p, dtype=np.int64)
        n_train = len(p)
        if n_train == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        counts = np.bincount(ytr[p], minlength=num_classes).astype(np.int64)
        n_test = max(1, int(np.floor(n_train * fraction + 0.5)))
        num = counts * n_test  # exact integer largest-remainder rounding
        want = num // n_train
        rem = num % n_train
        short = n_test - int(want.sum())
        if short > 0:
            order = np.lexsort((rng.random(num_classes), -rem))
            want[order[:short]] += 1
        want = np.minimum(want, avail)
        chunks = [
            rng.choice(test_by_class[c], size=int(w), replace=False)
            for c, w in enumerate(want)
            if w > 0
        ]
        out.append(
            np.sort(np.concatenate(chunks).astype(np.int64))
            if chunks
            else np.zeros(0, dtype=np.int64)
        )
    return out
