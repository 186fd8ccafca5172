"""Plots (matplotlib, Agg backend): learning curves, partition figures, 2-D features,
prototype geometry.

Every figure is built by a ``*_figure`` function that returns the matplotlib figure (the
tests read its axes, lines and legends) and saved by the function of the same name
without the suffix. Inputs are run folders only; a folder or metric that does not exist
raises :class:`ReportError` naming what is missing and what exists (the CLI prints that
one line and exits 2).
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import yaml

from ..config.coerce import load_yaml
from ..metrics import METRIC_INFO
from ..run_folder import CLIENTS, CONFIG, METRICS, read_rows, SUMMARY
from ..errors import InputError, one_line


class ReportError(InputError, ValueError):
    """Bad input to a plot or report: a missing folder, an unknown metric."""


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, dpi: int = 120) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    _plt().close(fig)
    return out


# ---------------------------------------------------------------------------------------
# metrics: units
# ---------------------------------------------------------------------------------------
def _accuracy(name: str) -> bool:
    info = METRIC_INFO.get(name)
    return info is not None and info.unit == "accuracy"


def metric_unit(metric: str) -> tuple[float, str]:
    """(scale, unit) for drawing ``metric``, from the metric registry (protofl/metrics.py):
    accuracies (``gm``, ``pa``, ``gm@logits``, ...) -> (100, "%"); their client spread
    ``<m>_std`` -> (100, "% points"); a registered unit (clients, samples, s, MB, degrees)
    as registered. Unregistered keys by their form: ``bytes_*`` -> (1e-6, "MB"), seconds
    ``*_s`` -> (1, "s"), angles ``*_angle`` -> (1, "degrees"); anything else (losses,
    learning rate, distances, diversity) is drawn as is, without a unit.
    """
    base = metric.split("@")[0]
    base = base[4:] if base.startswith("all_") else base  # the same metric over every client at the end
    if _accuracy(base):
        return 100.0, "%"
    if base.endswith("_std") and _accuracy(base[:-4]):
        return 100.0, "% points"
    info = METRIC_INFO.get(base)
    if info is not None:
        return info.scale, info.unit
    if base.startswith("bytes_"):
        return 1e-6, "MB"
    if base.endswith("_s"):
        return 1.0, "s"
    if base.endswith("_angle"):
        return 1.0, "degrees"
    return 1.0, ""


def metric_words(metric: str) -> str:
    """A logged key in words: ``train_loss`` -> "training loss", ``pa_std`` -> "personal
    accuracy, PA: spread over clients", ``all_pa`` -> "... (all clients, at the end)",
    ``gm@logits`` -> "... (logits)"; an unknown key with spaces for its underscores."""
    base, _, variant = metric.partition("@")
    suffix = f" ({variant})" if variant else ""
    if base in METRIC_INFO:
        return METRIC_INFO[base].words + suffix
    end = base.startswith("all_")
    core = base[4:] if end else base
    spread = core.endswith("_std")
    core = core[:-4] if spread else core
    words = METRIC_INFO[core].words if core in METRIC_INFO else core.replace("_", " ")
    return words + (": spread over clients" if spread else "") + (" (all clients, at the end)" if end else "") + suffix


def axis_label(metric: str) -> str:
    """``metric``'s axis label: its words and unit, e.g. "training loss", "global model accuracy, GM (%)"."""
    unit = metric_unit(metric)[1]
    words = metric_words(metric)
    return f"{words} ({unit})" if unit else words


# ---------------------------------------------------------------------------------------
# run folders
# ---------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    return read_rows(Path(run_dir) / METRICS)


def is_run_dir(d: Path) -> bool:
    return (Path(d) / METRICS).is_file()


def _names(paths: Sequence[Path], limit: int = 12) -> str:
    names = sorted(p.name for p in paths)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"


def expand_runs(paths: Sequence[Path | str]) -> list[Path]:
    """Run folders from a list of run folders and/or folders of runs (e.g. a compare folder).

    Raises :class:`ReportError` for a path that does not exist or holds no run, naming the
    run folders that do exist there.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            parent = p.parent if str(p.parent) else Path(".")
            runs = [d for d in parent.iterdir() if d.is_dir() and is_run_dir(d)] if parent.is_dir() else []
            raise ReportError(f"{p}: no such folder; run folders in {parent}: {_names(runs)}")
        if is_run_dir(p):
            out.append(p)
            continue
        inner = sorted(d for d in p.iterdir() if d.is_dir() and is_run_dir(d)) if p.is_dir() else []
        if not inner:
            raise ReportError(f"{p}: not a run folder (no metrics.jsonl) and holds no run folders")
        out += inner
    return out


def read_file(path: Path, kind: str = "json"):
    """A run or grid folder's JSON or YAML file; a damaged one (cut short, overwritten by
    something else) is a :class:`ReportError` naming it, not a traceback."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if kind == "json" else load_yaml(text)
    except (UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise ReportError(f"{path}: not a readable {kind.upper()} file ({one_line(e, 160)}); "
                          "it was cut short or replaced: run it again, or move it away") from e
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a mapping, found {type(data).__name__}")
    return data


def load_summary(run_dir: Path) -> Optional[dict]:
    """A run folder's summary for the report: None when it has none yet (a run in progress);
    a damaged one is a :class:`ReportError` naming it (protofl.run_folder names the file)."""
    p = Path(run_dir) / SUMMARY
    return read_file(p) if p.exists() else None


def run_config(run_dir: Path) -> dict:
    p = Path(run_dir) / CONFIG
    return read_file(p, "yaml") if p.exists() else {}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


COMPARE_NAME = re.compile(r"^(?P<label>.+)-s(?P<seed>\d+)-[0-9a-f]{8}(-\d+)?$")
NOT_A_SETTING = ("seed", "rounds", "output.", "execution.", "data.root")


def group_runs(dirs: Sequence[Path]) -> dict[str, list[Path]]:
    """Group run folders by method over seeds: runs whose configs differ only in ``seed``
    (and where/how long they ran) form one group.

    A group is labelled by its method name (``config.yaml``'s ``algorithm.name``); when
    two groups share a name, each label gets the settings that tell them apart, e.g.
    ``fedprox(algorithm.mu=0.1)``. Runs made by ``protofl compare`` keep their compare
    label (the folder name ``<label>-s<seed>-<fingerprint>``).
    """
    keys: dict[str, dict] = {}
    groups: dict[str, list[Path]] = {}
    names: dict[str, str] = {}
    for d in dirs:
        flat = {k: v for k, v in _flat(run_config(d)).items() if not k.startswith(NOT_A_SETTING)}
        key = json.dumps(flat, sort_keys=True, default=str)
        keys.setdefault(key, flat)
        groups.setdefault(key, []).append(Path(d))
        cfg = run_config(d)
        m = COMPARE_NAME.match(str((cfg.get("output") or {}).get("name") or ""))
        if m and int(m.group("seed")) == int(cfg.get("seed", -1)):
            names.setdefault(key, m.group("label"))
        else:
            names.setdefault(key, str(flat.get("algorithm.name", Path(d).name)))
    out: dict[str, list[Path]] = {}
    for key, paths in groups.items():
        label = names[key]
        same = [k for k in keys if names[k] == label and k != key]
        if same:
            diff = sorted({a for k in same for a in set(keys[key]) | set(keys[k])
                           if keys[key].get(a) != keys[k].get(a)})
            label += "(" + ", ".join(f"{a}={keys[key].get(a)}" for a in diff) + ")"
        while label in out:
            label += "'"
        out[label] = sorted(paths)
    return out


def total_rounds(dirs: Sequence[Path]) -> int:
    """The longest run's number of rounds (from summary.json, else its last row)."""
    best = 1
    for d in dirs:
        s = load_summary(d)
        if s is not None:
            best = max(best, int(s.get("rounds") or 1))
        rows = read_metrics(d)
        if rows:
            best = max(best, int(rows[-1]["round"]))
    return best


def class_names(run_dir: Path, num_classes: int) -> list[str]:
    p = Path(run_dir) / CLIENTS
    names = read_file(p).get("class_names") if p.exists() else None
    return list(names) if names and len(names) == num_classes else [str(c) for c in range(num_classes)]


# ---------------------------------------------------------------------------------------
# learning curves
# ---------------------------------------------------------------------------------------
SPARSE = 3  # a series with at most this many points gets markers on its line
BANDS = {"std": "mean ± 1 std over seeds (shaded)", "minmax": "mean, min-max over seeds (shaded)"}


def _series(dirs: Sequence[Path], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Rounds where any run has ``metric`` and the values, shape (runs, rounds[, classes]),
    NaN where a run did not log it that round (e.g. nobody arrived under dropout)."""
    per_run = [{r["round"]: r[metric] for r in read_metrics(d) if r.get(metric) is not None} for d in dirs]
    per_run = [s for s in per_run if s]
    if not per_run:
        return np.array([]), np.array([])
    rounds = sorted(set().union(*per_run))
    shape = np.shape(next(iter(per_run[0].values())))
    if len(shape) > 1 or any(isinstance(v, dict) for v in per_run[0].values()):
        raise ReportError(f"metric {metric!r} is not a number or a per-class list per round "
                          "(protofl report draws the matrices and client lists)")
    nan = np.full(shape, np.nan)
    return np.array(rounds), np.array([[s.get(r, nan) for r in rounds] for s in per_run], dtype=np.float64)


def _nanstats(ys: np.ndarray, band: str) -> tuple[np.ndarray, Optional[tuple[np.ndarray, np.ndarray]]]:
    """Mean over runs ignoring missing values, and the band where >= 2 runs have a value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rounds stay NaN (a gap)
        mean = np.nanmean(ys, axis=0)
        if len(ys) < 2:
            return mean, None
        n = (~np.isnan(ys)).sum(0)
        if band == "std":
            sd = np.nanstd(ys, axis=0, ddof=1)
            lo, hi = mean - sd, mean + sd
        else:
            lo, hi = np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)
        lo, hi = np.where(n >= 2, lo, np.nan), np.where(n >= 2, hi, np.nan)
    return mean, (lo, hi)


def curves_figure(runs: Mapping[str, Path | Sequence[Path]], metrics: Sequence[str] = ("gm",),
                  title: Optional[str] = None, band: str = "std", ncols: Optional[int] = None,
                  say_band: bool = True):
    """One panel per metric, one line per label: the mean over its runs (seeds) with a
    shaded band of the same colour (``band="std"``: ± 1 sample std; ``"minmax"``: the
    range) when it has more than one run; accuracy bands are clipped to [0, 100] %. A
    metric not logged on every round (``eval.every``, ``eval.personal_every``, rounds in
    which no update arrived) is drawn as markers only, never as a line through the rounds
    it skipped; a series of at most :data:`SPARSE` points gets markers on its line. Every
    panel spans the runs' full round range, and each axis says in words what it shows.
    List-valued metrics (``gm_per_class``) draw one labelled line per class. One legend
    for all methods, titled with the band's definition unless ``say_band`` is false (a
    report that says it once for all its figures). ``ncols``: panels per row (default:
    all in one row).
    """
    if band not in ("std", "minmax"):
        raise ReportError(f"band must be 'std' or 'minmax', got {band!r}")
    plt = _plt()
    by_label = {label: [Path(d)] if isinstance(d, (str, Path)) else [Path(x) for x in d] for label, d in runs.items()}
    all_dirs = [d for ds in by_label.values() for d in ds]
    for d in all_dirs:
        if not d.exists() or not is_run_dir(d):
            expand_runs([d])  # raises with what exists
    available = sorted({k for d in all_dirs for r in read_metrics(d) for k in r} - {"round"})
    for m in metrics:
        if m not in available:
            raise ReportError(f"metric {m!r} is not in these runs; available: {', '.join(available)}")
    R = total_rounds(all_dirs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {label: colors[i % len(colors)] for i, label in enumerate(by_label)}
    ncols = min(len(metrics), ncols or len(metrics))
    nrows = -(-len(metrics) // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.3 * nrows + 0.4), squeeze=False,
                             layout="constrained")
    axes = [list(grid.flat)[: len(metrics)]]
    for ax in list(grid.flat)[len(metrics):]:
        ax.remove()
    method_handles: dict[str, object] = {}
    banded = False
    styles = ["-", "--", ":", "-."]
    for ax, metric in zip(axes[0], metrics):
        scale, _ = metric_unit(metric)
        for i, (label, dirs) in enumerate(by_label.items()):
            x, ys = _series(dirs, metric)
            if not len(x):
                continue
            ys = ys * scale
            gaps = len(x) > 1 and bool(np.any(np.diff(x) > 1))  # rounds it was not logged on
            kw = (dict(marker="o", markersize=3.5, ls="none") if gaps
                  else dict(marker="o", markersize=3.5) if len(x) <= SPARSE else {})
            if ys.ndim == 3:  # per-class values: one line per class, linestyle per method
                names = class_names(dirs[0], ys.shape[2])
                cmap = plt.get_cmap("tab10" if ys.shape[2] <= 10 else "tab20")
                for c in range(ys.shape[2]):
                    name = f"class {names[c]}" if len(by_label) == 1 else f"{label}: class {names[c]}"
                    ax.plot(x, _nanstats(ys[:, :, c], band)[0], color=cmap(c % cmap.N), ls=styles[i % 4],
                            lw=1.2, label=name, **kw)
                ax.legend(fontsize=6, ncol=2 if ys.shape[2] > 5 else 1, loc="best")
                continue
            mean, spread = _nanstats(ys, band)
            (line,) = ax.plot(x, mean, color=color[label], label=label, **kw)
            method_handles.setdefault(label, line)
            if spread is not None and not np.all(np.isnan(spread[0])):
                lo, hi = _clip(metric, *spread, ys)
                if gaps:  # a bar per logged round, not a band across the rounds in between
                    ax.vlines(x, lo, hi, color=color[label], alpha=0.35, lw=3)
                else:
                    ax.fill_between(x, lo, hi, color=color[label], alpha=0.2, lw=0)
                banded = True
        pad = max(0.5, 0.02 * R)
        ax.set_xlim(1 - pad, R + pad)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel(axis_label(metric))
        ax.grid(alpha=0.3)
    if method_handles:
        n_runs = sorted({len(by_label[label]) for label in method_handles})
        seeds = "/".join(map(str, n_runs))
        legend_title = f"{BANDS[band]}, {seeds} run(s) per method" if banded and say_band else None
        fig.legend(list(method_handles.values()), list(method_handles), loc="outside lower center",
                   ncol=min(len(method_handles), 6), fontsize=8, title=legend_title, title_fontsize=8,
                   frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def _clip(metric: str, lo: np.ndarray, hi: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A band within what the metric can take: accuracies in [0, 100] %, and nothing below
    0 for a metric none of whose values is negative (a loss, a spread, bytes, seconds)."""
    if metric_unit(metric)[1] == "%":
        return np.clip(lo, 0, 100), np.clip(hi, 0, 100)
    if not np.any(ys < 0):  # NaN compares False
        return np.maximum(lo, 0), hi
    return lo, hi


def curves(runs: Mapping[str, Path | Sequence[Path]], out: Path, metrics: Sequence[str] = ("gm",),
           title: Optional[str] = None, band: str = "std", ncols: Optional[int] = None) -> Path:
    """:func:`curves_figure` saved to ``out`` (PNG, SVG, PDF by extension)."""
    return _save(curves_figure(runs, metrics, title, band, ncols), out)


# ---------------------------------------------------------------------------------------
# privacy: accuracy against epsilon
# ---------------------------------------------------------------------------------------
def accuracy_epsilon_figure(points: Mapping[str, Sequence[tuple[float, float, float]]], metric: str = "ga",
                            title: Optional[str] = None, references: Optional[dict[str, float]] = None):
    """Accuracy against the privacy spent: per label, points (epsilon, mean accuracy, std
    over seeds) joined in the order of epsilon, the std as error bars; epsilon on a log
    axis when it spans more than a factor 3 (an infinite epsilon, no noise, is left out).
    ``references``: accuracies without privacy, drawn as dashed horizontal lines."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 3.8), layout="constrained")
    spent = []
    for label, pts in points.items():
        pts = sorted((e, a, s) for e, a, s in pts if np.isfinite(e) and np.isfinite(a))
        if not pts:
            continue
        e, a, sd = (np.array(v, dtype=np.float64) for v in zip(*pts))
        spent += list(e)
        ax.errorbar(e, 100 * a, yerr=np.nan_to_num(100 * sd), marker="o", capsize=3, label=label)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, acc) in enumerate((references or {}).items()):
        ax.axhline(100 * acc, ls="--", lw=1, color=colors[(len(points) + i) % len(colors)], label=f"{label} (no DP)")
    if spent and max(spent) > 3 * min(spent):
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.set_xscale("log")
        ticks = sorted({float(f"{e:.2g}") for e in spent})  # the epsilons as plain numbers, not 2 x 10^0
        if len(ticks) <= 8:
            ax.set_xticks(ticks)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("epsilon (at the runs' delta)")
    ax.set_ylabel(axis_label(metric))
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return fig


# ---------------------------------------------------------------------------------------
# partitions
# ---------------------------------------------------------------------------------------
BARS_FROM = 40  # clients: from this many on, ``kind="auto"`` draws stacked bars


def partition_figure(counts: np.ndarray, title: str = "", class_names: Optional[Sequence[str]] = None,
                     kind: str = "auto", scale: str = "log"):
    """Training label counts per client.

    ``kind="heatmap"``: clients x classes, colour = samples (``scale="log"``: log colour
    scale, so one big cell does not wash out the rest; ``"client"``: each client's row
    normalized to its share of the client's samples; ``"linear"``). ``kind="bars"``: one
    stacked bar per client, one colour per class (readable at 100+ clients). ``"auto"``:
    bars from :data:`BARS_FROM` clients on. Ticks are integers; classes are named where
    the dataset names them.
    """
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    counts = np.asarray(counts)
    K, C = counts.shape
    names = list(class_names) if class_names is not None and len(class_names) == C else [str(c) for c in range(C)]
    if kind == "auto":
        kind = "bars" if K >= BARS_FROM else "heatmap"
    if kind not in ("heatmap", "bars"):
        raise ReportError(f"partition kind must be auto, heatmap or bars, got {kind!r}")
    if scale not in ("log", "client", "linear"):
        raise ReportError(f"partition scale must be log, client or linear, got {scale!r}")
    title = title or f"{K} clients x {C} classes"
    if kind == "bars":
        fig, ax = plt.subplots(figsize=(min(14, max(6, 0.09 * K + 3)), 4.0), layout="constrained")
        cmap = plt.get_cmap("tab10" if C <= 10 else "tab20")
        vals = counts / np.maximum(counts.sum(1, keepdims=True), 1) if scale == "client" else counts
        bottom = np.zeros(K)
        for c in range(C):
            ax.bar(np.arange(K), vals[:, c], bottom=bottom, width=0.85, color=cmap(c % cmap.N),
                   label=names[c] if C <= 20 else None, lw=0)
            bottom += vals[:, c]
        ax.set_xlabel("client")
        ax.set_ylabel("share of the client's samples" if scale == "client" else "samples")
        ax.set_xlim(-0.6, K - 0.4)
        if C <= 20:
            ax.legend(title="class", fontsize=7, title_fontsize=8, ncol=1 if C <= 10 else 2,
                      loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        size = (min(16, max(4.5, 0.4 * C + 2.5)), min(12, max(3, 0.22 * K + 1.5)))
        fig, ax = plt.subplots(figsize=size, layout="constrained")
        if scale == "client":
            vals = counts / np.maximum(counts.sum(1, keepdims=True), 1)
            norm, cl = Normalize(0, 1), "share of the client's samples"
        elif scale == "log":
            vals = np.ma.masked_less_equal(counts.astype(float), 0)
            norm, cl = LogNorm(vmin=1, vmax=max(2, counts.max())), "samples (log scale; blank = 0)"
        else:
            vals, norm, cl = counts, Normalize(0, max(1, counts.max())), "samples"
        cmap = plt.get_cmap("viridis").with_extremes(bad="white")
        im = ax.imshow(vals, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        if C <= 40:
            ax.set_xticks(range(C), names, rotation=45 if max(map(len, names)) > 2 else 0,
                          ha="right" if max(map(len, names)) > 2 else "center", fontsize=7)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, label=cl)
    if kind == "bars":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    return fig


def partition_heatmap(counts: np.ndarray, out: Path, title: str = "", class_names: Optional[Sequence[str]] = None,
                      kind: str = "auto", scale: str = "log") -> Path:
    """:func:`partition_figure` saved to ``out``."""
    return _save(partition_figure(counts, title, class_names, kind, scale), out)


def load_counts(run_dir: Path) -> np.ndarray:
    return np.asarray(read_file(Path(run_dir) / CLIENTS)["train_counts"])


# ---------------------------------------------------------------------------------------
# representations
# ---------------------------------------------------------------------------------------
def features_2d(panels: dict[str, tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]], out: Path,
                title: str = "") -> Path:
    """Scatter of 2-D features per class; optional class prototype directions as arrows.

    ``panels[label] = (features (N, 2), labels (N,), prototypes (C, 2) or None)``.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (label, (h, y, protos)) in zip(axes[0], panels.items()):
        for c in np.unique(y):
            m = y == c
            ax.scatter(h[m, 0], h[m, 1], s=2, alpha=0.4, color=cmap(int(c) % 10), label=f"class {c}")
        if protos is not None:
            scale = np.abs(h).max() if len(h) else 1.0
            for c, p in enumerate(protos):
                p = p / (np.linalg.norm(p) + 1e-12) * scale
                ax.annotate("", xy=(p[0], p[1]), xytext=(0, 0),
                            arrowprops=dict(arrowstyle="->", color=cmap(c % 10), lw=2))
        ax.set_title(label)
        ax.set_aspect("equal", adjustable="datalim")
    axes[0][-1].legend(fontsize=7, markerscale=4, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out)


def cosine_heatmap_figure(panels: dict[str, np.ndarray], class_names: Optional[Sequence[str]] = None):
    """Cosine similarity between class vectors (prototypes or classifier rows), one panel
    per method: ``panels[label] = (C, C)`` matrix."""
    plt = _plt()
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n + 0.8, 3.4), squeeze=False, layout="constrained")
    im = None
    for ax, (label, S) in zip(axes[0], panels.items()):
        S = np.asarray(S, dtype=float)
        C = S.shape[0]
        names = list(class_names) if class_names is not None and len(class_names) == C else [str(c) for c in range(C)]
        im = ax.imshow(S, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
        step = max(1, C // 10)
        ax.set_xticks(range(0, C, step), names[::step], fontsize=7)
        ax.set_yticks(range(0, C, step), names[::step], fontsize=7)
        ax.set_xlabel("class")
        ax.set_ylabel("class")
        ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label="cosine similarity")
    return fig
