"""Dataset loaders: tiny files written in each real format, plus the real data when present."""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.data.datasets import (
    DataFileError,
    ALL_LETTERS,
    archive_members,
    DATASETS,
    MissingDataError,
    default_root,
    encode_chars,
    load_dataset,
    parse_idx,
    resolve_root,
)

REAL_DATA = Path(os.environ.get("PROTOFL_TEST_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def real(*parts: str) -> Path:
    p = REAL_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"real data not present: {p}")
    return REAL_DATA


# ---------------------------------------------------------------------------------------
# writers of the published formats
# ---------------------------------------------------------------------------------------
def idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    dims = np.asarray(arr.shape, dtype=">u4").tobytes()
    return bytes([0, 0, code, arr.ndim]) + dims + arr.astype(np.uint8).tobytes()


def write_mnist(folder: Path, n_train=5, n_test=3, gz=True) -> tuple[np.ndarray, ...]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    xtr = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    xte = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    xtr[0, 0, 0] = 255
    ytr = np.arange(n_train, dtype=np.uint8) % 10
    yte = np.array([9, 0, 4][:n_test], dtype=np.uint8)
    for name, arr in (("train-images-idx3-ubyte", xtr), ("train-labels-idx1-ubyte", ytr),
                      ("t10k-images-idx3-ubyte", xte), ("t10k-labels-idx1-ubyte", yte)):
        data = idx_bytes(arr)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return xtr, ytr, xte, yte


def leaf_doc(users: dict[str, tuple[list, list]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }


def write_leaf(target: Path, files: dict[str, dict], tar: bool) -> None:
    """files: relative path -> json doc; as loose files under target or one tar.gz in it."""
    target.mkdir(parents=True, exist_ok=True)
    if not tar:
        for rel, doc in files.items():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).write_text(json.dumps(doc))
        return
    with tarfile.open(target / "leaf.tar.gz", "w:gz") as tf:
        for rel, doc in files.items():
            data = json.dumps(doc).encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def img(v: float) -> list[float]:
    return [v] * 784


FEMNIST_FILES = {
    # f_c only in train, f_d only in test; f_b listed before f_a (order must not matter)
    "train/all_data_1_niid_05_keep_0_train_9.json": leaf_doc(
        {"f_b": ([img(0.5), img(0.25)], [10, 61]), "f_a": ([img(1.0)], [3])}
    ),
    "train/all_data_2_niid_05_keep_0_train_9.json": leaf_doc({"f_c": ([img(0.0)] * 3, [0, 1, 2])}),
    "test/all_data_1_niid_05_keep_0_test_9.json": leaf_doc(
        {"f_a": ([img(0.75)], [4]), "f_b": ([img(0.1)], [36]), "f_d": ([img(0.2)] * 2, [5, 6])}
    ),
}


def pickle_dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # CIFAR's python pickles are protocol 2


def cifar_data(n: int, first: int) -> np.ndarray:
    """(n, 3072) uint8 whose channel c of image i is constant first + 10*i + c."""
    x = np.zeros((n, 3, 1024), dtype=np.uint8)
    for i in range(n):
        for c in range(3):
            x[i, c] = first + 10 * i + c
    return x.reshape(n, 3072)


# ---------------------------------------------------------------------------------------
# roots, registry
# ---------------------------------------------------------------------------------------
def test_registry_has_all_loaders():
    for name in ("spiral", "digits", "mnist", "fmnist", "femnist", "shakespeare", "cifar10", "cifar100", "svhn"):
        assert name in DATASETS


def test_resolve_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PROTOFL_DATA", raising=False)
    assert resolve_root() == default_root() == tmp_path / "cache" / "protofl" / "data"
    monkeypatch.setenv("PROTOFL_DATA", str(tmp_path / "env"))
    assert resolve_root() == tmp_path / "env"
    assert resolve_root(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_root(str(tmp_path / "arg")) == tmp_path / "arg"


# ---------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST
# ---------------------------------------------------------------------------------------
def test_mnist_tiny(tmp_path, published):
    xtr, ytr, xte, yte = write_mnist(tmp_path / "mnist")
    published("mnist", tmp_path)
    d = load_dataset("mnist", tmp_path)
    assert d.x_train.shape == (5, 1, 28, 28) and d.x_train.dtype == torch.uint8
    assert d.x_test.shape == (3, 1, 28, 28) and d.y_test.dtype == torch.int64
    assert np.array_equal(d.x_train[:, 0].numpy(), xtr) and np.array_equal(d.x_test[:, 0].numpy(), xte)
    assert d.y_train.tolist() == ytr.tolist() and d.y_test.tolist() == [9, 0, 4]
    assert d.num_classes == 10 and d.scale == 255 and d.class_names[0] == "0"
    z = d.normalize(d.x_train)
    assert z.dtype == torch.float32
    assert z[0, 0, 0, 0].item() == pytest.approx((1.0 - 0.1307) / 0.3081, rel=1e-5)


def test_mnist_in_root_itself_and_uncompressed(tmp_path):
    write_mnist(tmp_path)  # folder "" = the root itself
    assert len(load_dataset("mnist", tmp_path).x_train) == 5
    other = tmp_path / "other"
    write_mnist(other / "MNIST" / "raw", n_train=4, gz=False)
    assert len(load_dataset("mnist", other).x_train) == 4


def test_fmnist_tiny(tmp_path):
    write_mnist(tmp_path / "FashionMNIST" / "raw", n_train=7)
    d = load_dataset("fmnist", tmp_path)
    assert d.x_train.shape == (7, 1, 28, 28) and d.mean == (0.2860,) and d.std == (0.3530,)
    assert d.class_names[0] == "T-shirt/top" and d.class_names[9] == "Ankle boot"
    assert d.normalize(d.x_train)[0, 0, 0, 0].item() == pytest.approx((1.0 - 0.2860) / 0.3530, rel=1e-5)


def test_idx_bad_magic_and_size(tmp_path, published):
    good = idx_bytes(np.zeros((2, 28, 28), np.uint8))
    assert parse_idx(good).shape == (2, 28, 28)
    with pytest.raises(ValueError, match="magic"):
        parse_idx(b"\x01\x00" + good[2:])
    with pytest.raises(ValueError, match="magic"):
        parse_idx(b"\x00\x00\x07" + good[3:])  # unknown type code
    with pytest.raises(ValueError, match="size"):
        parse_idx(good[:-1])
    # through the loader: a labels file whose magic is corrupted
    write_mnist(tmp_path / "mnist")
    f = tmp_path / "mnist" / "train-labels-idx1-ubyte.gz"
    f.write_bytes(gzip.compress(b"\x00\x00\x08\x02" + gzip.decompress(f.read_bytes())[4:]))
    published("mnist", tmp_path)
    with pytest.raises(ValueError):
        load_dataset("mnist", tmp_path)


def test_idx_other_dtypes():
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    data = bytes([0, 0, 0x0C, 2]) + np.asarray(arr.shape, ">u4").tobytes() + arr.tobytes()
    out = parse_idx(data)
    assert out.dtype == np.int32 and out.dtype.isnative and out.tolist() == arr.tolist()


def test_mnist_missing(tmp_path):
    with pytest.raises(MissingDataError) as err:
        load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg and "t10k-labels-idx1-ubyte.gz" in msg
    assert str(tmp_path / "mnist") in msg and str(tmp_path / "MNIST" / "raw") in msg


# ---------------------------------------------------------------------------------------
# LEAF: FEMNIST, Shakespeare
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["folders", "tar", "data-subfolder"])
def test_femnist_tiny(tmp_path, layout):
    target = tmp_path / "femnist" / ("data" if layout == "data-subfolder" else "")
    write_leaf(target, FEMNIST_FILES, tar=layout == "tar")
    d = load_dataset("femnist", tmp_path)
    assert d.user_names == ["f_a", "f_b", "f_c", "f_d"]
    assert d.x_train.shape == (6, 1, 28, 28) and d.x_train.dtype == torch.float32
    assert d.x_test.shape == (4, 1, 28, 28)
    assert d.num_classes == 62 and d.kind == "image" and d.scale is None
    assert d.class_names[10] == "A" and d.class_names[36] == "a" and d.class_names[61] == "z"
    # train blocks in sorted user order: f_a, f_b, f_c; f_d has no train samples
    assert [u.tolist() for u in d.users_train] == [[0], [1, 2], [3, 4, 5], []]
    assert [u.tolist() for u in d.users_test] == [[0], [1], [], [2, 3]]
    assert d.y_train.tolist() == [3, 10, 61, 0, 1, 2] and d.y_test.tolist() == [4, 36, 5, 6]
    assert d.x_train[1].unique().tolist() == [0.5] and d.x_test[0].unique().tolist() == [0.75]
    assert torch.equal(d.normalize(d.x_train), d.x_train)  # stored values used as they are
    assert all(u.dtype == np.int64 for u in d.users_train + d.users_test)


def test_femnist_bad_values(tmp_path):
    files = dict(FEMNIST_FILES)
    files["test/all_data_1_niid_05_keep_0_test_9.json"] = leaf_doc({"f_a": ([img(0.1)], [62])})
    write_leaf(tmp_path / "femnist", files, tar=False)
    with pytest.raises(ValueError, match="labels"):
        load_dataset("femnist", tmp_path)
    files["test/all_data_1_niid_05_keep_0_test_9.json"] = leaf_doc({"f_a": ([[0.1] * 783], [1])})
    write_leaf(tmp_path / "femnist", files, tar=False)
    with pytest.raises(ValueError, match="784"):
        load_dataset("femnist", tmp_path)


def test_leaf_missing(tmp_path):
    (tmp_path / "femnist" / "train").mkdir(parents=True)  # test/ missing
    with pytest.raises(MissingDataError) as err:
        load_dataset("femnist", tmp_path)
    assert "train/" in str(err.value) and ".tar.gz" in str(err.value)
    assert str(tmp_path / "femnist") in str(err.value)
    with pytest.raises(MissingDataError, match="shakespeare"):
        load_dataset("shakespeare", tmp_path)


def shakespeare_files(nested: bool) -> dict[str, dict]:
    a = "To be, or not to be: that is the question." * 2
    b = "[Enter] \"Hamlet\" & 'Ophelia' (4 lines); what? 0123456789 >}\nZz"
    xa, xb = a[:80], (b * 2)[:80]
    train = leaf_doc({"HAMLET_OPHELIA": ([xb], ["!"]), "HAMLET_HAMLET": ([xa, xb[1:] + "x"], ["T", "\n"])})
    test = leaf_doc({"HAMLET_HAMLET": ([xb], ["}"]), "KING_LEAR_FOOL": ([xa], ["a"])})
    if nested:
        return {"data/train/s_train.json": train, "data/test/s_test.json": test}
    # the real LEAF sample's layout: split-named files at the top of the archive
    return {"all_data_niid_0_keep_0_train_9.json": train, "all_data_niid_0_keep_0_test_9.json": test}


@pytest.mark.parametrize("layout", ["tar-flat", "tar-nested", "folders"])
def test_shakespeare_tiny(tmp_path, layout):
    files = shakespeare_files(nested=layout != "tar-flat")
    if layout == "folders":
        files = {k.removeprefix("data/"): v for k, v in files.items()}
    write_leaf(tmp_path / "shakespeare", files, tar=layout.startswith("tar"))
    d = load_dataset("shakespeare", tmp_path)
    assert d.kind == "tokens" and d.num_classes == 80 and len(ALL_LETTERS) == 80
    assert d.user_names == ["HAMLET_HAMLET", "HAMLET_OPHELIA", "KING_LEAR_FOOL"]
    assert d.x_train.shape == (3, 80) and d.x_train.dtype == torch.int64 and d.y_train.dtype == torch.int64
    assert [u.tolist() for u in d.users_train] == [[0, 1], [2], []]
    assert [u.tolist() for u in d.users_test] == [[0], [], [1]]
    decode = lambda row: "".join(ALL_LETTERS[i] for i in row)  # noqa: E731
    assert decode(d.x_train[0].tolist()).startswith("To be, or not")
    assert "".join(ALL_LETTERS[i] for i in d.y_train.tolist()) == "T\n!"
    assert d.y_test.tolist() == [ALL_LETTERS.index("}"), ALL_LETTERS.index("a")] == [79, 53]
    assert ALL_LETTERS.index("\n") == 0 and d.class_names == list(ALL_LETTERS)
    assert torch.equal(d.normalize(d.x_train), d.x_train)


def test_shakespeare_encoding_errors():
    assert encode_chars(["ab"], 2).tolist() == [[ALL_LETTERS.index("a"), ALL_LETTERS.index("b")]]
    with pytest.raises(ValueError, match="vocabulary"):
        encode_chars(["a#"], 2)  # '#' is not in LEAF's 80 symbols
    with pytest.raises(ValueError, match="vocabulary"):
        encode_chars(["é?"], 2)  # non-ASCII must not slip through as '?'
    with pytest.raises(ValueError, match="3 characters"):
        encode_chars(["ab"], 3)


# ---------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100
# ---------------------------------------------------------------------------------------
def test_cifar10_tiny(tmp_path):
    d10 = tmp_path / "cifar10" / "cifar-10-batches-py"
    d10.mkdir(parents=True)
    for i in range(1, 6):
        pickle_dump(d10 / f"data_batch_{i}", {b"batch_label": b"x", b"data": cifar_data(2, 20 * i),
                                              b"labels": [i, 9 - i], b"filenames": [b"a", b"b"]})
    pickle_dump(d10 / "test_batch", {b"data": cifar_data(3, 200), b"labels": [0, 1, 2]})
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    pickle_dump(d10 / "batches.meta", {b"label_names": names, b"num_vis": 3072})
    d = load_dataset("cifar10", tmp_path)
    assert d.x_train.shape == (10, 3, 32, 32) and d.x_train.dtype == torch.uint8
    assert d.x_test.shape == (3, 3, 32, 32)
    assert d.y_train.tolist() == [1, 8, 2, 7, 3, 6, 4, 5, 5, 4] and d.y_test.tolist() == [0, 1, 2]
    assert d.class_names[0] == "airplane" and d.class_names[9] == "truck"
    # channel layout: image 1 of batch 1 has R=30, G=31, B=32 everywhere
    assert [d.x_train[1, c].unique().item() for c in range(3)] == [30, 31, 32]
    z = d.normalize(d.x_train[1:2])
    assert z[0, 2, 5, 7].item() == pytest.approx((32 / 255 - 0.4465) / 0.2616, rel=1e-5)


def test_cifar10_without_meta_and_flat_folder(tmp_path):
    d10 = tmp_path / "cifar-10-batches-py"
    d10.mkdir()
    for i in range(1, 6):
        pickle_dump(d10 / f"data_batch_{i}", {b"data": cifar_data(1, i), b"labels": [i]})
    pickle_dump(d10 / "test_batch", {b"data": cifar_data(1, 0), b"labels": [0]})
    d = load_dataset("cifar10", tmp_path)
    assert len(d.x_train) == 5 and d.class_names is None


def test_cifar100_tiny(tmp_path):
    d100 = tmp_path / "cifar-100-python"
    d100.mkdir()
    pickle_dump(d100 / "train", {b"data": cifar_data(4, 0), b"fine_labels": [0, 99, 50, 7], b"coarse_labels": [1, 2, 3, 4]})
    pickle_dump(d100 / "test", {b"data": cifar_data(2, 100), b"fine_labels": [98, 1], b"coarse_labels": [0, 0]})
    fine = [f"class{i}".encode() for i in range(100)]
    pickle_dump(d100 / "meta", {b"fine_label_names": fine, b"coarse_label_names": [b"c"] * 20})
    d = load_dataset("cifar100", tmp_path)
    assert d.num_classes == 100 and d.x_train.shape == (4, 3, 32, 32)
    assert d.y_train.tolist() == [0, 99, 50, 7] and d.y_test.tolist() == [98, 1]  # fine labels
    assert d.class_names[99] == "class99" and d.mean == (0.5071, 0.4865, 0.4409)


def test_cifar_missing(tmp_path):
    with pytest.raises(MissingDataError) as err:
        load_dataset("cifar10", tmp_path)
    msg = str(err.value)
    assert "data_batch_5" in msg and "test_batch" in msg and str(tmp_path / "cifar-10-batches-py") in msg
    with pytest.raises(MissingDataError, match="cifar-100-python"):
        load_dataset("cifar100", tmp_path)


# ---------------------------------------------------------------------------------------
# SVHN
# ---------------------------------------------------------------------------------------
def test_svhn_tiny(tmp_path, published):
    from scipy.io import savemat

    (tmp_path / "svhn").mkdir()
    for name, n, labels in (("train", 4, [10, 1, 5, 10]), ("test", 2, [3, 10])):
        x = np.zeros((32, 32, 3, n), dtype=np.uint8)
        x[1, 2, 0, 0] = 200  # row 1, column 2, red, image 0
        x[:, :, 2, n - 1] = 255  # last image all blue
        savemat(tmp_path / "svhn" / f"{name}_32x32.mat", {"X": x, "y": np.array(labels, np.uint8).reshape(n, 1)})
    published("svhn", tmp_path)
    d = load_dataset("svhn", tmp_path)
    assert d.x_train.shape == (4, 3, 32, 32) and d.x_train.dtype == torch.uint8 and d.x_test.shape == (2, 3, 32, 32)
    assert d.y_train.tolist() == [0, 1, 5, 0] and d.y_test.tolist() == [3, 0]
    assert d.x_train[0, 0, 1, 2].item() == 200 and d.x_train[0].sum().item() == 200
    assert d.x_train[3, 2].unique().tolist() == [255] and d.x_train[3, :2].sum().item() == 0
    assert d.normalize(d.x_test)[1, 2, 0, 0].item() == pytest.approx((1 - 0.4728) / 0.1970, rel=1e-5)


def test_svhn_missing(tmp_path):
    with pytest.raises(MissingDataError) as err:
        load_dataset("svhn", tmp_path)
    assert "train_32x32.mat" in str(err.value) and str(tmp_path / "svhn") in str(err.value)


# ---------------------------------------------------------------------------------------
# spiral, digits
# ---------------------------------------------------------------------------------------
def test_spiral_counts_and_determinism():
    d = load_dataset("spiral", seed=3)
    assert np.bincount(d.train_labels).tolist() == [3000] * 6
    assert np.bincount(d.test_labels).tolist() == [3000] * 6
    assert d.kind == "vector" and d.x_train.shape == (18000, 2)
    again = load_dataset("spiral", seed=3)
    assert torch.equal(d.x_train, again.x_train) and torch.equal(d.x_test, again.x_test)
    assert not torch.equal(d.x_train, load_dataset("spiral", seed=4).x_train)
    imb = load_dataset("spiral", seed=3, imbalanced=True)
    assert np.bincount(imb.train_labels).tolist() == [3000, 1500, 750, 375, 187, 93]
    assert np.bincount(imb.test_labels).tolist() == [3000] * 6


def test_spiral_radius_formula():
    d = load_dataset("spiral", seed=0)
    x, y = d.x_train.numpy().astype(np.float64), d.train_labels
    expected = 1 + (np.arange(1, 3001) - 1) * 9 / 2999  # r_i = 1 + (i-1) * 9/2999
    for k in range(6):
        r = np.sort(np.hypot(x[y == k, 0], x[y == k, 1]))
        np.testing.assert_allclose(r, expected, rtol=1e-6)
    # imbalanced classes sample the same arm: radii are a subset of the formula's values
    imb = load_dataset("spiral", seed=0, imbalanced=True)
    r5 = np.hypot(*imb.x_train.numpy()[imb.train_labels == 5].astype(np.float64).T)
    i = (r5 - 1) * 2999 / 9
    np.testing.assert_allclose(i, np.round(i), atol=1e-3)
    assert r5.max() > 5  # spread over the whole arm, not only its inner part


def test_digits_total():
    d = load_dataset("digits", seed=0)
    assert len(d.y_train) + len(d.y_test) == 1797
    assert d.x_train.shape[1:] == (1, 8, 8) and d.num_classes == 10


# ---------------------------------------------------------------------------------------
# real data (skipped when ../shared/data or PROTOFL_TEST_DATA is absent)
# ---------------------------------------------------------------------------------------
def test_real_mnist():
    d = load_dataset("mnist", real("mnist", "train-images-idx3-ubyte.gz"))
    assert d.x_train.shape == (60000, 1, 28, 28) and d.x_test.shape == (10000, 1, 28, 28)
    counts = np.bincount(d.train_labels, minlength=10)
    assert counts.sum() == 60000 and np.bincount(d.test_labels).sum() == 10000
    assert counts.tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert d.x_train.float().div(255).mean().item() == pytest.approx(0.1307, abs=1e-3)


def test_real_fmnist():
    d = load_dataset("fmnist", real("fashion-mnist", "train-images-idx3-ubyte.gz"))
    assert np.bincount(d.train_labels).tolist() == [6000] * 10
    assert np.bincount(d.test_labels).tolist() == [1000] * 10
    assert d.x_train.float().div(255).mean().item() == pytest.approx(0.2860, abs=1e-3)


def test_real_femnist():
    d = load_dataset("femnist", real("femnist"))
    assert len(d.x_train) == 14640 and len(d.x_test) == 1677 and d.x_train.shape[1:] == (1, 28, 28)
    assert len(d.user_names) == 105 and d.user_names == sorted(d.user_names)
    assert sum(map(len, d.users_train)) == 14640 and sum(map(len, d.users_test)) == 1677
    assert len(np.unique(d.train_labels)) == 62 and d.num_classes == 62
    assert 0.0 <= d.x_train.min().item() and d.x_train.max().item() <= 1.0


def test_real_shakespeare():
    d = load_dataset("shakespeare", real("shakespeare", "leaf_shakespeare_sample.tar.gz"))
    assert len(d.user_names) == 10 and d.x_train.shape == (41990, 80)
    assert sum(map(len, d.users_train)) == 41990 and all(len(u) for u in d.users_test)
    # the test json's num_samples declares 4,671, but its x/y lists hold 3,881 samples
    # (79 = 80-1 fewer per role); the loader uses the samples that are there
    assert d.info["declared_num_samples"] == {"train": 41990, "test": 4671}
    assert len(d.x_test) == sum(map(len, d.users_test)) == 3881


# ---------------------------------------------------------------------------------------
# EMNIST, USPS, MNIST-M, SynthDigits, Shakespeare's Hub csv: tiny files in the published formats
# ---------------------------------------------------------------------------------------
def test_emnist_from_the_published_zip(tmp_path, published):
    import zipfile

    (tmp_path / "emnist").mkdir()
    x = np.zeros((2, 28, 28), np.uint8)
    x[0, 0, 5] = 255  # stored transposed: row 0, column 5 -> upright row 5, column 0
    with zipfile.ZipFile(tmp_path / "emnist" / "gzip.zip", "w") as zf:
        for split, labels in (("train", [1, 26]), ("test", [3, 4])):
            zf.writestr(f"gzip/emnist-letters-{split}-images-idx3-ubyte.gz", gzip.compress(idx_bytes(x)))
            zf.writestr(f"gzip/emnist-letters-{split}-labels-idx1-ubyte.gz",
                        gzip.compress(idx_bytes(np.array(labels, np.uint8))))
    published("emnist", tmp_path)
    d = load_dataset("emnist", tmp_path, split="letters")
    assert d.num_classes == 26 and d.y_train.tolist() == [0, 25] and d.y_test.tolist() == [2, 3]
    assert d.x_train.shape == (2, 1, 28, 28) and d.x_train[0, 0, 5, 0].item() == 255
    with pytest.raises(DataFileError, match="lacks gzip/emnist-digits"):
        load_dataset("emnist", tmp_path, split="digits")  # not in this archive


def test_usps_libsvm_bz2(tmp_path, published):
    import bz2

    (tmp_path / "usps").mkdir()
    line = lambda label, v: f"{label} " + " ".join(f"{i}:{v}" for i in range(1, 257)) + "\n"  # noqa: E731
    (tmp_path / "usps" / "usps.bz2").write_bytes(bz2.compress((line(10, -1) + line(3, 1)).encode()))
    (tmp_path / "usps" / "usps.t.bz2").write_bytes(bz2.compress(line(1, 0).encode()))
    published("usps", tmp_path)
    d = load_dataset("usps", tmp_path)
    assert d.y_train.tolist() == [9, 2] and d.y_test.tolist() == [0]
    assert d.x_train[0].unique().tolist() == [0] and d.x_train[1].unique().tolist() == [255]
    assert d.x_test[0].unique().tolist() == [127] and d.x_train.shape == (2, 1, 16, 16)
    # mean/std measured on the training images: half 0, half 255
    assert d.mean == (0.5,) and d.std == (0.5,)


def _saved_pair(n, hw, value):
    buf = io.BytesIO()
    torch.save((torch.full((n, hw, hw, 3), value, dtype=torch.uint8), torch.arange(n) % 10), buf)
    return buf.getvalue()


def test_mnistm_and_synthdigits_as_published(tmp_path, published):
    (tmp_path / "mnistm").mkdir()
    for split, n in (("train", 3), ("test", 2)):
        with tarfile.open(tmp_path / "mnistm" / f"mnist_m_{split}.pt.tar.gz", "w:gz") as tf:
            data = _saved_pair(n, 28, 9)
            info = tarfile.TarInfo(f"mnist_m_{split}.pt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    published("mnistm", tmp_path)
    d = load_dataset("mnistm", tmp_path)
    assert d.x_train.shape == (3, 3, 28, 28) and d.y_train.tolist() == [0, 1, 2] and d.y_test.tolist() == [0, 1]
    (tmp_path / "synthdigits").mkdir()
    for split in ("train", "test"):
        (tmp_path / "synthdigits" / f"synth_{split}.pt.gz").write_bytes(gzip.compress(_saved_pair(2, 32, 5)))
    published("synthdigits", tmp_path)
    d = load_dataset("synthdigits", tmp_path)
    assert d.x_test.shape == (2, 3, 32, 32) and d.x_test.unique().tolist() == [5]
    (tmp_path / "synthdigits" / "synth_test.pt.gz").write_bytes(gzip.compress(_saved_pair(2, 28, 5)))
    published("synthdigits", tmp_path)
    with pytest.raises(DataFileError, match=r"expected uint8 images \(N, 32, 32, 3\)"):
        load_dataset("synthdigits", tmp_path)  # MNIST-M's shape where SynthDigits' should be


def test_shakespeare_from_the_hub_csv_splits_each_user_by_order(tmp_path, published):
    import csv

    (tmp_path / "shakespeare").mkdir()
    rows = [("A_KING", "a" * 79 + str(i % 10), "b") for i in range(20)] + [("B_FOOL", "x" * 80, "y")] * 3
    with open(tmp_path / "shakespeare" / "shakespeare.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["character_id", "x", "y"])
        w.writerows(rows)
    published("shakespeare", tmp_path)
    d = load_dataset("shakespeare", tmp_path)
    assert d.user_names == ["A_KING", "B_FOOL"]
    assert [len(u) for u in d.users_train] == [18, 3] and [len(u) for u in d.users_test] == [2, 0]
    assert d.x_train.dtype == torch.uint8 and d.normalize(d.x_train[:1]).dtype == torch.int64
    # the test split holds A_KING's last two samples (windows 18 and 19)
    assert d.x_test[:, -1].tolist() == [ALL_LETTERS.index("8"), ALL_LETTERS.index("9")]
    (tmp_path / "shakespeare" / "shakespeare.csv").write_text("user,text\nA,b\n")
    published("shakespeare", tmp_path)
    with pytest.raises(DataFileError, match="expected columns character_id, x, y"):
        load_dataset("shakespeare", tmp_path)


def test_hf_columns_to_a_dataset_and_missing_extra(monkeypatch):
    from PIL import Image

    from protofl.config import load_config
    from protofl.data.hf import from_columns
    from protofl.errors import ConfigError

    imgs = [Image.fromarray(np.full((4, 4), v, np.uint8)) for v in (0, 255, 0)]
    d = from_columns("me/tiny", {"image": imgs[:2], "label": [0, 2]}, {"image": imgs[2:], "label": [1]},
                     "image", "label", ["a", "b", "c"])
    assert d.x_train.shape == (2, 1, 4, 4) and d.num_classes == 3 and d.mean == (0.5,) and d.std == (0.5,)
    assert d.name == "hf:me/tiny" and d.y_test.tolist() == [1]
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda n, *a, **k: (_ for _ in ()).throw(ImportError(n))
                        if n == "datasets" else real_import(n, *a, **k))
    cfg = load_config("digits", ["data.name=hf:me/tiny"])  # options are load_hf's, checked at load
    with pytest.raises(ConfigError, match=r"pip install 'protofl\[hf\]'"):
        load_dataset(cfg.data.name)


def test_hf_local_parquet_folder_when_datasets_is_installed(tmp_path):
    import datasets  # the hf extra: `make test` installs it (part of `all`), so this runs, never skips
    from PIL import Image

    for split, labels in (("train", [0, 1]), ("test", [1])):
        ds = datasets.Dataset.from_dict({"img": [Image.fromarray(np.full((4, 4, 3), 9, np.uint8))] * len(labels),
                                         "label": labels})
        (tmp_path / "data").mkdir(exist_ok=True)
        ds.to_parquet(str(tmp_path / "data" / f"{split}-00000-of-00001.parquet"))
    d = load_dataset(f"hf:{tmp_path}")
    assert d.x_train.shape == (2, 3, 4, 4) and d.y_train.tolist() == [0, 1]
    from protofl.errors import InputError

    with pytest.raises(InputError, match="cannot be loaded"):
        load_dataset("hf:protofl-test/no-such-repository-anywhere")


def test_hf_respects_offline_and_download_false(tmp_path):
    """PROTOFL_OFFLINE=1 and data.download=false keep hf: off the network: a Hub endpoint
    on 127.0.0.1 counts the requests (and, online, proves that it is the one asked)."""
    import datasets  # noqa: F401 - the hf extra, installed by `make test`
    import os
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from conftest import REPO

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(404)
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    code = ("import sys; from protofl.data.datasets import load_dataset\n"
            "try:\n    load_dataset('hf:someone/tiny', download=(sys.argv[1] != 'no'))\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PROTOFL_OFFLINE"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{httpd.server_port}", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(REPO / "src"))

    def load(download: str, offline: bool) -> str:
        e = dict(env, PROTOFL_OFFLINE="1") if offline else env
        out = subprocess.run([sys.executable, "-c", code, download], env=e, capture_output=True, text=True, timeout=120)
        return out.stdout.strip()

    try:
        for download, offline, why in (("yes", True, "PROTOFL_OFFLINE=1"), ("no", False, "data.download=false")):
            out = load(download, offline)
            assert out.startswith("DataFileError") and f"downloads are off ({why})" in out and "\n" not in out, out
            assert seen == []
        out = load("yes", False)  # online: the endpoint is asked (so the two above would have been seen)
        assert out.startswith("DataFileError") and "downloads are off" not in out, out
        assert seen
    finally:
        httpd.shutdown()
        httpd.server_close()


# ------------------------------------------------------------------ decompression bounds
ZEROS = 20_000_000  # 20 MB of zeros: about 20 kB packed, so about 1,000x (bound: 100x, at least 1 MiB)


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    except DataFileError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_a_gzip_or_bzip2_bomb_is_refused_before_it_fills_memory(tmp_path):
    import bz2

    from protofl.data.datasets import inflate, inflate_bound

    packed = gzip.compress(bytes(ZEROS))
    assert inflate_bound(len(packed)) < ZEROS
    with pytest.raises(DataFileError, match="decompression bomb"):
        inflate(packed, "bomb.gz")
    assert _peak_bytes(lambda: inflate(packed, "bomb.gz")) < 2 * inflate_bound(len(packed)) + (1 << 20)
    with pytest.raises(DataFileError, match="decompression bomb"):
        inflate(bz2.compress(bytes(ZEROS)), "bomb.bz2", "bz2")
    # what real files are: inflated whole; a cut one is damaged, not read in part
    real = gzip.compress(idx_bytes(np.arange(28 * 28 * 50, dtype=np.uint8).reshape(50, 28, 28)))
    assert parse_idx(inflate(real, "ok.gz")).shape == (50, 28, 28)
    with pytest.raises(DataFileError, match="cut short"):
        inflate(real[: len(real) // 2], "cut.gz")
    with pytest.raises(DataFileError, match="damaged gzip"):
        inflate(b"not gzip at all", "junk.gz")


def test_a_hand_placed_bomb_with_verify_off_is_one_line_bad_input(tmp_path):
    """data.verify: false reads a hand-placed file before any checksum: a gzip bomb in
    MNIST's place is refused by the decompression bound, in one line."""
    write_mnist(tmp_path / "mnist")
    (tmp_path / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(bytes(ZEROS)))
    with pytest.raises(DataFileError) as err:
        load_dataset("mnist", tmp_path, download=False, verify=False)
    assert "decompression bomb" in str(err.value) and "\n" not in str(err.value)


def test_archive_members_larger_than_the_bound_are_refused_unread(tmp_path):
    import zipfile

    zpath = tmp_path / "a.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("small.bin", b"x" * 100)
        zf.writestr("big.bin", bytes(ZEROS))
    assert archive_members(zpath, ["small.bin"])["small.bin"] == b"x" * 100
    with pytest.raises(DataFileError, match="decompression bomb"):
        archive_members(zpath, ["small.bin", "big.bin"])
    tpath = tmp_path / "a.tar.gz"
    with tarfile.open(tpath, "w:gz") as tf:
        info = tarfile.TarInfo("big.bin")
        info.size = ZEROS
        tf.addfile(info, io.BytesIO(bytes(ZEROS)))
    assert _peak_bytes(lambda: archive_members(tpath, ["big.bin"])) < ZEROS // 4
    with pytest.raises(DataFileError, match="decompression bomb"):
        archive_members(tpath, ["big.bin"])
