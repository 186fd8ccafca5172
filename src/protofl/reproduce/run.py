"""Plan, run and collect a reproduction: every (setting x method x seed) of a table.

The runs go through the sweep machinery (:func:`protofl.sweeps.sweep`), one sweep per
setting, so a reproduction resumes cut runs, skips finished ones (by the fingerprint of
the whole config) and runs several at once (``jobs``). Its folder::

    <out>/<setting id>/<method>-s<seed>-<fingerprint>/   the runs (a sweep folder each,
                                                        with sweep.md and report.html)
    <out>/table.md, table.csv, report.html              written by reproduce/render.py

Every config of the plan is built and validated before the first run starts, so a typo
in an override costs seconds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..api import is_complete
from ..config import check_here, Config, load_config, parse_override
from ..errors import ConfigError
from ..report.plots import read_metrics
from ..report.tables import mean_std, select_value
from ..sweeps import plan as sweep_plan, sweep
from . import stats
from .spec import _METRIC_KEY, Metric, SCALES, Setting, TableSpec


@dataclass
class SettingPlan:
    setting: Setting
    cfg: Config  # the setting's config at this scale (the base of its sweep)
    methods: dict[str, dict]  # label -> {"algorithm": {...}, "config": {...}} (api.parse_methods form)
    out: Path
    runs: list = field(default_factory=list)  # sweeps.SweepRun, one per (method, seed)


@dataclass
class Plan:
    spec: TableSpec
    scale: str
    seeds: list[int]
    overrides: list[str]
    out: Path
    settings: list[SettingPlan]

    @property
    def num_runs(self) -> int:
        return sum(len(s.runs) for s in self.settings)


def method_specs(spec: TableSpec, setting: Setting, scale: str) -> dict[str, dict]:
    sc = spec.scales[scale]
    out = {}
    for m in spec.methods_of(setting):
        out[m.label] = {"algorithm": {"name": m.name, **m.params},
                        "config": {**m.config, **sc.methods.get(m.label, {})}}
    return out


def plan(spec: TableSpec, scale: str = "cpu", seeds: Optional[list[int]] = None,
         overrides: Optional[list[str]] = None, out: Optional[Path] = None) -> Plan:
    """Every run of ``spec`` at ``scale``, validated (``overrides``: ``key=value`` strings
    applied last, to every setting)."""
    if scale not in SCALES:
        raise ConfigError("--scale", scale, f"expected one of {', '.join(SCALES)}")
    sc = spec.scales[scale]
    seeds = list(sc.seeds if seeds is None else seeds)
    if not seeds:
        raise ConfigError("--seeds", seeds, "at least one seed")
    overrides = list(overrides or [])
    user = dict(parse_override(o) for o in overrides)
    base = load_config(spec.base)
    out = Path(out) if out is not None else Path(base.replace(**user).output.dir) / "reproduce" / spec.name / scale
    settings = []
    for s in spec.settings_at(scale):
        changes = {**spec.config, **s.config, **sc.config, **s.scales.get(scale, {}), **user}
        try:
            cfg = base.replace(**changes)
        except ConfigError as e:
            raise ConfigError(e.key, e.value, f"{e.allowed} (table {spec.name}, setting {s.id}, scale {scale})") from None
        sp = SettingPlan(s, cfg, method_specs(spec, s, scale), out / s.id)
        sp.runs = sweep_plan(cfg, {}, seeds, sp.out, sp.methods)
        settings.append(sp)
    return Plan(spec, scale, seeds, overrides, out, settings)


def row_labels(p: Plan, text: str) -> list[str]:
    """``--methods``: comma-separated row labels; a label may itself hold a comma
    ("FedGELA, Φ = 1"), so pieces are joined back while they spell a known label."""
    known = {label for sp in p.settings for label in sp.methods}
    pieces, out, i = [x.strip() for x in text.split(",")], [], 0
    while i < len(pieces):
        j = next((j for j in range(len(pieces), i, -1) if ", ".join(pieces[i:j]) in known), i + 1)
        out.append(", ".join(pieces[i:j]))
        i = j
    return [x for x in out if x]


def execute(p: Plan, jobs: Optional[int] = None, log: Callable[[str], None] = print,
            methods: Optional[Sequence[str]] = None) -> list:
    """Run every run of the plan not complete yet; returns the runs that failed.

    ``methods``: only the rows with these labels (the table still shows every finished
    run and names the missing ones)."""
    if methods is not None:
        known = {label for sp in p.settings for label in sp.methods}
        unknown = [m for m in methods if m not in known]
        if unknown or not methods:
            raise ConfigError("--methods", ",".join(methods),
                              f"rows of {p.spec.name}: {', '.join(sorted(known, key=str.lower))}")
    for sp in p.settings:
        check_here(sp.cfg)
    failed = []
    for i, sp in enumerate(p.settings, start=1):
        chosen = {k: v for k, v in sp.methods.items() if methods is None or k in methods}
        if not chosen:
            continue
        log(f"[reproduce {p.spec.name}] setting {i}/{len(p.settings)}: {sp.setting.label} "
            f"({len(chosen) * len(p.seeds)} runs) -> {sp.out}")
        _, _, bad = sweep(sp.cfg, {}, p.seeds, sp.out, methods=chosen, jobs=jobs, log=log)
        failed += bad
    return failed


# ---------------------------------------------------------------------------------------
# collecting the values
# ---------------------------------------------------------------------------------------
def run_value(rows: list[dict], metric: Metric) -> Optional[float]:
    """The metric's selected value of one run, in percent (None: the run never logged it)."""
    m = _METRIC_KEY.match(metric.key)
    key, idx = m.group(1), m.group(2)
    if idx is not None:
        i = int(idx)
        rows = [{key: r[key][i]} for r in rows if isinstance(r.get(key), list) and len(r[key]) > i
                and isinstance(r[key][i], (int, float))]
    v = select_value(rows, key, metric.select)
    return None if v is None else 100.0 * v


@dataclass
class Cell:
    values: dict[int, Optional[float]]  # seed -> value (%)
    paper: Optional[float]
    paper_std: Optional[float] = None

    @property
    def present(self) -> list[float]:
        return [v for v in self.values.values() if v is not None and not math.isnan(v)]

    @property
    def mean(self) -> float:
        return mean_std(self.present)[0]

    @property
    def std(self) -> float:
        return mean_std(self.present)[1]


@dataclass
class ClaimResult:
    claim: object  # spec.Claim
    setting: Setting
    verdict: stats.Verdict


@dataclass
class Results:
    plan: Plan
    cells: dict[str, dict[str, dict[str, Cell]]]  # setting id -> method label -> metric id -> Cell
    claims: list[ClaimResult]
    ranks: dict[str, stats.RankCorrelation]  # setting id -> rank correlation on spec.rank
    missing: list[str]  # runs not complete (failed or not run)
    extras: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # e.g. cluster purity


def collect(p: Plan) -> Results:
    """Read every finished run of the plan; runs not finished count as missing."""
    spec = p.spec
    cells: dict[str, dict[str, dict[str, Cell]]] = {}
    missing = []
    extras: dict[str, dict[str, dict[str, float]]] = {}
    for sp in p.settings:
        s = sp.setting
        per: dict[str, dict[str, Cell]] = {}
        rows_of = {}
        for r in sp.runs:
            if is_complete(r.dir, r.cfg.rounds):
                rows_of[(r.label, r.seed)] = read_metrics(r.dir)
            else:
                missing.append(f"{s.id} / {r.label} / seed {r.seed}")
        for m in spec.methods_of(s):
            per[m.label] = {}
            for met in spec.metrics:
                vals = {seed: (run_value(rows_of[(m.label, seed)], met) if (m.label, seed) in rows_of else None)
                        for seed in p.seeds}
                pv = spec.paper_value(s, m, met)
                ps = _paper_std(spec, s, m, met)
                per[m.label][met.id] = Cell(vals, pv, ps)
            # clustering methods: the final purity against the scenario's known groups
            pur = [rows_of[(m.label, seed)][-1].get("cluster_purity") for seed in p.seeds
                   if (m.label, seed) in rows_of and rows_of[(m.label, seed)]]
            pur = [x for x in pur if isinstance(x, (int, float))]
            if pur:
                extras.setdefault(s.id, {}).setdefault(m.label, {})["cluster_purity"] = pur
        cells[s.id] = per
    claims = [ClaimResult(c, sp.setting, judge(c, cells[sp.setting.id]))
              for c in spec.claims for sp in p.settings
              if c.settings is None or sp.setting.id in c.settings]
    ranks = {}
    if spec.rank is not None:
        for sp in p.settings:
            paper = {lab: cs[spec.rank].paper for lab, cs in cells[sp.setting.id].items()
                     if cs[spec.rank].paper is not None}
            ours = {lab: cs[spec.rank].mean for lab, cs in cells[sp.setting.id].items() if cs[spec.rank].present}
            ranks[sp.setting.id] = stats.rank_correlation(paper, ours)
    return Results(p, cells, claims, ranks, missing, extras)


def _paper_std(spec: TableSpec, s: Setting, m, met: Metric) -> Optional[float]:
    if s.paper is None or m.paper is None:
        return None
    v = ((spec.paper.get("numbers") or {}).get(s.paper) or {}).get(m.paper, {}).get(met.id)
    return float(v[1]) if isinstance(v, (list, tuple)) and len(v) > 1 and v[1] is not None else None


def judge(claim, cells: dict[str, dict[str, Cell]]) -> stats.Verdict:
    """The verdict of one claim on one setting's cells (reproduce/stats.py)."""
    sign = -1.0 if claim.better == "lower" else 1.0  # "a below b" is "-a above -b"

    def values(label: str) -> Optional[dict[int, Optional[float]]]:
        if label not in cells:
            return None
        c = cells[label][claim.metric]
        if not c.present:
            return None
        return {s: (None if v is None else sign * v) for s, v in c.values.items()}

    a = values(claim.a)
    if a is None:
        return stats.Verdict(stats.NOT_COMPARABLE, f"{claim.a} has no value of this metric in this setting")
    if claim.kind == "best":
        others = {lab: values(lab) for lab in claim.among}
        lacking = [lab for lab, v in others.items() if v is None]
        others = {lab: v for lab, v in others.items() if v is not None}
        v = stats.best(a, others)
        if lacking:
            v.detail += f" (left out, no value: {', '.join(lacking)})"
        return _lower_note(v, sign)
    b = values(claim.b)
    if b is None:
        return stats.Verdict(stats.NOT_COMPARABLE, f"{claim.b} has no value of this metric in this setting")
    v = stats.greater(a, b) if claim.kind == "greater" else stats.equal(a, b, claim.margin)
    return _lower_note(v, sign)


def _lower_note(v: stats.Verdict, sign: float) -> stats.Verdict:
    if sign < 0 and v.verdict != stats.NOT_COMPARABLE:
        v.detail += ' (lower is better: "above" means lower here, and the differences are b - a)'
    return v


def command_line(p: Plan) -> str:
    """The command that rebuilds this table (a data folder shows as DATA, never a path)."""
    parts = ["protofl", "reproduce", p.spec.name, "--scale", p.scale]
    if p.seeds != p.spec.scales[p.scale].seeds:
        parts += ["--seeds", ",".join(map(str, p.seeds))]
    has_root = False
    for o in p.overrides:
        key = o.partition("=")[0].strip()
        if key == "data.root":
            has_root = True
            continue
        parts.append(o if re.fullmatch(r"[\w.=,+\-:/@\[\]]+", o) else f"'{o}'")
    if has_root:
        parts += ["--data-dir", "DATA"]
    return " ".join(parts)
