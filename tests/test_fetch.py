"""Fetching datasets, against an HTTP server on 127.0.0.1 that the test starts and stops.

The server serves tiny files in each dataset's exact published format (a CIFAR-10 python
tarball, MNIST idx.gz, SVHN .mat, a Tiny-ImageNet zip with val_annotations.txt) and can
answer 404 or 500, cut the connection after N bytes, honour Range requests, and count
the requests it got. The checksums of these tiny files cannot be the published ones,
so each test builds its own catalog entry (a :class:`Source`) with the tiny files'
checksums; the shipped catalog keeps the real ones (checked at the end).
"""
from __future__ import annotations

import errno
import gzip
import hashlib
import io
import multiprocessing
import pickle
import re
import tarfile
import threading
import time
import zipfile
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from protofl.cli import main
from protofl.data import fetch as F
from protofl.data.catalog import CATALOG, RemoteFile, Source
from protofl.data.datasets import DataFileError, MissingDataError, load_dataset


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """These tests use the network of 127.0.0.1 only; conftest turns downloads off for the rest."""
    monkeypatch.delenv("PROTOFL_OFFLINE", raising=False)
    monkeypatch.delenv("PROTOFL_DATA_MIRROR", raising=False)


# ---------------------------------------------------------------------------------------
# the local server
# ---------------------------------------------------------------------------------------
class Server:
    """Files by path; per path a behaviour: "ok", "404", "500", ("cut", n) (first request
    sends n bytes of the promised length and drops the connection), ("slow", seconds)."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.mode: dict[str, object] = {}
        self.requests: list[tuple[str, str]] = []  # (path, Range header or "")
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # keep pytest's output clean
                pass

            def do_GET(self):
                path = self.path
                rng = self.headers.get("Range", "")
                with server.lock:
                    server.requests.append((path, rng))
                    n_before = sum(1 for p, _ in server.requests if p == path) - 1
                mode = server.mode.get(path, "ok")
                if mode == "500" or path not in server.files:
                    code = 500 if mode == "500" else 404
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if mode == "404":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = server.files[path]
                start = 0
                m = re.fullmatch(r"bytes=(\d+)-", rng)
                if m:
                    start = int(m.group(1))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                if mode == "gzip":  # a body the client would expand if it decoded what it did not ask for
                    body = gzip.compress(bytes(20_000_000), 9)
                    self.send_header("Content-Encoding", "gzip")
                if mode == "longer":  # more bytes than the file, and no length to say so
                    body = body + bytes(len(body))
                    self.send_header("Connection", "close")
                    self.close_connection = True
                else:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if isinstance(mode, tuple) and mode[0] == "cut" and n_before == 0:
                    self.wfile.write(body[: mode[1]])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the connection drops halfway
                    return
                if isinstance(mode, tuple) and mode[0] == "slow":
                    for i in range(0, len(body), max(1, len(body) // 10)):
                        self.wfile.write(body[i:i + max(1, len(body) // 10)])
                        self.wfile.flush()
                        time.sleep(mode[1] / 10)
                    return
                self.wfile.write(body)

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that hung up (the full-disk test)
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.requests if p == path)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


def source_for(name: str, server: Server, files: dict[str, bytes], folder: str | None = None, **kw) -> Source:
    """The catalog entry of ``name`` with its files replaced by tiny ones served locally."""
    base = CATALOG[name]
    folder = folder or base.folder
    remote = []
    for fname, data in files.items():
        path = f"/pub/{folder}/{fname}"
        server.files[path] = data
        remote.append(RemoteFile(fname, (server.url + path,), md5=md5(data), size=len(data)))
    return replace(base, files=tuple(remote), **kw)


# ---------------------------------------------------------------------------------------
# tiny files in the published formats
# ---------------------------------------------------------------------------------------
def cifar10_tarball(pad: int = 0, n: int = 0) -> bytes:
    """The python-version tarball with 5 + 1 tiny batches; ``pad`` random bytes in one more
    member make it larger than one network read (64 KB), for the cut and full-disk tests.
    ``n``: instead ``n`` images of random pixels in each batch, the labels cycling through
    the 10 classes (training batch i from class i on): enough for a few clients to train."""
    def batch(labels, first):
        k = len(labels)
        if n:
            data = np.random.default_rng(first).integers(0, 256, (k, 3072), dtype=np.uint8)
        else:
            data = np.zeros((k, 3072), np.uint8)
            for i in range(k):
                data[i] = first + i
        return pickle.dumps({b"data": data, b"labels": labels, b"batch_label": b"x"}, protocol=2)

    train = {i: [(i + j) % 10 for j in range(n)] if n else [i, 9 - i] for i in range(1, 6)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        members = {f"cifar-10-batches-py/data_batch_{i}": batch(labels, 10 * i) for i, labels in train.items()}
        members["cifar-10-batches-py/test_batch"] = batch([j % 10 for j in range(n)] if n else [3, 4, 5], 200)
        members["cifar-10-batches-py/batches.meta"] = pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]})
        if pad:
            members["cifar-10-batches-py/readme.html"] = np.random.default_rng(1).bytes(pad)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def mnist_files() -> dict[str, bytes]:
    def idx(arr):
        return gzip.compress(bytes([0, 0, 8, arr.ndim]) + np.asarray(arr.shape, ">u4").tobytes() + arr.tobytes())

    rng = np.random.default_rng(0)
    return {"train-images-idx3-ubyte.gz": idx(rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)),
            "train-labels-idx1-ubyte.gz": idx(np.array([1, 2, 3, 4], np.uint8)),
            "t10k-images-idx3-ubyte.gz": idx(rng.integers(0, 256, (2, 28, 28), dtype=np.uint8)),
            "t10k-labels-idx1-ubyte.gz": idx(np.array([7, 0], np.uint8))}


def svhn_files() -> dict[str, bytes]:
    from scipy.io import savemat

    out = {}
    for split, labels in (("train", [10, 3]), ("test", [1])):
        buf = io.BytesIO()
        savemat(buf, {"X": np.full((32, 32, 3, len(labels)), 7, np.uint8), "y": np.array(labels, np.uint8)[:, None]})
        out[f"{split}_32x32.mat"] = buf.getvalue()
    return out


def jpeg(value: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), value, np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def tiny_imagenet_zip(val_rows: list[tuple[str, str]]) -> bytes:
    """Two classes (n02, n01: sorted order n01 = 0, n02 = 1), two train images each, and
    the validation images of ``val_rows`` (file, wnid), all in val/images/."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("tiny-imagenet-200/wnids.txt", "n02\nn01\n")
        zf.writestr("tiny-imagenet-200/words.txt", "n01\tone\nn02\ttwo\n")
        for w, v in (("n01", 10), ("n02", 200)):
            for i in range(2):
                zf.writestr(f"tiny-imagenet-200/train/{w}/images/{w}_{i}.JPEG", jpeg(v))
            zf.writestr(f"tiny-imagenet-200/train/{w}/{w}_boxes.txt", "")
        ann = "".join(f"{f}\t{w}\t0\t0\t63\t63\n" for f, w in val_rows)
        zf.writestr("tiny-imagenet-200/val/val_annotations.txt", ann)
        for f, w in val_rows:
            zf.writestr(f"tiny-imagenet-200/val/images/{f}", jpeg(10 if w == "n01" else 200))
        zf.writestr("tiny-imagenet-200/test/images/test_0.JPEG", jpeg(0))
    return buf.getvalue()


# ---------------------------------------------------------------------------------------
# a fetch that succeeds, in each format, and what it leaves
# ---------------------------------------------------------------------------------------
def quiet(*_):
    pass


def test_fetch_cifar10_then_load_it_from_the_tarball(server, tmp_path, monkeypatch):
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": cifar10_tarball()})
    monkeypatch.setitem(CATALOG, "cifar10", src)
    said = []
    folder = F.fetch(src, tmp_path, say=said.append, progress=False)
    assert folder == tmp_path / "cifar10"
    assert len(said) == 1 and "cifar10" in said[0] and str(folder) in said[0] and "715 B" in said[0]
    assert sorted(p.name for p in folder.iterdir()) == [".protofl-fetch.lock", ".protofl-verified.json",
                                                        "cifar-10-python.tar.gz"]
    d = load_dataset("cifar10", tmp_path)
    assert d.y_train.tolist() == [1, 8, 2, 7, 3, 6, 4, 5, 5, 4] and d.y_test.tolist() == [3, 4, 5]
    assert d.x_train[2].unique().tolist() == [20] and d.class_names[9] == "c9"
    assert F.status(src, tmp_path).checksums == "verified"
    F.fetch(src, tmp_path, say=quiet)  # present and verified: no request at all
    assert server.count("/pub/cifar10/cifar-10-python.tar.gz") == 1


@pytest.mark.parametrize("name,files", [("mnist", mnist_files), ("svhn", svhn_files)])
def test_fetch_mnist_and_svhn_in_their_formats(server, tmp_path, name, files, monkeypatch):
    src = source_for(name, server, files())
    monkeypatch.setitem(CATALOG, name, src)
    F.fetch(src, tmp_path, say=quiet, progress=False)
    d = load_dataset(name, tmp_path)
    if name == "mnist":
        assert d.y_train.tolist() == [1, 2, 3, 4] and d.y_test.tolist() == [7, 0]
    else:
        assert d.y_train.tolist() == [0, 3] and d.y_test.tolist() == [1] and d.x_train.unique().tolist() == [7]


def test_tiny_imagenet_validation_labels_come_from_val_annotations(server, tmp_path, monkeypatch):
    """PFLlib #231: reading val/ as an image folder gives all 10,000 images class 0."""
    rows = [("val_0.JPEG", "n02"), ("val_1.JPEG", "n01"), ("val_2.JPEG", "n02")]
    src = source_for("tinyimagenet", server, {"tiny-imagenet-200.zip": tiny_imagenet_zip(rows)})
    monkeypatch.setitem(CATALOG, "tinyimagenet", src)
    F.fetch(src, tmp_path, say=quiet, progress=False)
    d = load_dataset("tinyimagenet", tmp_path)
    assert d.class_names == ["n01", "n02"] and d.num_classes == 200
    assert d.y_train.tolist() == [0, 0, 1, 1]
    assert d.y_test.tolist() == [1, 0, 1]  # n02 -> 1, n01 -> 0, as the annotations say
    # and the pixels agree with the labels (n01 images are dark, n02 bright)
    assert [int(x.float().mean() > 100) for x in d.x_test] == d.y_test.tolist()
    assert d.x_train.shape == (4, 3, 64, 64)


def test_tiny_imagenet_annotation_naming_an_unknown_class_is_one_line(tmp_path, published):
    (tmp_path / "tinyimagenet").mkdir()
    (tmp_path / "tinyimagenet" / "tiny-imagenet-200.zip").write_bytes(tiny_imagenet_zip([("val_0.JPEG", "n99")]))
    published("tinyimagenet", tmp_path)
    with pytest.raises(DataFileError, match="val_annotations.txt line 1"):
        load_dataset("tinyimagenet", tmp_path)


# ---------------------------------------------------------------------------------------
# failures: one line, nothing left that looks complete
# ---------------------------------------------------------------------------------------
def test_wrong_checksum_leaves_nothing_complete(server, tmp_path):
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": cifar10_tarball()})
    wrong = replace(src.files[0], md5="0" * 32)
    src = replace(src, files=(wrong,))
    with pytest.raises(F.FetchError) as err:
        F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "checksum mismatch" in msg and src.files[0].urls[0] in msg
    left = [p.name for p in (tmp_path / "cifar10").iterdir() if not p.name.startswith(".protofl")]
    assert left == []  # no file under its final name, no partial, no temporary


@pytest.mark.parametrize("mode,code", [("404", "HTTP 404"), ("500", "HTTP 500")])
def test_404_and_500_are_one_line_naming_the_url(server, tmp_path, mode, code):
    src = source_for("mnist", server, mnist_files())
    path = "/pub/mnist/train-images-idx3-ubyte.gz"
    server.mode[path] = mode
    with pytest.raises(F.FetchError) as err:
        F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and code in msg and server.url + path in msg
    assert not (tmp_path / "mnist" / "train-images-idx3-ubyte.gz").exists()


def test_cli_fetch_failure_exit_code_and_one_line(server, tmp_path, monkeypatch, capsys):
    src = source_for("mnist", server, mnist_files())
    server.mode["/pub/mnist/train-images-idx3-ubyte.gz"] = "404"
    monkeypatch.setitem(CATALOG, "mnist", src)
    assert main(["data", "fetch", "mnist", "--root", str(tmp_path)]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("protofl: fetching mnist") and "HTTP 404" in err[1]


def test_a_cut_connection_resumes_with_range(server, tmp_path):
    data = cifar10_tarball(pad=300_000)
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": data})
    path = "/pub/cifar10/cifar-10-python.tar.gz"
    server.mode[path] = ("cut", 100_000)
    F.fetch(src, tmp_path, say=quiet, retries=1, progress=False)
    # every byte read before the cut is kept and continued
    assert [r for p, r in server.requests if p == path] == ["", "bytes=100000-"]
    assert (tmp_path / "cifar10" / "cifar-10-python.tar.gz").read_bytes() == data
    assert not (tmp_path / "cifar10" / "cifar-10-python.tar.gz.part").exists()


def test_a_cut_connection_without_retries_resumes_in_the_next_fetch(server, tmp_path):
    data = cifar10_tarball(pad=300_000)
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": data})
    path = "/pub/cifar10/cifar-10-python.tar.gz"
    server.mode[path] = ("cut", 100_000)
    with pytest.raises(F.FetchError, match="partial download is kept"):
        F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    part = tmp_path / "cifar10" / "cifar-10-python.tar.gz.part"
    assert part.stat().st_size == 100_000 and not (tmp_path / "cifar10" / "cifar-10-python.tar.gz").exists()
    F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    assert server.requests[-1] == (path, "bytes=100000-")
    assert (tmp_path / "cifar10" / "cifar-10-python.tar.gz").read_bytes() == data and not part.exists()


def test_a_full_disk_is_one_line_and_keeps_only_the_partial(server, tmp_path):
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": cifar10_tarball(pad=300_000)})

    class Full(io.FileIO):
        written = 0

        def write(self, b):
            if Full.written > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.name))
            Full.written += len(b)
            return super().write(b)

    with pytest.raises(OSError) as err:
        F.fetch(src, tmp_path, say=quiet, retries=0, progress=False, opener=lambda p, m: Full(p, m))
    assert err.value.errno == errno.ENOSPC
    names = sorted(p.name for p in (tmp_path / "cifar10").iterdir() if not p.name.startswith(".protofl"))
    assert names == ["cifar-10-python.tar.gz.part"]  # kept to resume; nothing under the final name


def test_cli_full_disk_exit_4_one_line(server, tmp_path, monkeypatch, capsys):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "mnist" / "x.part"))

    monkeypatch.setitem(CATALOG, "mnist", source_for("mnist", server, mnist_files()))
    monkeypatch.setattr(F, "_fetch_file", full)
    assert main(["data", "fetch", "mnist", "--root", str(tmp_path)]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    # the I/O line of every full disk (with the free space the disk reports)
    assert err[-1].startswith("protofl: error: No space left on device (the disk is full, ")
    assert err[-1].endswith(f"free): {tmp_path / 'mnist' / 'x.part'}")


def test_offline_one_line_says_how_to_place_by_hand(server, tmp_path, monkeypatch):
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": cifar10_tarball()})
    monkeypatch.setitem(CATALOG, "cifar10", src)
    monkeypatch.setenv("PROTOFL_OFFLINE", "1")
    with pytest.raises(MissingDataError) as err:
        load_dataset("cifar10", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "PROTOFL_OFFLINE=1" in msg and "place the files by hand" in msg
    assert str(tmp_path / "cifar10") in msg and src.files[0].urls[0] in msg and src.files[0].md5 in msg
    monkeypatch.delenv("PROTOFL_OFFLINE")
    with pytest.raises(MissingDataError, match="data.download=false"):
        load_dataset("cifar10", tmp_path, download=False)
    assert server.requests == [] and not (tmp_path / "cifar10").exists()
    d = load_dataset("cifar10", tmp_path)  # online: fetched on first use, then read
    assert len(d.y_test) == 3 and server.count("/pub/cifar10/cifar-10-python.tar.gz") == 1


def test_a_run_config_fetches_on_first_use_and_data_download_false_stops_it(server, tmp_path, monkeypatch):
    from protofl.config import load_config
    from protofl.data.build import build_federated

    monkeypatch.setitem(CATALOG, "mnist", source_for("mnist", server, mnist_files()))
    cfg = load_config("digits", ["data.name=mnist", f"data.root={tmp_path}", "partition.name=iid",
                                 "partition.num_clients=2", "data.download=false"])
    with pytest.raises(MissingDataError, match="data.download=false"):
        build_federated(cfg)
    cfg = cfg.replace(**{"data.download": True})
    assert build_federated(cfg).num_clients == 2
    assert server.count("/pub/mnist/train-images-idx3-ubyte.gz") == 1


def _fetch_in_child(src, root, out):
    try:
        F.fetch(src, Path(root), say=quiet, progress=False)
        out.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.put(repr(e))


def test_two_processes_fetching_at_once_download_once(server, tmp_path):
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": cifar10_tarball()})
    path = "/pub/cifar10/cifar-10-python.tar.gz"
    server.mode[path] = ("slow", 1.0)  # long enough for the second process to find the lock taken
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_child, args=(src, str(tmp_path), out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert sorted(out.get(timeout=5) for _ in procs) == ["ok", "ok"]
    assert server.count(path) == 1
    assert F.status(src, tmp_path).checksums == "verified"


def test_a_mirror_answers_when_the_first_source_fails(server, tmp_path, monkeypatch):
    files = mnist_files()
    src = source_for("mnist", server, files)
    monkeypatch.setitem(CATALOG, "mnist", src)
    for f in files:  # the publisher's URLs fail ...
        server.mode[f"/pub/mnist/{f}"] = "500"
        server.files[f"/mirror/mnist/{f}"] = files[f]  # ... the mirror has the data root's layout
    F.fetch(src, tmp_path, mirrors=[server.url + "/nowhere", server.url + "/mirror"], say=quiet, retries=0)
    assert load_dataset("mnist", tmp_path).y_test.tolist() == [7, 0]
    assert server.count("/nowhere/mnist/train-images-idx3-ubyte.gz") == 1  # tried first, 404
    assert server.count("/mirror/mnist/train-images-idx3-ubyte.gz") == 1
    assert server.count("/pub/mnist/train-images-idx3-ubyte.gz") == 0  # never needed


def test_mirror_from_the_environment_and_a_local_folder(server, tmp_path, monkeypatch):
    files = mnist_files()
    src = source_for("mnist", server, files)
    monkeypatch.setitem(CATALOG, "mnist", src)
    for f in files:
        server.mode[f"/pub/mnist/{f}"] = "404"
    mirror = tmp_path / "mirror"
    (mirror / "mnist").mkdir(parents=True)
    for f, data in files.items():
        (mirror / "mnist" / f).write_bytes(data)
    monkeypatch.setenv("PROTOFL_DATA_MIRROR", mirror.as_uri())
    F.fetch(src, tmp_path / "root", say=quiet, retries=0)
    assert load_dataset("mnist", tmp_path / "root").y_train.tolist() == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------
# bad input on the data side: one line, exit 2, nothing half-written
# ---------------------------------------------------------------------------------------
def test_corrupt_and_truncated_archives_are_one_line(tmp_path, capsys, published):
    data = cifar10_tarball()
    folder = tmp_path / "cifar10"
    folder.mkdir()
    (folder / "cifar-10-python.tar.gz").write_bytes(data[: len(data) // 2])  # truncated
    published("cifar10", tmp_path)  # its checksum pinned: the reader meets it
    assert main(["run", "digits", "data.name=cifar10", f"data.root={tmp_path}", "model.name=mlp",
                 "rounds=1", f"output.dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cifar10" in err
    (folder / "cifar-10-python.tar.gz").write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)  # corrupt
    published("cifar10", tmp_path)
    with pytest.raises(DataFileError):
        load_dataset("cifar10", tmp_path)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))


def test_files_of_another_dataset_are_refused(tmp_path, capsys, published):
    folder = tmp_path / "cifar10"
    folder.mkdir()
    buf = io.BytesIO()  # a CIFAR-100 tarball where CIFAR-10's should be
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("cifar-100-python/train", "cifar-100-python/test"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
    (folder / "cifar-10-python.tar.gz").write_bytes(buf.getvalue())
    # `data verify` says which files are not the published ones, exit 2
    assert main(["data", "verify", "cifar10", "--root", str(tmp_path)]) == 2
    cap = capsys.readouterr()
    assert "MISMATCH: cifar-10-python.tar.gz" in cap.out and cap.err.count("\n") == 1
    # and, were its checksum the pinned one, the reader itself refuses it
    published("cifar10", tmp_path)
    with pytest.raises(DataFileError, match="not the archive this dataset is published in"):
        load_dataset("cifar10", tmp_path)


def test_an_unknown_dataset_to_fetch_is_one_line(tmp_path, capsys):
    assert main(["data", "fetch", "cifar11", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cifar11" in err and "cifar10" in err


def test_not_fetchable_datasets_say_how_to_place_them(tmp_path, capsys):
    assert main(["data", "fetch", "domainnet", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be fetched" in err and str(tmp_path / "domainnet") in err


# ---------------------------------------------------------------------------------------
# data list / verify and the shipped catalog
# ---------------------------------------------------------------------------------------
def test_data_list_shows_every_dataset(tmp_path, capsys, monkeypatch):
    from protofl.data.datasets import DATASETS

    assert main(["data", "list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in [*CATALOG, *DATASETS.names()]:
        assert re.search(rf"^{name}: ", out, re.M), name
    for name in ("domainnet", "fed_isic2019", "femnist"):
        assert re.search(rf"^{name}: .*not fetchable", out, re.M)
    assert "present: no" in out and "license:" in out and "source:" in out


def test_verify_reports_verified_files(server, tmp_path, monkeypatch, capsys):
    src = source_for("mnist", server, mnist_files())
    monkeypatch.setitem(CATALOG, "mnist", src)
    assert main(["data", "fetch", "mnist", "--root", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["data", "verify", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "mnist: present: yes; checksums: verified"
    p = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    raw = p.read_bytes()
    p.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))  # one byte changed
    assert main(["data", "verify", "mnist", "--root", str(tmp_path)]) == 2
    assert "MISMATCH: t10k-labels-idx1-ubyte.gz" in capsys.readouterr().out


def test_shipped_catalog_pins_every_fetchable_file():
    """Each fetchable file has a pinned checksum of the right length and an https/http URL;
    the values themselves are the publishers' (see catalog.py) and unchanged here."""
    for src in CATALOG.values():
        for f in src.files:
            assert (f.md5 and len(f.md5) == 32) or (f.sha256 and len(f.sha256) == 64), (src.name, f.name)
            assert all(u.startswith(("https://", "http://")) for u in f.urls)
    assert CATALOG["cifar10"].files[0].md5 == "c58f30108f718f92721af3b95e74349a"  # torchvision cifar.py
    assert CATALOG["mnist"].files[0].md5 == "f68b3c2dcbeaaa9fbdd348bbdeb94873"  # torchvision mnist.py
    assert {s.name for s in CATALOG.values() if not s.fetchable} == {"femnist", "domainnet", "fed_isic2019"}


def test_catalog_md5s_match_the_real_files_where_present():
    """The real MNIST / Fashion-MNIST files of the shared data folder have the pinned MD5s."""
    from conftest import shared_data

    root = shared_data()
    if not (root / "mnist").exists():
        pytest.skip(f"real data not present: {root}")
    for name in ("mnist", "fmnist"):
        src = CATALOG[name]
        for f in src.files:
            p = root / src.folder / f.name
            assert F.file_checksum(p, "md5") == f.md5 and p.stat().st_size == f.size, (name, f.name)


def test_docs_data_page_lists_every_dataset_and_checksum():
    from conftest import REPO

    page = (REPO / "docs" / "data.md").read_text()
    rows = {line.split(" | ")[0].strip("| `"): line for line in page.splitlines() if line.startswith("| `")}
    for src in CATALOG.values():
        assert f"| `{src.name}` |" in page, src.name
        for f in src.files:
            assert (f.sha256 or f.md5) in page and f.urls[0] in page, (src.name, f.name)
        if src.files:  # the size a download will show (decimal MB from the pinned bytes)
            assert f"| {src.size_text} | {src.license} |" in rows[src.name], src.name


def test_a_source_with_pinned_byte_counts_states_its_size_from_them():
    assert CATALOG["cifar10"].size_text == "170.5 MB"  # 170,498,071 bytes, as the download shows it
    assert not [s.name for s in CATALOG.values() if s.total_bytes is not None and s.size]  # no second, typed size
    assert CATALOG["emnist"].size_text == "536 MB"  # no pinned byte count: the catalog's words


# ---------------------------------------------------------------------------------------
# a copy that is not the published one is never read unless the user says so
# ---------------------------------------------------------------------------------------
def test_a_tampered_tarball_in_the_data_root_stops_a_run_in_one_line(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "cifar10"
    folder.mkdir()
    (folder / "cifar-10-python.tar.gz").write_bytes(cifar10_tarball())  # readable, but not the published bytes
    argv = ["run", "digits", "data.name=cifar10", f"data.root={tmp_path}", "model.name=mlp", "rounds=1",
            "partition.num_clients=2", f"output.dir={tmp_path / 'runs'}", "output.progress=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cifar-10-python.tar.gz" in err and "not the published file" in err
    assert CATALOG["cifar10"].files[0].md5 in err and "data.verify=false" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))
    assert main(["data", "verify", "cifar10", "--root", str(tmp_path)]) == 2  # and data verify agrees
    capsys.readouterr()
    # data.verify=false: read anyway, and said in one line, every time
    for _ in range(2):
        d = load_dataset("cifar10", tmp_path, verify=False)
        assert d.y_test.tolist() == [3, 4, 5]
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "data.verify=false" in err and "does not match" in err


def test_a_copy_is_checksummed_once_and_again_when_it_changes(tmp_path, published, monkeypatch):
    folder = tmp_path / "cifar10"
    folder.mkdir()
    p = folder / "cifar-10-python.tar.gz"
    p.write_bytes(cifar10_tarball())
    published("cifar10", tmp_path)
    reads = []
    real = F.file_checksum
    monkeypatch.setattr(F, "file_checksum", lambda path, alg: reads.append(path) or real(path, alg))
    load_dataset("cifar10", tmp_path)
    load_dataset("cifar10", tmp_path)
    assert reads == [p]  # the record (size, mtime, checksum) spares the second read
    p.write_bytes(cifar10_tarball(pad=1))  # another file under the same name
    with pytest.raises(DataFileError, match="not the published file"):
        load_dataset("cifar10", tmp_path)
    assert reads[:2] == [p, p]  # read again (and then once per algorithm, to name whose file it is)


def test_a_mirror_serving_a_wrong_archive_is_asked_once(server, tmp_path, online):
    files = mnist_files()
    src = source_for("mnist", server, files)
    name = "t10k-labels-idx1-ubyte.gz"
    server.files[f"/mirror/mnist/{name}"] = files[name][:-1] + bytes([files[name][-1] ^ 0xFF])  # other bytes, whole
    for f in files:
        if f != name:
            server.files[f"/mirror/mnist/{f}"] = files[f]
    F.fetch(src, tmp_path, mirrors=[server.url + "/mirror"], say=quiet, retries=3, progress=False)
    assert server.count(f"/mirror/mnist/{name}") == 1  # a checksum mismatch is not a transfer error
    assert server.count(f"/pub/mnist/{name}") == 1  # the next URL at once
    assert F.status(src, tmp_path).checksums == "verified"


def test_a_failed_download_names_the_file_its_place_its_checksum_and_offline(tmp_path, online):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    f = RemoteFile("cifar-10-python.tar.gz", (f"http://127.0.0.1:{port}/cifar-10-python.tar.gz",), md5="1" * 32)
    src = replace(CATALOG["cifar10"], files=(f,))
    with pytest.raises(F.FetchError) as err:
        F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "Connection refused" in msg
    assert f"cifar-10-python.tar.gz (md5 {'1' * 32}) into {tmp_path / 'cifar10'}" in msg and "PROTOFL_OFFLINE=1" in msg


def test_a_read_only_data_root_is_checked_but_left_as_it_is(tmp_path, published):
    folder = tmp_path / "cifar10"
    folder.mkdir()
    (folder / "cifar-10-python.tar.gz").write_bytes(cifar10_tarball())
    published("cifar10", tmp_path)
    folder.chmod(0o555)  # a shared, read-only copy
    try:
        for _ in range(2):
            assert load_dataset("cifar10", tmp_path).y_test.tolist() == [3, 4, 5]
        assert sorted(p.name for p in folder.iterdir()) == ["cifar-10-python.tar.gz"]  # no record written
    finally:
        folder.chmod(0o755)


def test_a_read_only_root_with_the_published_files_fetches_and_verifies(server, tmp_path, capsys, monkeypatch):
    src = source_for("mnist", server, mnist_files())
    monkeypatch.setitem(CATALOG, "mnist", src)
    folder = tmp_path / "mnist"
    folder.mkdir()
    for name, data in mnist_files().items():
        (folder / name).write_bytes(data)
    folder.chmod(0o555)  # a shared copy nobody may write to
    try:
        assert F.fetch(src, tmp_path, say=quiet, progress=False) == folder  # checked in place: no download
        assert server.requests == [] and sorted(p.name for p in folder.iterdir()) == sorted(mnist_files())
        assert main(["data", "verify", "mnist", "--root", str(tmp_path)]) == 0
        assert "checksums: verified" in capsys.readouterr().out
        assert main(["data", "fetch", "mnist", "--root", str(tmp_path)]) == 0
        assert sorted(p.name for p in folder.iterdir()) == sorted(mnist_files())  # no lock, no record
    finally:
        folder.chmod(0o755)


# ---------------------------------------------------------------------------------------
# a server that abuses the download: bounded by the published size and a deadline
# ---------------------------------------------------------------------------------------
def test_a_gzip_body_is_not_expanded_and_a_longer_one_is_cut(server, tmp_path, caplog):
    import logging

    data = cifar10_tarball(pad=300_000)
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": data})
    path = "/pub/cifar10/cifar-10-python.tar.gz"
    for mode, says in (("gzip", "checksum mismatch"), ("longer", "sent more than")):
        server.mode[path] = mode
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="protofl.data"), pytest.raises(F.FetchError, match=says):
            F.fetch(src, tmp_path, say=quiet, retries=3, progress=False)
        assert server.count(path) == 1  # not retried: the same bytes would come again
        assert [p.name for p in (tmp_path / "cifar10").iterdir() if not p.name.startswith(".")] == []
        assert len(caplog.records) <= 12  # progress at most every 10 % of the file, never past 100 %
        assert all("%" not in r.getMessage() or int(r.getMessage().split(": ")[1].split("%")[0]) <= 100
                   for r in caplog.records)
        server.requests.clear()


def test_a_trickling_server_meets_a_deadline_and_the_part_is_kept(server, tmp_path, monkeypatch):
    data = cifar10_tarball(pad=300_000)
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": data})
    path = "/pub/cifar10/cifar-10-python.tar.gz"
    server.mode[path] = ("slow", 4.0)  # the file in ten pieces over 4 s: each read well within its timeout
    monkeypatch.setattr(F, "DEADLINE_S", 1.0)
    monkeypatch.setattr(F, "DEADLINE_RATE", 1e12)
    with pytest.raises(F.FetchError, match="slower than its deadline"):
        F.fetch(src, tmp_path, say=quiet, retries=3, progress=False)
    part = tmp_path / "cifar10" / "cifar-10-python.tar.gz.part"
    assert server.count(path) == 1 and 0 < part.stat().st_size < len(data)  # kept for the next fetch
    server.mode[path] = "ok"
    F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    assert (tmp_path / "cifar10" / "cifar-10-python.tar.gz").read_bytes() == data



def test_a_fetch_killed_mid_transfer_leaves_no_stray_file_after_the_next(server, tmp_path):
    """kill -9 during a transfer leaves pooch's (empty) temporary file beside the partial
    download; the next fetch resumes the partial file and removes the stray one."""
    import os
    import signal

    data = cifar10_tarball(pad=300_000)
    src = source_for("cifar10", server, {"cifar-10-python.tar.gz": data})
    path = "/pub/cifar10/cifar-10-python.tar.gz"
    server.mode[path] = ("slow", 10.0)  # ten pieces, a second apart: the first 64 KiB after two
    folder = tmp_path / "cifar10"
    part = folder / "cifar-10-python.tar.gz.part"
    child = multiprocessing.get_context("fork").Process(
        target=F.fetch, args=(src, tmp_path), kwargs={"say": quiet, "retries": 0, "progress": False})
    child.start()
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size > 0):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    strays = [p.name for p in folder.iterdir() if F.POOCH_TEMP.fullmatch(p.name)]
    assert strays, sorted(p.name for p in folder.iterdir())  # what the kill left
    (folder / f"{F.RECORD_NAME}.{child.pid}.tmp").write_text("{")  # a record rewrite cut short, too
    server.mode[path] = "ok"
    F.fetch(src, tmp_path, say=quiet, retries=0, progress=False)
    assert (folder / "cifar-10-python.tar.gz").read_bytes() == data
    assert server.requests[-1][1].startswith("bytes=")  # the partial file was resumed
    assert sorted(p.name for p in folder.iterdir()) == sorted(["cifar-10-python.tar.gz", F.LOCK_NAME, F.RECORD_NAME])
