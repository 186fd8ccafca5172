"""A reproduction's outputs: ``table.md`` (a short page: the command, the date, the
machine, the seeds, the table with each cell "ours mean ± std (paper)", the paper's
ranking beside ours with the rank correlation, one verdict per claim, and apart from all
of them the exploratory runs), ``table.csv`` (one row per setting, method and metric, with
the per-seed values) and ``report.html`` (the same, self-contained, with learning curves).

The page ends with its verdicts in machine-readable form (an HTML comment, invisible when
rendered), from which ``protofl reproduce index`` writes the index of the published pages
(benchmarks/RESULTS.md) without anyone retyping a verdict."""
from __future__ import annotations

import csv
import datetime
import html
import io
import json
import math
import os
import platform
import re
import statistics
from pathlib import Path
from typing import cast, Optional

import torch

from ..errors import ConfigError
from ..report import plots
from ..report.html import _img, _table, CSS
from ..report.tables import markdown, parse_select
from . import stats
from ..run_folder import SUMMARY as RUN_SUMMARY
from .pages import page_data, read_summary, SUMMARY
from .run import Cell, claim_out, command_line, Plan, Results
from .spec import Claim, Split, TableSpec

# the scale of the published pages: a table's "changes" describe its published page, so a
# page made at another scale (a user's smoke check) does not carry them
PUBLISHED_SCALE = "cpu"
LABEL = {stats.SHOWN: "shown", stats.NOT_SHOWN: "not shown", stats.CONTRADICTED: "contradicted",
         stats.NOT_COMPARABLE: "not comparable"}
EQUAL_LABEL = {stats.SHOWN: "shown equal", stats.CONTRADICTED: "shown different"}


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


def seeds_text(seeds: list[int]) -> str:
    return ", ".join(map(str, seeds)) if seeds else "none"


def cell_text(c: Cell) -> str:
    """"ours mean ± std (paper)"; over fewer seeds than the setting's when some of its runs
    are no result (diverged, collapsed), with how many count: "(2 of 3 seeds)"."""
    v = c.present
    ours = "–" if not v else (fmt(c.mean) if len(v) == 1 else f"{fmt(c.mean)} ± {fmt(c.std)}")
    if c.excluded and (v or len(c.excluded) == len(c.values)):  # none at all on its results: no such metric
        ours = "no result" if not v else ours
        ours += f" [{len(v)} of {len(c.values)} seeds]"
    return f"{ours} ({fmt(c.paper)})"


def verdict_label(claim: Claim, v: stats.Verdict, bold: bool = True) -> str:
    """"**shown**", "not shown", "**contradicted**" ("**shown equal**" / "**shown
    different**" for an equal claim), with the verdict's own qualification."""
    text = (EQUAL_LABEL.get(v.verdict) if claim.kind == "equal" else None) or LABEL[v.verdict]
    if bold and v.verdict in (stats.SHOWN, stats.CONTRADICTED):
        text = f"**{text}**"
    return text + (f", {v.note}" if v.note else "")


def tested_text(c: Claim) -> str:
    """What the verdict tests, in symbols: "FedNH > each of FedAvg, FedROD"."""
    lower = c.better == "lower"
    op = "<" if lower else ">"
    rivals = c.b if c.b else f"each of {', '.join(c.among)}"
    if c.kind == "equal":
        return f"{c.a} ≈ {c.b} (±{c.margin:g} pts)"
    if c.kind == "not_worse":
        return f"{c.a} {'≤' if lower else '≥'} {rivals} {'+' if lower else '−'} {c.margin:g} pts"
    if c.kind == "smaller_std":
        return f"std over seeds: {c.a} < {rivals}"
    if c.kind == "steadier":
        return f"{c.a} steadier than {rivals}"
    return f"{c.a} {op} {rivals}"


# ---------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------
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
        paper_vals = {lab: cast(float, cells[lab][met.id].paper) for lab in rc.paper_order}  # ranked: not None
        our_vals = {lab: cells[lab][met.id].mean for lab in rc.our_order}
        if not rc.paper_order:
            out.append(f"* {sp.setting.label}, {met.label}: the paper gives no values to rank.")
            continue
        out.append(f"* {sp.setting.label}, {met.label}: {rc.text()}.\n"
                   f"  * paper: {stats.format_order(rc.paper_order, paper_vals)}\n"
                   f"  * ours: {stats.format_order(rc.our_order, our_vals)}")
    return out


# ---------------------------------------------------------------------------------------
# the claims
# ---------------------------------------------------------------------------------------
VERDICT_HEADER = ["claim", "setting", "metric", "tested", "verdict", "what it rests on"]


def verdict_rows(res: Results, role: str, bold: bool = True) -> list[list[str]]:
    spec = res.plan.spec
    return [[cr.claim.id, cr.setting.label, spec.metric(cr.claim.metric).label, tested_text(cr.claim),
             verdict_label(cr.claim, cr.verdict, bold), cr.verdict.detail]
            for cr in res.claims if cr.claim.role == role]


def claim_line(c: Claim) -> str:
    """The claim as the paper states it (its words in quotation marks; a reading of a table
    or our own question without), its source, and its scope."""
    text = f"\"{c.text.strip()}\"" if c.role == "paper" and c.quoted else c.text.strip()
    return f"`{c.id}`: {text} ({c.source})" + (f" Scope: {c.scope}" if c.scope else "")


def claim_texts(res: Results, role: str) -> list[str]:
    seen, out = set(), []
    for cr in res.claims:
        c = cr.claim
        if c.role == role and c.id not in seen:
            seen.add(c.id)
            out.append(f"* {claim_line(c)}")
    return out


def verdict_rules(res: Results) -> str:
    """The rules of the page's verdicts, with the minimum effects its claims use and the
    number of claims Holm's correction counted."""
    effects = sorted({cr.claim.effect for cr in res.claims if cr.claim.effect})
    effect = (f"larger than the claim's minimum effect ({' or '.join(f'{e:g}' for e in effects)} pts here; "
              f"{stats.MIN_EFFECT:g} pts where the paper states no margin), i.e. the 90 % interval printed "
              "beside it lies above it" if effects else "on the claim's side, i.e. the 90 % interval printed beside "
              "it lies there")
    fams = [f"the paper's {n} claims" if role == "paper" else f"our {n} ablations"
            for role, n in res.holm.items() if n > 1]
    holm = (f" A *shown* is corrected for the number of claims tested with it (Holm's step-down at 0.05 over "
            f"{' and, apart, over '.join(fams)}, counting each setting a claim is tested in); *contradicted* is not "
            "corrected." if fams else "")
    return VERDICT_RULES.replace("{effect}", effect) + holm


VERDICT_RULES = (
    "Verdicts: paired over the seeds above (same seed = same partition, initial weights and sampled "
    "clients), at level 0.05, three ways. *shown*: the one-sided paired t-test gives p < 0.05 for a difference "
    "{effect} (for \"each of\": against every listed method; for ≈: "
    "the 90 % interval lies inside the margin, *shown equal*; for \"not worse\": the 90 % interval's lower end lies "
    "above minus the margin; for \"steadier\": a smaller spread of the metric over "
    "the last evaluations; for \"std over seeds\": the Pitman-Morgan test); *contradicted*: the opposite is shown at "
    "the same level (for \"each of\": against one of the k methods at 0.05 / k; for ≈: the interval lies wholly "
    "beyond the margin, *shown different*; for \"not worse\": its upper end lies below minus the margin); *not shown*: neither; *not comparable*: fewer than three paired "
    "seeds, the planned seeds not all finished, a run of the claim's methods that is no result (diverged or "
    "collapsed), or a method without the metric. A difference that is the same on "
    "every seed counts only when at least one test sample in size. The Wilcoxon signed-rank p beside it cannot "
    "fall below 0.125 with three seeds (docs/reproduce.md).")


# ---------------------------------------------------------------------------------------
# the exploratory runs
# ---------------------------------------------------------------------------------------
def _per_seed(values: dict[int, Optional[float]]) -> str:
    return ", ".join(f"{fmt(v)} (s{s})" for s, v in values.items()) or "·"


def exploratory_lines(res: Results) -> list[str]:
    """Every finished run outside the cells' seeds, listed per seed; for each claim, the
    per-seed differences those runs give. Never a mean across methods, never a verdict."""
    spec, p = res.plan.spec, res.plan
    if not res.explore and not res.explore_missing:
        return []
    extra = f" (here {seeds_text(p.extra)})" if p.extra else ""
    lines = ["## Exploratory: runs on other seeds", "",
             f"No number above and no verdict uses these runs: runs on seeds beyond the ones fixed in the table "
             f"file{extra}, and runs on a planned seed that not every method of their setting finished. One value "
             f"per seed; the differences a − b are per seed too, without a test."]
    for sp in p.settings:
        per = res.explore.get(sp.setting.id)
        if not per:
            continue
        header = ["method", *(m.label for m in spec.metrics)]
        rows = [[label, *(_per_seed(vals[m.id]) for m in spec.metrics)] for label, vals in per.items()]
        lines += ["", f"**{sp.setting.label}**", "", markdown(header, rows).rstrip()]
        diffs = []
        for c in spec.claims:
            if c.settings is not None and sp.setting.id not in c.settings:
                continue
            a = per.get(c.a, {}).get(c.metric, {})
            for r in c.rivals:
                b = per.get(r, {}).get(c.metric, {})
                both = [s for s in a if a[s] is not None and b.get(s) is not None]
                if both:
                    diffs.append(f"* `{c.id}`, {c.a} − {r} ({spec.metric(c.metric).label}): "
                                 + ", ".join(f"{cast(float, a[s]) - cast(float, b[s]):+.2f} (s{s})" for s in both))
        if diffs:
            lines += ["", *diffs]
    if res.explore_missing:
        lines += ["", f"Not finished on the exploratory seeds: {', '.join(res.explore_missing[:12])}"
                  + (" ..." if len(res.explore_missing) > 12 else "") + "."]
    return lines


# ---------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------
def seeds_line(res: Results) -> str:
    p = res.plan
    line = (f"Seeds: {seeds_text(p.planned)}, fixed for scale `{p.scale}` in the table file before any run; "
            f"every number and every verdict below comes from exactly these.")
    short = [f"{sp.setting.label}: {seeds_text(res.seeds[sp.setting.id])}" for sp in p.settings
             if not res.complete(sp.setting.id)]
    if short:
        line += (f" Not every method finished them all, so the cells use the seeds every method of the setting "
                 f"finished ({'; '.join(short)}) and the claims there get no verdict.")
    if p.extra:
        line += f" Exploratory seeds {seeds_text(p.extra)}: listed apart at the end, in no number and no verdict."
    return line


def data_lines(spec: TableSpec) -> str:
    """Which data the page ran on, and what of the paper's table is left out."""
    left = f" Left out: {spec.left_out}" if spec.left_out else ""
    return spec.data_text() + left


def header_lines(res: Results, date: str, mach: str) -> list[str]:
    spec, p = res.plan.spec, res.plan
    paper = spec.paper
    page = f", page {paper['page']}" if paper.get("page") else ""
    where = f" ({paper['where']})" if paper.get("where") else ""
    return [
        f"# {spec.title}",
        "",
        f"Paper: {paper['authors']}, \"{paper['title']}\", {paper['venue']}: {paper['table']}{page}{where}. "
        f"Paper's setting: {paper['setting']}",
        "",
        f"Ours: {filled(spec.dataset, res)}, scale `{p.scale}`. {filled(data_lines(spec), res)}",
        "",
        seeds_line(res),
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
        lines += ["", f"**Scale `{p.scale}`.** {filled(sc.notes.strip(), res)}"]
    if spec.changes and p.scale == PUBLISHED_SCALE:
        lines += ["", f"**Changes since the last page.** {spec.changes.strip()}"]
    sel = "; ".join(f"{m.label}: {_select_text(m.select)}" for m in spec.metrics)
    lines += ["", "## Table"]
    for title, header, rows in split_tables(res):
        lines += ["", *([f"**{title}**", ""] if title else []), markdown(header, rows).rstrip()]
    lines += ["",
              f"Each cell: ours, mean ± sample std over the seeds above (percent), and the paper's value in "
              f"parentheses ({_paper_col_text(res)}); – = no value, · = not run in that setting. "
              f"Which value of a run counts: {sel}."
              + (" † = our ablation, not a row of the paper's table." if any(m.role == "ablation"
                                                                              for m in spec.methods) else "")]
    for s in spec.settings:
        if s.note:
            lines += ["", f"{s.label}: {filled(s.note.strip(), res, s.id)}"]
    gaps = gap_lines(res)
    if gaps:
        lines += ["", *gaps]
    recipe = recipe_block(res)
    if recipe:
        lines += ["", *recipe]
    timing = time_lines(res)
    if timing:
        lines += ["", *timing]
    split_lines = splits_lines(res)
    if split_lines:
        lines += ["", *split_lines]
    extra = extras_lines(res)
    if extra:
        lines += ["", *extra]
    bad = no_result_lines(res)
    if bad:
        lines += ["", *bad]
    rl = ranking_lines(res)
    if rl:
        lines += ["", "## Ranking, the paper's beside ours", "", *rl]
    for role, title in (("paper", "Claims of the paper"), ("ablation", "Our ablations (not claims of the paper)")):
        vr = verdict_rows(res, role)
        if not vr:
            continue
        lines += ["", f"## {title}", "", *claim_texts(res, role), "", markdown(VERDICT_HEADER, vr).rstrip()]
    if res.claims:
        lines += ["", verdict_rules(res)]
    if spec.notes:
        lines += ["", "## Notes", "", filled(spec.notes.strip(), res)]
    if res.missing:
        lines += ["", f"**Incomplete:** {len(res.missing)} run(s) of the planned seeds not finished: "
                  f"{', '.join(res.missing[:12])}" + (" ..." if len(res.missing) > 12 else "")
                  + ". Their settings' cells use the planned seeds every method finished, and give no verdict."]
    ex = exploratory_lines(res)
    if ex:
        lines += ["", *ex]
    lines += ["", summary_comment(res)]
    return "\n".join(lines) + "\n"


def run_configs(res: Results, setting_id: Optional[str] = None) -> dict[str, list[dict]]:
    """The configs of the runs on the cells' seeds, by method label (of one setting, or of
    every setting of the page); each setting's read from its run folders once a page."""
    from ..run_folder import read_config

    per: dict[str, list[dict]] = {}
    for sp in res.plan.settings:
        sid = sp.setting.id
        if setting_id is not None and sid != setting_id:
            continue
        if sid not in res.configs:
            used = set(res.seeds.get(sid, []))
            found: dict[str, list[dict]] = {}
            for r in sp.runs:
                cfg = read_config(r.dir) if r.seed in used else None
                if cfg is not None:
                    found.setdefault(r.label, []).append(cfg)
            res.configs[sid] = found
        for label, cfgs in res.configs[sid].items():
            per.setdefault(label, []).extend(cfgs)
    return per


def recipe_block(res: Results) -> list[str]:
    """Each setting's recipe and its methods' settings, read from the configs of its runs on
    the cells' seeds (protofl.report.recipe): what the runs did, whatever the notes say."""
    from ..report.recipe import method_lines, recipe_lines

    out = []
    for sp in res.plan.settings:
        per = run_configs(res, sp.setting.id)
        lines = recipe_lines(per) + method_lines(per)
        if lines:
            out += [f"**{sp.setting.label}.** " + " ".join(lines)]
    return [x for line in out for x in (line, "")][:-1]


SETTING = re.compile(r"\{\{\s*(?:([^{}:]+?)\s*:\s*)?([A-Za-z_][\w.]*)\s*\}\}")


UNFILLED = "[unfilled setting: "  # how a page marks a setting its runs do not give


def filled(text: str, res: Results, setting_id: Optional[str] = None) -> str:
    """A table file's prose with each ``{{dotted.key}}`` (every method's runs) or
    ``{{Label: dotted.key}}`` (that method's runs) replaced by the value the page's runs
    hold (protofl.report.recipe.setting): a setting the prose states is the one the runs
    used (``setting_id``: of that setting's runs only, for its note). Where the runs hold no
    value or more than one (a page without those runs, or a user's override for some of
    them), the page says so in its place, marked :data:`UNFILLED`."""
    return filled_from(text, run_configs(res, setting_id) if "{{" in text else {})


def planned_configs(p: Plan) -> dict[str, list[dict]]:
    """The configs a plan's runs will have, by method label (before any run: a dry run, the
    list of tables)."""
    per: dict[str, list[dict]] = {}
    for sp in p.settings:
        for r in sp.runs:
            per.setdefault(r.label, []).append(r.cfg.to_dict())
    return per


def filled_from(text: str, per: dict[str, list[dict]]) -> str:
    """``text`` with its settings filled from ``per`` (method label -> configs)."""
    from ..report.recipe import setting

    def one(m: re.Match) -> str:
        try:
            return setting(per, m.group(2), m.group(1))
        except ValueError as e:
            return f"{UNFILLED}{e}]"

    return SETTING.sub(one, text)


def gap_lines(res: Results) -> list[str]:
    """Per setting and metric: ours minus the paper's value over the methods that have both
    (mean over the cell's seeds), its least and greatest with their methods and its median."""
    out = []
    for sp in res.plan.settings:
        sid, per_metric = sp.setting.id, []
        for m in res.plan.spec.metrics:
            diffs = sorted((c.mean - c.paper, label) for label, cells in res.cells.get(sid, {}).items()
                           if (c := cells.get(m.id)) is not None and c.paper is not None and c.present)
            if not diffs:
                continue
            (lo, lo_m), (hi, hi_m) = diffs[0], diffs[-1]
            if len(diffs) == 1:
                per_metric.append(f"{m.label} {lo:+.1f} ({lo_m})")
                continue
            median = statistics.median(d for d, _ in diffs)
            per_metric.append(f"{m.label} from {lo:+.1f} ({lo_m}) to {hi:+.1f} ({hi_m}), median {median:+.1f} "
                              f"over {len(diffs)} methods")
        if per_metric:
            out.append(f"Ours minus the paper's ({sp.setting.label}, points): {'; '.join(per_metric)}.")
    return out


def time_lines(res: Results) -> list[str]:
    """Per setting: how long its runs of the cells' seeds took, summed over their rounds as
    the records hold them (wall-clock of each round, this machine or the one that made them)."""
    from ..run_folder import METRICS, read_rows

    out = []
    for sp in res.plan.settings:
        used = set(res.seeds.get(sp.setting.id, []))
        minutes = []
        for r in sp.runs:
            path = r.dir / METRICS
            if r.seed in used and path.exists():
                rows = read_rows(path)
                if rows and all("wall_s" in row for row in rows):
                    minutes.append(sum(row["wall_s"] for row in rows) / 60)
        if minutes:
            out.append(f"Run time ({sp.setting.label}), the recorded rounds' wall-clock summed: median "
                       f"{statistics.median(minutes):.1f} minutes a run, {min(minutes):.1f} to {max(minutes):.1f}, "
                       f"over {len(minutes)} runs.")
    return out


def no_result_lines(res: Results) -> list[str]:
    """The runs of the cells' seeds that ended but are no result, each named with why; none
    is in a cell (the cell says over how many seeds it is) or in a verdict."""
    from ..run_folder import chance_margin_text

    items = [f"* {sp.setting.label} / {label} / seed {seed}: {why}"
             for sp in res.plan.settings for (label, seed), why in res.unhealthy.get(sp.setting.id, {}).items()
             if seed in res.seeds.get(sp.setting.id, [])]
    if not items:
        return []
    return ["**Runs that are no result**, left out of every cell (the cell says over how many seeds it is, "
            "\"[k of n seeds]\") and every claim on their method (*not comparable*). A run diverged when a NaN/inf "
            f"training loss stopped it; it {chance_margin_text()}.", "", *items]


def splits_lines(res: Results) -> list[str]:
    """One line per setting whose cells average over splits."""
    return [f"{sp.setting.label}: each cell (and each seed's value in table.csv) is the mean over the splits "
            f"{', '.join(cast(Split, pt.split).label for pt in sp.parts)}, one run each per method and seed."
            for sp in res.plan.settings if len(sp.parts) > 1]


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
    m = re.fullmatch(r"spread:(\d+)", select)
    if m:
        return f"the sample std of the last {m.group(1)} evaluations (its swings; lower is steadier)"
    how, k = parse_select(select)
    return {"final": "the last evaluation", "best": "the best evaluation",
            "last": f"the mean of the last {k} evaluations"}[how]


def _paper_col_text(res: Results) -> str:
    cols = [f"{sp.setting.label}: {sp.setting.paper}" for sp in res.plan.settings if sp.setting.paper]
    return "paper column " + "; ".join(cols) if cols else "the paper gives no numbers for this table"


# ---------------------------------------------------------------------------------------
# the page's verdicts, machine-readable, and the index of the published pages
# ---------------------------------------------------------------------------------------
# the rules a page's verdicts follow; 2: a minimum effect, Holm's correction, collapsed runs
# left out (2026-11-29). The index marks a page judged under earlier rules.
RULES = 2


def summary(res: Results) -> dict:
    spec, p = res.plan.spec, res.plan
    return {"table": spec.name, "title": spec.title, "rules": RULES,
            "paper": f"{spec.paper.get('short') or spec.paper['title']}, {spec.paper['table']}",
            "data": spec.runs_on, **({"data_changed": True} if spec.data_changes else {}),
            "scale": p.scale, "seeds": p.planned, "exploratory": p.extra,
            "complete": all(res.complete(sp.setting.id) for sp in p.settings),
            "claims": [{"id": cr.claim.id, "role": cr.claim.role, "setting": cr.setting.label,
                        "verdict": cr.verdict.verdict, "label": verdict_label(cr.claim, cr.verdict, bold=False),
                        "line": short_line(cr.verdict)}
                       for cr in res.claims]}


def short_line(v: stats.Verdict) -> str:
    """What a verdict rests on, short enough to quote (protofl reproduce quotes): the
    difference and its interval for one test, the first sentence for "each of"."""
    if len(v.tests) == 1:
        return v.tests[0].line()
    return v.detail.split(". ")[0]


def summary_comment(res: Results) -> str:
    # "--" may not appear inside an HTML comment; JSON escapes make sure it cannot
    text = json.dumps(summary(res), ensure_ascii=False).replace("--", "-\\u002d")
    return f"<!-- {SUMMARY} {text} -->"


INDEX_START, INDEX_END = "<!-- reproduce-index: start -->", "<!-- reproduce-index: end -->"


def index_text(pages: Path, specs: dict[str, TableSpec], relative_to: Path, also: tuple = ()) -> str:
    """The index of the pages in ``pages`` (one ``<table>.md`` each as written by
    ``protofl reproduce``, ``<table>.paper-data.md`` for the paper's data): one row per
    page with its data, seeds and every verdict, then the shipped tables that have no page
    yet, and those whose paper-data page is still to be made."""
    have: set[tuple[str, Optional[str]]] = set()  # (table, data); data None: a page made before summaries
    rows, old_rules = [], False
    for page in [*sorted(Path(pages).glob("*.md")), *map(Path, also)]:
        s = read_summary(page)
        link = f"[{page.stem}]({Path(os.path.relpath(page, relative_to)).as_posix()})"
        if s is None:
            have.add((page.stem, None))
            rows.append([link, "–", "–", "–", "made before pages carried their verdicts: regenerate it", "–"])
            continue
        data = s["data"] if s["table"] not in specs else page_data(s, specs.get(s["table"]))
        have.add((s["table"], data))
        seeds = f"`{s['scale']}`: {seeds_text(s['seeds'])}"
        if s.get("exploratory"):
            seeds += f" (exploratory: {seeds_text(s['exploratory'])})"
        if not s.get("complete", True):
            seeds += ", incomplete"
        if s.get("rules", 1) < RULES:
            seeds += ", **earlier rules**"
            old_rules = True
        verdicts = {role: "; ".join(f"`{c['id']}` ({c['setting']}): {c['label']}" for c in s["claims"]
                                    if c["role"] == role) or "–" for role in ("paper", "ablation")}
        rows.append([link, s["title"], f"`{data}`" + (", changed" if s.get("data_changed") else ""), seeds,
                     verdicts["paper"], verdicts["ablation"]])
    out = markdown(["page", "what it rebuilds", "data", "seeds", "the paper's claims", "our ablations"], rows)
    if old_rules:
        out += ("\n**earlier rules**: the page's verdicts were made before a shown verdict needed a minimum effect "
                "and Holm's correction, and before runs that collapsed were left out; without its runs' records it "
                "cannot be judged again, only made again.\n")
    tables = {t for t, _ in have}
    missing = [name for name in specs if name not in tables]
    if missing:
        out += f"\nNo page yet: {', '.join(f'`{n}`' for n in missing)}.\n"
    paper = [name for name, spec in specs.items() if spec is not None and spec.has_paper_data
             and name not in missing and (name, "paper") not in have]
    if paper:
        out += f"\nNo page on the paper's data (`--data paper`) yet: {', '.join(f'`{n}`' for n in paper)}.\n"
    return out


def write_index(pages: Path, target: Path, specs: dict[str, TableSpec], also: tuple = ()) -> str:
    """Replace the block between INDEX_START and INDEX_END in ``target`` by the index."""
    try:
        text = target.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("--write", str(target), f"cannot read it ({e.strerror})") from None
    if INDEX_START not in text or INDEX_END not in text:
        raise ConfigError("--write", str(target), f"has no {INDEX_START} ... {INDEX_END} block to replace")
    head, rest = text.split(INDEX_START, 1)
    _, tail = rest.split(INDEX_END, 1)
    block = index_text(pages, specs, target.parent, also)
    target.write_text(f"{head}{INDEX_START}\n{block}{INDEX_END}{tail}", encoding="utf-8")
    return block


# ---------------------------------------------------------------------------------------
# table.csv
# ---------------------------------------------------------------------------------------
def write_csv(res: Results, path: Path) -> Path:
    spec = res.plan.spec
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["setting", "method", "role", "metric", "select", "seeds", "ours_mean", "ours_std", "paper_mean",
                "paper_std", "paper_column", "values", "exploratory_values"])
    for sp in res.plan.settings:
        for m in spec.methods_of(sp.setting):
            for met in spec.metrics:
                c = res.cells[sp.setting.id][m.label][met.id]
                n = len(c.present)
                other = res.explore.get(sp.setting.id, {}).get(m.label, {}).get(met.id, {})
                w.writerow([sp.setting.id, m.label, m.role, met.id, met.select, n,
                            _num(c.mean if n else None), _num(c.std if n > 1 else None), _num(c.paper),
                            _num(c.paper_std), sp.setting.paper or "",
                            ";".join(f"{s}:{_num(v)}" for s, v in c.values.items()),
                            ";".join(f"{s}:{_num(v)}" for s, v in other.items())])
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
             f"<p>Ours: {esc(filled(spec.dataset, res))}, scale <code>{p.scale}</code>. "
             f"{esc(filled(data_lines(spec), res))}</p>",
             f"<p>{esc(seeds_line(res))}</p>", f"<pre>{esc(command_line(p))}</pre>",
             f"<p class='note'>Made by <code>protofl reproduce</code> on {date}; machine: {esc(mach)}.</p>"]
    notes = spec.scales[p.scale].notes
    if notes:
        parts.append(f"<p class='note'><b>Scale {p.scale}.</b> {esc(filled(notes.strip(), res))}</p>")
    if spec.changes and p.scale == PUBLISHED_SCALE:
        parts.append(f"<p class='note'><b>Changes since the last page.</b> {esc(spec.changes.strip())}</p>")
    parts.append("<h2>Table</h2>")
    for title, header, rows in split_tables(res):
        parts += ([f"<h3>{esc(title)}</h3>"] if title else []) + [_table(header, rows)]
    parts += [f"<p class='note'>Each cell: ours, mean ± sample std over the seeds above (%), and the paper's value "
              f"in parentheses ({esc(_paper_col_text(res))}).</p>"]
    for line in [x for x in recipe_block(res) if x] + splits_lines(res) + extras_lines(res):
        parts.append(f"<p class='note'>{esc(line.replace('**', ''))}</p>")
    rl = ranking_lines(res)
    if rl:
        parts += ["<h2>Ranking, the paper's beside ours</h2>",
                  "<pre>" + esc("\n".join(rl)) + "</pre>"]
    for role, title in (("paper", "Claims of the paper"), ("ablation", "Our ablations")):
        vr = verdict_rows(res, role, bold=False)
        if vr:
            parts += [f"<h2>{title}</h2>", "<ul>" + "".join(f"<li>{esc(t[2:])}</li>" for t in claim_texts(res, role))
                      + "</ul>", _table(VERDICT_HEADER, vr)]
    if res.claims:
        parts.append(f"<p class='note'>{esc(verdict_rules(res))}</p>")
    keys = []
    for met in p.metrics:
        k = met.key.split("[")[0]
        if k not in keys:
            keys.append(k)
    for sp in p.settings:
        used = set(res.seeds.get(sp.setting.id, []))
        groups: dict[str, list[Path]] = {}
        for r in sp.runs:
            if r.seed in used and (r.dir / RUN_SUMMARY).exists():
                groups.setdefault(r.label, []).append(r.dir)
        if not groups:
            continue
        available = {k for ds in groups.values() for d in ds for row in plots.read_metrics(d) for k in row}
        ms = [k for k in keys if k in available and k != "gm_per_class"][:4]
        if not ms:
            continue
        reports = [f"{sp.setting.id}/{pt.split.id}" if pt.split else sp.setting.id for pt in sp.parts]
        parts += [f"<h2>Learning curves: {esc(sp.setting.label)}</h2>",
                  _img(plots.curves_figure(groups, ms, ncols=min(3, len(ms))), f"curves {sp.setting.label}"),
                  f"<p class='note'>Mean over the seeds above{' and the splits' if len(sp.parts) > 1 else ''}, "
                  f"± 1 sample std shaded. Every run of this setting: "
                  + ", ".join(f"<a href='{esc(r)}/report.html'>{esc(r)}/report.html</a>" for r in reports) + ".</p>"]
    if spec.notes:
        parts += ["<h2>Notes</h2>", f"<p>{esc(filled(spec.notes.strip(), res))}</p>"]
    if res.missing:
        parts.append(f"<p><b>Incomplete:</b> {len(res.missing)} run(s) of the planned seeds not finished.</p>")
    ex = exploratory_lines(res)
    if ex:
        parts += ["<h2>Exploratory: runs on other seeds</h2>", "<pre>" + esc("\n".join(ex[2:])) + "</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_all(res: Results, date: Optional[str] = None) -> list[Path]:
    out = res.plan.out
    claim_out(res.plan)  # never over the pages of the other data
    mach = machine()
    md = out / "table.md"
    md.write_text(markdown_page(res, date, mach))
    written = [md, write_csv(res, out / "table.csv")]
    page = out / "report.html"
    page.write_text(build_html(res, date, mach), encoding="utf-8")
    written.append(page)
    return written


def dataset_text(spec: TableSpec, scale: str = PUBLISHED_SCALE) -> str:
    """A table's ``dataset`` line before any run: its settings filled from the configs its
    runs at ``scale`` will have."""
    if "{{" not in spec.dataset:
        return spec.dataset
    from .run import plan

    return filled_from(spec.dataset, planned_configs(plan(spec, scale)))


def list_text(specs: dict[str, TableSpec]) -> str:
    """``protofl reproduce list``: one row per table; runs "n" for a table with one
    variant, "substitute / paper data" for one with two."""
    rows = []
    for name, s in specs.items():
        paper = s.variant("paper")
        runs = [str(s.runs(sc)) + (f" / {paper.runs(sc)}" if s.has_paper_data else "")
                for sc in ("smoke", "cpu", "paper")]
        rows.append([name, f"{s.paper['short'] or s.paper['title']}, {s.paper['table']}", dataset_text(s),
                     dataset_text(paper) if s.has_paper_data else "the same", *runs])
    return markdown(["table", "paper", "--data substitute", "--data paper", "runs smoke", "runs cpu", "runs paper"],
                    rows)
