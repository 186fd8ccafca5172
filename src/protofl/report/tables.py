"""Result tables: one value per metric and method, mean ± std over seeds, the way the
papers report them, as markdown, LaTeX and CSV.

Which value of a run counts (papers disagree): ``select="final"`` (the last evaluation),
``"best"`` (the best evaluation of the run: optimistic, it picks on the test set),
``"last:k"`` (the mean of the last k evaluations: steadier under dropout). See
:func:`select_value`.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, cast, Iterable, Optional, Sequence

import numpy as np

from ..engine.privacy import NOT_PRIVATE, SEEDED_KEY
from ..errors import ConfigError
from ..metrics import headline_metrics, METRIC_INFO
from .plots import load_summary, read_metrics

# the table columns, their labels and directions: the metric registry (protofl/metrics.py
# METRIC_INFO, headline_metrics()), read at each call, so that a metric registered there
# shows up here
LOWER_IS_BETTER = ("_std",)  # suffixes of metrics where the smallest value is the best


def label(metric: str) -> str:
    """A metric's column label: its registered ``label`` (``pm_v`` -> "PM(V)"); ``<m>_std``
    -> "<label> std" (its spread over clients), ``all_<m>`` -> "<label> all" (every client's
    personalized model after the last round); an unregistered metric as it is named."""
    if metric in METRIC_INFO and METRIC_INFO[metric].headline:
        return METRIC_INFO[metric].label
    if metric.endswith("_std") and metric[:-4] in METRIC_INFO:
        return label(metric[:-4]) + " std"
    if metric.startswith("all_") and metric[4:] in METRIC_INFO:
        return label(metric[4:]) + " all"
    return metric


def plain(metric: str) -> bool:
    """A metric shown as it is, never in bold, not in percent: a cost or a setting, not a
    score (registered with no direction: ``epsilon``)."""
    info = METRIC_INFO.get(metric)
    return info is not None and info.higher_is_better is None


def lower_is_better(metric: str) -> bool:
    """Its best value is its smallest: a spread over clients (``_std``), or a metric
    registered so (``train_loss``)."""
    info = METRIC_INFO.get(metric)
    return metric.endswith(LOWER_IS_BETTER) or (info is not None and info.higher_is_better is False)


# a row of a run under privacy.noise: seeded carries SEEDED_KEY: its epsilon is not a guarantee


def mean_std(values: Iterable[Optional[float]]) -> tuple[float, float]:
    """Mean and sample std (ddof = 1) over seeds, ignoring missing values; std 0 for one."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def number(mean: Optional[float], std: Optional[float] = None, missing: str = "–") -> str:
    """A plain number (epsilon): "3.10" or "3.10 ± 0.02"."""
    if mean is None or math.isnan(mean):
        return missing
    return f"{mean:.2f}" if std is None or math.isnan(std) else f"{mean:.2f} ± {std:.2f}"


def pct(mean: Optional[float], std: Optional[float] = None, missing: str = "–") -> str:
    """Accuracy in [0, 1] -> "97.13" or "97.13 ± 0.30" (percent)."""
    if mean is None or math.isnan(mean):
        return missing
    if std is None or math.isnan(std):
        return f"{100 * mean:.2f}"
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------
# which value of a run counts
# ---------------------------------------------------------------------------------------
def parse_select(select: str) -> tuple[str, int]:
    """``"final"`` -> ("final", 1); ``"best"`` -> ("best", 0); ``"last:5"`` -> ("last", 5)."""
    if select in ("final", "best"):
        return select, 1 if select == "final" else 0
    if select.startswith("last:") and select[5:].isdigit() and int(select[5:]) >= 1:
        return "last", int(select[5:])
    raise ConfigError("--select", select, "expected final, best or last:K (K >= 1)")


def select_value(rows: Sequence[dict], metric: str, select: str = "final") -> Optional[float]:
    """One number for ``metric`` from a run's metrics rows (the rounds that logged it).

    final: the last logged value; best: the largest (the smallest for ``*_std``);
    last:k: the mean of the last k logged values (fewer if the run logged fewer).
    None when the run never logged the metric.
    """
    how, k = parse_select(select)
    v = [float(r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
    v = [x for x in v if not math.isnan(x)]
    if not v:
        return None
    if how == "final":
        return v[-1]
    if how == "best":
        return min(v) if lower_is_better(metric) else max(v)
    return float(np.mean(v[-k:]))


def select_rows(rows: Sequence[dict], how: str = "final") -> dict[str, float]:
    """Every numeric metric of a run's rows reduced by :func:`select_value` (``final``,
    ``best`` or ``last:k``); ``round`` is left out. Metrics reported once (e.g. the
    ``all_*`` keys of the final round) give that value in every mode."""
    keys = dict.fromkeys(k for r in rows for k, v in r.items()
                         if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool))
    out = {k: select_value(rows, k, how) for k in keys}
    return {k: v for k, v in out.items() if v is not None}


def load_rows(run_dir: Path) -> list[dict]:
    """A run's per-round rows (``metrics.jsonl``, read as the engine reads it on resume)."""
    return read_metrics(run_dir)


def seconds_per_round(rows: Sequence[dict], key: str = "wall_s") -> Optional[float]:
    """Mean wall time of a round (training + evaluation), leaving out the first round of
    the run, which also pays the start-up (worker processes, first model builds). With
    ``key="cpu_s"``: the mean CPU time of a round instead, None unless every row has it
    (runs made before protofl recorded it have none)."""
    w = [r[key] for r in rows if key in r]
    if key != "wall_s" and len(w) < len(rows):
        return None
    if len(w) > 1:
        w = w[1:]
    return float(np.mean(w)) if w else None


def compare_rows(groups: dict[str, list[Path]], metrics: Optional[Iterable[str]] = None,
                 select: str = "final") -> list[dict]:
    """One row per label: each metric's selected value (:func:`select_value`), mean and
    sample std over its runs (seeds). ``row[m] = (mean, std)``; std is NaN with one value.
    ``row["count"][m]`` = how many runs had the metric. ``row["global_model"]`` = False
    when no run of the label has a global model (GA is then not a copy of GM)."""
    parse_select(select)
    metrics = headline_metrics() if metrics is None else tuple(metrics)
    out = []
    for name, dirs in groups.items():
        rows_per_run = [read_metrics(d) for d in dirs]
        sums = [s for s in map(load_summary, dirs) if s is not None]
        secs = [s for s in (seconds_per_round(r) for r in rows_per_run) if s is not None]
        cpu = [seconds_per_round(r, "cpu_s") for r in rows_per_run]
        row: dict[str, Any]
        row = {"method": name, "runs": len(dirs), "select": select,
               "rounds": max((s.get("rounds_completed", 0) for s in sums), default=0),
               "s_per_round": float(np.mean(secs)) if secs else float("nan"),
               # CPU seconds only where every run has them: a mean over some runs would mix
               "cpu_per_round": float(np.mean(cast(list[float], cpu))) if cpu and None not in cpu else float("nan"),
               "global_model": any("gm" in r for rows in rows_per_run for r in rows),
               # privacy.noise: seeded: an epsilon that no noise stands behind (its rows say so)
               "seeded": any(r.get(SEEDED_KEY) for rows in rows_per_run for r in rows),
               "count": {}}
        for m in metrics:
            vals = [v for v in (select_value(rows, m, select) for rows in rows_per_run) if v is not None]
            mean, std = mean_std(vals)
            row[m] = (mean, std if len(vals) > 1 else float("nan"))
            row["count"][m] = len(vals)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------
def _present(rows: list[dict], metrics: Sequence[str]) -> list[str]:
    present = [m for m in metrics if any(not math.isnan(r[m][0]) for r in rows)]
    # GA = GM for every method with a global model: a column only where it says something
    if "ga" in present and all(r.get("global_model", True) for r in rows):
        present.remove("ga")
    return present


def best_rows(rows: list[dict], metric: str) -> set[int]:
    """Indices of the rows with the best mean of ``metric`` (ties share it); none for one row."""
    if len(rows) < 2 or plain(metric):
        return set()
    vals = [r[metric][0] if metric != "ga" or not r.get("global_model", True) else float("nan") for r in rows]
    ok = [v for v in vals if not math.isnan(v)]
    if len(ok) < 2:
        return set()
    best = min(ok) if lower_is_better(metric) else max(ok)
    return {i for i, v in enumerate(vals) if not math.isnan(v) and round(v, 6) == round(best, 6)}


def _cells(rows: list[dict], metrics: Sequence[str], bold) -> list[list[str]]:
    present = _present(rows, metrics)
    best = {m: best_rows(rows, m) for m in present}
    out = []
    for i, r in enumerate(rows):
        cells = [r["method"]]
        for m in present:
            if m == "ga" and r.get("global_model", True):
                cells.append("= GM")
                continue
            text = number(*r[m]) if plain(m) else pct(*r[m])
            if m == "epsilon" and r.get("seeded") and text != "–":
                text += f" ({NOT_PRIVATE})"
            cells.append(bold(text) if i in best[m] else text)
        secs = r["s_per_round"]
        cells += [str(r["runs"]), str(r["rounds"]), "–" if math.isnan(secs) else f"{secs:.2f}"]
        out.append(cells)
    return out


def _header(rows: list[dict], metrics: Sequence[str], pct_sign: str = "%") -> list[str]:
    return ["method", *(label(m) + ("" if plain(m) else f" ({pct_sign})") for m in _present(rows, metrics)),
            "seeds", "rounds", "s/round"]


def caption(rows: list[dict]) -> str:
    """One sentence saying what the numbers are."""
    select = rows[0].get("select", "final") if rows else "final"
    how, k = parse_select(select)
    what = {"final": "the last evaluation", "best": "the best evaluation of each run (chosen on the test set)",
            "last": f"the mean of the last {k} evaluations"}[how]
    seeds = sorted({r["runs"] for r in rows})
    spread = "mean ± sample std over seeds" if max(seeds, default=1) > 1 else "one seed, no spread"
    eps = (" ε: the privacy spent by the end of the run, at the run's privacy.delta."
           if any(not math.isnan(r.get("epsilon", (math.nan,))[0]) for r in rows) else "")
    if any(r.get("seeded") for r in rows):
        eps += (f" ({NOT_PRIVATE}): that run's noise can be replayed from its seed (privacy.noise: seeded), so its "
                "ε is no guarantee.")
    return (f"Accuracies in %: {what} of each run, {spread}; best per column in bold. "
            "s/round: mean seconds per round (training + evaluation) without the first round's start-up." + eps)


def to_markdown(rows: list[dict], metrics: Optional[Sequence[str]] = None, with_caption: bool = False) -> str:
    metrics = headline_metrics() if metrics is None else metrics
    table = markdown(_header(rows, metrics), _cells(rows, metrics, lambda t: f"**{t}**"))
    return table + ("\n" + caption(rows) + "\n" if with_caption else "")


def _tex(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("±", r"$\pm$"), ("–", "--"), ("ε", r"$\varepsilon$")):
        s = s.replace(a, b)
    return s


def to_latex(rows: list[dict], metrics: Optional[Sequence[str]] = None) -> str:
    """A booktabs ``tabular`` (``\\usepackage{booktabs}``) with the caption as a comment."""
    metrics = headline_metrics() if metrics is None else metrics
    head = [_tex(h) for h in _header(rows, metrics)]
    body = _cells(rows, metrics, lambda t: "\\textbf{" + t + "}")
    lines = [f"% {caption(rows)}", "\\begin{tabular}{l" + "r" * (len(head) - 1) + "}", "\\toprule",
             " & ".join(head) + " \\\\", "\\midrule"]
    for cells in body:
        tex = [_tex(c) if not c.startswith("\\textbf{") else "\\textbf{" + _tex(c[8:-1]) + "}" for c in cells]
        lines.append(" & ".join(tex) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict], metrics: Optional[Sequence[str]] = None) -> str:
    """Every metric's mean and std (fractions, not percent; std empty for one seed)."""
    metrics = headline_metrics() if metrics is None else metrics
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["method", *(x for m in metrics for x in (m + "_mean", m + "_std")), "seeds", "rounds",
                "s_per_round", "select"])

    def num(x: float, fmt: str = ".6f") -> str:
        return "" if x is None or math.isnan(x) else format(x, fmt)

    for r in rows:
        w.writerow([r["method"], *(num(x) for m in metrics for x in r[m]), r["runs"], r["rounds"],
                    num(r["s_per_round"], ".4f"), r.get("select", "final")])
    return buf.getvalue()


# ---------------------------------------------------------------------------------------
# stability of the global model (the demo's finding; a section of every report)
# ---------------------------------------------------------------------------------------
STABILITY_WINDOW = 10  # rounds at the end over which stability is measured


def stability(run_dir: Path, window: int = STABILITY_WINDOW) -> Optional[dict]:
    """GM over a run's last ``window`` rounds: the mean |change| from one round to the next
    (``step``, in points; its window + 1 last values give ``window`` changes), and the
    ``worst``, ``best`` and ``mean`` round (in %). None unless GM was logged on each of
    the last ``window + 1`` rounds (with ``eval.every`` > 1 a change would span rounds)."""
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("gm"), (int, float))]
    tail = rows[-window - 1:]
    if len(tail) < window + 1 or tail[-1]["round"] - tail[0]["round"] != window:
        return None
    gm = np.array([r["gm"] for r in rows]) * 100
    last = gm[-window:]
    return {"step": float(np.abs(np.diff(gm[-window - 1:])).mean()), "worst": float(last.min()),
            "best": float(last.max()), "mean": float(last.mean())}


def stability_rows(groups: dict[str, list[Path]], window: int = STABILITY_WINDOW) -> list[dict]:
    """Per label: ``label``, ``per_seed`` (one :func:`stability` dict per run, in the
    group's order) and ``mean`` (their mean per key); labels whose runs lack the window
    are left out."""
    out = []
    for name, dirs in groups.items():
        st = [stability(d, window) for d in dirs]
        if st and all(s is not None for s in st):
            per_seed = cast(list[dict], st)  # every run has the window
            out.append({"label": name, "per_seed": per_seed,
                        "mean": {k: float(np.mean([s[k] for s in per_seed])) for k in per_seed[0]}})
    return out
