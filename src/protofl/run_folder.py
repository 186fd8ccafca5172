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

import yaml

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


def read_config(run_dir: Path) -> Optional[dict]:
    """A run folder's config as written (a mapping; a record's has no machine paths), or
    None where it has none that reads as one."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return cfg if isinstance(cfg, dict) else None


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


# ---------------------------------------------------------------------------------------
# run health: a run that ended but whose model is no result
# ---------------------------------------------------------------------------------------
COLLAPSED = "collapsed"
COLLAPSE_MARGIN = 2.0  # points above chance


def chance_margin_text() -> str:
    """The collapse rule in words, for the pages that apply it."""
    return (f"collapsed when its last accuracy on the global test set (GM; GA for a method without a global "
            f"model) lies within {COLLAPSE_MARGIN:g} points of chance (100/C % for C classes): its model "
            f"predicts (nearly) one class")


def collapsed(run_dir: Path, rows: Optional[list[dict]] = None) -> Optional[str]:
    """Why a finished run collapsed, or None: its last accuracy on the (balanced) global
    test set, the global model's (``gm``; ``ga``, the personalized models' mean, for a
    method without one), is within ``COLLAPSE_MARGIN`` points of chance (100/C % for the C
    classes of ``clients.json``). Such a run ended without error but its model predicts
    (nearly) one class, so it is no result to average: the pages flag it beside the
    diverged runs. The reason names the value, and the round its training loss jumped where
    it did (to 100x round 1's or more). A method without a global model whose clients each
    hold one class has a GA at chance by construction: this rule would flag it (no page
    has such a setting)."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir / METRICS) if rows is None else rows
    try:
        clients = json.loads((run_dir / CLIENTS).read_text())
        classes = int(clients.get("num_classes") or len(clients["train_counts"][0]))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if classes < 2:
        return None
    key = "gm" if any(isinstance(r.get("gm"), (int, float)) for r in rows) else "ga"
    evals = [r for r in rows if isinstance(r.get(key), (int, float))]
    if not evals:
        return None
    last = 100.0 * float(evals[-1][key])
    chance = 100.0 / classes
    if not abs(last - chance) <= COLLAPSE_MARGIN:  # NaN: not this rule's to judge
        return None
    what = "GM" if key == "gm" else "GA"
    why = (f"{COLLAPSED}: its last {what} ({last:.2f} % in round {evals[-1].get('round')}) is within "
           f"{COLLAPSE_MARGIN:g} points of chance ({chance:.2f} % for {classes} classes)")
    losses = [(r.get("round"), r["train_loss"]) for r in rows if isinstance(r.get("train_loss"), (int, float))]
    if len(losses) > 1 and losses[0][1] > 0:
        rnd, peak = max(losses[1:], key=lambda x: x[1])
        if peak >= 100 * losses[0][1]:
            why += f"; its training loss jumped to {peak:.3g} in round {rnd} ({losses[0][1]:.3g} in round 1)"
    return why


def health(run_dir: Path) -> Optional[str]:
    """None for a run that is a result; else why it is not: it diverged (its summary's
    error), or it :func:`collapsed`. Only for finished runs (:func:`finished`)."""
    s = finished(run_dir)
    if s is None:
        return None
    if s.get("status") == DIVERGED:
        return f"diverged: {s.get('error') or 'a non-finite training loss'}"
    return collapsed(run_dir) if s.get("status") == COMPLETE else None
