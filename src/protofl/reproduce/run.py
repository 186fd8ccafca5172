"""Plan, run and collect a reproduction: every (setting x method x seed) of a table.

The runs go through the sweep machinery (:func:`protofl.sweeps.sweep`), one sweep per
setting (per split of a setting with splits), so a reproduction resumes cut runs, skips
finished ones (by the fingerprint of the whole config) and runs several at once
(``jobs``). Its folder::

    <out>/<setting id>/<method>-s<seed>-<fingerprint>/   the runs (a sweep folder each,
                                                        with sweep.md and report.html)
    <out>/<setting id>/<split id>/...                   the same, per split
    <out>/table.md, table.csv, report.html              written by reproduce/render.py
    <out>/reproduce.json                                which table and data the folder holds

The default ``<out>`` is ``<output.dir>/reproduce/<table>/<scale>`` on the substitute
data (as it always was) and ``<output.dir>/reproduce/<table>/paper-data/<scale>`` on the
paper's: the two variants' runs differ in their configs, so in their run folders, and
their pages never share a folder (``reproduce.json`` refuses a folder of the other).

Data. ``--data paper`` runs the paper's own datasets, models and augmentation; every
catalog dataset its runs read is fetched (and verified) before the first run when it is
missing, unless downloads are off (the catalog's one-line error then says how to place
it). Without ``--data``, :func:`default_data` picks the paper's data when all of it is
present under the data root, else the substitute, and says so in one line.

Every config of the plan is built and validated before the first run starts, so a typo
in an override costs seconds.

Seeds. A scale's seeds are fixed in the table file before any run; every number of the
page (cells, ranking, verdicts) comes from them, and a verdict only when every method of
its setting finished every one of them. Seeds beyond them (``--seeds``) run too, but
their runs, like any run on a seed not every method finished, are only listed apart, as
exploratory: they never enter a cell or a verdict.
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast, Iterator, Optional, Sequence

import numpy as np

from ..api import is_complete
from ..config import check_here, Config, load_config, parse_override
from ..data.build import build_federated, datasets_read
from ..data.datasets import resolve_root
from ..errors import ConfigError, InputError, one_line
from ..records import carried, is_packed, read_packed
from ..run_folder import health
from ..report.plots import read_metrics
from ..report.tables import mean_std, select_value
from ..sweeps import plan as sweep_plan, sweep
from . import stats
from .pages import page_data, read_summary
from .spec import _METRIC_KEY, Claim, Metric, SCALES, Setting, Split, TableSpec


@dataclass
class Part:
    """One sweep of a setting: the whole setting, or one of its splits."""
    split: Optional[Split]
    cfg: Config  # the base of the sweep
    out: Path
    runs: list = field(default_factory=list)  # sweeps.SweepRun, one per (method, seed)


@dataclass
class SettingPlan:
    setting: Setting
    cfg: Config  # the setting's config at this scale (its first split's with splits)
    methods: dict[str, dict]  # label -> {"algorithm": {...}, "config": {...}} (api.parse_methods form)
    out: Path
    runs: list = field(default_factory=list)  # sweeps.SweepRun, one per (method, seed, split)
    parts: list[Part] = field(default_factory=list)  # one sweep each, in the order of the splits

    def part_of(self, run) -> Part:
        return next(pt for pt in self.parts if any(r is run for r in pt.runs))


@dataclass
class Plan:
    spec: TableSpec
    scale: str
    seeds: list[int]  # every seed run: the scale's, then the exploratory ones
    overrides: list[str]
    out: Path
    settings: list[SettingPlan]
    records: Optional[Path] = None  # the folder of the runs' records (protofl.records), if any

    @property
    def num_runs(self) -> int:
        return sum(len(s.runs) for s in self.settings)

    @property
    def metrics(self) -> list[Metric]:
        """The table's metrics, read from the keys of this scale."""
        return self.spec.metrics_at(self.scale)

    def metric(self, mid: str) -> Metric:
        return next(m for m in self.metrics if m.id == mid)

    @property
    def planned(self) -> list[int]:
        """The scale's seeds from the table file: what every verdict uses."""
        return list(self.spec.scales[self.scale].seeds)

    @property
    def extra(self) -> list[int]:
        """Seeds beyond the planned ones (``--seeds``): exploratory, never in a verdict."""
        return [s for s in self.seeds if s not in self.planned]


def method_specs(spec: TableSpec, setting: Setting, scale: str) -> dict[str, dict]:
    sc = spec.scales[scale]
    out = {}
    for m in spec.methods_of(setting):
        out[m.label] = {"algorithm": {"name": m.name, **m.params},
                        "config": {**m.config, **sc.methods.get(m.label, {})}}
    return out


def plan(spec: TableSpec, scale: str = "cpu", seeds: Optional[list[int]] = None,
         overrides: Optional[list[str]] = None, out: Optional[Path] = None,
         records: Optional[Path] = None) -> Plan:
    """Every run of ``spec`` at ``scale``, validated (``overrides``: ``key=value`` strings
    applied last, to every setting). ``seeds``: exploratory seeds to run besides the
    scale's own (those always run; naming them again changes nothing). ``records``: the
    folder of the runs' records (:func:`records_carried`)."""
    if scale not in SCALES:
        raise ConfigError("--scale", scale, f"expected one of {', '.join(SCALES)}")
    sc = spec.scales[scale]
    seeds = list(dict.fromkeys([*sc.seeds, *(seeds or [])]))
    overrides = list(overrides or [])
    user = dict(parse_override(o) for o in overrides)
    base = load_config(spec.base)
    out = Path(out) if out is not None else default_out(spec, scale, Path(base.replace(**user).output.dir))
    settings = []
    for s in spec.settings_at(scale):
        methods = method_specs(spec, s, scale)
        sp = SettingPlan(s, cast(Config, None), methods, out / s.id)  # its cfg is set below, from its parts
        splits: Sequence[Optional[Split]] = s.splits or [None]
        for split in splits:
            changes = {**spec.config, **s.config, **sc.config, **s.scales.get(scale, {}),
                       **(split.config if split else {}), **user}
            where = f"table {spec.name}, setting {s.id}" + (f", split {split.id}" if split else "") + f", scale {scale}"
            try:
                cfg = base.replace(**changes)
            except ConfigError as e:
                raise ConfigError(e.key, e.value, f"{e.allowed} ({where})") from None
            folder = sp.out / split.id if split else sp.out
            pt = Part(split, cfg, folder, sweep_plan(cfg, {}, seeds, folder, methods))
            sp.parts.append(pt)
            sp.runs += pt.runs
        sp.cfg = sp.parts[0].cfg
        settings.append(sp)
    return Plan(spec, scale, seeds, overrides, out, settings, Path(records) if records is not None else None)


def default_out(spec: TableSpec, scale: str, output_dir: Path) -> Path:
    """``<output.dir>/reproduce/<table>/<scale>``; on the paper's data of a table whose two
    variants differ, ``.../<table>/paper-data/<scale>`` (the substitute keeps the folder
    it always had, so its finished runs are found again)."""
    folder = Path(output_dir) / "reproduce" / spec.name
    return folder / "paper-data" / scale if spec.data == "paper" and spec.has_paper_data else folder / scale


# ---------------------------------------------------------------------------------------
# which data: present, fetched, or the substitute
# ---------------------------------------------------------------------------------------
def data_needed(p: Plan) -> list[tuple[str, Path, Config]]:
    """Every catalog dataset the plan's runs read: (name, data root, a config reading it)."""
    from ..data.catalog import CATALOG

    out, seen = [], set()
    for sp in p.settings:
        for pt in sp.parts:
            root = resolve_root(pt.cfg.data.root)
            for name in datasets_read(pt.cfg):
                if name in CATALOG and (name, root) not in seen:
                    seen.add((name, root))
                    out.append((name, root, pt.cfg))
    return out


def data_missing(p: Plan) -> list[tuple[str, Path, Config]]:
    """The datasets of :func:`data_needed` not present under their data root. Present:
    what ``protofl data list`` calls present (the published files or a hand-placed copy),
    or, failing that, what the loader finds without the network (a layout the catalog does
    not list; a missing file fails at once)."""
    from ..data.catalog import CATALOG
    from ..data.datasets import load_dataset, MissingDataError
    from ..data.fetch import status

    def present(name: str, root: Path) -> bool:
        if status(CATALOG[name], root).readable:
            return True
        try:
            load_dataset(name, root, download=False)
        except MissingDataError:
            return False
        except InputError:  # there but damaged: the run says so
            return True
        return True

    return [(n, root, cfg) for n, root, cfg in data_needed(p) if not present(n, root)]


def default_data(spec: TableSpec, scale: str, overrides: Optional[list[str]] = None) -> tuple[str, str]:
    """``--data`` when it is not given: (data, one line saying why, or "").

    The paper's data when every catalog dataset its runs read at ``scale`` is present
    under the data root, else the substitute, with a line that says so and how to get
    the paper's data. A table without paper_data has one variant: "paper" if it has no
    substitute."""
    if not spec.has_paper_data:
        return ("substitute" if spec.substitute else "paper"), ""
    paper = spec.variant("paper")
    try:
        missing = data_missing(plan(paper, scale, overrides=overrides))
    except ConfigError as e:  # an override for the substitute's config that the paper's does not take
        return "substitute", f"protofl: {spec.name} runs on the substitute data: with --data paper, {one_line(e)}"
    if not missing:
        return "paper", ""
    names = [n for n, _, _ in missing]
    roots = sorted({str(root) for _, root, _ in missing})
    from .render import dataset_text

    substitute = dataset_text(spec.variant("substitute"), scale)
    return "substitute", (f"protofl: {spec.name} runs on the substitute data ({substitute}): "
                          f"the paper's {', '.join(names)} {'is' if len(names) == 1 else 'are'} not under "
                          f"{', '.join(roots)}; `--data paper` fetches {'it' if len(names) == 1 else 'them'} on "
                          f"first use (or first `protofl data fetch {' '.join(names)}`)")


def ensure_data(p: Plan) -> None:
    """Fetch every catalog dataset the runs read that is missing, once, before the first
    run (offline: the catalog's one-line error, how to place it by hand)."""
    from ..data.catalog import CATALOG
    from ..data.fetch import fetch

    for name, root, cfg in data_missing(p):
        fetch(CATALOG[name], root, mirrors=tuple(cfg.data.mirrors), download=cfg.data.download)


FOLDER_RECORD = "reproduce.json"


def claim_out(p: Plan, folder: Optional[Path] = None, option: str = "--out") -> None:
    """Mark ``folder`` (default ``p.out``) as this table's on this data; refuse a folder that
    holds the pages or runs of the other data (or of another table): a ConfigError naming
    both. A folder with a table.md from before pages named their data holds the
    substitute's."""
    folder = p.out if folder is None else folder
    want = {"table": p.spec.name, "data": p.spec.runs_on}
    have = None
    try:
        have = json.loads((folder / FOLDER_RECORD).read_text())
    except (OSError, ValueError):
        page = folder / "table.md"
        if page.is_file():
            s = read_summary(page) or {}
            have = {"table": s.get("table", p.spec.name), "data": page_data(s, p.spec)}
    if isinstance(have, dict) and (have.get("table"), have.get("data")) != (want["table"], want["data"]):
        raise ConfigError(option, str(folder), f"holds {have.get('table')} on the {have.get('data')} data; "
                          f"{want['table']} on the {want['data']} data needs a folder of its own"
                          + (" (leave --out out for the default)" if option == "--out" else ""))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FOLDER_RECORD).write_text(json.dumps(want) + "\n")


@contextmanager
def records_carried(p: Plan, log: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """:func:`protofl.records.carried` for the runs of the plan: the finished runs of
    ``p.records`` brought into ``p.out`` before, every run finished written back after (an
    interruption too); the records folder refused, as ``--out`` is, when it holds another
    table or data. Nothing without records."""
    folders = [r.dir.relative_to(p.out) for sp in p.settings for r in sp.runs]
    if p.records is not None:
        if is_packed(p.records):
            _same_table(p, folders)
        else:
            claim_out(p, p.records, "--records")
        claim_out(p)
    with carried(p.records, p.out, folders, log):
        yield


def _same_table(p: Plan, folders: list[Path]) -> None:
    """A records file (protofl.records.pack) holds this table's runs: one of its runs at
    least is a run of the plan (another table's, or another data's, share none)."""
    records = p.records
    assert records is not None  # called for a plan with records
    if not records.exists():
        return
    have = {r["run"] for r in read_packed(records)}
    if have and not have & {f.as_posix() for f in folders}:
        raise ConfigError("--records", str(p.records), f"holds none of the runs of {p.spec.name} on the "
                          f"{p.spec.runs_on} data at scale {p.scale} (another table's, or runs of other configs)")


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
        for pt in sp.parts:
            check_here(pt.cfg)
    claim_out(p)
    ensure_data(p)
    failed = []
    for i, sp in enumerate(p.settings, start=1):
        chosen = {k: v for k, v in sp.methods.items() if methods is None or k in methods}
        if not chosen:
            continue
        log(f"[reproduce {p.spec.name}] setting {i}/{len(p.settings)}: {sp.setting.label} "
            f"({len(chosen) * len(p.seeds) * len(sp.parts)} runs) -> {sp.out}")
        for pt in sp.parts:
            if pt.split is not None:
                log(f"[reproduce {p.spec.name}] {sp.setting.label}, split {pt.split.label} -> {pt.out}")
            _, _, bad = sweep(pt.cfg, {}, p.seeds, pt.out, methods=chosen, jobs=jobs, log=log)
            failed += bad
    return failed


# ---------------------------------------------------------------------------------------
# collecting the values
# ---------------------------------------------------------------------------------------
def parts_value(parts: list[list[dict]], metric: Metric) -> Optional[float]:
    """The metric of one (method, seed): its run's value, or with splits the mean over
    the splits' runs (None when one of them lacks it)."""
    vals = [run_value(rows, metric) for rows in parts]
    if any(v is None for v in vals):
        return None
    return vals[0] if len(vals) == 1 else float(np.mean(cast(list[float], vals)))


def run_value(rows: list[dict], metric: Metric) -> Optional[float]:
    """The metric's selected value of one run, in percent (None: the run never logged it).
    ``spread:K``: the sample std of its last K evaluations (None with fewer than two)."""
    m = _METRIC_KEY.match(metric.key)
    assert m is not None  # spec.py checked every metric's key
    key, idx = m.group(1), m.group(2)
    if idx is not None:
        i = int(idx)
        rows = [{key: r[key][i]} for r in rows if isinstance(r.get(key), list) and len(r[key]) > i
                and isinstance(r[key][i], (int, float))]
    k = metric.spread
    if k is not None:
        v = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])][-k:]
        return 100.0 * float(np.std(v, ddof=1)) if len(v) >= 2 else None
    val = select_value(rows, key, metric.select)
    return None if val is None else 100.0 * val


def sample_count(key: str, fed) -> Optional[int]:
    """How many test samples a metric's value averages over (so one of them is worth
    100 / N points): the global test set (its block for ``gm:group``, class i's samples
    for ``key[i]``) for the global model and for the personalized models scored on it
    (``acc``, ``pm_v``, ``pm_l``, ``ga``); the clients' local test sets together (their
    group's for ``pa:group``) for ``pa``. ``all_`` / ``_std`` / ``@name`` forms count as
    their metric."""
    m = _METRIC_KEY.match(key)
    assert m is not None  # spec.py checked every metric's key
    name, idx = m.group(1), m.group(2)
    name = name[4:] if name.startswith("all_") else name
    name = name[:-4] if name.endswith("_std") else name
    name, _, group = name.split("@")[0].partition(":")
    if name == "pa":
        clients: Sequence[int] = range(fed.num_clients)
        if group:
            names = fed.feature_group_names or []
            clients = [c for c in clients if fed.feature_groups is not None and names[fed.feature_groups[c]] == group]
        return sum(len(fed.test_idx[c]) for c in clients) or None
    if group:
        block = (fed.test_groups or {}).get(group)
        return None if block is None else len(block)
    y = np.asarray(fed.dataset.y_test)
    return int((y == int(idx)).sum()) if idx is not None else len(y)


class OneSample:
    """The accuracy one test sample is worth (points) for a metric of a setting, from its
    data rebuilt from the runs' configs (the data the runs used: their folders carry the
    fingerprint of the config). Built only when a constant difference asks, once per
    seed; the largest over the seeds (local test sets differ with the partition)."""

    def __init__(self, sp: SettingPlan, seeds: list[int]) -> None:
        self.sp, self.seeds = sp, seeds
        self._fed: dict[tuple[int, int], Any] = {}  # (seed, part) -> the data rebuilt, None when it is gone

    def of(self, metric: Metric):
        return lambda: self.points(metric)

    def points(self, metric: Metric) -> Optional[float]:
        """With splits: the largest over them too (a mean over splits moves by less than
        one sample of a split only where every split moves by less)."""
        out = []
        for seed in self.seeds:
            for i in range(len(self.sp.parts)):
                fed = self._data(seed, i)
                n = None if fed is None else sample_count(metric.key, fed)
                if not n:
                    return None
                out.append(100.0 / n)
        return max(out) if out else None

    def _data(self, seed: int, part: int = 0):
        if (seed, part) not in self._fed:
            run = next(r for r in self.sp.parts[part].runs if r.seed == seed)
            try:
                self._fed[(seed, part)] = build_federated(run.cfg)
            except (InputError, OSError):  # data gone: a constant difference then counts for nothing
                self._fed[(seed, part)] = None
        return self._fed[(seed, part)]


@dataclass
class Cell:
    values: dict[int, Optional[float]]  # seed -> value (%), over the seeds every method of the setting shares
    paper: Optional[float]
    paper_std: Optional[float] = None
    excluded: list[int] = field(default_factory=list)  # seeds whose run is no result (diverged, collapsed): None

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
    claim: Claim
    setting: Setting
    verdict: stats.Verdict


@dataclass
class Results:
    plan: Plan
    cells: dict[str, dict[str, dict[str, Cell]]]  # setting id -> method label -> metric id -> Cell
    claims: list[ClaimResult]
    ranks: dict[str, stats.RankCorrelation]  # setting id -> rank correlation on spec.rank
    missing: list[str]  # runs of the planned seeds not complete (failed or not run)
    extras: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)  # e.g. cluster purity
    seeds: dict[str, list[int]] = field(default_factory=dict)  # setting id -> the seeds of its cells
    # setting id -> method label -> metric id -> {seed: value}: finished runs on any other seed
    explore: dict[str, dict[str, dict[str, dict[int, Optional[float]]]]] = field(default_factory=dict)
    explore_missing: list[str] = field(default_factory=list)  # exploratory runs not complete
    # setting id -> (method label, seed) -> why its run is no result (run_folder.health)
    unhealthy: dict[str, dict[tuple[str, int], str]] = field(default_factory=dict)
    holm: dict[str, int] = field(default_factory=dict)  # role -> the claims Holm's correction counted (stats.holm)
    # setting id -> method label -> the configs of its runs on the cells' seeds, read once
    # for the page (render.run_configs)
    configs: dict[str, dict[str, list[dict]]] = field(default_factory=dict, repr=False)

    def complete(self, sid: str) -> bool:
        """Every method of the setting finished every planned seed."""
        return self.seeds.get(sid) == self.plan.planned


def collect(p: Plan) -> Results:
    """Read every finished run of the plan. The cells, ranking and verdicts of a setting use
    the planned seeds that every one of its methods finished; a verdict needs them all.
    Finished runs on other seeds go to ``explore``."""
    spec = p.spec
    res = Results(p, {}, [], {}, [])
    verdicts: dict[tuple[str, str], stats.Verdict] = {}
    for sp in p.settings:
        s = sp.setting
        # (label, seed) -> the metrics rows of its run, one list per split: only when the
        # runs of every split finished
        # a run that ended but is no result (it diverged, or collapsed: run_folder.health)
        # counts as run: its seed is not missing, but its value is no value
        rows_of: dict[tuple[str, int], list[list[dict]]] = {}
        cut: set[tuple[str, int]] = set()
        bad: dict[tuple[str, int], list[str]] = {}
        for pt in sp.parts:
            for r in pt.runs:
                split = f" / {pt.split.id}" if pt.split else ""
                why = health(r.dir)
                if why is not None:
                    bad.setdefault((r.label, r.seed), []).append(
                        f"{why}{' (split ' + pt.split.id + ')' if pt.split else ''}")
                    rows_of.setdefault((r.label, r.seed), []).append([])
                elif is_complete(r.dir, r.cfg.rounds):
                    rows_of.setdefault((r.label, r.seed), []).append(read_metrics(r.dir))
                else:
                    cut.add((r.label, r.seed))
                    (res.missing if r.seed in p.planned else res.explore_missing).append(
                        f"{s.id}{split} / {r.label} / seed {r.seed}")
        rows_of = {k: v for k, v in rows_of.items() if k not in cut}
        labels = [m.label for m in spec.methods_of(s)]
        shared = [seed for seed in p.planned if all((lab, seed) in rows_of for lab in labels)]
        res.seeds[s.id] = shared
        res.unhealthy[s.id] = {k: "; ".join(v) for k, v in bad.items() if k in rows_of}
        per: dict[str, dict[str, Cell]] = {}
        for m in spec.methods_of(s):
            out = [seed for seed in shared if (m.label, seed) in bad]
            per[m.label] = {met.id: Cell({seed: None if seed in out else parts_value(rows_of[(m.label, seed)], met)
                                          for seed in shared},
                                         spec.paper_value(s, m, met), _paper_std(spec, s, m, met), out)
                            for met in p.metrics}
            other = [seed for seed in p.seeds if seed not in shared and (m.label, seed) in rows_of]
            if other:
                res.explore.setdefault(s.id, {})[m.label] = {
                    met.id: {seed: None if (m.label, seed) in bad else parts_value(rows_of[(m.label, seed)], met)
                             for seed in other} for met in p.metrics}
            # clustering methods: the final purity against the scenario's known groups
            logged = [rows[-1].get("cluster_purity") for seed in shared if seed not in out
                      for rows in rows_of[(m.label, seed)] if rows]
            pur = [x for x in logged if isinstance(x, (int, float))]
            if pur:
                res.extras.setdefault(s.id, {}).setdefault(m.label, {})["cluster_purity"] = pur
        res.cells[s.id] = per
        one = OneSample(sp, shared)
        for c in spec.claims:
            if c.settings is None or s.id in c.settings:
                verdicts[(c.id, s.id)] = (judge(c, per, one.of(p.metric(c.metric)), p.metric(c.metric).label)
                                          if res.complete(s.id) else _incomplete(p, labels, rows_of))
    res.claims = [ClaimResult(c, sp.setting, verdicts[(c.id, sp.setting.id)])
                  for c in spec.claims for sp in p.settings if (c.id, sp.setting.id) in verdicts]
    # two families: the paper's claims, and our ablations (our own questions)
    res.holm = {role: stats.holm([cr.verdict for cr in res.claims if cr.claim.role == role],
                                 "claims of the paper" if role == "paper" else "ablations")
                for role in ("paper", "ablation")}
    if spec.rank is not None:
        for sp in p.settings:
            cells = res.cells[sp.setting.id]
            paper_of = {lab: cs[spec.rank].paper for lab, cs in cells.items()}
            paper = {lab: v for lab, v in paper_of.items() if v is not None}
            # a mean over fewer seeds (a run that is no result) is not ranked against the others
            ours = {lab: cs[spec.rank].mean for lab, cs in cells.items()
                    if cs[spec.rank].present and not cs[spec.rank].excluded}
            res.ranks[sp.setting.id] = stats.rank_correlation(paper, ours)
    return res


def _incomplete(p: Plan, labels: list[str], rows_of: dict) -> stats.Verdict:
    lacking = [f"{lab} seed {seed}" for seed in p.planned for lab in labels if (lab, seed) not in rows_of]
    return stats.Verdict(stats.NOT_COMPARABLE, f"the setting lacks runs of the planned seeds "
                         f"({', '.join(lacking[:6])}{' ...' if len(lacking) > 6 else ''}); a verdict uses "
                         f"exactly the seeds {', '.join(map(str, p.planned))}, every method finished")


def _paper_std(spec: TableSpec, s: Setting, m, met: Metric) -> Optional[float]:
    if s.paper is None or m.paper is None:
        return None
    v = ((spec.paper.get("numbers") or {}).get(s.paper) or {}).get(m.paper, {}).get(met.id)
    return float(v[1]) if isinstance(v, (list, tuple)) and len(v) > 1 and v[1] is not None else None


WHAT = {"greater": "above", "best": "above", "steadier": "steadier than", "not_worse": "not worse than",
        "smaller_std": "less spread over seeds than"}


def judge(claim: Claim, cells: dict[str, dict[str, Cell]], step: stats.Step = None,
          metric_label: Optional[str] = None) -> stats.Verdict:
    """The verdict of one claim on one setting's cells (reproduce/stats.py). ``step``: the
    accuracy one test sample is worth (or a function giving it), for constant differences."""
    lower = claim.better == "lower" or claim.kind == "steadier"  # a steadier run has the smaller spread
    sign = -1.0 if lower else 1.0  # "a below b" is "-a above -b"
    label = metric_label or claim.metric

    def values(lab: str) -> Optional[dict[int, Optional[float]]]:
        if lab not in cells:
            return None
        c = cells[lab][claim.metric]
        if not c.present:
            return None
        return {s: (None if v is None else sign * v) for s, v in c.values.items()}

    no_result = [f"{lab} seed {seed}" for lab in [claim.a, *claim.rivals] if lab in cells
                 for seed in cells[lab][claim.metric].excluded]
    if no_result:
        return stats.Verdict(stats.NOT_COMPARABLE, f"no result from {', '.join(no_result)} (the run diverged or "
                             "collapsed; see the runs that are no result): the claim's methods are not paired over "
                             "every planned seed")
    a = values(claim.a)
    if a is None:
        return stats.Verdict(stats.NOT_COMPARABLE, f"{claim.a} has no {label} in this setting")
    if claim.kind == "equal":
        b = values(cast(str, claim.b))  # an equal claim names b (spec.py)
        if b is None:
            return stats.Verdict(stats.NOT_COMPARABLE, f"{claim.b} has no {label} in this setting")
        return stats.equal(a, b, claim.margin, step)
    test = {"not_worse": lambda x, y: stats.not_worse(x, y, claim.margin, step),
            "smaller_std": stats.smaller_std}.get(
        claim.kind, lambda x, y: stats.greater(x, y, step, min_effect=claim.effect))
    found = {lab: values(lab) for lab in claim.rivals}
    lacking = [lab for lab, v in found.items() if v is None]
    others = {lab: v for lab, v in found.items() if v is not None}
    if claim.b:
        if lacking:
            return stats.Verdict(stats.NOT_COMPARABLE, f"{claim.b} has no {label} in this setting")
        v = test(a, others[claim.b])
    else:
        if not others:
            return stats.Verdict(stats.NOT_COMPARABLE, f"none of {', '.join(lacking)} has {label} in this setting")
        v = stats.each_of(a, others, test, WHAT[claim.kind])
        if lacking:  # the verdict itself says so: it holds against fewer methods than claimed
            v.note = f"against {len(others)} of {len(claim.rivals)}: no {label} for {', '.join(lacking)}"
    if lower and claim.kind != "smaller_std" and v.verdict != stats.NOT_COMPARABLE:
        v.detail += ' (lower is better: "above" means lower here, and the differences are b - a)'
    return v


def command_line(p: Plan) -> str:
    """The command that rebuilds this table (a data folder shows as DATA, never a path)."""
    parts = ["protofl", "reproduce", p.spec.name, "--scale", p.scale]
    if p.spec.has_paper_data:
        parts += ["--data", p.spec.data]
    if p.extra:
        parts += ["--seeds", ",".join(map(str, p.extra))]
    has_root = False
    for o in p.overrides:
        key = o.partition("=")[0].strip()
        if key == "data.root":
            has_root = True
            continue
        parts.append(o if re.fullmatch(r"[\w.=,+\-:/@\[\]]+", o) else f"'{o}'")
    if has_root:
        parts += ["--data-dir", "DATA"]
    if p.records is not None:  # a relative folder as given (a page's records beside it), else a name
        parts += ["--records", p.records.as_posix() if not p.records.is_absolute() else "RECORDS"]
    return " ".join(parts)
