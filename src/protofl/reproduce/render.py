"""A reproduction's outputs: ``table.md`` (a short page: the command, the date, the
machine, the table with each cell "ours mean ± std (paper)", the paper's ranking beside
ours with the rank correlation, and one verdict per claim), ``table.csv`` (one row per
setting, method and metric, with the per-seed values) and ``report.html`` (the same,
self-contained, with learning curves)."""
from __future__ import annotations

import csv
import datetime
import html
import io
import math
import os
import platform
from pathlib import Path
from typing import Optional

import torch

from ..report import plots
from ..report.html import _img, _table, CSS
from ..report.tables import markdown, parse_select
from . import stats
from .run import Cell, command_line, Results
from .spec import TableSpec

VERDICT_MARK = {stats.SHOWN: "**shown**", stats.NOT_SHOWN: "not shown", stats.NOT_COMPARABLE: "not comparable"}


def machine() -> str:
    """One line naming this machine (CPU model and count, GPU if used, torch, Python)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip() + ", "
                break
    except OSError:
        pass
    gpu = ""
    if torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name(0)}"
    return (f"{platform.system()} {platform.machine()}, {cpu}{os.cpu_count()} CPU cores{gpu}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def fmt(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def cell_text(c: Cell) -> str:
    v = c.present
    ours = "–" if not v else (fmt(c.mean) if len(v) == 1 else f"{fmt(c.mean)} ± {fmt(c.std)}")
    return f"{ours} ({fmt(c.paper)})"


def _columns(res: Results, settings: Optional[list] = None) -> list[tuple]:
    spec = res.plan.spec
    settings = res.plan.settings if settings is None else settings
    many = len(settings) > 1
    cols = []
    for sp in settings:
        for met in spec.metrics:
            cols.append((sp.setting, met, f"{sp.setting.label}: {met.label}" if many else met.label))
    return cols


MAX_COLUMNS = 8  # wider than this, one table per setting


def split_tables(res: Results) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows): one table with the settings as column groups (the papers'
    layout), or one table per setting when that would exceed MAX_COLUMNS columns."""
    spec = res.plan.spec
    if len(res.plan.settings) * len(spec.metrics) <= MAX_COLUMNS:
        return [("", *table_rows(res))]
    out = []
    for sp in res.plan.settings:
        header, rows = table_rows(res, [sp])
        labels = {m.label for m in spec.methods_of(sp.setting)}
        out.append((sp.setting.label, header, [r for r, m in zip(rows, spec.methods) if m.label in labels]))
    return out


def table_rows(res: Results, settings: Optional[list] = None) -> tuple[list[str], list[list[str]]]:
    spec = res.plan.spec
    cols = _columns(res, settings)
    header = ["method", *(c[2] for c in cols)]
    rows = []
    for m in spec.methods:
        row = [m.label + ("†" if m.role == "ablation" else "")]
        for s, met, _ in cols:
            c = res.cells[s.id].get(m.label)
            row.append("·" if c is None else cell_text(c[met.id]))
        rows.append(row)
    return header, rows


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    return markdown(header, rows)


def ranking_lines(res: Results) -> list[str]:
    spec = res.plan.spec
    if spec.rank is None:
        return []
    met = spec.metric(spec.rank)
    out = []
    for sp in res.plan.settings:
        rc = res.ranks.get(sp.setting.id)
        if rc is None:
            continue
        cells = res.cells[sp.setting.id]
        paper_vals = {lab: cells[lab][met.id].paper for lab in rc.paper_order}
        our_vals = {lab: cells[lab][met.id].mean for lab in rc.our_order}
        if not rc.paper_order:
            out.append(f"* {sp.setting.label}, {met.label}: the paper gives no values to rank.")
            continue
        out.append(f"* {sp.setting.label}, {met.label}: {rc.text()}.\n"
                   f"  * paper: {stats.format_order(rc.paper_order, paper_vals)}\n"
                   f"  * ours: {stats.format_order(rc.our_order, our_vals)}")
    return out


def verdict_rows(res: Results, role: str) -> list[list[str]]:
    spec = res.plan.spec
    rows = []
    for cr in res.claims:
        c = cr.claim
        if c.role != role:
            continue
        op = "<" if c.better == "lower" else ">"  # lower is better: the claim is "a below b"
        what = {"greater": f"{c.a} {op} {c.b}", "equal": f"{c.a} ≈ {c.b} (±{c.margin:g} pts)",
                "best": f"{c.a} {op} each of {', '.join(c.among)}"}[c.kind]
        rows.append([c.id, cr.setting.label, spec.metric(c.metric).label, what,
                     VERDICT_MARK[cr.verdict.verdict], cr.verdict.detail])
    return rows


def claim_texts(res: Results, role: str) -> list[str]:
    seen, out = set(), []
    for cr in res.claims:
        c = cr.claim
        if c.role == role and c.id not in seen:
            seen.add(c.id)
            out.append(f"* `{c.id}`: \"{c.text}\" ({c.source})")
    return out


def header_lines(res: Results, date: str, mach: str) -> list[str]:
    spec, p = res.plan.spec, res.plan
    paper = spec.paper
    sub = f" Substitute: {spec.substitute}." if spec.substitute else ""
    page = f", page {paper['page']}" if paper.get("page") else ""
    where = f" ({paper['where']})" if paper.get("where") else ""
    return [
        f"# {spec.title}",
        "",
        f"Paper: {paper['authors']}, \"{paper['title']}\", {paper['venue']}: {paper['table']}{page}{where}. "
        f"Paper's setting: {paper['setting']}",
        "",
        f"Ours: {spec.dataset}, scale `{p.scale}`, seeds {', '.join(map(str, p.seeds))}.{sub}",
        "",
        "```",
        command_line(p),
        "```",
        "",
        f"Made by `protofl reproduce` on {date}; machine: {mach}.",
    ]


def markdown_page(res: Results, date: Optional[str] = None, mach: Optional[str] = None) -> str:
    spec, p = res.plan.spec, res.plan
    date = date or datetime.date.today().isoformat()
    mach = mach or machine()
    lines = header_lines(res, date, mach)
    sc = spec.scales[p.scale]
    if sc.notes:
        lines += ["", f"**Scale `{p.scale}`.** {sc.notes.strip()}"]
    sel = "; ".join(f"{m.label}: {_select_text(m.select)}" for m in spec.metrics)
    lines += ["", "## Table"]
    for title, header, rows in split_tables(res):
        lines += ["", *([f"**{title}**", ""] if title else []), _md_table(header, rows).rstrip()]
    lines += ["",
              f"Each cell: ours, mean ± sample std over seeds (percent), and the paper's value in "
              f"parentheses ({_paper_col_text(res)}); – = no value, · = not run in that setting. "
              f"Which value of a run counts: {sel}."
              + (" † = our ablation, not a row of the paper's table." if any(m.role == "ablation"
                                                                              for m in spec.methods) else "")]
    for s in spec.settings:
        if s.note:
            lines += ["", f"{s.label}: {s.note.strip()}"]
    extra = extras_lines(res)
    if extra:
        lines += ["", *extra]
    rl = ranking_lines(res)
    if rl:
        lines += ["", "## Ranking, the paper's beside ours", "", *rl]
    for role, title in (("paper", "Claims of the paper"), ("ablation", "Our ablations (not claims of the paper)")):
        vr = verdict_rows(res, role)
        if not vr:
            continue
        lines += ["", f"## {title}", "", *claim_texts(res, role), "",
                  _md_table(["claim", "setting", "metric", "tested", "verdict", "what it rests on"], vr).rstrip()]
    if any(c.claim.role for c in res.claims):
        lines += ["", "Verdicts: paired over seeds (same seed = same partition, initial weights and sampled "
                  "clients). *shown*: the one-sided paired t-test gives p < 0.05 (for \"each of\": against every "
                  "listed method; for ≈: both one-sided tests of a TOST within the margin); *not shown*: it does not; "
                  "*not comparable*: fewer than two seeds with a value for both, or a method without the metric. "
                  "The Wilcoxon signed-rank p beside it cannot fall below 0.125 with three seeds "
                  "(docs/reproduce.md)."]
    if spec.notes:
        lines += ["", "## Notes", "", spec.notes.strip()]
    if res.missing:
        lines += ["", f"**Incomplete:** {len(res.missing)} run(s) not finished: {', '.join(res.missing[:12])}"
                  + (" ..." if len(res.missing) > 12 else "") + ". Their cells use the finished seeds only."]
    return "\n".join(lines) + "\n"


def extras_lines(res: Results) -> list[str]:
    out = []
    for sid, per in res.extras.items():
        label = next(sp.setting.label for sp in res.plan.settings if sp.setting.id == sid)
        for method, vals in per.items():
            if "cluster_purity" in vals:
                v = vals["cluster_purity"]
                out.append(f"Cluster purity of {method} against the scenario's groups after the last round "
                           f"({label}), per seed: {', '.join(f'{x:.2f}' for x in v)}.")
    return out


def _select_text(select: str) -> str:
    how, k = parse_select(select)
    return {"final": "the last evaluation", "best": "the best evaluation",
            "last": f"the mean of the last {k} evaluations"}[how]


def _paper_col_text(res: Results) -> str:
    cols = [f"{sp.setting.label}: {sp.setting.paper}" for sp in res.plan.settings if sp.setting.paper]
    return "paper column " + "; ".join(cols) if cols else "the paper gives no numbers for this table"


def write_csv(res: Results, path: Path) -> Path:
    spec = res.plan.spec
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["setting", "method", "role", "metric", "select", "seeds", "ours_mean", "ours_std", "paper_mean",
                "paper_std", "paper_column", "values"])
    for sp in res.plan.settings:
        for m in spec.methods_of(sp.setting):
            for met in spec.metrics:
                c = res.cells[sp.setting.id][m.label][met.id]
                n = len(c.present)
                w.writerow([sp.setting.id, m.label, m.role, met.id, met.select, n,
                            _num(c.mean if n else None), _num(c.std if n > 1 else None), _num(c.paper),
                            _num(c.paper_std), sp.setting.paper or "",
                            ";".join(f"{s}:{_num(v)}" for s, v in c.values.items())])
    path.write_text(buf.getvalue())
    return path


def _num(x: Optional[float]) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


# ---------------------------------------------------------------------------------------
# report.html
# ---------------------------------------------------------------------------------------
def build_html(res: Results, date: Optional[str] = None, mach: Optional[str] = None) -> str:
    spec, p = res.plan.spec, res.plan
    date = date or datetime.date.today().isoformat()
    mach = mach or machine()
    paper = spec.paper
    esc = html.escape
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(spec.title)}</title>"
             f"<style>{CSS}</style></head><body>", f"<h1>{esc(spec.title)}</h1>",
             f"<p class='sub'>{esc(paper['authors'])}, “{esc(paper['title'])}”, {esc(paper['venue'])}: "
             f"{esc(paper['table'])}. Paper's setting: {esc(paper['setting'])}</p>",
             f"<p>Ours: {esc(spec.dataset)}, scale <code>{p.scale}</code>, seeds "
             f"{', '.join(map(str, p.seeds))}." + (f" Substitute: {esc(spec.substitute)}." if spec.substitute else "")
             + "</p>", f"<pre>{esc(command_line(p))}</pre>",
             f"<p class='note'>Made by <code>protofl reproduce</code> on {date}; machine: {esc(mach)}.</p>"]
    notes = spec.scales[p.scale].notes
    if notes:
        parts.append(f"<p class='note'><b>Scale {p.scale}.</b> {esc(notes.strip())}</p>")
    parts.append("<h2>Table</h2>")
    for title, header, rows in split_tables(res):
        parts += ([f"<h3>{esc(title)}</h3>"] if title else []) + [_table(header, rows)]
    parts += [
              f"<p class='note'>Each cell: ours, mean ± sample std over seeds (%), and the paper's value in "
              f"parentheses ({esc(_paper_col_text(res))}).</p>"]
    for line in extras_lines(res):
        parts.append(f"<p class='note'>{esc(line)}</p>")
    rl = ranking_lines(res)
    if rl:
        parts += ["<h2>Ranking, the paper's beside ours</h2>",
                  "<pre>" + esc("\n".join(rl)) + "</pre>"]
    for role, title in (("paper", "Claims of the paper"), ("ablation", "Our ablations")):
        vr = verdict_rows(res, role)
        if vr:
            parts += [f"<h2>{title}</h2>", "<ul>" + "".join(f"<li>{esc(t[2:])}</li>" for t in claim_texts(res, role))
                      + "</ul>", _table(["claim", "setting", "metric", "tested", "verdict", "what it rests on"],
                                        [[*r[:4], r[4].strip("*"), r[5]] for r in vr])]
    keys = []
    for met in spec.metrics:
        k = met.key.split("[")[0]
        if k not in keys:
            keys.append(k)
    for sp in p.settings:
        groups = {}
        for r in sp.runs:
            if (r.dir / "summary.json").exists():
                groups.setdefault(r.label, []).append(r.dir)
        if not groups:
            continue
        available = {k for ds in groups.values() for d in ds for row in plots.read_metrics(d) for k in row}
        ms = [k for k in keys if k in available and k != "gm_per_class"][:4]
        if not ms:
            continue
        parts += [f"<h2>Learning curves: {esc(sp.setting.label)}</h2>",
                  _img(plots.curves_figure(groups, ms, ncols=min(3, len(ms))), f"curves {sp.setting.label}"),
                  f"<p class='note'>Mean over seeds, ± 1 sample std shaded. Every run of this setting: "
                  f"<a href='{esc(sp.setting.id)}/report.html'>{esc(sp.setting.id)}/report.html</a>.</p>"]
    if spec.notes:
        parts += ["<h2>Notes</h2>", f"<p>{esc(spec.notes.strip())}</p>"]
    if res.missing:
        parts.append(f"<p><b>Incomplete:</b> {len(res.missing)} run(s) not finished.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_all(res: Results, date: Optional[str] = None) -> list[Path]:
    out = res.plan.out
    out.mkdir(parents=True, exist_ok=True)
    mach = machine()
    md = out / "table.md"
    md.write_text(markdown_page(res, date, mach))
    written = [md, write_csv(res, out / "table.csv")]
    page = out / "report.html"
    page.write_text(build_html(res, date, mach), encoding="utf-8")
    written.append(page)
    return written


def list_text(specs: dict[str, TableSpec]) -> str:
    """``protofl reproduce list``: one block per table."""
    rows = []
    for name, s in specs.items():
        rows.append([name, f"{s.paper['short'] or s.paper['title']}, {s.paper['table']}", s.dataset,
                     s.substitute or "–", *(str(s.runs(sc)) for sc in ("smoke", "cpu", "paper"))])
    return markdown(["table", "paper", "ours", "substitute for the paper's data", "runs smoke", "runs cpu",
                     "runs paper"], rows)
