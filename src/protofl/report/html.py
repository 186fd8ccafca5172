"""``protofl report DIR``: one self-contained ``report.html`` per experiment.

DIR is a run folder or a compare folder (or any folder of run folders). The page holds
the resolved config, the partition, the results table (mean ± std over seeds), learning
curves grouped by method, per-class accuracy of the global model, the distribution of PA
over clients, bytes per round and, for methods with class prototypes or a fixed head,
the cosine similarity of the class vectors and their minimum angle over rounds. Figures
are embedded as base64 PNG and the styles inline: the file opens without a network.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..metrics import headline_metrics
from ..run_folder import CLIENTS
from . import plots, tables
from .plots import ReportError

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:2em auto;max-width:1180px;
color:#222;padding:0 1em;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:1.8em}.sub{color:#666;margin-top:0}table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}pre{background:#f7f7f7;padding:.8em;overflow:auto;font-size:.85em;
max-height:28em}img{max-width:100%;height:auto;display:block;margin:.4em 0}.note{color:#555;font-size:.9em}
details summary{cursor:pointer;color:#333}
table.fit{table-layout:fixed;width:100%}table.fit td,table.fit th{overflow-wrap:anywhere;text-align:left}
"""
# the one definition of the shaded band in every figure of a report (said once, in its
# learning-curves section) and of the demo's demo.png
BAND = "std"


def _img(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plots._plt().close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: Sequence[Sequence[object]], raw: bool = False, fit: bool = False) -> str:
    """An HTML table; ``fit``: as wide as the page and never wider (long cells wrap)."""
    esc = (lambda x: x) if raw else html.escape
    cls = " class='fit'" if fit else ""
    out = [f"<table{cls}><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>" for r in rows]
    return "\n".join(out) + "</table>"


# ---------------------------------------------------------------------------------------
# what the folder holds
# ---------------------------------------------------------------------------------------
def find_groups(folder: Path) -> tuple[str, dict[str, list[Path]]]:
    """("run" | "compare", {label: run folders}) for a run folder or a folder of runs."""
    folder = Path(folder)
    if plots.is_run_dir(folder):
        return "run", plots.group_runs([folder])
    meta = next((m for m in (folder / "compare.json", folder / "sweep.json") if m.exists()), None)
    if meta is not None:
        groups = {label: [folder / n for n in names]
                  for label, names in plots.read_file(meta)["groups"].items()}
        missing = [d for ds in groups.values() for d in ds if not plots.is_run_dir(d)]
        if missing:
            raise ReportError(f"{folder}: compare.json names runs that are not there: {plots._names(missing)}")
        return "compare", groups
    return "compare", plots.group_runs(plots.expand_runs([folder]))


def _last_row_with(dirs: list[Path], key: str) -> list[dict]:
    out = []
    for d in dirs:
        rows = [r for r in plots.read_metrics(d) if key in r]
        if rows:
            out.append(rows[-1])
    return out


# ---------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------
def per_class_figure(groups: dict[str, list[Path]], names: list[str]):
    """Grouped bars: the global model's final per-class accuracy, mean over seeds, per method."""
    plt = plots._plt()
    data = {}
    for label, dirs in groups.items():
        rows = _last_row_with(dirs, "gm_per_class")
        if rows:
            data[label] = np.mean([r["gm_per_class"] for r in rows], axis=0) * 100
    if not data:
        return None
    C = len(next(iter(data.values())))
    names = names if len(names) == C else [str(c) for c in range(C)]
    fig, ax = plt.subplots(figsize=(min(14, max(6, 0.55 * C * max(1, len(data)) ** 0.5 + 2)), 3.4), layout="constrained")
    width = 0.8 / len(data)
    for i, (label, acc) in enumerate(data.items()):
        ax.bar(np.arange(C) + (i - (len(data) - 1) / 2) * width, acc, width, label=label)
    ax.set_xticks(range(C), names, fontsize=8, rotation=45 if max(map(len, names)) > 2 else 0,
                  ha="right" if max(map(len, names)) > 2 else "center")
    ax.set_xlabel("class")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(data), 6), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return fig


def fairness_figure(groups: dict[str, list[Path]]):
    """PA of every evaluated client in the last full evaluation, pooled over seeds: a box
    per method with the clients as points."""
    plt = plots._plt()
    data = {}
    for label, dirs in groups.items():
        vals = [v for r in _last_row_with(dirs, "pa_clients") for _, v in r["pa_clients"]]
        if vals:
            data[label] = np.asarray(vals) * 100
    if not data:
        return None
    fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * len(data) + 2), 3.4), layout="constrained")
    ax.boxplot(list(data.values()), showfliers=False, widths=0.5)
    ax.set_xticks(range(1, len(data) + 1), list(data), fontsize=8)
    rng = np.random.default_rng(0)
    for i, v in enumerate(data.values(), start=1):
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(v)), v, s=8, alpha=0.5, color="C0")
    ax.set_ylabel("PA of a client (%)")
    ax.set_xlabel("method")
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------
def build_report(folder: Path, select: str = "final") -> str:
    kind, groups = find_groups(folder)
    if not groups:
        raise ReportError(f"{folder}: no runs to report")
    first = next(iter(groups.values()))[0]
    cfg = plots.run_config(first)
    all_dirs = [d for ds in groups.values() for d in ds]
    clients = plots.read_file(first / CLIENTS) if (first / CLIENTS).exists() else {}
    C = clients.get("num_classes") or len((clients.get("train_counts") or [[0]])[0])
    names = plots.class_names(first, C)
    available = {k for d in all_dirs for r in plots.read_metrics(d) for k in r}
    seeds = sorted({plots.run_config(d).get("seed") for d in all_dirs}, key=str)
    R = plots.total_rounds(all_dirs)
    part = cfg.get("partition", {})
    title = (f"{', '.join(groups)} on {cfg.get('data', {}).get('name', '?')}"
             if kind == "compare" else f"{next(iter(groups))} on {cfg.get('data', {}).get('name', '?')}")
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p class='sub'>{html.escape(Path(folder).resolve().name)}: {len(groups)} method(s), "
             f"seeds {', '.join(map(str, seeds))}, "
             f"{R} rounds; partition {html.escape(str(part.get('name')))} over {part.get('num_clients')} clients; "
             f"participation: {html.escape(participation_text(cfg))}. Made by <code>protofl report</code>.</p>"]

    # results
    rows = tables.compare_rows(groups, select=select)
    metrics = headline_metrics()
    header = tables._header(rows, metrics)
    cells = tables._cells(rows, metrics, lambda t: f"<b>{t}</b>")
    parts += ["<h2>Results</h2>", _table(header, [[html.escape(c) if not c.startswith("<b>") else c for c in r]
                                                  for r in cells], raw=True),
              f"<p class='note'>{html.escape(tables.caption(rows))} Definitions: docs/metrics.md.</p>"]

    # stability
    window = min(tables.STABILITY_WINDOW, R - 1)
    stab = tables.stability_rows(groups, window) if window >= 1 else []
    if stab:
        def stab_cells(st: dict, key: str, fmt: str) -> str:
            per = " / ".join(format(s[key], fmt) for s in st["per_seed"])
            return per if len(st["per_seed"]) == 1 else f"{per} ({st['mean'][key]:.1f})"

        parts += [f"<h2>Stability of the global model over the last {window} rounds</h2>",
                  _table(["method", "change per round (points)", "worst round (%)", "best round (%)",
                          "mean of the rounds (%)"],
                         [[st["label"], stab_cells(st, "step", ".1f"), stab_cells(st, "worst", ".0f"),
                           stab_cells(st, "best", ".0f"), stab_cells(st, "mean", ".1f")] for st in stab]),
                  "<p class='note'>GM of each run (seeds in the order of the Runs table; in brackets their "
                  "mean): the mean absolute change from one round to the next, the worst and the best round. "
                  "A method whose "
                  "global model follows whichever clients' updates arrived moves a lot from round to round; "
                  f"here {html.escape(participation_text(cfg))}.</p>"]

    # curves
    acc = [m for m in ("gm", "ga", "pa", "pm_l") if m in available]
    if "gm" in acc and "ga" in acc:
        acc.remove("ga")
    if acc:
        parts += ["<h2>Learning curves</h2>",
                  f"<p class='note'>In every figure of this report: the mean over seeds; where a method has "
                  f"more than one run, {BAND_WORDS[BAND]} (accuracies within 0-100 %). A metric not logged on "
                  "every round is drawn as markers on the rounds that have it (its spread as a bar), never as a "
                  "line through the rounds in between.</p>",
                  _img(plots.curves_figure(groups, acc[:3] + (["train_loss"] if "train_loss" in available else []),
                                           ncols=2, band=BAND, say_band=False), "learning curves")]

    # privacy
    if "epsilon" in available:
        parts += ["<h2>Privacy</h2>", privacy_section(groups, rows)]

    # per class
    fig = per_class_figure(groups, names)
    if fig is not None:
        parts += ["<h2>Per-class accuracy of the global model</h2>", _img(fig, "per-class accuracy"),
                  "<p class='note'>Last evaluation, mean over seeds, on the balanced global test set.</p>"]

    # fairness
    fig = fairness_figure(groups)
    if fig is not None:
        parts += ["<h2>Fairness: PA over clients</h2>", _img(fig, "PA distribution"),
                  "<p class='note'>PA (each client's personalized model on its own local test set) of every "
                  "client evaluated in the last full evaluation, all seeds pooled; boxes: quartiles and median.</p>"]

    # communication
    if "bytes_up" in available:
        parts += ["<h2>Communication</h2>", _img(plots.curves_figure(groups, ["bytes_down", "bytes_up"], band=BAND, say_band=False),
                                                 "bytes per round"),
                  "<p class='note'>Real message sizes per round, summed over the messages sent to the sampled "
                  "clients (down) and the replies that arrived (up).</p>"]

    # geometry
    geo = {label: dirs for label, dirs in groups.items() if _last_row_with(dirs, "proto_cos")}
    if geo:
        mats = {label: np.array([[np.nan if v is None else v for v in row]
                                 for row in _last_row_with(dirs, "proto_cos")[0]["proto_cos"]], dtype=float)
                for label, dirs in geo.items()}
        parts += ["<h2>Class prototypes / classifier vectors</h2>",
                  _img(plots.cosine_heatmap_figure(mats, names), "cosine similarity of class vectors"),
                  "<p class='note'>Cosine similarity between the class vectors the server holds at the end "
                  "(first seed): FedNH's prototypes, FedGELA's ETF, FedProto/ReBaFL's global prototypes, MP-FedCL's "
                  "mean pool direction per class. Blank: a class without a vector.</p>"]
        angle = {label: dirs for label, dirs in geo.items() if _last_row_with(dirs, "proto_min_angle")}
        if angle:
            parts += [_img(plots.curves_figure(angle, ["proto_min_angle"], band=BAND, say_band=False),
                           "minimum angle over rounds"),
                      "<p class='note'>Minimum angle between two classes' vectors, per evaluation round.</p>"]

    # partition
    if clients.get("train_counts"):
        counts = np.asarray(clients["train_counts"])
        parts += ["<h2>Partition</h2>",
                  _img(plots.partition_figure(counts, f"training labels per client (seed {cfg.get('seed')})", names),
                       "partition"),
                  f"<p class='note'>{counts.shape[0]} clients, {int(counts.sum())} training samples, "
                  f"{np.mean((counts > 0).sum(1)):.1f} classes per client on average. The partition depends on "
                  "the seed; this is the first run's.</p>"]

    # config
    differing = _differences(groups)
    parts += ["<h2>Configuration</h2>",
              f"<p class='note'>The resolved config of {html.escape(first.name)} (config.yaml).</p>",
              f"<pre>{html.escape((first / 'config.yaml').read_text() if (first / 'config.yaml').exists() else '')}</pre>"]
    if differing:  # one row per setting, one column per method: as wide as the page, whatever the keys
        keys = sorted({k for d in differing.values() for k in d})
        parts += ["<p class='note'>Settings that differ between methods:</p>",
                  _table(["setting", *differing], [[k, *(str(d.get(k, "")) for d in differing.values())]
                                                   for k in keys], fit=True)]
    parts += ["<h2>Runs</h2>", _table(["method", "run folder", "seed", "status", "rounds"],
                                       [[label, d.name, plots.run_config(d).get("seed"), *_status(d)]
                                        for label, ds in groups.items() for d in ds])]
    parts.append("</body></html>")
    return "\n".join(parts)


def privacy_section(groups: dict[str, list[Path]], rows: list[dict]) -> str:
    """Runs with differential privacy: epsilon over the rounds, and each method's accuracy
    against the epsilon it spent (GA: GM for a method with a global model)."""
    eps = {label: dirs for label, dirs in groups.items() if _last_row_with(dirs, "epsilon")}
    points = {r["method"]: [(r["epsilon"][0], r["ga"][0], r["ga"][1])] for r in rows
              if r["method"] in eps and not np.isnan(r["ga"][0])}
    out = [_img(plots.curves_figure(eps, ["epsilon"], band=BAND, say_band=False), "epsilon over rounds")]
    if points:
        out.append(_img(plots.accuracy_epsilon_figure(points), "accuracy against epsilon"))
    out.append("<p class='note'>epsilon: the privacy spent after each round at the run's privacy.delta, by "
               "dp-accounting's accountant (privacy.accountant): under privacy.mode client for one client's "
               "participation, under sample for one training sample (the largest over the clients). "
               "Accuracy against epsilon: each method's GA and the epsilon it ended with, mean over seeds "
               "(bars: ± 1 std). What each mode protects: docs/privacy.md.</p>")
    seeded = [r["method"] for r in rows if r["method"] in eps and r.get("seeded")]
    if seeded:
        out.append(f"<p class='note'><b>Not private</b>: {', '.join(seeded)} ran with privacy.noise: seeded, "
                   "noise anyone can replay from the run's seed; their epsilon is what the noise would give if "
                   "it were secret, not a guarantee.</p>")
    return "\n".join(out)


BAND_WORDS = {"std": "the shaded band (the colour of its line) is ± 1 sample std over seeds",
              "minmax": "the shaded band (the colour of its line) is the min-max range over seeds"}


def participation_text(cfg: dict) -> str:
    """Who is asked and whose update arrives, in words, from a run's config.yaml."""
    p = {"fraction": 1.0, "clients_per_round": None, "p": 1.0, "group_p": None, "period": 1, "sampling": "fixed",
         **(cfg.get("participation") or {})}
    K = (cfg.get("partition") or {}).get("num_clients")
    if p["sampling"] == "poisson" and K:  # each client on its own coin: q = m / K (config/sections.py)
        from ..config import ceil_fraction

        m = p["clients_per_round"] or ceil_fraction(p["fraction"], K)  # as engine/participation.py
        asked = (f"each of the {K} clients is asked with probability q = {m / K:g} each round, independently "
                 f"(Poisson sampling: {m} expected, a round may ask nobody)")
    elif p["clients_per_round"]:
        asked = f"{p['clients_per_round']} clients are asked each round"
    elif p["fraction"] >= 1:
        asked = "every client is asked each round"
    else:
        asked = f"a fraction {p['fraction']:g} of the {K} clients is asked each round"
    if p["group_p"]:
        arrive = f"an update arrives with its group's probability p = {', '.join(f'{q:g}' for q in p['group_p'])}"
    elif p["p"] < 1:
        arrive = f"an update arrives with probability p = {p['p']:g}"
    else:
        return f"{asked} and every update arrives"
    redraw = "redrawn every round (client dropout)" if p["period"] == 1 else \
        f"redrawn every {p['period']} rounds (persistent stragglers)"
    return f"{asked}; {arrive}, {redraw}"


def _status(d: Path) -> list:
    s = plots.load_summary(d)
    if s is None:
        return ["unfinished", "–"]
    return [s.get("status"), s.get("rounds_completed")]


def _differences(groups: dict[str, list[Path]]) -> dict[str, dict]:
    flats = {label: {k: v for k, v in plots._flat(plots.run_config(ds[0])).items()
                     if not k.startswith(plots.NOT_A_SETTING)} for label, ds in groups.items()}
    if len(flats) < 2:
        return {}
    keys = {k for f in flats.values() for k in f}
    diff = sorted(k for k in keys if len({json.dumps(f.get(k), default=str) for f in flats.values()}) > 1)
    return {label: {k: f.get(k, "–") for k in diff} for label, f in flats.items()}


def write_report(folder: Path, out: Optional[Path] = None, select: str = "final") -> Path:
    """Write ``report.html`` (default: inside ``folder``) and return its path."""
    folder = Path(folder)
    if not folder.exists():
        plots.expand_runs([folder])  # raises with what exists
    text = build_report(folder, select=select)
    out = Path(out) if out else folder / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out

