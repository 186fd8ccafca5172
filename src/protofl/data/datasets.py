"""Dataset loaders: name -> in-memory :class:`Dataset`.

Every loader has the signature ``loader(root: Path, seed: int, **options) -> Dataset``;
options are validated against the signature by the config layer. Files are read in the
datasets' published formats, straight from the published archives where there are some.
A dataset of the catalog (:mod:`protofl.data.catalog`) whose files are missing is
fetched on first use (:mod:`protofl.data.fetch`), unless ``PROTOFL_OFFLINE`` is set or
``data.download`` is false.

Data root resolution (first that is set): ``--data-dir`` / ``data.root``, the
``PROTOFL_DATA`` environment variable, then ``$XDG_CACHE_HOME/protofl/data``
(``~/.cache/protofl/data``).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import math
import os
import pickle
import re
import io
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import cast, IO, Optional, Sequence

import numpy as np
import numpy.typing as npt
import torch

from ..errors import DataFileError, human_bytes, InputError, one_line
from ..registry import Registry
from .dataset import channel_stats, Dataset, MissingDataError

DATASETS: Registry = Registry("dataset", "protofl.datasets")
HF_PREFIX = "hf:"  # data.name: hf:<repo> loads a Hugging Face dataset (protofl.data.hf)
HF_USAGE = "hf:<repo> (any Hugging Face image-classification dataset, e.g. hf:uoft-cs/cifar10; the hf extra)"


# MD5 of the published files (MNIST: LeCun's site; Fashion-MNIST: Zalando's release),
# keyed by (dataset, file name). A file that is not the published one stops a run before
# it is read (fetch.check_before_reading, which also names the dataset whose file it is);
# read anyway (data.verify: false), a readable file that is byte for byte another
# published file is still refused here (e.g. Fashion-MNIST's images in the MNIST folder:
# same names, same shapes), while a re-packed copy or a subset is read, gzip's CRC and the
# IDX header/size checks catching damage.
PUBLISHED_MD5 = {
    ("mnist", "train-images-idx3-ubyte.gz"): "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    ("mnist", "train-labels-idx1-ubyte.gz"): "d53e105ee54ea40749a09fcbcd1e9432",
    ("mnist", "t10k-images-idx3-ubyte.gz"): "9fb629c4189551a2d022fa330f9573f3",
    ("mnist", "t10k-labels-idx1-ubyte.gz"): "ec29112dd5afa0611ce80d1b7f02629c",
    ("fmnist", "train-images-idx3-ubyte.gz"): "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    ("fmnist", "train-labels-idx1-ubyte.gz"): "25c81989df183df01b3e8a0aad5dffbe",
    ("fmnist", "t10k-images-idx3-ubyte.gz"): "bef4ecab320f06d8554ea6380940ec79",
    ("fmnist", "t10k-labels-idx1-ubyte.gz"): "bb300cfdad3c16e7a12a480ee83cd310",
}


def verify_published(path: Path, dataset: str, raw: bytes) -> None:
    """Refuse a file that is another published file than the one its name says."""
    expected = PUBLISHED_MD5.get((dataset, path.name))
    if expected is None:
        return
    digest = hashlib.md5(raw).hexdigest()
    known = next(((d, f) for (d, f), m in PUBLISHED_MD5.items() if m == digest), None)
    if known is not None and known != (dataset, path.name):
        raise DataFileError(f"{path}: not the {dataset} file of that name, it is {known[0]}'s {known[1]} "
                            f"(byte for byte); copy the right file there")


def default_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "protofl" / "data"


def resolve_root(root: Optional[str | os.PathLike] = None) -> Path:
    if root:
        return Path(root).expanduser()
    env = os.environ.get("PROTOFL_DATA")
    if env:
        return Path(env).expanduser()
    return default_root()


def find_files(root: Path, dataset: str, folders: list[str], files: list[str]) -> Path:
    """Return the first folder under ``root`` (among ``folders``) that holds all ``files``.

    Raises :class:`MissingDataError` naming the files expected and the folders searched.
    """
    searched = []
    for sub in folders:
        d = root / sub if sub else root
        searched.append(str(d))
        if all((d / f).exists() for f in files):
            return d
    raise MissingDataError(
        f"dataset {dataset!r}: expected files {', '.join(files)} in one of: {'; '.join(searched)}. "
        f"Set --data-dir or PROTOFL_DATA to the folder that holds them{_fetch_hint(dataset)}."
    )


def _fetch_hint(dataset: str) -> str:
    from .catalog import CATALOG

    src = CATALOG.get(dataset)
    return f", or run `protofl data fetch {dataset}`" if src is not None and src.fetchable else ""


def load_dataset(name: str, root: Optional[str | os.PathLike] = None, seed: int = 0, *,
                 download: Optional[bool] = None, mirrors: tuple[str, ...] | list[str] = (), verify: bool = True,
                 **options) -> Dataset:
    """Load a registered dataset; a file that exists but cannot be read is one-line bad input.

    A catalog dataset whose files are missing is fetched first (``download=False`` or
    ``PROTOFL_OFFLINE=1`` forbid it: the error then says how to place the files by hand).
    A catalog file that is present but not the published bytes stops the load in one line
    (``verify=False``, ``data.verify: false``: read anyway, said in one line).
    ``hf:<repo>`` loads a Hugging Face dataset (the ``hf`` extra).
    """
    if name.startswith(HF_PREFIX):
        from .hf import load_hf

        return load_hf(name[len(HF_PREFIX):], seed, download=download, **options)
    from .catalog import CATALOG
    from .fetch import check_before_reading

    loader = DATASETS.get(name)
    path = resolve_root(root)
    if name in COMPOSITE:  # each part fetched on first use as this call says
        names, pool = COMPOSITE[name]
        parts = [load_dataset(n, path, seed, download=download, mirrors=mirrors, verify=verify) for n in names]
        return _read(name, lambda _root, s, **o: pool(parts, s, **o), path, seed, options)
    if name in CATALOG:
        check_before_reading(CATALOG[name], path, verify)
    try:
        return _read(name, loader, path, seed, options)
    except MissingDataError as missing:
        from .catalog import CATALOG
        from .fetch import fetch

        source = CATALOG.get(name)
        if source is None:
            raise
        try:
            fetch(source, path, mirrors=mirrors, download=download)
        except MissingDataError as e:  # offline, or not fetchable: what was looked for, then how to place it
            detail = str(e).removeprefix(f"dataset {name!r}: ")
            raise MissingDataError(f"{missing} Not fetched: {detail}") from None
        return _read(name, loader, path, seed, options)


def _read(name, loader, root: Path, seed: int, options: dict) -> Dataset:
    try:
        return loader(root, seed, **options)
    except InputError:
        raise
    except (ValueError, OSError, EOFError, zlib.error, tarfile.TarError, pickle.UnpicklingError,
            zipfile.BadZipFile) as e:
        # a file that exists but cannot be read as the dataset's format: one line, exit 2
        raise DataFileError(f"dataset {name!r}: {one_line(e)}") from None


def load_configured(cfg) -> Dataset:
    """The dataset of a config's ``data`` section (fetched on first use as it says)."""
    d = cfg.data
    return load_dataset(d.name, d.root, seed=cfg.seed, download=d.download, mirrors=tuple(d.mirrors), verify=d.verify,
                        **d.params)


# ---------------------------------------------------------------------------------------
# spiral: the FedNH paper's motivating example (Dai et al., AAAI 2023, section 3.1)
# ---------------------------------------------------------------------------------------
SPIRAL_IMBALANCED_COUNTS = (3000, 1500, 750, 375, 187, 93)


def spiral_points(counts: tuple[int, ...], rng: np.random.Generator, n_max: int = 3000, noise: float = 1.0):
    """Points of the 6-class spiral.

    For class k and i in 1..n_max: r_i = 1 + (i-1) * 9 / (n_max-1),
    w = k*pi/3 + (i-1) * k*pi / (3*(n_max-1)) + b_i, b_i ~ N(0, noise^2) (the paper: N(0, 1));
    point (r cos w, r sin w).
    A class with count n < n_max keeps n of the n_max indices, drawn uniformly without
    replacement: the same arm, sampled more sparsely (the minority class of the paper's
    imbalanced setting covers the whole arm, not only its inner part).
    """
    xs, ys = [], []
    for k, n in enumerate(counts):
        if n > n_max:
            raise ValueError(f"spiral: class count {n} exceeds n_max={n_max}")
        i = np.arange(n_max, dtype=np.float64)  # i - 1
        if n < n_max:
            i = np.sort(rng.choice(n_max, size=n, replace=False)).astype(np.float64)
        r = 1.0 + i * 9.0 / (n_max - 1)
        w = k * math.pi / 3.0 + i * k * math.pi / (3.0 * (n_max - 1)) + noise * rng.standard_normal(n)
        xs.append(np.stack([r * np.cos(w), r * np.sin(w)], axis=1))
        ys.append(np.full(n, k, dtype=np.int64))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys)


@DATASETS.register("spiral")
def load_spiral(root: Path, seed: int, imbalanced: bool = False, test_per_class: int = 3000,
                noise: float = 1.0) -> Dataset:
    """6-class 2-D spiral; the test set is always balanced (``test_per_class`` per class).

    ``noise`` is the standard deviation (radians) of the angular noise b_i. The paper's
    formula uses 1.0; at that level the six arms overlap heavily (a 50-nearest-neighbour
    classifier reaches about 37 % on the balanced set), so a smaller value gives arms
    a model can actually separate.
    """
    if noise < 0:
        raise ValueError(f"spiral: noise must be >= 0, got {noise}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5B1A]))
    counts = SPIRAL_IMBALANCED_COUNTS if imbalanced else (3000,) * 6
    xtr, ytr = spiral_points(counts, rng, noise=noise)
    xte, yte = spiral_points((test_per_class,) * 6, rng, n_max=max(test_per_class, 2), noise=noise)
    return Dataset(
        name="spiral",
        x_train=torch.from_numpy(xtr),
        y_train=torch.from_numpy(ytr),
        x_test=torch.from_numpy(xte),
        y_test=torch.from_numpy(yte),
        num_classes=6,
        kind="vector",
        info={"imbalanced": imbalanced, "counts": list(counts), "noise": noise},
    )


# ---------------------------------------------------------------------------------------
# digits: scikit-learn's bundled 8x8 handwritten digits (1,797 images, values 0..16)
# ---------------------------------------------------------------------------------------
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(1797, 8, 8) uint8 images and int64 labels of scikit-learn's bundled digits.

    Reads the CSV that ships inside the scikit-learn wheel without importing scikit-learn
    (its import costs seconds, which every Flower client process would pay); falls back
    to ``sklearn.datasets.load_digits`` if the file is not where we expect it.
    """
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.exists():
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",", dtype=np.float64)
            return table[:, :64].astype(np.uint8).reshape(-1, 8, 8), table[:, 64].astype(np.int64)
    from sklearn.datasets import load_digits as _load

    d = _load()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


@DATASETS.register("digits")
def load_digits(root: Path, seed: int, test_fraction: float = 0.25) -> Dataset:
    """sklearn's digits, split into train/test by a stratified, seeded shuffle."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"data.test_fraction must be in (0, 1), got {test_fraction}")
    images, target = _digits_arrays()
    x = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 8, 8) uint8, 0..16
    y = torch.from_numpy(target)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xD161]))
    test_parts = []
    for c in range(10):
        idx = np.flatnonzero(target == c)
        rng.shuffle(idx)
        test_parts.append(idx[: int(round(len(idx) * test_fraction))])
    test_idx = np.sort(np.concatenate(test_parts))
    train_mask = np.ones(len(y), dtype=bool)
    train_mask[test_idx] = False
    train_idx = np.flatnonzero(train_mask)
    return Dataset(
        name="digits",
        x_train=x[train_idx],
        y_train=y[train_idx],
        x_test=x[test_idx],
        y_test=y[test_idx],
        num_classes=10,
        scale=16.0,
        mean=(0.3,),
        std=(0.38,),
    )


# ---------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST: the four official IDX files (LeCun's format)
# ---------------------------------------------------------------------------------------
# IDX: 2 zero bytes, a type code, the number of dims, then each dim as a big-endian
# uint32, then the values (big-endian for multi-byte types), row-major.
IDX_DTYPES: dict[int, npt.DTypeLike] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4",
                                        0x0E: ">f8"}
MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
FMNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]


def parse_idx(data: bytes, what: str = "IDX data") -> np.ndarray:
    """Bytes of an IDX file -> array of its declared dtype and shape (validated)."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise ValueError(f"{what}: not an IDX file (bad magic number {data[:4].hex() or 'empty'})")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{what}: IDX header truncated ({len(data)} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_DTYPES[data[2]])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{what}: IDX size mismatch: header says {dims} ({expected} bytes), file has {len(data)}")
    # native byte order (so torch.from_numpy accepts it), in a writable array of its own
    return np.frombuffer(data, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="), copy=True)


# Decompression bounds. A file placed by hand is read before any checksum when
# data.verify is false, so what it expands to is bounded by rule: no published data file
# expands more than about 25x (FEMNIST's LEAF tarball 21x, MNIST's images 4.8x), gzip and
# bzip2 up to about 1,000x and more. Beyond INFLATE_RATIO x its packed size (at least
# 1 MiB, at most INFLATE_MAX) a file or archive member is refused before it fills memory.
INFLATE_RATIO = 100
INFLATE_MAX = 4 << 30


def inflate_bound(packed: int) -> int:
    """The most bytes ``packed`` compressed bytes may expand to."""
    return min(INFLATE_MAX, max(1 << 20, INFLATE_RATIO * packed))


def _too_large(what: str, packed: int) -> DataFileError:
    return DataFileError(f"{what}: expands past {human_bytes(inflate_bound(packed))} ({INFLATE_RATIO}x its "
                         f"{human_bytes(packed)}), which no published data file does (a decompression bomb?); "
                         "remove it and fetch the dataset again")


def inflate(raw: bytes, what: str, fmt: str = "gzip", hint: str = "fetch it again") -> bytes:
    """``raw`` (one gzip member, or a bzip2 stream) decompressed, within :func:`inflate_bound`."""
    import bz2

    limit = inflate_bound(len(raw))
    try:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS) if fmt == "gzip" else bz2.BZ2Decompressor()
        out = d.decompress(raw, limit + 1)  # at most limit + 1 bytes, however far it would go
    except (zlib.error, OSError, EOFError) as e:
        raise DataFileError(f"{what}: damaged {fmt} file ({len(raw)} bytes; {e}); {hint}") from None
    if len(out) > limit:
        raise _too_large(what, len(raw))
    if not d.eof:
        raise DataFileError(f"{what}: damaged {fmt} file ({len(raw)} bytes; the stream is cut short); {hint}")
    return out


def _member_fits(what: str, size: int, packed: int) -> None:
    """An archive member's declared size against the archive's (or its own packed) size."""
    if size > inflate_bound(packed):
        raise _too_large(what, packed)


def _zip_read(zf: zipfile.ZipFile, name: str, path: Path) -> bytes:
    """Member ``name`` of the zip at ``path``, within the bound (zipfile reads no more than
    the size a member declares, so the declared size is the one to check)."""
    info = zf.getinfo(name)
    _member_fits(f"{path}: {name}", info.file_size, info.compress_size)
    return zf.read(name)


def read_idx(path: Path, dataset: Optional[str] = None) -> np.ndarray:
    raw = packed = path.read_bytes()
    if path.suffix == ".gz":
        # one inflate into one output buffer (gzip.open().read() joins a list of chunks,
        # which briefly holds the decompressed data twice), bounded
        raw = inflate(raw, str(path), hint="copy it again")
    try:
        array = parse_idx(raw, str(path))
    except ValueError as e:
        raise DataFileError(str(e)) from None
    if dataset is not None:  # readable, but is it the published file?
        verify_published(path, dataset, packed)
    return array


def _load_idx_pair(root: Path, dataset: str, folders: list[str]):
    """(x_train, y_train, x_test, y_test, folder); falls back to uncompressed files."""
    names: Sequence[str]
    try:
        d, names = find_files(root, dataset, folders, list(MNIST_FILES)), MNIST_FILES
    except MissingDataError as err:
        raw = [f[: -len(".gz")] for f in MNIST_FILES]  # torchvision's raw/ keeps these too
        try:
            d, names = find_files(root, dataset, folders, raw), raw
        except MissingDataError:
            raise err from None
    xtr, ytr, xte, yte = (read_idx(d / f, dataset) for f in names)
    for x, y, split in ((xtr, ytr, "train"), (xte, yte, "test")):
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[1:] != (28, 28):
            raise ValueError(f"{dataset} {split} images: expected uint8 (N, 28, 28), got {x.dtype} {x.shape}")
        if y.dtype != np.uint8 or y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{dataset} {split} labels: expected uint8 ({len(x)},), got {y.dtype} {y.shape}")
        if y.size and y.max() > 9:
            raise ValueError(f"{dataset} {split} labels: value {int(y.max())} outside 0..9")
    return xtr, ytr, xte, yte, d


def _grey28(name, root, folders, mean, std, class_names) -> Dataset:
    xtr, ytr, xte, yte, d = _load_idx_pair(root, name, folders)
    return Dataset(
        name=name,
        x_train=torch.from_numpy(xtr).unsqueeze(1),  # (N, 1, 28, 28) uint8
        y_train=torch.from_numpy(ytr.astype(np.int64)),
        x_test=torch.from_numpy(xte).unsqueeze(1),
        y_test=torch.from_numpy(yte.astype(np.int64)),
        num_classes=10,
        scale=255.0,
        mean=(mean,),
        std=(std,),
        class_names=class_names,
        info={"source": str(d)},
    )


@DATASETS.register("mnist")
def load_mnist(root: Path, seed: int) -> Dataset:
    return _grey28("mnist", root, ["mnist", "MNIST/raw", ""], 0.1307, 0.3081, [str(i) for i in range(10)])


@DATASETS.register("fmnist")
def load_fmnist(root: Path, seed: int) -> Dataset:
    folders = ["fashion-mnist", "fmnist", "FashionMNIST/raw"]
    return _grey28("fmnist", root, folders, 0.2860, 0.3530, list(FMNIST_CLASSES))


# ---------------------------------------------------------------------------------------
# LEAF (FEMNIST, Shakespeare): JSON files {"users", "num_samples", "user_data"}, split into
# train/ and test/ by LEAF's preprocessing; read from those folders or straight out of a
# .tar.gz (never extracted to disk). Users are matched across splits by name.
# ---------------------------------------------------------------------------------------
LEAF_SPLITS = ("train", "test")
FEMNIST_CLASSES = [str(i) for i in range(10)] + [chr(c) for c in range(65, 91)] + [chr(c) for c in range(97, 123)]
# LEAF's Shakespeare vocabulary (leaf/models/utils/language_utils.py), index = position
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SHAKESPEARE_SEQ_LEN = 80


def _leaf_split_of(name: str) -> Optional[str]:
    """'train'/'test' for a LEAF json path: its nearest train/ or test/ folder, else a
    ``_train_``/``_test_`` token in the file name (LEAF's all_data_..._train_9.json)."""
    p = PurePosixPath(name)
    if p.suffix != ".json" or p.name.startswith("."):
        return None
    for part in reversed(p.parts[:-1]):
        if part in LEAF_SPLITS:
            return part
    tokens = re.split(r"[_.\-]", p.stem)
    return next((s for s in LEAF_SPLITS if s in tokens), None)


def _read_leaf(root: Path, dataset: str, folders: list[str], archive: str = ""):
    """Return (source, {split: [json docs]}) from the first folder that has both splits,
    as extracted json (``train/*.json``, ``test/*.json``, or split-named json files) or
    in a ``.tar.gz`` (``archive`` first if given, then the others by name)."""
    searched = []
    for sub in folders:
        d = root / sub
        searched.append(str(d))
        if not d.is_dir():
            continue
        files: dict[str, list[Path]] = {s: [] for s in LEAF_SPLITS}
        for p in sorted([*d.glob("*.json"), *d.glob("train/*.json"), *d.glob("test/*.json")]):
            split = _leaf_split_of(p.relative_to(d).as_posix())
            if split:
                files[split].append(p)
        if all(files.values()):
            return d, {s: [json.loads(p.read_bytes()) for p in ps] for s, ps in files.items()}
        tars = sorted({*d.glob("*.tar.gz"), *d.glob("*.tgz")}, key=lambda p: (p.name != archive, p.name))
        for tar_path in tars:
            docs: dict[str, list] = {s: [] for s in LEAF_SPLITS}
            # one sequential pass: getmembers() + extractfile() would re-decompress on seeks
            packed = tar_path.stat().st_size
            with tarfile.open(tar_path, "r:gz") as tf:
                for m in tf:
                    split = _leaf_split_of(m.name) if m.isfile() else None
                    if split:
                        _member_fits(f"{tar_path}: {m.name}", m.size, packed)
                        docs[split].append((m.name, json.load(cast(IO[bytes], tf.extractfile(m)))))  # a file
            if all(docs.values()):
                return tar_path, {s: [doc for _, doc in sorted(v, key=lambda t: t[0])] for s, v in docs.items()}
    raise MissingDataError(
        f"dataset {dataset!r}: expected LEAF json files in train/ and test/ folders, or a .tar.gz "
        f"holding them, in one of: {'; '.join(searched)}. Set --data-dir or PROTOFL_DATA to the "
        f"folder that holds them."
    )


def _leaf_dataset(name, root, folders, archive, encode_x, encode_y, **fields) -> Dataset:
    """Concatenate users' samples in sorted-user order; users_* index those blocks.
    A user present in only one split gets an empty index array on the other side."""
    source, docs = _read_leaf(root, name, folders, archive)
    return _users_dataset(name, source, docs, encode_x, encode_y, **fields)


def _users_dataset(name, source, docs, encode_x, encode_y, **fields) -> Dataset:
    """LEAF-form docs ({split: [{"users", "num_samples", "user_data"}]}) -> a Dataset."""
    per: dict[str, dict[str, tuple[list, list]]] = {s: {} for s in LEAF_SPLITS}
    declared = {s: 0 for s in LEAF_SPLITS}
    for split, split_docs in docs.items():
        for doc in split_docs:
            declared[split] += int(sum(doc.get("num_samples", [])))
            for user in doc["users"]:
                ud = doc["user_data"][user]
                if len(ud["x"]) != len(ud["y"]):
                    raise ValueError(f"{name}: user {user!r} has {len(ud['x'])} x but {len(ud['y'])} y in {split}")
                xs, ys = per[split].setdefault(user, ([], []))  # a user may span files
                xs.extend(ud["x"])
                ys.extend(ud["y"])
    users = sorted(set(per["train"]) | set(per["test"]))
    out = {}
    for split in LEAF_SPLITS:
        xs, ys, index, start = [], [], [], 0
        for user in users:
            ux, uy = per[split].get(user, ((), ()))
            xs.extend(ux)
            ys.extend(uy)
            index.append(np.arange(start, start + len(uy), dtype=np.int64))
            start += len(uy)
        y = encode_y(ys)
        if y.size and (y.min() < 0 or y.max() >= fields["num_classes"]):
            raise ValueError(f"{name} {split}: labels outside 0..{fields['num_classes'] - 1}")
        out[split] = (torch.from_numpy(encode_x(xs)), torch.from_numpy(y), index)
    return Dataset(
        name=name,
        x_train=out["train"][0],
        y_train=out["train"][1],
        x_test=out["test"][0],
        y_test=out["test"][1],
        users_train=out["train"][2],
        users_test=out["test"][2],
        user_names=users,
        # LEAF's num_samples is kept for reference; the counts used are those of x/y
        info={"source": str(source), "declared_num_samples": declared},
        **fields,
    )


def _femnist_x(xs: list) -> np.ndarray:
    x = np.asarray(xs, dtype=np.float32).reshape(len(xs), -1) if xs else np.zeros((0, 784), np.float32)
    if x.shape[1:] != (784,):
        raise ValueError(f"femnist: expected 784 values per image, got {x.shape[1]}")
    return x.reshape(-1, 1, 28, 28)


@DATASETS.register("femnist")
def load_femnist(root: Path, seed: int) -> Dataset:
    """LEAF FEMNIST: 28x28 float images in [0, 1] (white background = 1), 62 classes
    (digits, upper case, lower case), one user per writer. Used as stored: no scaling."""
    return _leaf_dataset(
        "femnist", root, ["femnist", "femnist/data"], "",
        _femnist_x, lambda ys: np.asarray(ys, dtype=np.int64),
        num_classes=62, class_names=list(FEMNIST_CLASSES), kind="image",
    )


def encode_chars(texts: list[str], length: int, what: str = "shakespeare", dtype=np.int64) -> np.ndarray:
    """Strings of ``length`` characters -> (N, length) indices into ALL_LETTERS (int64, or
    ``dtype``: uint8 keeps the full LEAF Shakespeare at 340 MB instead of 2.7 GB).

    A character outside LEAF's vocabulary is an error (LEAF itself maps it to -1 via
    str.find, which silently aliases the last embedding row)."""
    bad = next((t for t in texts if len(t) != length), None)
    if bad is not None:
        raise ValueError(f"{what}: expected strings of {length} characters, got {bad!r}")
    joined = "".join(texts)
    unknown = set(joined) - set(ALL_LETTERS)
    if unknown:
        raise ValueError(f"{what}: characters outside LEAF's 80-symbol vocabulary: {sorted(unknown)!r}")
    lut = np.zeros(128, dtype=dtype)  # ALL_LETTERS is ASCII, checked above
    lut[np.frombuffer(ALL_LETTERS.encode("ascii"), np.uint8)] = np.arange(len(ALL_LETTERS))
    return lut[np.frombuffer(joined.encode("ascii"), np.uint8)].reshape(len(texts), length)


@DATASETS.register("shakespeare")
def load_shakespeare(root: Path, seed: int) -> Dataset:
    """LEAF Shakespeare next-character prediction: x 80 characters, y the next one, both
    as indices into LEAF's 80-symbol ALL_LETTERS; one user per (play, role).

    Read from LEAF's json (train/ and test/ folders or a .tar.gz), else from the fetched
    ``shakespeare.csv`` (LEAF's samples as published on the Hugging Face Hub,
    ``character_id,x,y``: one split), whose every user's last tenth of samples is the test
    split: consecutive samples are windows shifted by one character, so a random split
    would put nearly the same text on both sides."""
    fields = dict(num_classes=len(ALL_LETTERS), class_names=list(ALL_LETTERS), kind="tokens")
    folders = ["shakespeare", "shakespeare/data"]
    try:
        return _leaf_dataset(
            "shakespeare", root, folders, "leaf_shakespeare_sample.tar.gz",
            lambda xs: encode_chars(xs, SHAKESPEARE_SEQ_LEN), lambda ys: encode_chars(ys, 1).reshape(-1), **fields)
    except MissingDataError:
        csv_path = root / "shakespeare" / SHAKESPEARE_CSV
        if not csv_path.exists():
            raise
    docs = _shakespeare_csv_docs(csv_path)
    return _users_dataset(
        "shakespeare", csv_path, docs,
        lambda xs: encode_chars(xs, SHAKESPEARE_SEQ_LEN, dtype=np.uint8),
        lambda ys: encode_chars(ys, 1, dtype=np.uint8).reshape(-1).astype(np.int64), **fields)


SHAKESPEARE_CSV = "shakespeare.csv"
SHAKESPEARE_TEST_EVERY = 10  # a user's last n // 10 samples are its test split


def _shakespeare_csv_docs(path: Path) -> dict:
    """``character_id,x,y`` rows -> LEAF-form docs, each user's samples in file order."""
    import csv

    users: dict[str, tuple[list, list]] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        cols = {c: i for i, c in enumerate(header or [])}
        if not {"character_id", "x", "y"} <= set(cols):
            raise DataFileError(f"{path}: not the Shakespeare csv (expected columns character_id, x, y; "
                                f"got {', '.join(header or []) or 'an empty file'})")
        ci, xi, yi = cols["character_id"], cols["x"], cols["y"]
        for row in reader:
            xs, ys = users.setdefault(row[ci], ([], []))
            xs.append(row[xi])
            ys.append(row[yi])
    docs: dict[str, list] = {"train": [], "test": []}
    for split in LEAF_SPLITS:
        data = {}
        for u, (xs, ys) in users.items():
            cut = len(ys) - len(ys) // SHAKESPEARE_TEST_EVERY
            sl = slice(0, cut) if split == "train" else slice(cut, None)
            data[u] = {"x": xs[sl], "y": ys[sl]}
        docs[split].append({"users": list(data), "num_samples": [len(v["y"]) for v in data.values()],
                            "user_data": data})
    return docs


# ---------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100: the "python version" pickles (dicts with bytes keys; b"data" is
# (N, 3072) uint8, the 1024 R, then G, then B values of each image, row-major).
# A pickle can run code when loaded: these are read with an unpickler that rebuilds
# plain values and numpy arrays only, so a file that names anything else is refused.
# ---------------------------------------------------------------------------------------
class _ArraysOnly(pickle.Unpickler):
    # numpy arrays and scalars; ``_codecs.encode``: how a protocol-2 pickle written by
    # Python 3 spells a bytes value
    path: Path  # the file, for the message (set after construction)
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{getattr(self, 'path', 'the file')} holds {module}.{name}, which a "
                                         "CIFAR batch never holds (loading it could run code); it was not loaded")
        return super().find_class(module, name)


def _unpickle(path: Path, data: Optional[bytes] = None) -> dict:
    """A CIFAR batch (a file, or ``data``: its bytes read from the archive at ``path``)
    with values and arrays only."""
    with (open(path, "rb") if data is None else io.BytesIO(data)) as f:
        loader = _ArraysOnly(f, encoding="bytes")  # written by Python 2: str keys -> bytes
        loader.path = path
        return loader.load()


def archive_members(path: Path, wanted: list[str], optional: tuple[str, ...] = ()) -> dict[str, bytes]:
    """The bytes of the named members of a tar (any compression) or zip archive, in one
    sequential pass; a missing member says that the archive is not the dataset's."""
    found: dict[str, bytes] = {}
    names = set(wanted) | set(optional)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            for n in sorted(names & set(zf.namelist())):
                found[n] = _zip_read(zf, n, path)
    else:
        packed = path.stat().st_size
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                if m.isfile() and m.name in names:
                    _member_fits(f"{path}: {m.name}", m.size, packed)
                    found[m.name] = cast(IO[bytes], tf.extractfile(m)).read()  # a file: not None
    lacking = [n for n in wanted if n not in found]
    if lacking:
        raise DataFileError(f"{path}: not the archive this dataset is published in (it lacks {', '.join(lacking[:3])}"
                            f"{'...' if len(lacking) > 3 else ''}); fetch it again or copy the right file there")
    return found


def _cifar(name, root, folders, train_files, test_file, label_key, meta_file, names_key, num_classes, mean, std,
           archive, inner):
    try:
        d = find_files(root, name, folders, [*train_files, test_file])
        read = lambda f: _unpickle(d / f)  # noqa: E731
        has_meta = (d / meta_file).exists()
    except MissingDataError:
        d = root / name / archive  # the published tarball, read without unpacking it
        if not d.exists():
            raise
        members = archive_members(d, [f"{inner}/{f}" for f in (*train_files, test_file)], (f"{inner}/{meta_file}",))
        read = lambda f: _unpickle(d, members[f"{inner}/{f}"])  # noqa: E731
        has_meta = f"{inner}/{meta_file}" in members
    splits = []
    for files in (train_files, [test_file]):
        batches = [read(f) for f in files]
        x = np.concatenate([np.asarray(b[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32) for b in batches])
        y = np.concatenate([np.asarray(b[label_key], dtype=np.int64).reshape(-1) for b in batches])
        if len(x) != len(y) or (y.size and (y.min() < 0 or y.max() >= num_classes)):
            raise ValueError(f"{name}: bad labels in {', '.join(files)} ({len(x)} images, {len(y)} labels)")
        splits.append((torch.from_numpy(x), torch.from_numpy(y)))
    class_names = None
    if has_meta:  # optional: only for readable class names
        class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in read(meta_file)[names_key]]
    return Dataset(
        name=name,
        x_train=splits[0][0],
        y_train=splits[0][1],
        x_test=splits[1][0],
        y_test=splits[1][1],
        num_classes=num_classes,
        scale=255.0,
        mean=mean,
        std=std,
        class_names=class_names,
        info={"source": str(d)},
    )


# per-channel mean/std of the training images (the std is the true pixel std, not the
# often-copied (0.2023, 0.1994, 0.2010))
@DATASETS.register("cifar10")
def load_cifar10(root: Path, seed: int) -> Dataset:
    return _cifar(
        "cifar10", root, ["cifar10/cifar-10-batches-py", "cifar-10-batches-py", "cifar10"],
        [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels", "batches.meta", b"label_names",
        10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), "cifar-10-python.tar.gz", "cifar-10-batches-py",
    )


@DATASETS.register("cifar100")
def load_cifar100(root: Path, seed: int) -> Dataset:
    return _cifar(
        "cifar100", root, ["cifar100/cifar-100-python", "cifar-100-python", "cifar100"],
        ["train"], "test", b"fine_labels", "meta", b"fine_label_names",
        100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), "cifar-100-python.tar.gz", "cifar-100-python",
    )


# ---------------------------------------------------------------------------------------
# SVHN: the cropped-digits MATLAB files; X is (32, 32, 3, N) uint8, y (N, 1) with 10 = "0"
# ---------------------------------------------------------------------------------------
@DATASETS.register("svhn")
def load_svhn(root: Path, seed: int) -> Dataset:
    from scipy.io import loadmat

    d = find_files(root, "svhn", ["svhn", ""], ["train_32x32.mat", "test_32x32.mat"])
    splits = []
    for f in ("train_32x32.mat", "test_32x32.mat"):
        m = loadmat(d / f)
        x, y = np.asarray(m["X"]), np.asarray(m["y"]).reshape(-1).astype(np.int64)
        if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != len(y):
            raise ValueError(f"svhn {f}: expected X (32, 32, 3, {len(y)}), got {x.shape}")
        if y.size and (y.min() < 1 or y.max() > 10):
            raise ValueError(f"svhn {f}: labels outside 1..10")
        y[y == 10] = 0  # SVHN stores the digit 0 as label 10
        x = np.ascontiguousarray(x.transpose(3, 2, 0, 1)).astype(np.uint8, copy=False)  # -> (N, 3, 32, 32)
        splits.append((torch.from_numpy(x), torch.from_numpy(y)))
    return Dataset(
        name="svhn",
        x_train=splits[0][0],
        y_train=splits[0][1],
        x_test=splits[1][0],
        y_test=splits[1][1],
        num_classes=10,
        scale=255.0,
        mean=(0.4377, 0.4438, 0.4728),
        std=(0.1980, 0.2010, 0.1970),
        class_names=[str(i) for i in range(10)],
        info={"source": str(d)},
    )


def _image_dataset(name, xtr, ytr, xte, yte, num_classes, source, class_names=None, **info) -> Dataset:
    """uint8 (N, C, H, W) arrays and int labels -> a Dataset normalized on the fly by the
    training split's per-channel mean and std."""
    mean, std = channel_stats(xtr)
    for y, split in ((ytr, "train"), (yte, "test")):
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{name} {split}: labels outside 0..{num_classes - 1}")
    return Dataset(
        name=name,
        x_train=torch.from_numpy(np.ascontiguousarray(xtr)),
        y_train=torch.from_numpy(np.asarray(ytr, dtype=np.int64)),
        x_test=torch.from_numpy(np.ascontiguousarray(xte)),
        y_test=torch.from_numpy(np.asarray(yte, dtype=np.int64)),
        num_classes=num_classes,
        scale=255.0,
        mean=mean,
        std=std,
        class_names=class_names,
        info={"source": str(source), **info},
    )


def _published(root: Path, dataset: str, folder: str, files: list[str]) -> Path:
    """The folder holding a catalog dataset's published files (``root/folder``)."""
    return find_files(root, dataset, [folder], files)


# ---------------------------------------------------------------------------------------
# EMNIST: NIST's gzip.zip, every split's IDX files inside (read from the zip as it is)
# ---------------------------------------------------------------------------------------
EMNIST_SPLITS = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}


@DATASETS.register("emnist")
def load_emnist(root: Path, seed: int, split: str = "byclass") -> Dataset:
    """EMNIST ``split`` (byclass, bymerge, balanced, letters, digits, mnist) as 28x28
    uint8 images, turned upright (the files store them transposed). ``letters`` labels
    1..26 become 0..25 (26 classes); the others keep the publisher's label order."""
    if split not in EMNIST_SPLITS:
        raise ValueError(f"emnist: split must be one of {', '.join(EMNIST_SPLITS)}, got {split!r}")
    d = _published(root, "emnist", "emnist", ["gzip.zip"])
    names = [f"gzip/emnist-{split}-{part}-ubyte.gz" for part in
             ("train-images-idx3", "train-labels-idx1", "test-images-idx3", "test-labels-idx1")]
    members = archive_members(d / "gzip.zip", names)
    xtr, ytr, xte, yte = (parse_idx(inflate(members[n], f"{d / 'gzip.zip'}: {n}"), n) for n in names)
    if split == "letters":
        ytr, yte = ytr.astype(np.int64) - 1, yte.astype(np.int64) - 1
    upright = [np.ascontiguousarray(x.transpose(0, 2, 1))[:, None] for x in (xtr, xte)]
    return _image_dataset("emnist", upright[0], ytr, upright[1], yte, EMNIST_SPLITS[split], d / "gzip.zip",
                          split=split)


# ---------------------------------------------------------------------------------------
# Tiny-ImageNet-200: the published zip; 64x64 JPEGs, train/<wnid>/images/*.JPEG, and the
# validation labels in val/val_annotations.txt (every validation image sits in one folder)
# ---------------------------------------------------------------------------------------
TINY_ROOT = "tiny-imagenet-200"


def tiny_imagenet_val_labels(text: str, wnids: list[str]) -> dict[str, int]:
    """val_annotations.txt (``file<TAB>wnid<TAB>x0<TAB>y0<TAB>x1<TAB>y1`` per line) -> {file: class}.

    The class of a validation image is in this file only: its folder (val/images/) is
    shared by all 10,000 images, so a folder-per-class reader gives every one class 0."""
    index = {w: i for i, w in enumerate(wnids)}
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) < 2 or parts[1] not in index:
            raise ValueError(f"val_annotations.txt line {n}: expected a file name and one of the 200 wnids, got {line!r}")
        out[parts[0]] = index[parts[1]]
    return out


@DATASETS.register("tinyimagenet")
def load_tinyimagenet(root: Path, seed: int) -> Dataset:
    """Tiny-ImageNet-200: 100,000 training images (500 per class) and the 10,000 labelled
    validation images as the test split; classes are the wnids in sorted order. Read
    from the published zip, or from an extracted tiny-imagenet-200/ folder."""
    import io

    from PIL import Image

    zpath = root / "tinyimagenet" / "tiny-imagenet-200.zip"
    if zpath.exists():
        zf = zipfile.ZipFile(zpath)
        names = zf.namelist()
        read = lambda n: _zip_read(zf, n, zpath)  # noqa: E731
        source = zpath
    else:
        d = find_files(root, "tinyimagenet", [f"tinyimagenet/{TINY_ROOT}", TINY_ROOT, "tinyimagenet"],
                       ["wnids.txt", "val/val_annotations.txt"])
        base = d.parent
        names = [p.relative_to(base).as_posix() for p in d.rglob("*") if p.is_file()]
        read = lambda n: (base / n).read_bytes()  # noqa: E731
        source = d
    prefix = next((n[: -len("wnids.txt")] for n in names if n.endswith("wnids.txt")), None)
    if prefix is None or prefix + "val/val_annotations.txt" not in names:
        raise DataFileError(f"{source}: not Tiny-ImageNet (no wnids.txt and val/val_annotations.txt)")
    wnids = sorted(read(prefix + "wnids.txt").decode().split())
    val_labels = tiny_imagenet_val_labels(read(prefix + "val/val_annotations.txt").decode(), wnids)
    index = {w: i for i, w in enumerate(wnids)}

    def decode(name: str) -> np.ndarray:
        img = Image.open(io.BytesIO(read(name))).convert("RGB")  # a few are greyscale
        a = np.asarray(img, dtype=np.uint8)
        if a.shape != (64, 64, 3):
            raise ValueError(f"{name}: expected a 64x64 image, got {a.shape[:2]}")
        return a

    train, val = [], []
    for n in sorted(names):
        rel = n[len(prefix):]
        parts = rel.split("/")
        if not rel.lower().endswith((".jpeg", ".jpg")):
            continue
        if parts[0] == "train" and len(parts) == 4 and parts[1] in index:
            train.append((n, index[parts[1]]))
        elif parts[0] == "val" and parts[-1] in val_labels:
            val.append((n, val_labels[parts[-1]]))
    listed = len(val_labels)
    if len(val) != listed:
        raise DataFileError(f"{source}: val_annotations.txt lists {listed} images, {len(val)} of them are there")
    xs = [np.stack([decode(n) for n, _ in split]).transpose(0, 3, 1, 2) if split else
          np.zeros((0, 3, 64, 64), np.uint8) for split in (train, val)]
    return _image_dataset("tinyimagenet", xs[0], np.array([c for _, c in train]), xs[1],
                          np.array([c for _, c in val]), 200, source, class_names=wnids)


# ---------------------------------------------------------------------------------------
# Digit-5's other domains: USPS (LIBSVM's bz2 text), MNIST-M and SynthDigits (torch
# tensors as their publisher saves them)
# ---------------------------------------------------------------------------------------
def parse_usps(text: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """LIBSVM lines ``label i:v ...`` (labels 1..10, values in [-1, 1], 256 pixels) ->
    uint8 (N, 1, 16, 16) images ((v + 1) / 2 * 255, as torchvision) and labels 0..9."""
    xs, ys = [], []
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        row = np.zeros(256, dtype=np.float32)
        try:
            for item in parts[1:]:
                i, v = item.split(":")
                row[int(i) - 1] = float(v)
            ys.append(int(float(parts[0])) - 1)
        except (ValueError, IndexError):
            raise ValueError(f"{what} line {n}: not a LIBSVM line of 256 pixels") from None
        xs.append(row)
    x = ((np.stack(xs) + 1) / 2 * 255).astype(np.uint8).reshape(-1, 1, 16, 16) if xs else np.zeros((0, 1, 16, 16), np.uint8)
    return x, np.asarray(ys, dtype=np.int64)


@DATASETS.register("usps")
def load_usps(root: Path, seed: int) -> Dataset:
    """USPS handwritten digits: 7,291 train / 2,007 test, 16x16 grey (a Digit-5 domain)."""
    d = _published(root, "usps", "usps", ["usps.bz2", "usps.t.bz2"])
    (xtr, ytr), (xte, yte) = (parse_usps(inflate((d / f).read_bytes(), str(d / f), "bz2").decode("ascii"), f)
                              for f in ("usps.bz2", "usps.t.bz2"))
    return _image_dataset("usps", xtr, ytr, xte, yte, 10, d, [str(i) for i in range(10)])


def _torch_pair(raw: bytes, what: str, hw: int) -> tuple[np.ndarray, np.ndarray]:
    """A ``torch.save((images, labels))`` file: uint8 (N, H, W, 3) images -> (N, 3, H, W)."""
    import io

    try:
        data, targets = torch.load(io.BytesIO(raw), weights_only=True)  # tensors only: no code runs
    except (RuntimeError, pickle.UnpicklingError, ValueError, TypeError) as e:
        raise ValueError(f"{what}: not a saved (images, labels) pair ({one_line(e, 120)})") from None
    x, y = np.asarray(data), np.asarray(targets).reshape(-1)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (hw, hw, 3) or len(x) != len(y):
        raise ValueError(f"{what}: expected uint8 images (N, {hw}, {hw}, 3) and N labels, got {x.dtype} {x.shape}")
    return x.transpose(0, 3, 1, 2), y.astype(np.int64)


@DATASETS.register("mnistm")
def load_mnistm(root: Path, seed: int) -> Dataset:
    """MNIST-M (MNIST digits blended with BSDS500 patches): 60,000 / 10,000, 28x28 RGB."""
    d = _published(root, "mnistm", "mnistm", ["mnist_m_train.pt.tar.gz", "mnist_m_test.pt.tar.gz"])
    pairs = [_torch_pair(archive_members(d / f"{s}.tar.gz", [s])[s], s, 28)
             for s in ("mnist_m_train.pt", "mnist_m_test.pt")]
    return _image_dataset("mnistm", *pairs[0], *pairs[1], 10, d, [str(i) for i in range(10)])


@DATASETS.register("synthdigits")
def load_synthdigits(root: Path, seed: int) -> Dataset:
    """SynthDigits (Ganin & Lempitsky's synthetic numbers): 32x32 RGB (a Digit-5 domain)."""
    d = _published(root, "synthdigits", "synthdigits", ["synth_train.pt.gz", "synth_test.pt.gz"])
    pairs = []
    for f in ("synth_train.pt.gz", "synth_test.pt.gz"):
        pairs.append(_torch_pair(inflate((d / f).read_bytes(), str(d / f)), f, 32))
    return _image_dataset("synthdigits", *pairs[0], *pairs[1], 10, d,
                          [str(i) for i in range(10)])


# ---------------------------------------------------------------------------------------
# Digit-5 (MNIST, SVHN, USPS, SynthDigits, MNIST-M) as one dataset: MP-FedCL's label-skew
# setting (Table VI) partitions the five domains pooled; its feature-skew setting (Table V)
# gives each client one domain (features: {name: domains}, data/features.py)
# ---------------------------------------------------------------------------------------
DIGIT5 = ("mnist", "svhn", "usps", "synthdigits", "mnistm")
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601: RGB -> grey


def to_image_shape(x: torch.Tensor, shape: tuple[int, int, int], chunk: int = 4096) -> torch.Tensor:
    """uint8 (N, C, H, W) images -> uint8 (N, *shape): resized bilinearly
    (``align_corners=False``) to shape's H x W, grey replicated to 3 channels or RGB turned
    grey by ITU-R 601 luma; in chunks, so no float copy of the whole set is held."""
    c, h, w = (int(v) for v in shape)
    if x.dim() != 4 or x.dtype != torch.uint8 or x.shape[1] not in (1, 3) or c not in (1, 3):
        raise ValueError(f"expected uint8 (N, 1 or 3, H, W) images and 1 or 3 channels, got {tuple(x.shape)} "
                         f"{x.dtype} -> {shape}")
    if tuple(x.shape[1:]) == (c, h, w):
        return x
    out = torch.empty((len(x), c, h, w), dtype=torch.uint8)
    for i in range(0, len(x), chunk):
        f = x[i:i + chunk].to(torch.float32)
        if f.shape[2:] != (h, w):
            f = torch.nn.functional.interpolate(f, size=(h, w), mode="bilinear", align_corners=False)
        if f.shape[1] == 1 and c == 3:
            f = f.expand(-1, 3, -1, -1)
        elif f.shape[1] == 3 and c == 1:
            f = (f * torch.tensor(LUMA).view(1, 3, 1, 1)).sum(1, keepdim=True)
        out[i:i + chunk] = f.round().clamp_(0, 255).to(torch.uint8)  # round(): f may be an expanded view
    return out


def domain_subset(d: Dataset, n_train: int, n_test: int, seed: int, tag: str):
    """Seeded subsets of ``n_train`` training and ``n_test`` test samples of a domain
    (sorted indices, drawn from the stream ``np_rng(seed, "features", "domains", tag)``, the
    one the ``domains`` scenario has always drawn from)."""
    from ..rng import np_rng

    rng = np_rng(seed, "features", "domains", tag)
    itr = torch.from_numpy(np.sort(rng.choice(len(d.y_train), size=n_train, replace=False)))
    ite = torch.from_numpy(np.sort(rng.choice(len(d.y_test), size=n_test, replace=False)))
    return d.x_train[itr], d.y_train[itr], d.x_test[ite], d.y_test[ite]


def pool_digit5(parts: list[Dataset], seed: int, train_per_domain: Optional[int] = None,
                test_per_domain: Optional[int] = None, size: int = 32) -> Dataset:
    """The five Digit-5 domains as (3, size, size) uint8 images, the same number of
    training (test) samples drawn from each (default: the smallest domain's split, USPS's
    7,291 / 2,007), pooled in the order of DIGIT5; normalized by the pooled training
    images' per-channel mean and std."""
    for what, v in (("train_per_domain", train_per_domain), ("test_per_domain", test_per_domain)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"digit5: {what} must be a whole number >= 1 or null, got {v!r}")
    if not isinstance(size, int) or size < 8:
        raise ValueError(f"digit5: size must be a whole number of pixels >= 8, got {size!r}")
    sizes = {}
    for what, i, asked in (("train_per_domain", 0, train_per_domain), ("test_per_domain", 1, test_per_domain)):
        counts = [len(p.y_train if i == 0 else p.y_test) for p in parts]
        smallest = min(counts)
        if asked is not None and asked > smallest:
            raise ValueError(f"digit5: {what}={asked} exceeds the smallest domain "
                             f"({parts[counts.index(smallest)].name}: {smallest} samples)")
        sizes[i] = asked or smallest
    xs: list[list[torch.Tensor]] = [[], [], [], []]
    for p in parts:
        for j, t in enumerate(domain_subset(p, sizes[0], sizes[1], seed, p.name)):
            xs[j].append(to_image_shape(t, (3, size, size)) if j % 2 == 0 else t)
    xtr, ytr, xte, yte = (torch.cat(v) for v in xs)
    return _image_dataset("digit5", xtr.numpy(), ytr.numpy(), xte.numpy(), yte.numpy(), 10,
                          ", ".join(p.info.get("source", p.name) for p in parts), [str(i) for i in range(10)],
                          domains=[p.name for p in parts], train_per_domain=sizes[0], test_per_domain=sizes[1])


@DATASETS.register("digit5")
def load_digit5(root: Path, seed: int, train_per_domain: Optional[int] = None,
                test_per_domain: Optional[int] = None, size: int = 32) -> Dataset:
    """Digit-5: MNIST, SVHN, USPS, SynthDigits and MNIST-M pooled, each resized to
    size x size RGB, the same number of samples from each (``pool_digit5``); every
    domain is a catalog dataset of its own (fetched and verified on its own). The
    signature is what ``data.params`` are checked against; the loading is
    :func:`load_dataset`'s for every ``COMPOSITE`` dataset, which passes its download
    settings on to the parts."""
    return load_dataset("digit5", root, seed, train_per_domain=train_per_domain, test_per_domain=test_per_domain,
                        size=size)


# datasets assembled from other catalog datasets, each fetched and verified on its own:
# name -> (the parts, pool(parts, seed, **options))
COMPOSITE = {"digit5": (DIGIT5, pool_digit5)}


def dataset_parts(name: str) -> tuple[str, ...]:
    """The datasets whose files ``name`` reads: its parts for a composite one, else itself."""
    return COMPOSITE[name][0] if name in COMPOSITE else (name,)
