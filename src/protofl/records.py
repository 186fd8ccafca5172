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
"""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import yaml

from .errors import InputError
from .run_folder import CLIENTS, CONFIG, finished, METRICS, SUMMARY

RECORD = (METRICS, CLIENTS, CONFIG, SUMMARY)  # the order they are written in: the summary last
DATA_ROOT = "DATA"  # what a record's config says for the data root


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
            if have.get("fingerprint") != finished(run).get("fingerprint") or results(to) != results(run):
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


@contextmanager
def carried(records: Optional[Path], out: Path, folders: Iterable[Path],
            log: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Around the runs of a grid (``folders``, relative to ``out``): the runs finished in
    ``records`` are brought into ``out`` first, where they count as finished; when the block
    ends, an interruption too, every run finished in ``out`` is written to ``records``.
    ``records`` None: nothing. ``log``: a line for each copy that moved any run."""
    if records is None:
        yield
        return
    folders = list(folders)
    brought = copy_records(records, out, folders)
    if brought and log is not None:
        log(f"{len(brought)} finished run(s) from the records in {records}")
    try:
        yield
    finally:
        written = copy_records(out, records, folders)
        if written and log is not None:
            log(f"{len(written)} run record(s) written to {records}")
