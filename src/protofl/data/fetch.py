"""Fetching the catalog's datasets, and proving the bytes are the published ones.

The transfer is pooch's (a :class:`pooch.Pooch` registry per file and URL): it checks the pinned checksum, retries
a failed transfer, and moves a file into place only once its checksum matches, so a file
under its final name is always complete and verified. pooch was chosen over
torchvision's download helpers (which need torchvision, and check checksums only after
writing the final file) and over huggingface_hub (Hub-hosted files only); pooch is small
and pure Python (requests, platformdirs, packaging). On top of it protofl adds what
pooch lacks:

* resumable partial files: the downloader below keeps ``<file>.part`` and continues it
  with an HTTP ``Range`` request after a cut connection (within pooch's retries, and in a
  later ``protofl data fetch``);
* mirrors: ``data.mirrors`` / ``PROTOFL_DATA_MIRROR`` (base URLs laid out like the data
  root, ``file://`` folders too) are tried before the publisher's URLs, and each URL
  after the one before it failed;
* one download per dataset at a time: a file lock (the ``filelock`` package) in the
  dataset's folder; a second process waits for it, then finds the files verified;
* a record of what was verified (``.protofl-verified.json``: size, mtime and checksum of
  each file), so ``protofl data list`` can say "verified" without re-reading every file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, cast, Iterable, Optional, Sequence
from urllib.parse import unquote, urlparse

from ..errors import human_bytes, one_line
from .catalog import CATALOG, RemoteFile, Source

OFFLINE_ENV = "PROTOFL_OFFLINE"
MIRROR_ENV = "PROTOFL_DATA_MIRROR"  # one or more base URLs, separated by whitespace or commas
RETRIES = 3  # attempts after the first, per URL (pooch's retry_if_failed)
TIMEOUT_S = 60.0  # connect/read timeout of one request
# the whole of one transfer: 10 minutes plus the file at 100 kB/s (a server that sends a
# byte every few seconds passes the read timeout, never this); the partial file is kept
DEADLINE_S, DEADLINE_RATE = 600.0, 100e3
LOCK_NAME = ".protofl-fetch.lock"
RECORD_NAME = ".protofl-verified.json"
CHUNK = 1 << 16

log = logging.getLogger("protofl.data")


class FetchError(OSError):
    """A dataset could not be fetched (no URL answered with the right bytes): one line, exit 4."""


def offline_reason(download: Optional[bool] = None) -> Optional[str]:
    """Why the network may not be used (``PROTOFL_OFFLINE`` or ``data.download: false``), or None."""
    env = os.environ.get(OFFLINE_ENV, "").strip().lower()
    if env not in ("", "0", "false", "no"):
        return f"{OFFLINE_ENV}={os.environ[OFFLINE_ENV]}"
    if download is False:
        return "data.download=false"
    return None


def mirror_list(mirrors: Sequence[str] = ()) -> list[str]:
    """Configured mirrors first, then those of ``PROTOFL_DATA_MIRROR``."""
    env = os.environ.get(MIRROR_ENV, "").replace(",", " ").split()
    out: list[str] = []
    for m in [*mirrors, *env]:
        if m and m not in out:
            out.append(m)
    return out


def candidate_urls(source: Source, f: RemoteFile, mirrors: Sequence[str]) -> list[str]:
    return [f"{m.rstrip('/')}/{source.folder}/{f.name}" for m in mirror_list(mirrors)] + list(f.urls)


# ---------------------------------------------------------------------------------------
# checksums and the verified record
# ---------------------------------------------------------------------------------------
def file_checksum(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record_path(folder: Path) -> Path:
    return folder / RECORD_NAME


def _read_record(folder: Path) -> dict:
    try:
        return json.loads(_record_path(folder).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(folder: Path, record: dict) -> None:
    try:
        if not folder.stat().st_mode & stat.S_IWUSR:  # a data root made read-only (even for root): left as it is
            return
    except OSError:
        return
    tmp = folder / f"{RECORD_NAME}.{os.getpid()}.tmp"  # one per process: two runs may check the same copy
    try:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, _record_path(folder))
    except OSError:  # a read-only data root: the record is a convenience, not needed
        tmp.unlink(missing_ok=True)


# what a fetch killed mid-way leaves beside the files: pooch's temporary file (created
# empty by tempfile.NamedTemporaryFile(dir=folder) before the transfer; the downloader fills
# it only at the end, from ``<file>.part``) and a record being rewritten by a process gone
POOCH_TEMP = re.compile(r"tmp[a-z0-9_]{8}")
RECORD_TEMP = re.compile(re.escape(RECORD_NAME) + r"\.(\d+)\.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def sweep_strays(folder: Path) -> list[str]:
    """Remove what killed fetches left in ``folder``; called with the fetch lock held, when
    no other fetch can be writing there. ``<file>.part`` files stay: they resume."""
    gone = []
    for p in folder.iterdir() if folder.is_dir() else ():
        stale = (POOCH_TEMP.fullmatch(p.name) and p.is_file() and p.stat().st_size == 0) or \
            ((m := RECORD_TEMP.fullmatch(p.name)) and not _pid_alive(int(m.group(1))))
        if stale:
            try:
                p.unlink()
                gone.append(p.name)
            except OSError:
                pass
    return gone


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def check_file(path: Path, f: RemoteFile, record: Optional[dict] = None) -> bool:
    """Whether ``path`` holds exactly the published bytes of ``f`` (re-read in full)."""
    known = f.known_hash
    assert known is not None  # called for files with a published checksum only
    alg, want = known.split(":", 1)
    ok = file_checksum(path, alg) == want
    if record is not None:
        if ok:
            record[f.name] = {"stat": _stat_key(path), "hash": f.known_hash}
        else:
            record.pop(f.name, None)
    return ok


def recorded_ok(folder: Path, f: RemoteFile, record: dict) -> bool:
    """Verified earlier and unchanged since (same size and mtime)."""
    entry = record.get(f.name)
    p = folder / f.name
    return bool(entry and p.exists() and entry.get("hash") == f.known_hash and entry.get("stat") == _stat_key(p))


_CHECKED: set[tuple] = set()  # (path, size, mtime_ns, checksum) this process found to be the published bytes


def check_before_reading(source: Source, root: Path, verify: bool = True,
                         say: Optional[Callable[[str], None]] = None) -> None:
    """Before a run reads ``source`` from ``root``: every published file present is the
    published bytes, or the run stops in one line (:class:`~protofl.errors.DataFileError`).

    A copy is read in full once; the record (size, mtime, checksum) spares the re-read
    until the file changes. ``verify=False`` (``data.verify: false``) reads a copy that
    does not match anyway, and says so in one line each time. A copy placed by hand in
    another layout (an extracted archive) has no published checksum to check."""
    from ..errors import DataFileError

    folder = Path(root) / source.folder
    have = [f for f in source.files if f.known_hash and (folder / f.name).is_file()]
    if not have:
        return
    record = _read_record(folder)
    unknown = [f for f in have if not recorded_ok(folder, f, record)
               and (str(folder / f.name), *_stat_key(folder / f.name), f.known_hash) not in _CHECKED]
    if not unknown:
        return
    bad = [f for f in unknown if not check_file(folder / f.name, f, record)]
    _write_record(folder, record)
    # (a read-only root keeps no record: this process remembers what it checked, so a sweep's
    # runs read a copy once)
    _CHECKED.update((str(folder / f.name), *_stat_key(folder / f.name), f.known_hash) for f in unknown if f not in bad)
    if not bad:
        return
    names = ", ".join(f"{f.name} (expected {_hash_words(f)}{_whose(folder / f.name, source)})" for f in bad)
    if verify:
        raise DataFileError(f"dataset {source.name!r}: {names} under {folder} is not the published file; "
                            f"remove it and run `protofl data fetch {source.name}`, or place the published file by "
                            f"hand ({source.how_to_place(root)}); data.verify=false reads it anyway")
    (say or (lambda m: print(m, file=sys.stderr)))(
        f"protofl: data.verify=false: reading {source.name}'s {names} under {folder}, which does not match "
        "the published checksum")


def _whose(path: Path, source: Source) -> str:
    """", it is <dataset>'s <file>" when ``path`` is byte for byte another published file
    of the catalog (Fashion-MNIST's images in the MNIST folder: same names, same shapes)."""
    digests: dict[str, str] = {}
    for other in CATALOG.values():
        for f in other.files:
            if f.known_hash is None or (other.name == source.name and f.name == path.name):
                continue
            alg, want = f.known_hash.split(":", 1)
            if alg not in digests:
                digests[alg] = file_checksum(path, alg)
            if digests[alg] == want:
                return f"; it is {other.name}'s {f.name}, byte for byte"
    return ""


def _hash_words(f: RemoteFile) -> str:
    known = f.known_hash
    assert known is not None  # called for files with a published checksum only
    alg, want = known.split(":", 1)
    return f"{alg} {want}"


# ---------------------------------------------------------------------------------------
# status: present? verified?
# ---------------------------------------------------------------------------------------
@dataclass
class Status:
    present: str  # "yes", "partly (k of n files)", "no", "hand-placed" (another layout)
    checksums: str  # "verified", "MISMATCH: ...", "not checked (run protofl data verify NAME)", "-"
    ok: Optional[bool]  # True verified, False a mismatch, None not known

    @property
    def readable(self) -> bool:
        """Whole: every published file, or a copy placed by hand in another layout."""
        return self.present in ("yes", "hand-placed")


def status(source: Source, root: Path, recheck: bool = False) -> Status:
    folder = root / source.folder
    have = [f for f in source.files if (folder / f.name).exists()]
    if source.files and len(have) == len(source.files):
        present = "yes"
    elif have:
        present = f"partly ({len(have)} of {len(source.files)} files)"
    elif any(next(root.glob(alt), None) is not None for alt in source.also_present_as):
        return Status("hand-placed", "not checkable (the published archives are not there)", None)
    else:
        return Status("no", "-", None)
    if not all(f.known_hash for f in have):
        return Status(present, "no pinned checksum", None)
    record = _read_record(folder)
    bad, unknown = [], []
    for f in have:
        if recheck:
            if not check_file(folder / f.name, f, record):
                bad.append(f.name)
        elif not recorded_ok(folder, f, record):
            unknown.append(f.name)
    if recheck:
        _write_record(folder, record)
    if bad:
        return Status(present, f"MISMATCH: {', '.join(bad)}", False)
    if unknown:
        return Status(present, f"not checked (protofl data verify {source.name})", None)
    return Status(present, "verified", True if present == "yes" else None)


# ---------------------------------------------------------------------------------------
# the transfer: a pooch downloader with resumable partial files
# ---------------------------------------------------------------------------------------
class PermanentError(Exception):
    """An answer that retrying cannot change (404, 403, ...): go to the next URL at once."""


class Progress:
    """A tqdm bar on a terminal; otherwise a plain log line at every 10 % (and the end)."""

    def __init__(self, label: str, total: Optional[int], start: int, tty: Optional[bool] = None):
        self.label, self.total, self.done = label, total, start
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.bar = None
        self.next_mark = 0.1
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="B", unit_scale=True, desc=label, leave=False,
                            file=sys.stderr)

    def update(self, n: int) -> None:
        self.done = min(self.done + n, self.total) if self.total else self.done + n  # never past 100 %
        if self.bar is not None:
            self.bar.update(n)
        elif self.total and self.done / self.total >= self.next_mark:
            log.info("%s: %d%% (%s of %s)", self.label, int(100 * self.done / self.total),
                     human_bytes(self.done), human_bytes(self.total))
            while self.next_mark <= self.done / self.total:
                self.next_mark += 0.1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class ResumableDownloader:
    """pooch downloader: HTTP(S) into ``<file>.part``, continued with ``Range`` when the
    part exists; ``file://`` URLs and plain paths are copied. The finished part is moved
    onto pooch's temporary file, which pooch checks and moves into place."""

    def __init__(self, part: Path, label: str, progress: Optional[bool] = None, timeout: float = TIMEOUT_S,
                 opener: Callable = open, known_hash: Optional[str] = None, size: Optional[int] = None):
        self.part, self.label, self.progress, self.timeout = part, label, progress, timeout
        self.opener = opener  # how the part is opened for writing (tests pass one that fills the disk)
        self.known_hash = known_hash  # checked on the whole part: a wrong file is not fetched again
        self.size = size  # the published byte count: no server may send more

    def __call__(self, url: str, output_file, pooch_obj=None, check_only: bool = False):
        parsed = urlparse(url)
        if parsed.scheme in ("http", "https"):
            self._http(url)
        elif parsed.scheme in ("file", ""):
            src = Path(unquote(parsed.path) if parsed.scheme else url)
            if not src.is_file():
                raise PermanentError(f"{url}: no such file")
            with open(src, "rb") as r, self.opener(self.part, "wb") as w:
                shutil.copyfileobj(r, w, CHUNK)
        else:
            raise PermanentError(f"{url}: unsupported URL scheme {parsed.scheme!r}")
        if self.known_hash:
            # a whole file with other bytes: retrying the same URL would fetch them again (pooch
            # retries a checksum mismatch like a cut connection), so it goes to the next URL at once
            alg, want = self.known_hash.split(":", 1)
            if file_checksum(self.part, alg) != want:
                self.part.unlink(missing_ok=True)
                raise PermanentError(f"{url}: checksum mismatch (not the published file; expected {alg} {want}); "
                                     "nothing was kept")
        os.replace(self.part, output_file)

    def _http(self, url: str) -> None:
        import requests

        from ..version import __version__

        have = self.part.stat().st_size if self.part.exists() else 0
        headers = {"User-Agent": f"protofl/{__version__}", "Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
        with requests.get(url, headers=headers, stream=True, timeout=self.timeout, allow_redirects=True) as r:
            if r.status_code == 416:  # the part is already whole (or longer than the file): start over
                self.part.unlink(missing_ok=True)
                raise requests.exceptions.RetryError(f"{url}: range not satisfiable; starting again")
            if r.status_code in (400, 401, 403, 404, 405, 410):
                raise PermanentError(f"{url}: HTTP {r.status_code} {r.reason}")
            if r.status_code >= 400:
                raise requests.exceptions.HTTPError(f"{url}: HTTP {r.status_code} {r.reason}", response=r)
            resumed = have and r.status_code == 206
            if not resumed:
                have = 0  # the server sent the whole file
            length = r.headers.get("Content-Length")
            total = have + int(length) if length is not None and length.isdigit() else None
            if self.size is not None and total is not None and total > self.size:
                raise PermanentError(f"{url}: announces {human_bytes(total)}, the published file has "
                                     f"{human_bytes(self.size)}")
            bound = self.size if self.size is not None else total  # no body beyond it is taken
            if resumed:
                log.info("%s: resuming at %s", self.label, human_bytes(have))
            deadline = time.monotonic() + DEADLINE_S + (bound or 0) / DEADLINE_RATE
            bar = Progress(self.label, bound, have, self.progress)
            got = have
            import urllib3

            try:
                with self.opener(self.part, "ab" if resumed else "wb") as fh:
                    # the bytes as sent: no transparent decoding of a Content-Encoding the server
                    # chose (a gzip body would expand on the way, unbounded); checked by checksum
                    for chunk in r.raw.stream(CHUNK, decode_content=False):
                        got += len(chunk)
                        if bound is not None and got > bound:
                            fh.close()
                            self.part.unlink(missing_ok=True)
                            raise PermanentError(f"{url}: sent more than the {human_bytes(bound)} of the file; "
                                                 "nothing was kept")
                        fh.write(chunk)
                        bar.update(len(chunk))
                        if time.monotonic() > deadline:
                            raise PermanentError(f"{url}: slower than its deadline ({human_bytes(got)} in "
                                                 f"{DEADLINE_S + (bound or 0) / DEADLINE_RATE:.0f} s); the partial "
                                                 "file is kept and resumes next time")
            except urllib3.exceptions.HTTPError as e:  # a cut or timed-out transfer: pooch retries it
                raise requests.exceptions.ConnectionError(f"{url}: {type(e).__name__}") from e
            finally:
                bar.close()
        got = self.part.stat().st_size
        if total is not None and got != total:
            raise requests.exceptions.ConnectionError(f"{url}: connection closed at {got} of {total} bytes")


def _fetch_file(source: Source, f: RemoteFile, folder: Path, mirrors: Sequence[str], retries: int,
                progress: Optional[bool], opener: Callable) -> Path:
    import pooch
    import requests

    pooch.get_logger().setLevel(logging.WARNING)  # its "Downloading ..." lines would repeat ours
    failures = []
    for url in candidate_urls(source, f, mirrors):
        part = folder / (f.name + ".part")
        downloader = ResumableDownloader(part, f"{source.name}/{f.name}", progress, opener=opener,
                                         known_hash=f.known_hash, size=f.size)
        try:
            # one pooch registry per URL: it pins the checksum and carries the retries
            pup = pooch.create(path=folder, base_url="", registry={f.name: f.known_hash}, urls={f.name: url},
                               retry_if_failed=retries)
            return Path(pup.fetch(f.name, downloader=downloader))
        except PermanentError as e:
            failures.append(str(e))
        except ValueError as e:  # pooch: the checksum did not match; it kept nothing
            part.unlink(missing_ok=True)
            if "hash" not in str(e).lower():
                raise
            failures.append(f"{url}: checksum mismatch (not the published file; expected {f.known_hash}); "
                            "nothing was kept")
        except requests.exceptions.RequestException as e:
            failures.append(f"{url}: {_reason(e, url)}")
    raise FetchError(f"could not fetch {source.name}'s {f.name}: " + "; ".join(failures)
                     + (" (a partial download is kept and resumes next time)" if (folder / (f.name + '.part')).exists()
                        else "")
                     + f". A copy you already have works as well: {f.name} ({_hash_words(f)}) into {folder}, and "
                       f"{OFFLINE_ENV}=1 keeps protofl off the network")


def _reason(e: Exception, url: str) -> str:
    """The short cause of a requests error (its messages embed whole urllib3 reprs)."""
    text = one_line(str(e), 300).removeprefix(f"{url}: ")
    for known in ("Connection refused", "Name or service not known", "timed out", "Connection aborted",
                  "Connection reset"):
        if known in text:
            return known
    return text


def fetch(source: Source, root: Path, *, mirrors: Sequence[str] = (), download: Optional[bool] = None,
          retries: int = RETRIES, progress: Optional[bool] = None, say: Optional[Callable[[str], None]] = None,
          opener: Callable = open) -> Path:
    """Make every file of ``source`` present and verified under ``root/<folder>``; returns the folder.

    Files already there with the published checksum are kept as they are. Raises
    :class:`~protofl.data.dataset.MissingDataError` when the network may not be used or the
    dataset cannot be fetched, :class:`FetchError` when no URL gave the right bytes, and
    ``OSError`` when a file cannot be written (a full disk: the partial file is kept).
    """
    from filelock import FileLock, Timeout

    from .dataset import MissingDataError

    say = say or (lambda m: print(m, file=sys.stderr))
    folder = Path(root) / source.folder
    if not source.fetchable:
        raise MissingDataError(f"dataset {source.name!r} cannot be fetched: {source.not_fetchable}; place it "
                               f"by hand: {source.how_to_place(root)}")
    why = offline_reason(download)
    record = _read_record(folder) if folder.is_dir() else {}
    todo = [f for f in source.files if not (folder / f.name).exists() or not recorded_ok(folder, f, record)]
    if todo and all((folder / f.name).is_file() for f in todo):
        # every file is there, only not yet checked: check it in place, without the lock (a
        # read-only data root holding the published files verifies, and nothing is written);
        # what passed is recorded, so the pass under the lock re-reads only what did not
        passed = [check_file(folder / f.name, f, record) for f in todo]
        _write_record(folder, record)
        if all(passed):
            return folder
    if not todo:
        return folder
    if why:
        missing = [f.name for f in todo if not (folder / f.name).exists()]
        if missing:
            raise MissingDataError(f"dataset {source.name!r}: {', '.join(missing)} missing under {folder} and "
                                   f"downloads are off ({why}); place the files by hand: {source.how_to_place(root)}")
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / LOCK_NAME))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"protofl: another process is fetching {source.name} into {folder}; waiting for it")
        lock.acquire()
    try:
        sweep_strays(folder)  # a fetch killed before this one left its temporary files
        record = _read_record(folder)  # the other process may have finished meanwhile
        todo = []
        for f in source.files:
            p = folder / f.name
            if p.exists() and (recorded_ok(folder, f, record) or check_file(p, f, record)):
                continue
            todo.append(f)
        _write_record(folder, record)
        if not todo:
            return folder
        if why:  # present but not the published bytes, and no network to replace them
            raise MissingDataError(f"dataset {source.name!r}: {', '.join(f.name for f in todo)} under {folder} "
                                   f"do not match the published checksums and downloads are off ({why}); "
                                   f"place the right files by hand: {source.how_to_place(root)}")
        sizes = [f.size for f in todo]
        size = human_bytes(sum(cast(list[int], sizes))) if all(s is not None for s in sizes) else source.size_text
        say(f"protofl: fetching {source.name} ({source.title}, {size}) into {folder}")
        from ..logs import ensure_log_handler

        ensure_log_handler()  # the plain progress lines without a terminal
        for f in todo:
            _fetch_file(source, f, folder, mirrors, retries, progress, opener)
            check_file(folder / f.name, f, record)  # pooch checked it; record size and mtime for `data list`
            _write_record(folder, record)
            log.info("%s/%s: verified (%s)", source.name, f.name, f.known_hash)
    finally:
        lock.release()
    return folder


def verify(sources: Iterable[Source], root: Path) -> list[tuple[Source, Status]]:
    """Re-read every present file of each source and compare it with its pinned checksum."""
    return [(s, status(s, root, recheck=True)) for s in sources]


def get_source(name: str) -> Source:
    from ..registry import UnknownNameError

    if name not in CATALOG:
        raise UnknownNameError(f"unknown dataset {name!r} for fetching; known: {', '.join(CATALOG)}")
    return CATALOG[name]
