"""Side concerns as callbacks: progress (bar or log lines), metrics.jsonl. The engine only emits events."""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..logs import ensure_log_handler, LOGGER  # noqa: F401 (re-exported)
from ..metrics import METRIC_INFO, shown_metrics
from .store import usage_line


class Callback:
    """Hooks the engine calls: ``on_start`` once, ``on_round`` with each metrics row (in
    round order), ``on_end`` with the summary.

    ``immediate = True`` (the default, and what a callback that may stop the run needs)
    guarantees that ``on_round`` sees round t's row before round t+1 starts. A callback
    that only records rows (a writer, a logger, a tracker) sets it False: it then lets
    ``execution.overlap_eval`` evaluate round t's global model while round t+1 trains,
    and receives the row when that evaluation is done, up to one round later.
    """

    immediate: bool = True

    def on_start(self, info: dict[str, Any]) -> None: ...
    def on_round(self, row: dict[str, Any]) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


class JsonlWriter(Callback):
    """Appends one JSON line per round to ``metrics.jsonl`` (flushed every round)."""

    immediate = False  # records rows only

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_round(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")


# One short set of metrics for the bar and the log lines (those registered with a ``short``
# name in protofl/metrics.py, shown_metrics(): loss, gm, pa, and eps under privacy.*),
# accuracies in percent (the unit of every table and of the CLI's final line): the bar
# never outgrows a terminal, whatever a method logs.


def short_metrics(row: dict[str, Any], latest: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``{"loss": "0.512", "gm": "76.89%", "pa": "80.12%"}`` from a metrics row (and ``"eps": "3.10"``
    under differential privacy).

    ``gm`` falls back to ``ga`` for methods without a global model. Metrics absent from
    this row keep their value in ``latest`` (evaluation every k rounds).
    """
    out = dict(latest or {})
    for key, label in shown_metrics():
        v = row.get(key)
        if key == "gm" and v is None:
            v = row.get("ga")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isnan(v):
                out[label] = "nan"
            elif METRIC_INFO[key].unit == "accuracy":
                out[label] = f"{100 * v:.2f}%"
            elif key == "epsilon":  # the privacy spent so far, at privacy.delta (a seeded run's is no guarantee)
                out[label] = f"{v:.2f}" + (" (not private)" if row.get("privacy_seeded") else "")
            else:
                out[label] = f"{v:.3f}" if abs(v) < 1e4 else f"{v:.2e}"
    return out


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where tqdm.auto draws a widget)."""
    ip = sys.modules.get("IPython")
    try:
        shell = ip.get_ipython() if ip is not None else None
    except Exception:  # pragma: no cover
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _clock(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class ProgressBar(Callback):
    """A tqdm bar (``tqdm.auto``: a widget in notebooks) with round, ETA and :func:`short_metrics`."""

    immediate = False  # records rows only

    def __init__(self, enabled: bool = True, file: Any = None, desc_width: int = 28) -> None:
        self.enabled = enabled
        self.file = file
        self.desc_width = desc_width
        self.bar = None
        self.latest: dict[str, str] = {}

    def on_start(self, info: dict[str, Any]) -> None:
        if not self.enabled:
            return

        if importlib.util.find_spec("ipywidgets") is not None:
            from tqdm.auto import tqdm  # a widget in notebooks
        else:
            from tqdm.std import tqdm  # text; tqdm.auto would warn about the missing widgets

        name = info["name"]
        if info.get("where"):  # the run's first line: where its clients train
            print(f"{name}: {info['rounds']} rounds on {info['where']}", file=self.file or sys.stderr, flush=True)
        if len(name) > self.desc_width:
            name = name[: self.desc_width - 1] + "…"
        self.bar = tqdm(total=info["rounds"], initial=info["start_round"] - 1, desc=name, unit="round",
                        file=self.file or sys.stderr, dynamic_ncols=self.file is None,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                   "[{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]")

    def on_round(self, row: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.latest = short_metrics(row, self.latest)
        self.bar.set_postfix(self.latest, refresh=False)
        self.bar.update(1)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class RoundLogger(Callback):
    """One plain ``logging`` line every ``every`` rounds (and the last): for nohup, SLURM, CI.

    ``<run> round 3/20: loss=0.512 gm=76.89% pa=80.12% | 0.41 s/round, ETA 0:07``
    """

    immediate = False  # records rows only

    def __init__(self, every: int = 1, logger: Optional[logging.Logger] = None) -> None:
        self.every = max(1, every)
        self.log = logger or LOGGER
        self.latest: dict[str, str] = {}
        self.name, self.rounds, self.t0, self.first = "", 0, 0.0, 1

    def on_start(self, info: dict[str, Any]) -> None:
        if self.log is LOGGER:
            ensure_log_handler()
        self.name, self.rounds, self.first = info["name"], info["rounds"], info["start_round"]
        self.t0 = time.perf_counter()
        if info.get("where"):  # the run's first line: where its clients train
            self.log.info("%s: %d rounds on %s", self.name, self.rounds, info["where"])
        if self.first > 1:
            self.log.info("%s: resuming at round %d/%d", self.name, self.first, self.rounds)

    def on_round(self, row: dict[str, Any]) -> None:
        self.latest = short_metrics(row, self.latest)
        rnd = row["round"]
        if rnd % self.every and rnd != self.rounds:
            return
        per_round = (time.perf_counter() - self.t0) / (rnd - self.first + 1)
        metrics = " ".join(f"{k}={v}" for k, v in self.latest.items())
        self.log.info("%s round %d/%d: %s | %.2f s/round, ETA %s", self.name, rnd, self.rounds, metrics,
                      per_round, _clock(per_round * (self.rounds - rnd)))

    def on_end(self, summary: dict[str, Any]) -> None:
        line = usage_line(summary.get("client_state"))
        if line:
            self.log.info("%s %s", self.name, line)


def progress_callback(enabled: bool, log_every: int = 1) -> Optional[Callback]:
    """The per-round progress for this process: a bar on a terminal or in a notebook, else
    one log line every ``log_every`` rounds; ``None`` when progress is off."""
    if not enabled:
        return None
    if sys.stderr.isatty() or in_notebook():
        return ProgressBar()
    return RoundLogger(log_every)


class OverallProgress:
    """``[run k/n]`` and the ETA of a grid of runs (compare, sweep), from the runs timed so far."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.timed, self.seconds = total, 0, 0, 0.0
        self.t0 = time.perf_counter()

    def prefix(self, word: str = "run") -> str:
        return f"[{word} {self.done + 1}/{self.total}]"

    def finished(self, ran: bool, seconds: Optional[float] = None) -> None:
        """One run is done; ``ran=False`` for one skipped as already complete."""
        self.done += 1
        if ran:
            self.timed += 1
            self.seconds += seconds if seconds is not None else 0.0

    def eta(self, parallel: int = 1) -> str:
        left = self.total - self.done
        if not self.timed or not left:
            return ""
        return f", ETA {_clock(self.seconds / self.timed * left / max(1, parallel))}"
