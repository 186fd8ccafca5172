"""Run records: the part of a finished run that its tables are made of, small enough to
publish beside them.

A run folder holds checkpoints and the final model (megabytes) and four small files:
``summary.json`` (its status, rounds and the fingerprint of its config), ``metrics.jsonl``
(every round's metrics), ``clients.json`` (the partition's class counts) and
``config.yaml``. Those four are the run's *record*: every number of a sweep table, a
reproduction page or the comparison page is read from them, so a page published with the
records of its runs can be rebuilt and checked by anyone (``protofl reproduce TABLE
--records DIR --no-run``), and a grid that takes longer than one sitting can be carried
on elsewhere: a run whose record is there is finished, and is not run again.

:func:`copy_records` copies the record of every finished run under one folder to the same
place under another, leaving the runs already finished there alone; :func:`carried` does
it both ways around the runs of a grid (``--records`` of ``protofl sweep`` and ``protofl
reproduce``). The copied
``config.yaml`` names no machine: its data root reads ``DATA`` and its output folder is
the run's folder relative to the records' root (neither enters the fingerprint). A record
is written summary last, so a copy cut short is not taken for a finished run.

A page's records are published as one file, ``<name>.jsonl.gz`` (:func:`pack`): gzip'd
JSON lines, one run a line, ``{"run": its folder relative to the root, "config": ...,
"summary": ..., "clients": ..., "metrics": [one row a round]}``, sorted by folder and
written byte for byte the same for the same runs.
``pandas.read_json(path, lines=True, precise_float=True)`` reads it as a table; :func:`unpack` gives back the run folders. Wherever a records folder
is taken (``--records``), such a file is taken too: its runs are unpacked into a
temporary folder, and the file is written again from it when runs were added.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import yaml

from .errors import InputError
from .run_folder import CLIENTS, CONFIG, finished, METRICS, SUMMARY

RECORD = (METRICS, CLIENTS, CONFIG, SUMMARY)  # the order they are written in: the summary last
DATA_ROOT = "DATA"  # what a record's config says for the data root
PACKED = ".jsonl.gz"  # the suffix of a packed records file


def finished_runs(root: Path) -> list[Path]:
    """Every finished run folder under ``root``, sorted."""
    return sorted(p.parent for p in Path(root).rglob(SUMMARY) if finished(p.parent) is not None)


def without_machine(config_text: str, run_dir: Path, root: Path) -> str:
    """A run's config.yaml with the machine's paths taken out: the data root as ``DATA``,
    the output folder as the run's parent relative to ``root``."""
    cfg = yaml.safe_load(config_text)
    if not isinstance(cfg, dict):
        raise InputError(f"{run_dir / CONFIG}: not a config (a YAML mapping)")
    if isinstance(cfg.get("data"), dict) and cfg["data"].get("root") is not None:
        cfg["data"]["root"] = DATA_ROOT
    if isinstance(cfg.get("output"), dict):
        cfg["output"]["dir"] = run_dir.parent.relative_to(root).as_posix()
    return yaml.safe_dump(cfg, sort_keys=False)


def results(run_dir: Path) -> list[dict]:
    """A run's metrics rows without its timings (keys ending in ``_s``: seconds, which two
    runs of the same config never share)."""
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.endswith("_s")} for row in rows]


def copy_records(src: Path, dest: Path, only: Optional[Iterable[Path]] = None) -> list[Path]:
    """Copy the record of every finished run under ``src`` (``only``: of these run folders,
    relative to ``src``) to the same place under ``dest`` where no finished run is yet;
    returns the run folders written under ``dest``.

    A finished run on both sides must be the same run: a different fingerprint, or other
    results (its metrics but the timings), is an error naming the folder (never
    overwritten): runs are deterministic, so the same config gives the same results."""
    src, dest = Path(src), Path(dest)
    runs = finished_runs(src) if only is None else [src / rel for rel in only if finished(src / rel) is not None]
    written = []
    for run in runs:
        rel = run.relative_to(src)
        to = dest / rel
        have = finished(to)
        if have is not None:
            ran = finished(run)
            assert ran is not None  # runs holds finished runs only
            if have.get("fingerprint") != ran.get("fingerprint") or results(to) != results(run):
                raise InputError(f"{to}: a finished run that differs from {run} (another config or other "
                                 "results); remove one of them")
            continue
        missing = [name for name in RECORD if not (run / name).is_file()]
        if missing:
            raise InputError(f"{run}: a finished run without {', '.join(missing)}; it cannot be recorded")
        to.mkdir(parents=True, exist_ok=True)
        (to / SUMMARY).unlink(missing_ok=True)  # a cut run's summary: replaced last
        for name in RECORD:
            if name == CONFIG:
                (to / CONFIG).write_text(without_machine((run / CONFIG).read_text(), to, dest))
            else:
                shutil.copyfile(run / name, to / name)
        written.append(to)
    return written


def is_packed(records: Path) -> bool:
    """A records file (:func:`pack`) rather than a folder."""
    return Path(records).name.endswith(PACKED)


def pack(root: Path, dest: Path) -> int:
    """Write the record of every finished run under ``root`` into the one file ``dest``
    (``*.jsonl.gz``); returns how many runs it holds. The same runs give the same bytes
    (sorted, no time stamp in the gzip header); the file is replaced whole, never cut."""
    dest = Path(dest)
    if not is_packed(dest):
        raise InputError(f"{dest}: a records file is named *{PACKED}")
    lines = []
    for run in finished_runs(root):
        missing = [name for name in RECORD if not (run / name).is_file()]
        if missing:
            raise InputError(f"{run}: a finished run without {', '.join(missing)}; it cannot be recorded")
        entry = {"run": run.relative_to(root).as_posix(),
                 "config": yaml.safe_load(without_machine((run / CONFIG).read_text(), run, root)),
                 "summary": json.loads((run / SUMMARY).read_text()),
                 "clients": json.loads((run / CLIENTS).read_text()),
                 "metrics": [json.loads(line) for line in (run / METRICS).read_text().splitlines() if line.strip()]}
        lines.append(json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            gz.write("".join(lines).encode("utf-8"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # a file's usual mode (mkstemp makes it private)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(lines)


def read_packed(path: Path) -> list[dict]:
    """The runs of a records file, one mapping each (see :func:`pack`)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            runs = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, ValueError) as e:
        raise InputError(f"{path}: not a records file ({e})") from None
    for r in runs:
        if not isinstance(r, dict) or not {"run", "config", "summary", "clients", "metrics"} <= set(r):
            raise InputError(f"{path}: a line that is not a run's record")
    return runs


def unpack(path: Path, dest: Path) -> list[Path]:
    """The run folders of a records file, written under ``dest`` (summary last); returns them."""
    out = []
    for r in read_packed(path):
        rel = Path(r["run"])
        if rel.is_absolute() or ".." in rel.parts:
            raise InputError(f"{path}: a run outside the records ({r['run']})")
        run = Path(dest) / rel
        run.mkdir(parents=True, exist_ok=True)
        (run / METRICS).write_text("".join(json.dumps(row) + "\n" for row in r["metrics"]))
        (run / CLIENTS).write_text(json.dumps(r["clients"], indent=2))
        (run / CONFIG).write_text(yaml.safe_dump(r["config"], sort_keys=False))
        (run / SUMMARY).write_text(json.dumps(r["summary"], indent=2))
        out.append(run)
    return out


@contextmanager
def carried(records: Optional[Path], out: Path, folders: Iterable[Path],
            log: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Around the runs of a grid (``folders``, relative to ``out``): the runs finished in
    ``records`` are brought into ``out`` first, where they count as finished; when the block
    ends, an interruption too, every run finished in ``out`` is written to ``records``.
    ``records`` None: nothing; a records file (``*.jsonl.gz``): the same through a
    temporary folder, the file written again when a run was added. ``log``: a line for
    each copy that moved any run."""
    if records is None:
        yield
        return
    folders = list(folders)
    if is_packed(records):
        with tempfile.TemporaryDirectory(prefix="protofl-records-") as tmp:
            had = unpack(records, Path(tmp)) if Path(records).exists() else []
            try:
                with carried(Path(tmp), out, folders, log=None):
                    brought = [f for f in folders if finished(Path(tmp) / f) is not None]
                    if brought and log is not None:
                        log(f"{len(brought)} finished run(s) from the records in {records}")
                    yield
            finally:
                written = [r for r in finished_runs(Path(tmp)) if r not in had]
                if written:
                    pack(Path(tmp), Path(records))
                    if log is not None:
                        log(f"{len(written)} run record(s) written to {records}")
        return
    brought = copy_records(records, out, folders)
    if brought and log is not None:
        log(f"{len(brought)} finished run(s) from the records in {records}")
    try:
        yield
    finally:
        written = copy_records(out, records, folders)
        if written and log is not None:
            log(f"{len(written)} run record(s) written to {records}")
