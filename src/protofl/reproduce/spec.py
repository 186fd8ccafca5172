"""A reproducible paper table as data: one YAML file per table in ``reproduce/tables/``.

Each file holds the paper's numbers with their source (paper, table, page, setting) and
what we run to rebuild the table: a packaged base config, the settings (the table's column
groups, e.g. Dir(0.3) and Dir(1.0)), the methods (rows), the metrics, the claims the paper
makes about them, and three scales:

* ``smoke``: seconds to a couple of minutes; checks that the table builds end to end.
* ``cpu``: what fits a 2-core machine (the scaled settings of protofl's benchmarks); each
  scale's ``notes`` say how it differs from the paper.
* ``paper``: the paper's rounds, clients and epochs.

Schema (every key is checked when the file is loaded; unknown keys are errors)::

    name: fednh-table1            # the command's argument (the file name, '_' -> '-')
    title: ...
    paper: {title, short, authors, venue, table, page, where, setting, numbers}
      numbers: {column: {row: {metric: value | [mean, std] | null}}}   # as printed, in %
    dataset: ...                  # what we run on
    substitute: ...               # what replaces the paper's data, or null
    data_changes: ...             # without paper_data: how the data differs from the paper's own, if it does
    base: fednh_fmnist            # a packaged config (protofl configs)
    config: {dotted.key: value}   # on top of the base, every setting and scale
    settings: [{id, label, paper: column | null, config: {...}, methods: [labels] | null,
                scales: {scale: {...}}}]   # config order: base, config, setting, scale, setting.scales
    methods: [{label, name, params: {...}, config: {...}, paper: row | null, role}]
      role: paper (a row of the paper's table) | ablation (ours, not the paper's) | extra
    metrics: [{id, key, label, select}]   # key: a metrics.jsonl key, or key[i] for a list entry
      select: final | best | last:K | spread:K (the std of the last K evaluations: round-to-round swings)
    rank: metric id               # the paper's ordering vs ours, per setting
    claims: [{id, text, source, quoted, scope, kind, metric, a, b | among, margin, min_effect, settings, role,
              better}]
      min_effect: greater, best, steadier: the difference in points the claim needs to be shown
        (the paper's where it states one; default stats.MIN_EFFECT)
      kind: greater | best | equal | not_worse | smaller_std | steadier  (reproduce/stats.py
            says what each verdict means)
      text: the paper's own words (quoted: true, the default; "..." marks a cut), or, with
            quoted: false, a statement read off a table, its source then "from Table N ..."
      scope: where the paper makes the claim and where we test it (required for the paper's claims)
    scales: {smoke|cpu|paper: {seeds, settings, config, methods: {label: {dotted: value}}, metrics, notes}}
      metrics: {metric id: key} a metric read from another key at this scale (pm_v -> all_pm_v)
      seeds: fixed before any run; every verdict uses exactly these (at least 3 at cpu and
             paper); `--seeds` adds exploratory ones, shown apart and never in a verdict
    changes: what changed since the last published page (optional)
    left_out: what of the paper's table no variant runs, and why (optional; shown on the page)
    paper_data: {dataset, title, left_out, base, config, settings, metrics, scales, notes,
                 changes, claims: {claim id: {scope, settings}}}   # see below

Two variants of a table: ``substitute`` (the file as read: the data that needs no
download beyond what it always ran on, e.g. Fashion-MNIST in place of CIFAR-10) and
``paper`` (the paper's own datasets, models and augmentation). ``paper_data`` holds the
paper variant as changes to the file: each key it gives replaces the file's key of that
name, except ``config`` (applied on top of the file's ``config``), ``scales`` (per scale,
each key given replaces that key of the file's scale) and ``claims`` (a new ``scope`` or
``settings`` per claim id). ``substitute`` is null in the paper variant. A table without
``paper_data`` runs the paper's own data already (its ``substitute`` must be null): both
variants are then the same runs. A setting may hold ``splits: [{id, label, config}]``:
its cells are then, per seed, the mean over the splits' runs (a paper's cell that
averages several partitions, e.g. FedGELA's Table 4).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import yaml_problem
from ..config.coerce import check_path_component, load_yaml
from ..errors import ConfigError
from ..report.tables import parse_select
from .stats import MIN_EFFECT, MIN_SEEDS

TABLES_DIR = Path(__file__).resolve().parent / "tables"
SCALES = ("smoke", "cpu", "paper")
KINDS = ("greater", "best", "equal", "not_worse", "smaller_std", "steadier")
ROLES = ("paper", "ablation", "extra")
DATA = ("paper", "substitute")  # the two variants of a table (``--data``)
_METRIC_KEY = re.compile(r"^([\w@:.\-]+)(?:\[(\d+)\])?$")
_SPREAD = re.compile(r"^spread:(\d+)$")


@dataclass
class Method:
    label: str
    name: str
    params: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    paper: Optional[str] = None  # its row in the paper's table
    role: str = "paper"
    note: str = ""


@dataclass
class Split:
    """One of the partitions a setting's cells average over (its config after the setting's)."""
    id: str
    label: str
    config: dict = field(default_factory=dict)


@dataclass
class Setting:
    id: str
    label: str
    paper: Optional[str] = None  # the column group of paper.numbers beside it
    config: dict = field(default_factory=dict)
    methods: Optional[list[str]] = None  # None: every method
    note: str = ""
    scales: dict = field(default_factory=dict)  # scale -> {dotted: value}, after the scale's own config
    splits: list[Split] = field(default_factory=list)  # empty: one run per (method, seed)


@dataclass
class Metric:
    id: str
    key: str  # metrics.jsonl key, optionally with [i] (an entry of a per-class list)
    label: str
    select: str = "final"  # report/tables.py: final, best, last:K; here also spread:K

    @property
    def spread(self) -> Optional[int]:
        """K of ``spread:K`` (the std of the last K evaluations), else None."""
        m = _SPREAD.match(self.select)
        return int(m.group(1)) if m else None


@dataclass
class Claim:
    id: str
    text: str  # the paper's words (quoted) or what a table shows (quoted: false)
    source: str  # where in the paper; "from Table N ..." for a claim read off a table
    kind: str  # greater | best | equal | not_worse | smaller_std | steadier
    metric: str
    a: str
    b: Optional[str] = None
    among: list[str] = field(default_factory=list)
    margin: float = 1.0  # equal, not_worse: the margin in points
    min_effect: Optional[float] = None  # greater, best, steadier: in points; None: stats.MIN_EFFECT
    settings: Optional[list[str]] = None  # None: every setting
    role: str = "paper"  # paper: the paper claims it; ablation: our own question
    better: str = "higher"  # lower: the smaller value wins (e.g. the spread over clients)
    quoted: bool = True  # text is the paper's own words
    scope: str = ""  # where the paper makes the claim, and where (how narrower) we test it

    @property
    def rivals(self) -> list[str]:
        return [self.b] if self.b else list(self.among)

    @property
    def effect(self) -> float:
        """The difference (points) a greater, best or steadier claim needs to be shown; 0 for
        the others (their margins say what they need)."""
        if self.kind not in ("greater", "best", "steadier"):
            return 0.0
        return MIN_EFFECT if self.min_effect is None else self.min_effect


@dataclass
class Scale:
    seeds: list[int]
    settings: Optional[list[str]] = None  # the settings run at this scale (None: all)
    config: dict = field(default_factory=dict)
    methods: dict = field(default_factory=dict)  # label -> {dotted key: value}
    notes: str = ""
    metrics: dict = field(default_factory=dict)  # metric id -> the key it is read from at this scale


@dataclass
class TableSpec:
    name: str
    title: str
    paper: dict
    dataset: str
    substitute: Optional[str]
    base: str
    config: dict
    settings: list[Setting]
    methods: list[Method]
    metrics: list[Metric]
    rank: Optional[str]
    claims: list[Claim]
    scales: dict[str, Scale]
    path: Path
    notes: str = ""
    changes: str = ""  # what changed since the last published page
    left_out: str = ""  # what of the paper's table this variant does not run, and why
    data: str = "substitute"  # which variant this is (``--data``)
    # a table on the paper's own data (no paper_data) that changes it: how, in the page's words
    data_changes: str = ""
    paper_variant: Optional["TableSpec"] = field(default=None, repr=False)  # from paper_data
    substitute_variant: Optional["TableSpec"] = field(default=None, repr=False)  # in a paper variant

    # -- the two variants -----------------------------------------------------------------
    @property
    def has_paper_data(self) -> bool:
        """The two variants differ (the file has ``paper_data``)."""
        return self.paper_variant is not None or self.substitute_variant is not None

    @property
    def runs_on(self) -> str:
        """The data its page says it ran on: the variant of a table with two, "paper" for
        a table with one (it runs the paper's own data; a substitute needs paper_data)."""
        return self.data if self.has_paper_data else "paper"

    def data_text(self) -> str:
        """One sentence for the page: which data this variant runs, and the other's."""
        if not self.has_paper_data:
            return f"Data: the paper's own, changed: {self.data_changes}" if self.data_changes else \
                "Data: the paper's own."
        if self.data == "paper":
            return "Data: the paper's own (`--data paper`)."
        paper = self.variant("paper").dataset
        if self.substitute:
            return (f"Data: a substitute (`--data substitute`): {self.substitute}. `--data paper` runs the "
                    f"paper's: {paper}.")
        return (f"Data: `--data substitute`, the paper's own data for these columns only. `--data paper` runs the "
                f"paper's: {paper}.")

    def variant(self, data: str) -> "TableSpec":
        """The table on ``data`` (paper | substitute). A table without ``paper_data``
        runs the paper's own data already: both are the table itself."""
        if data not in DATA:
            raise ConfigError("--data", data, f"expected one of {', '.join(DATA)}")
        if data == "paper" and self.paper_variant is not None:
            return self.paper_variant
        if data == "substitute" and self.substitute_variant is not None:
            return self.substitute_variant
        return self

    # -- look-ups -------------------------------------------------------------------------
    def method(self, label: str) -> Method:
        return next(m for m in self.methods if m.label == label)

    def metric(self, mid: str) -> Metric:
        return next(m for m in self.metrics if m.id == mid)

    def metrics_at(self, scale: str) -> list[Metric]:
        """The metrics with the keys they are read from at ``scale``."""
        keys = self.scales[scale].metrics
        return [replace(m, key=keys.get(m.id, m.key)) for m in self.metrics]

    def methods_of(self, setting: Setting) -> list[Method]:
        return [m for m in self.methods if setting.methods is None or m.label in setting.methods]

    def paper_value(self, setting: Setting, method: Method, metric: Metric) -> Optional[float]:
        """The paper's mean for this cell (percent), or None."""
        if setting.paper is None or method.paper is None:
            return None
        v = ((self.paper.get("numbers") or {}).get(setting.paper) or {}).get(method.paper, {}).get(metric.id)
        if isinstance(v, (list, tuple)):
            v = v[0]
        return None if v is None else float(v)

    def settings_at(self, scale: str) -> list[Setting]:
        ids = self.scales[scale].settings
        return [s for s in self.settings if ids is None or s.id in ids]

    def runs(self, scale: str, seeds: Optional[list[int]] = None) -> int:
        n = len(seeds if seeds is not None else self.scales[scale].seeds)
        return sum(len(self.methods_of(s)) * max(1, len(s.splits)) for s in self.settings_at(scale)) * n

    def source(self) -> str:
        p = self.paper
        page = f", p. {p['page']}" if p.get("page") else ""
        return f"{p.get('authors', '')}, {p.get('venue', '')}: {p.get('table', '')}{page}".strip(", ")


# ---------------------------------------------------------------------------------------
# loading and checking
# ---------------------------------------------------------------------------------------
def _take(raw: dict, where: str, required: tuple, optional: dict) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "expected a mapping")
    unknown = set(raw) - set(required) - set(optional)
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", raw[sorted(unknown)[0]],
                          f"unknown key; allowed: {', '.join(sorted([*required, *optional]))}")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}", None, "required key is missing")
    return {**optional, **raw}


def _dotted(d: Any, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ConfigError(where, d, "expected a mapping of dotted config keys to values")
    return dict(d)


PAPER_DATA_KEYS: dict[str, Any] = {"title": None, "left_out": None, "base": None, "config": {}, "settings": None,
                                   "metrics": None, "scales": {}, "notes": None, "changes": "", "claims": {}}


def paper_data_raw(raw: dict, w: str) -> dict:
    """The table file as its paper variant: ``paper_data``'s keys in place of the file's
    (``config`` on top of the file's, ``scales`` key by key, ``claims`` a new scope or
    settings per id); ``substitute`` null; ``changes`` only the paper variant's own."""
    pd = _take(raw["paper_data"], f"{w}: paper_data", ("dataset",), PAPER_DATA_KEYS)
    if "{{" in str(pd["dataset"]):  # the substitute's page shows it too, where other runs would fill it
        raise ConfigError(f"{w}: paper_data.dataset", pd["dataset"],
                          "no {{setting}} here: the substitute's page shows this line too, beside other runs")
    out = {k: v for k, v in raw.items() if k not in ("paper_data", "changes")}
    config = {**_dotted(raw.get("config"), f"{w}: config"), **_dotted(pd["config"], f"{w}: paper_data.config")}
    out.update(substitute=None, dataset=pd["dataset"], changes=pd["changes"] or "", config=config)
    for key in ("title", "left_out", "base", "settings", "metrics", "notes"):
        if pd[key] is not None:
            out[key] = pd[key]
    scales = dict(raw.get("scales") or {})
    for name, patch in (pd["scales"] or {}).items():
        if name not in SCALES:
            raise ConfigError(f"{w}: paper_data.scales", name, f"unknown scale; scales: {', '.join(SCALES)}")
        if not isinstance(patch, dict):
            raise ConfigError(f"{w}: paper_data.scales.{name}", patch, "expected a mapping")
        scales[name] = {**(scales.get(name) or {}), **patch}
    out["scales"] = scales
    claims = [dict(c) if isinstance(c, dict) else c for c in raw.get("claims") or []]
    ids = [c.get("id") for c in claims if isinstance(c, dict)]
    for cid, patch in (pd["claims"] or {}).items():
        if cid not in ids:
            raise ConfigError(f"{w}: paper_data.claims", cid, f"not a claim id ({', '.join(map(str, ids))})")
        patch = _take(patch, f"{w}: paper_data.claims.{cid}", (), {"scope": None, "settings": None})
        claims[ids.index(cid)].update({k: v for k, v in patch.items() if v is not None})
    out["claims"] = claims
    return out


def parse_spec(raw: dict, path: Path, data: str = "substitute") -> TableSpec:
    w = path.name if data == "substitute" else f"{path.name} (paper_data)"
    t = _take(raw, w, ("name", "title", "paper", "dataset", "base", "settings", "methods", "metrics", "scales"),
              {"substitute": None, "config": {}, "rank": None, "claims": [], "notes": "", "changes": "",
               "left_out": "", "paper_data": None, "data_changes": ""})
    if t["data_changes"] and (t["paper_data"] is not None or t["substitute"]):
        raise ConfigError(f"{w}: data_changes", t["data_changes"], "only for a table on the paper's own data "
                          "(no substitute, no paper_data): a substitute says how it differs in substitute")
    if t["substitute"] and t["paper_data"] is None:
        raise ConfigError(f"{w}: paper_data", None, "a table on a substitute says how it runs on the paper's own "
                          "data (paper_data), or, where that cannot be had, says so there")
    paper = _take(t["paper"], f"{w}: paper", ("title", "authors", "venue", "table", "setting"),
                  {"page": None, "where": "", "numbers": {}, "url": None, "short": None})
    methods = []
    for i, m in enumerate(t["methods"]):
        m = _take(m, f"{w}: methods[{i}]", ("label", "name"),
                  {"params": {}, "config": {}, "paper": None, "role": "paper", "note": ""})
        if m["role"] not in ROLES:
            raise ConfigError(f"{w}: methods[{i}].role", m["role"], f"expected one of {', '.join(ROLES)}")
        methods.append(Method(str(m["label"]), m["name"], dict(m["params"] or {}),
                              _dotted(m["config"], f"{w}: methods[{i}].config"), m["paper"], m["role"], m["note"]))
    labels = [m.label for m in methods]
    _unique(labels, f"{w}: methods")
    settings = []
    for i, s in enumerate(t["settings"]):
        s = _take(s, f"{w}: settings[{i}]", ("id", "label"),
                  {"paper": None, "config": {}, "methods": None, "note": "", "scales": {}, "splits": []})
        for sc in s["scales"] or {}:
            if sc not in SCALES:
                raise ConfigError(f"{w}: settings[{i}].scales", sc, f"unknown scale; scales: {', '.join(SCALES)}")
        for lab in s["methods"] or []:
            if lab not in labels:
                raise ConfigError(f"{w}: settings[{i}].methods", lab, f"not a method label; labels: {', '.join(labels)}")
        check_path_component(f"{w}: settings[{i}].id", str(s["id"]))  # a folder of the table's output
        if s["paper"] is not None and s["paper"] not in paper["numbers"]:
            raise ConfigError(f"{w}: settings[{i}].paper", s["paper"],
                              f"not a column of paper.numbers ({', '.join(paper['numbers']) or 'none'})")
        settings.append(Setting(str(s["id"]), s["label"], s["paper"], _dotted(s["config"], f"{w}: settings[{i}].config"),
                                s["methods"], s["note"],
                                {k: _dotted(v, f"{w}: settings[{i}].scales.{k}") for k, v in (s["scales"] or {}).items()},
                                _splits(s["splits"], f"{w}: settings[{i}].splits")))
    _unique([s.id for s in settings], f"{w}: settings")
    metrics = []
    for i, m in enumerate(t["metrics"]):
        m = _take(m, f"{w}: metrics[{i}]", ("id", "label"), {"key": None, "select": "final"})
        key = m["key"] or m["id"]
        if not _METRIC_KEY.match(key):
            raise ConfigError(f"{w}: metrics[{i}].key", key, "expected a metrics key, optionally with [index]")
        spread = _SPREAD.match(str(m["select"]))
        if spread is None:
            try:
                parse_select(m["select"])
            except ConfigError:
                raise ConfigError(f"{w}: metrics[{i}].select", m["select"],
                                  "expected final, best, last:K or spread:K") from None
        elif int(spread.group(1)) < 2:
            raise ConfigError(f"{w}: metrics[{i}].select", m["select"], "a spread needs K >= 2 evaluations")
        metrics.append(Metric(m["id"], key, m["label"], m["select"]))
    _unique([m.id for m in metrics], f"{w}: metrics")
    mids = [m.id for m in metrics]
    if t["rank"] is not None and t["rank"] not in mids:
        raise ConfigError(f"{w}: rank", t["rank"], f"not a metric id ({', '.join(mids)})")
    claims = []
    for i, c in enumerate(t["claims"]):
        c = _take(c, f"{w}: claims[{i}]", ("id", "text", "source", "kind", "metric", "a"),
                  {"b": None, "among": [], "margin": 1.0, "min_effect": None, "settings": None, "role": "paper",
                   "better": "higher", "quoted": True, "scope": ""})
        where = f"{w}: claims[{i}]"
        _check_claim(c, where, mids, labels, metrics)
        for sid in c["settings"] or []:
            if sid not in [s.id for s in settings]:
                raise ConfigError(f"{where}.settings", sid, "not a setting id")
        claims.append(Claim(c["id"], c["text"], c["source"], c["kind"], c["metric"], c["a"], c["b"],
                            list(c["among"]), float(c["margin"]),
                            None if c["min_effect"] is None else float(c["min_effect"]), c["settings"], c["role"],
                            c["better"], bool(c["quoted"]), str(c["scope"] or "").strip()))
    _unique([c.id for c in claims], f"{w}: claims")
    scales = {}
    for name in SCALES:
        if name not in t["scales"]:
            raise ConfigError(f"{w}: scales.{name}", None, "every table has the scales smoke, cpu and paper")
        s = _take(t["scales"][name], f"{w}: scales.{name}", ("seeds",),
                  {"settings": None, "config": {}, "methods": {}, "notes": "", "metrics": {}})
        for mid, key in (s["metrics"] or {}).items():
            if mid not in mids:
                raise ConfigError(f"{w}: scales.{name}.metrics", mid, f"not a metric id ({', '.join(mids)})")
            if not isinstance(key, str) or not _METRIC_KEY.match(key):
                raise ConfigError(f"{w}: scales.{name}.metrics.{mid}", key, "expected a metrics key")
        for lab in s["methods"] or {}:
            if lab not in labels:
                raise ConfigError(f"{w}: scales.{name}.methods", lab, "not a method label")
        for sid in s["settings"] or []:
            if sid not in [x.id for x in settings]:
                raise ConfigError(f"{w}: scales.{name}.settings", sid, "not a setting id")
        _check_seeds(s["seeds"], f"{w}: scales.{name}.seeds", name)
        scales[name] = Scale([int(x) for x in s["seeds"]], s["settings"],
                             _dotted(s["config"], f"{w}: scales.{name}.config"),
                             {k: _dotted(v, f"{w}: scales.{name}.methods.{k}") for k, v in (s["methods"] or {}).items()},
                             s["notes"], dict(s["metrics"] or {}))
    extra = set(t["scales"]) - set(SCALES)
    if extra:
        raise ConfigError(f"{w}: scales", sorted(extra)[0], f"unknown scale; scales: {', '.join(SCALES)}")
    spec = TableSpec(t["name"], t["title"], paper, t["dataset"], t["substitute"], t["base"],
                     _dotted(t["config"], f"{w}: config"), settings, methods, metrics, t["rank"], claims, scales,
                     path, t["notes"], t["changes"] or "", str(t["left_out"] or "").strip(), data,
                     data_changes=str(t["data_changes"] or "").strip())
    if t["paper_data"] is not None:
        spec.paper_variant = parse_spec(paper_data_raw(raw, path.name), path, data="paper")
        spec.paper_variant.substitute_variant = spec
    return spec


def _splits(raw: Any, where: str) -> list[Split]:
    if not isinstance(raw, list):
        raise ConfigError(where, raw, "expected a list of {id, label, config}")
    out = []
    for j, sp in enumerate(raw):
        sp = _take(sp, f"{where}[{j}]", ("id", "label"), {"config": {}})
        check_path_component(f"{where}[{j}].id", str(sp["id"]))  # a folder of the setting's runs
        out.append(Split(str(sp["id"]), str(sp["label"]), _dotted(sp["config"], f"{where}[{j}].config")))
    _unique([x.id for x in out], where)
    if len(out) == 1:
        raise ConfigError(where, raw, "a mean over one split is that split: give its config to the setting")
    return out


def _check_claim(c: dict, where: str, mids: list[str], labels: list[str], metrics: list[Metric]) -> None:
    kind = c["kind"]
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind", kind, f"expected one of {', '.join(KINDS)}")
    if c["metric"] not in mids:
        raise ConfigError(f"{where}.metric", c["metric"], f"not a metric id ({', '.join(mids)})")
    for lab in [c["a"], *([c["b"]] if c["b"] else []), *c["among"]]:
        if lab not in labels:
            raise ConfigError(f"{where}", lab, f"not a method label; labels: {', '.join(labels)}")
    if kind in ("greater", "equal") and (not c["b"] or c["among"]):
        raise ConfigError(f"{where}.b", c["b"], f"a {kind} claim compares a with one method b (no among)")
    if kind == "best" and (not c["among"] or c["b"]):
        raise ConfigError(f"{where}.among", None, "a best claim lists the methods it beats in among (no b)")
    if kind in ("not_worse", "smaller_std", "steadier") and bool(c["b"]) == bool(c["among"]):
        raise ConfigError(f"{where}.b", c["b"], f"a {kind} claim compares a with b or with each of among")
    metric = next(m for m in metrics if m.id == c["metric"])
    if kind == "steadier" and metric.spread is None:
        raise ConfigError(f"{where}.metric", c["metric"], "a steadier claim needs a metric with select spread:K")
    if c["role"] not in ("paper", "ablation"):
        raise ConfigError(f"{where}.role", c["role"], "expected paper or ablation")
    if c["better"] not in ("higher", "lower"):
        raise ConfigError(f"{where}.better", c["better"], "expected higher or lower")
    if not isinstance(c["quoted"], bool):
        raise ConfigError(f"{where}.quoted", c["quoted"], "expected true or false")
    if not c["quoted"] and not str(c["source"]).startswith("from "):
        raise ConfigError(f"{where}.source", c["source"], 'a claim read off a table says where: "from Table N ..."')
    if c["role"] == "paper" and not str(c["scope"] or "").strip():
        raise ConfigError(f"{where}.scope", None, "a claim of the paper says where the paper makes it and where "
                          "we test it")
    if float(c["margin"]) <= 0:
        raise ConfigError(f"{where}.margin", c["margin"], "expected a positive number of points")
    if c["min_effect"] is not None:
        if kind not in ("greater", "best", "steadier"):
            raise ConfigError(f"{where}.min_effect", c["min_effect"], f"a {kind} claim has a margin, not a "
                              "minimum effect (greater, best and steadier claims have one)")
        if isinstance(c["min_effect"], bool) or not isinstance(c["min_effect"], (int, float)) \
                or not 0 <= c["min_effect"] < 100:
            raise ConfigError(f"{where}.min_effect", c["min_effect"], "expected points in [0, 100)")


def _check_seeds(seeds: Any, where: str, scale: str) -> None:
    if not isinstance(seeds, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
        raise ConfigError(where, seeds, "expected a list of integer seeds")
    _unique([str(x) for x in seeds], where)
    if scale != "smoke" and len(seeds) < MIN_SEEDS:
        raise ConfigError(where, seeds, f"a verdict needs {MIN_SEEDS} paired seeds: fix at least {MIN_SEEDS}")


def _unique(items: list[str], where: str) -> None:
    dup = next((x for x in items if items.count(x) > 1), None)
    if dup is not None:
        raise ConfigError(where, dup, "each entry must appear once")


def load_spec(path: Path) -> TableSpec:
    try:
        raw = load_yaml(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(str(path), None, f"not valid YAML: {yaml_problem(e)}") from None
    return parse_spec(raw, Path(path))


def table_files() -> list[Path]:
    return sorted(TABLES_DIR.glob("*.yaml"))


def all_specs() -> dict[str, TableSpec]:
    """Every table shipped with protofl, by name."""
    specs = [load_spec(p) for p in table_files()]
    return {s.name: s for s in specs}


def get_spec(name: str, data: str = "substitute") -> TableSpec:
    """The shipped table ``name`` on ``data`` (paper | substitute)."""
    specs = all_specs()
    if name not in specs:
        raise ConfigError("TABLE", name, "no reproducible table of that name; `protofl reproduce list` shows them: "
                          + ", ".join(specs))
    return specs[name].variant(data)
