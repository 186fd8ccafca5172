"""Feature-distribution skew: the same classes look different from client to client.

A scenario is chosen by the config's ``features`` section (``features: {name: noise,
sigma: 0.1}``), next to ``partition`` (which decides the *labels* each client holds);
the two compose, and ``partition.name=iid`` gives pure feature skew. The default
(``none``) leaves the data as it is.

=========  ==========================================================================
noise      NIID-Bench (Li et al., ICDE 2022): client k of K adds Gaussian noise of
           standard deviation ``sigma * k / (K - 1)`` to its [0, 1] pixels, on its
           training and local-test data; the global test set stays clean.
rotate     IFCA (Ghosh et al., 2020): G rotation groups (0, 90, 180, 270 degrees for
           G = 4, by exact ``rot90``); every client's train and local test are rotated
           by its group's angle; the global test set is the union over the groups.
domains    Real domain shift from the digit sources on disk: MNIST, FEMNIST's digits
           and scikit-learn's 8x8 digits resized to 28x28, or Digit-5's five (MNIST,
           SVHN, USPS, SynthDigits, MNIST-M brought to one ``shape``); one test set per
           domain.
writers    NIID-Bench "real": FEMNIST's writers permuted with the seed and split into
           K groups, one group per client.
=========  ==========================================================================

Determinism: every transform is a function of (seed, client, sample position), never
of the process that applies it, so worker processes, a resumed run and Flower clients
see the same pixels as a sequential run. Deterministic transforms (rotations, domains,
writers) are applied once when the federated data is built, and the result stays in the
source dtype (uint8 images stay uint8). The noise is added when a client's slice is
loaded (see :class:`GaussianNoise`), so no float copy of the dataset is ever held.

Per-group accuracies: ``rotate`` and ``domains`` name a group per client and a block of
the global test set per group; the engine then logs ``gm:<group>`` (the global model on
that group's test block) and ``pa:<group>`` (the local-test accuracy of that group's
clients), next to the usual ``gm`` and ``pa``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, cast, Optional

import numpy as np
import torch

from ..registry import Registry
from ..rng import np_rng, torch_gen
from .dataset import Dataset
from .datasets import channel_stats, DIGIT5, domain_subset, load_configured, load_dataset, resolve_root, to_image_shape
from .federated import FederatedData, make_partition
from .partition import local_test_indices

FEATURES: Registry = Registry("feature scenario")


def _rng(seed: int, *keys: object) -> np.random.Generator:
    return np_rng(seed, "features", *keys)


def _assign(assign: Optional[list[int]], num_clients: int, groups: int, what: str) -> np.ndarray:
    """Group id per client: round-robin (k % G) or the explicit list."""
    if assign is None:
        return np.arange(num_clients, dtype=np.int64) % groups
    if len(assign) != num_clients:
        raise ValueError(f"{what}: assign has {len(assign)} entries for {num_clients} clients")
    a = np.asarray(assign, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= groups):
        raise ValueError(f"{what}: assign values must be in 0..{groups - 1}, got {list(assign)}")
    return a


class Scenario:
    """A feature-skew scenario. Subclasses either transform an already partitioned
    :class:`~protofl.data.federated.FederatedData` (``apply``) or assemble their own
    dataset and partition it per pool of clients (``build``)."""

    name = "?"
    builds_dataset = False  # True: build(cfg, dataset) replaces the usual load + partition

    def check(self, cfg) -> None:
        """Cross-section checks (e.g. the dataset kind); raise ValueError."""

    def apply(self, fed, seed: int):  # pragma: no cover - interface
        raise NotImplementedError

    def build(self, cfg, dataset: Optional[Dataset] = None):  # pragma: no cover - interface
        raise NotImplementedError

    def datasets(self, cfg) -> list[str]:
        """The registered datasets the scenario reads (what must be under the data root)."""
        return [cfg.data.name]


# ---------------------------------------------------------------------------------------
# noise
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GaussianNoise:
    """Per-client additive Gaussian pixel noise, drawn when a client's slice is loaded.

    ``sigmas[k]`` is client k's standard deviation in [0, 1] pixel units. The noise of a
    slice comes from a generator seeded by (seed, split, client) -- and the round when
    ``redraw`` is on -- and is drawn in the order of the client's sample indices, so
    sample j of client k gets the same noise in every process. It is added to the
    normalized input as ``n / std[c]`` (normalization is affine, so this equals adding
    ``n`` to the [0, 1] pixel before normalizing). Values are not clipped (NIID-Bench's
    ``AddGaussianNoise`` does not clip either).
    """

    seed: int
    sigmas: tuple[float, ...]
    redraw: bool
    std: Optional[tuple[float, ...]]

    def __call__(self, x: torch.Tensor, cid: int, rnd: int, split: str) -> torch.Tensor:
        sigma = self.sigmas[cid]
        if sigma == 0 or x.numel() == 0:
            return x
        keys = ("noise", split, cid) + ((rnd,) if self.redraw else ())
        g = torch_gen(self.seed, *keys)
        n = torch.randn(x.shape, generator=g, dtype=torch.float32).mul_(sigma)
        if self.std is not None:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            n.div_(torch.as_tensor(self.std, dtype=torch.float32).view(shape))
        return x + n.to(x.device)


class Noise(Scenario):
    name = "noise"

    def __init__(self, sigma: float = 0.1, redraw: bool = True) -> None:
        if not np.isfinite(sigma) or sigma < 0:
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
        self.sigma, self.redraw = float(sigma), bool(redraw)

    def sigmas(self, num_clients: int) -> tuple[float, ...]:
        """sigma * k / (K - 1) for k = 0..K-1 (a single client gets sigma)."""
        if num_clients == 1:
            return (self.sigma,)
        return tuple(self.sigma * k / (num_clients - 1) for k in range(num_clients))

    def apply(self, fed, seed: int):
        ds = fed.dataset
        if ds.kind == "tokens":
            raise ValueError(f"noise needs image or vector inputs; {ds.name!r} holds tokens")
        std = tuple(float(s) for s in ds.std) if ds.std is not None else None
        return replace(fed, transform=GaussianNoise(seed, self.sigmas(fed.num_clients), self.redraw, std))


@FEATURES.register("noise")
def noise(sigma: float = 0.1, redraw: bool = True) -> Scenario:
    """Gaussian noise of std ``sigma * k / (K - 1)`` on client k's train and local-test
    pixels ([0, 1] units); the global test set stays clean. ``redraw`` (default, as
    NIID-Bench's transform): fresh noise every round; false: the same noise for a
    sample every time it is loaded."""
    return Noise(sigma, redraw)


# ---------------------------------------------------------------------------------------
# rotate
# ---------------------------------------------------------------------------------------
class Rotate(Scenario):
    name = "rotate"

    def __init__(self, groups: int = 4, angles: Optional[list[int]] = None,
                 assign: Optional[list[int]] = None) -> None:
        if angles is None:
            if groups not in (1, 2, 4):
                raise ValueError(f"groups must be 1, 2 or 4 (exact rot90 angles 360*g/G), got {groups}; "
                                 f"give angles for other sets")
            angles = [360 * g // groups for g in range(groups)]
        if not angles or any(a % 90 for a in angles):
            raise ValueError(f"angles must be multiples of 90 degrees, got {angles}")
        self.angles = [int(a) % 360 for a in angles]
        self.assign = assign

    @property
    def group_names(self) -> list[str]:
        return [f"rot{a}" for a in self.angles]

    def apply(self, fed, seed: int):
        ds = fed.dataset
        if ds.kind != "image" or ds.x_train.dim() != 4 or ds.x_train.shape[-1] != ds.x_train.shape[-2]:
            raise ValueError(f"rotate needs square images; {ds.name!r} has inputs of shape {ds.input_shape}")
        G = len(self.angles)
        group = _assign(self.assign, fed.num_clients, G, "rotate")
        rot = [lambda x, a=a: torch.rot90(x, a // 90, dims=(-2, -1)) for a in self.angles]
        # training data: each client's samples, rotated by its group's angle, in one block
        xs, ys, parts, start = [], [], [], 0
        for k, idx in enumerate(fed.train_idx):
            t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
            xs.append(rot[group[k]](ds.x_train[t]))
            ys.append(ds.y_train[t])
            parts.append(np.arange(start, start + len(idx), dtype=np.int64))
            start += len(idx)
        # global test: the test split once per group; local tests point into their group's block
        n_test = len(ds.y_test)
        x_test = torch.cat([r(ds.x_test) for r in rot]).contiguous()
        y_test = ds.y_test.repeat(G)
        tests = [np.asarray(t, dtype=np.int64) + group[k] * n_test for k, t in enumerate(fed.test_idx)]
        new = replace(ds, x_train=torch.cat(xs).contiguous() if xs else ds.x_train[:0],
                      y_train=torch.cat(ys) if ys else ds.y_train[:0], x_test=x_test, y_test=y_test,
                      users_train=None, users_test=None,
                      info={**ds.info, "features": {"rotate": self.angles}})
        test_groups = {name: np.arange(g * n_test, (g + 1) * n_test, dtype=np.int64)
                       for g, name in enumerate(self.group_names)}
        return replace(fed, dataset=new, train_idx=parts, test_idx=tests, feature_groups=group,
                       feature_group_names=self.group_names, test_groups=test_groups)


@FEATURES.register("rotate")
def rotate(groups: int = 4, angles: Optional[list[int]] = None, assign: Optional[list[int]] = None) -> Scenario:
    """G rotation groups (``groups`` 1, 2 or 4: angles 360*g/G; or ``angles``, multiples
    of 90), clients assigned round-robin (client k -> group k % G) or by ``assign``.
    Train and local test are rotated by exact ``rot90``; the global test set is the test
    split once per group, rotated."""
    return Rotate(groups, angles, assign)


# ---------------------------------------------------------------------------------------
# pooled partitioning: the label partitioner runs inside each pool of clients
# ---------------------------------------------------------------------------------------
def pooled_partition(cfg, ds: Dataset, pools: list[tuple[np.ndarray, np.ndarray]], pool_of: np.ndarray):
    """Run ``cfg.partition`` inside each pool: pool p's clients split its training
    indices ``pools[p][0]``; their local test sets are drawn (training class
    proportions) from its test indices ``pools[p][1]``. Returns (train_idx, test_idx)."""
    K = len(pool_of)
    train: list[np.ndarray] = [np.zeros(0, np.int64)] * K
    test: list[np.ndarray] = [np.zeros(0, np.int64)] * K
    for p, (tr, te) in enumerate(pools):
        members = np.flatnonzero(pool_of == p)
        if len(members) == 0:
            continue
        labels = ds.train_labels[tr]
        pseed = int(_rng(cfg.seed, "pool", p).integers(2**31 - 1))
        parts = make_partition(cfg.partition.name, labels, len(members), pseed, cfg.partition.params)
        tests = local_test_indices(parts, labels, ds.test_labels[te], ds.num_classes, pseed,
                                   fraction=cfg.eval.local_test_fraction)
        for j, k in enumerate(members):
            train[k] = np.sort(tr[parts[j]])
            test[k] = np.sort(te[tests[j]])
    return train, test


# ---------------------------------------------------------------------------------------
# domains
# ---------------------------------------------------------------------------------------
def _domain(name: str) -> Callable:
    """A domain that is a whole catalog dataset of digits (MNIST, SVHN, USPS, SynthDigits,
    MNIST-M), as its loader returns it."""
    def load(root, seed, **fetch):
        d = load_dataset(name, root, seed, **fetch)
        return d.x_train, d.y_train, d.x_test, d.y_test

    return load


def _domain_femnist(root, seed, **fetch):
    """FEMNIST's digits (labels 0-9), [0, 1] floats (white background) -> uint8 0..255."""
    d = load_dataset("femnist", root, seed, **fetch)
    out = []
    for x, y in ((d.x_train, d.y_train), (d.x_test, d.y_test)):
        keep = y < 10
        out += [x[keep].mul(255).round_().clamp_(0, 255).to(torch.uint8), y[keep].clone()]
    return tuple(out)


def resize_digits(x: torch.Tensor, size: int = 28) -> torch.Tensor:
    """sklearn's 8x8 digits (uint8 0..16) -> (N, 1, size, size) uint8 0..255: 0..16 is
    mapped to [0, 1], resized bilinearly (``align_corners=False``), then stored as uint8."""
    f = x.to(torch.float32).div_(16.0)
    f = torch.nn.functional.interpolate(f, size=(size, size), mode="bilinear", align_corners=False)
    return f.mul_(255).round_().clamp_(0, 255).to(torch.uint8)


def _domain_digits(root, seed, **fetch):
    d = load_dataset("digits", root, seed)
    return resize_digits(d.x_train), d.y_train, resize_digits(d.x_test), d.y_test


# every source is the catalog dataset of the same name (sklearn's digits ship with scikit-learn)
DOMAIN_SOURCES: dict[str, Callable] = {"mnist": _domain("mnist"), "femnist": _domain_femnist, "digits": _domain_digits,
                                       **{n: _domain(n) for n in DIGIT5 if n != "mnist"}}


class Domains(Scenario):
    name = "domains"
    builds_dataset = True

    def __init__(self, sources: Optional[list[str]] = None, train_size: Optional[int] = None,
                 test_size: Optional[int] = None, assign: Optional[list[int]] = None,
                 shape: Optional[list[int]] = None) -> None:
        sources = list(sources) if sources is not None else ["mnist", "femnist", "digits"]
        if not sources:
            raise ValueError("sources must name at least one domain")
        bad = [s for s in sources if s not in DOMAIN_SOURCES]
        if bad:
            raise ValueError(f"unknown domain {bad[0]!r}; known: {', '.join(DOMAIN_SOURCES)}")
        if len(set(sources)) != len(sources):
            raise ValueError(f"sources must not repeat a domain, got {sources}")
        for what, v in (("train_size", train_size), ("test_size", test_size)):
            if v is not None and v < 1:
                raise ValueError(f"{what} must be >= 1 or null, got {v}")
        if shape is not None and (not isinstance(shape, (list, tuple)) or len(shape) != 3 or shape[0] not in (1, 3)
                                  or not all(isinstance(v, int) and v >= 8 for v in shape[1:])):
            raise ValueError(f"shape must be [channels (1 or 3), height, width] (at least 8 pixels), got {shape}")
        self.sources, self.train_size, self.test_size, self.assign = sources, train_size, test_size, assign
        self.shape = cast("tuple[int, int, int]", tuple(shape)) if shape is not None else None  # checked above

    def datasets(self, cfg) -> list[str]:
        return list(self.sources)

    def check(self, cfg) -> None:
        _assign(self.assign, cfg.partition.num_clients, len(self.sources), "domains")
        if cfg.partition.name == "natural":
            raise ValueError("domains assigns the clients' data itself; natural (writer) partitions do not apply")

    def build(self, cfg, dataset: Optional[Dataset] = None):
        root = resolve_root(cfg.data.root)
        fetch = {"download": cfg.data.download, "mirrors": tuple(cfg.data.mirrors), "verify": cfg.data.verify}
        parts = [DOMAIN_SOURCES[s](root, cfg.seed, **fetch) for s in self.sources]
        shapes = {s: tuple(p[0].shape[1:]) for s, p in zip(self.sources, parts)}
        if self.shape is None and len(set(shapes.values())) > 1:
            raise ValueError("the domains' images differ in shape (" + ", ".join(f"{s} {list(v)}" for s, v in
                             shapes.items()) + "); give features.shape, e.g. [3, 32, 32], to bring them to one")
        n_tr = min(len(p[1]) for p in parts)
        n_te = min(len(p[3]) for p in parts)
        n_tr = self._size("train_size", self.train_size, n_tr, parts, 1)
        n_te = self._size("test_size", self.test_size, n_te, parts, 3)
        xtr, ytr, xte, yte, pools = [], [], [], [], []
        for d, (a, b, c, e) in enumerate(parts):
            dom = Dataset(self.sources[d], a, b, c, e, 10)
            x1, y1, x2, y2 = domain_subset(dom, n_tr, n_te, cfg.seed, self.sources[d])
            if self.shape is not None:
                x1, x2 = to_image_shape(x1, self.shape), to_image_shape(x2, self.shape)
            xtr.append(x1)
            ytr.append(y1)
            xte.append(x2)
            yte.append(y2)
            pools.append((np.arange(d * n_tr, (d + 1) * n_tr, dtype=np.int64),
                          np.arange(d * n_te, (d + 1) * n_te, dtype=np.int64)))
        x_train = torch.cat(xtr)
        # normalization from the pooled training images (every domain counts equally): one
        # mean and std for grey images (as ever), per channel for RGB ones
        mean: tuple[float, ...]
        std: tuple[float, ...]
        if x_train.shape[1] == 1:
            f = x_train.to(torch.float32).div_(255.0)
            mean, std = (float(f.mean()),), (float(f.std()),)
            del f
        else:
            mean, std = channel_stats(x_train.numpy())
        ds = Dataset(name="domains", x_train=x_train, y_train=torch.cat(ytr), x_test=torch.cat(xte),
                     y_test=torch.cat(yte), num_classes=10, scale=255.0, mean=mean, std=std,
                     class_names=[str(i) for i in range(10)],
                     info={"domains": self.sources, "train_per_domain": n_tr, "test_per_domain": n_te})
        group = _assign(self.assign, cfg.partition.num_clients, len(self.sources), "domains")
        train, test = pooled_partition(cfg, ds, pools, group)
        test_groups = {s: pools[d][1] for d, s in enumerate(self.sources)}
        return FederatedData(ds, train, test, None, feature_groups=group, feature_group_names=list(self.sources),
                             test_groups=test_groups)

    def _size(self, what, asked, smallest, parts, i) -> int:
        if asked is None:
            return smallest
        if asked > smallest:
            which = self.sources[int(np.argmin([len(p[i]) for p in parts]))]
            raise ValueError(f"{what}={asked} exceeds the smallest domain ({which}: {smallest} samples)")
        return asked


@FEATURES.register("domains")
def domains(sources: Optional[list[str]] = None, train_size: Optional[int] = None,
            test_size: Optional[int] = None, assign: Optional[list[int]] = None,
            shape: Optional[list[int]] = None) -> Scenario:
    """One dataset per domain (``sources``, default mnist, femnist digits 0-9, sklearn
    digits resized to 28x28; also svhn, usps, synthdigits and mnistm, the rest of
    Digit-5), the same number of training samples from each (``train_size``; default: the
    smallest domain's training split) and one test set per domain (``test_size``;
    default: the smallest domain's test split). Domains whose images differ in shape are
    brought to ``shape`` ([C, H, W], e.g. [3, 32, 32] for Digit-5: bilinear resize, grey
    replicated to RGB). Clients are assigned to domains round-robin or by ``assign``; the
    label partitioner splits each domain among its clients. ``data.name`` is not used
    (only ``data.root``)."""
    return Domains(sources, train_size, test_size, assign, shape)


# ---------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------
class Writers(Scenario):
    name = "writers"
    builds_dataset = True

    def check(self, cfg) -> None:
        if cfg.partition.name == "natural":
            raise ValueError("writers already groups the natural users; use a label partitioner "
                             "(partition.name=iid keeps every sample of the group)")

    def build(self, cfg, dataset: Optional[Dataset] = None):
        ds = dataset if dataset is not None else load_configured(cfg)
        if ds.users_train is None or ds.users_test is None:
            raise ValueError(f"writers needs a dataset with natural users (femnist, shakespeare); "
                             f"{ds.name!r} has none")
        K, U = cfg.partition.num_clients, len(ds.users_train)
        if K > U:
            raise ValueError(f"writers: {K} clients but only {U} writers")
        perm = _rng(cfg.seed, "writers").permutation(U)
        groups = np.array_split(perm, K)
        pools = [(np.sort(np.concatenate([ds.users_train[u] for u in g]).astype(np.int64)),
                  np.sort(np.concatenate([ds.users_test[u] for u in g]).astype(np.int64))) for g in groups]
        train, test = pooled_partition(cfg, ds, pools, np.arange(K))
        # the built-in loaders name their users; a dataset (a plugin's) that does not: by index
        names = ds.user_names if ds.user_names is not None else [str(u) for u in range(U)]
        ds = replace(ds, info={**ds.info, "writer_groups": [[names[u] for u in g] for g in groups]})
        return FederatedData(ds, train, test, None)


@FEATURES.register("writers")
def writers() -> Scenario:
    """FEMNIST (or any dataset with natural users) writers permuted with the seed and
    split into K near-equal groups, one per client; the label partitioner then runs
    inside each client's group (iid keeps all of it). Local test: the group's own test
    samples, in the client's training class proportions."""
    return Writers()


@FEATURES.register("none")
def none() -> Optional[Scenario]:
    """No feature skew (the default)."""
    return None


def make_scenario(name: str, params: dict) -> Optional[Scenario]:
    return FEATURES.get(name)(**params)


def check_scenario(cfg) -> Any:
    """Build the scenario and run its cross-section checks; ValueError on bad values."""
    scen = make_scenario(cfg.features.name, cfg.features.params)
    if scen is not None:
        scen.check(cfg)
    return scen
