"""A run folder: the one place that names its files, reads them back and says when a run
is done (a bottom-layer module: the engine writes run folders through these names; the
records, the report and the API read them through these functions).

A run folder holds ``config.yaml`` (the validated config), ``metrics.jsonl`` (one row a
round), ``clients.json`` (the partition's class counts), ``summary.json`` (its status,
rounds and the fingerprint of its config; written last) and ``checkpoint.pt`` (the state
to resume from). :mod:`protofl.records` copies the four small files as a run's record.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

CONFIG, METRICS, CLIENTS, SUMMARY, CHECKPOINT = (
    "config.yaml", "metrics.jsonl", "clients.json", "summary.json", "checkpoint.pt")

# a summary's status: every round done; a NaN/inf loss stopped it (a result of its config:
# it diverges again in the same round); stopped before a round that would take it past its
# privacy budget (privacy.target_epsilon: again a result of its config)
COMPLETE, DIVERGED, STOPPED = "complete", "diverged", "stopped"
# the statuses of a run that ended as its config says, with no error: its model is saved,
# a tracker marks it finished, a sweep does not count it as failed
SUCCEEDED = (COMPLETE, STOPPED)


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a line cut short by a kill (or damaged) ends them
    (the rows before it count); no file: none."""
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text(errors="replace").splitlines():  # damaged bytes: an unreadable line
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def read_summary(run_dir: Path) -> Optional[dict]:
    """A run folder's summary, or None where it has none that can be read (a mapping)."""
    try:
        s = json.loads((Path(run_dir) / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return s if isinstance(s, dict) else None


def finished(run_dir: Path) -> Optional[dict]:
    """The summary of a finished run, else None: status complete with every round done;
    status diverged before its last round; or status stopped at its privacy target before
    its last round. Running a finished run again gives the same run; this is the one rule
    of ``run --resume``, ``compare``, ``sweep`` and ``reproduce`` (through
    :func:`protofl.api.ended`, which adds the run's length and config)."""
    s = read_summary(run_dir)
    if s is None or not isinstance(s.get("rounds"), int):
        return None
    done = s.get("rounds_completed")
    if s.get("status") in (DIVERGED, STOPPED):
        return s if isinstance(done, int) and done < s["rounds"] else None
    return s if s.get("status") == COMPLETE and done == s["rounds"] else None
