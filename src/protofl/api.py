"""The Python API the CLI calls.

```python
import protofl
cfg = protofl.load_config("digits", ["algorithm.name=fedprox", "rounds=5"])
result = protofl.run(cfg)
print(result.summary["final"]["gm"])
```
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Optional

from .config import Config
from .engine.callbacks import Callback, OverallProgress
from .engine.simulation import RunResult, Simulation, run_dir_for, SUMMARY
from .errors import ConfigError


def fresh_dir(cfg: Config) -> Path:
    """The config's run folder, or the first free ``<name>-N`` beside it (never overwrite)."""
    base = run_dir_for(cfg)
    d, n = base, 1
    while d.exists() and any(d.iterdir()):
        d = base.with_name(f"{base.name}-{n}")
        n += 1
    return d


def run(cfg: Config, resume: bool = False, callbacks: Iterable[Callback] = (),
        run_dir: Optional[Path] = None) -> RunResult:
    """Run one simulation.

    ``resume=True`` continues the run folder of this config from its last checkpoint
    (or starts it); otherwise a fresh folder is used and existing results are kept.
    """
    from .config import check_here

    check_here(cfg)
    if run_dir is None:
        run_dir = run_dir_for(cfg) if resume else fresh_dir(cfg)
    summary = Path(run_dir) / SUMMARY
    if resume and not extendable(cfg) and summary.exists():
        import json

        old = json.loads(summary.read_text()).get("rounds")
        if old != cfg.rounds:
            raise ConfigError("rounds", cfg.rounds, f"{cfg.algorithm.name} depends on the total number of "
                              f"rounds, so its run of {old} rounds in {run_dir} cannot be resumed with another")
    return Simulation(cfg, callbacks=callbacks, run_dir=run_dir).run(resume=resume)


def is_complete(run_dir: Path, rounds: int) -> bool:
    import json

    p = Path(run_dir) / SUMMARY
    if not p.exists():
        return False
    s = json.loads(p.read_text())
    return s.get("status") == "complete" and s.get("rounds_completed") == rounds


# ---------------------------------------------------------------------------------------
# grids of runs: methods x seeds
# ---------------------------------------------------------------------------------------
def split_top_level(text: str) -> list[str]:
    """``"0.01,0.05"`` -> ["0.01", "0.05"]; commas inside [], () or {} do not split
    (``"fedavg,fedprox(mu=0.1,weighting=uniform)"``, ``"[64,64],[128]"``)."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch in "[({"
        depth -= ch in "])}"
        cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


def parse_methods(spec: str) -> dict[str, dict]:
    """``"fedavg,fedprox(mu=0.1),uh=fednh(rho=1.0),fast=fedavg(training.lr=0.1)"`` ->
    {label: {"algorithm": {name, params...}, "config": {dotted key: value}}}.

    Each item is ``[label=]name[(key=value;key=value)]`` (``;`` or ``,`` inside the
    parentheses separate them). A key without a dot is a parameter of the method
    (``mu``); a dotted key (``training.lr``, ``participation.p``, ``algorithm.mu``) or
    ``rounds`` sets that config key for this entry only. Seeds come from ``--seeds``.
    """
    import re

    from .config import ConfigError, parse_override

    items = split_top_level(spec)
    out: dict[str, dict] = {}
    pat = re.compile(r"^\s*(?:([\w.\-+]+)\s*=\s*)?([\w\-]+)\s*(?:\((.*)\))?\s*$")
    for item in filter(str.strip, items):
        m = pat.match(item)
        if not m:
            raise ConfigError("--methods", item, "expected [label=]name[(key=value;...)]")
        label, name, args = m.group(1) or m.group(2), m.group(2), m.group(3)
        ov: dict = {"algorithm": {"name": name}, "config": {}}
        for kv in filter(str.strip, re.split(r"[;,]", args or "")):
            k, v = parse_override(kv)
            if k == "seed":
                raise ConfigError(f"--methods {label}", kv, "seeds come from --seeds")
            if k.startswith("algorithm."):
                k = k[len("algorithm."):]
                if k == "name":
                    raise ConfigError(f"--methods {label}", kv, "the method is the name before the parentheses")
            if "." in k or k == "rounds":
                ov["config"][k] = v
            else:
                ov["algorithm"][k] = v
        if label in out:
            raise ConfigError("--methods", label, "each label must appear once")
        out[label] = ov
    return out


# ---------------------------------------------------------------------------------------
# Reuse rule. A compare in a folder that already holds a finished run of the same config
# and seed continues that run from its last checkpoint to the new number of rounds
# instead of starting again (and skips it when the rounds match). The run fingerprint
# therefore leaves out ``rounds``. That is exact because nothing in a run depends on the
# total number of rounds: client sampling, participation, the learning rate
# (lr * lr_decay^(r-1)) and every registered method depend on the round index only. The
# one visible difference: the old last round carries the evaluation that every last
# round gets (PM(V)/PM(L) when ``eval.personal_every`` would have skipped it). A method
# whose updates depend on the total (e.g. a schedule over ``rounds``) must set
# ``Algorithm.uses_total_rounds = True``: its runs are then kept per number of rounds
# and never extended. ``tests/test_report.py`` checks an extended run against a fresh one.
# ---------------------------------------------------------------------------------------
def extendable(cfg: Config) -> bool:
    """Whether a finished run of ``cfg`` may be continued to more rounds (see the reuse rule)."""
    from .algorithms import ALGORITHMS

    return not ALGORITHMS.get(cfg.algorithm.name).uses_total_rounds


def grid_config(cfg: Config, method: dict, seed: int, label: str) -> Config:
    from .config import apply_overrides, from_dict

    raw = cfg.to_dict()
    base = raw["algorithm"] if raw["algorithm"]["name"] == method["algorithm"]["name"] else {}
    raw["algorithm"] = {**base, **method["algorithm"]}  # the config's params count for its own method
    raw["seed"] = seed
    raw["output"] = {**raw["output"], "name": None}
    c = from_dict(apply_overrides(raw, method.get("config", {})))
    c.output.name = f"{label}-s{seed}-{c.fingerprint()}"
    if not extendable(c):
        c.output.name += f"-R{c.rounds}"
    return c


def _set_name(labels: Iterable[str], limit: int = 60) -> str:
    """A file-name-safe name for a set of method labels, e.g. ``fedavg+prox``."""
    import hashlib
    import re

    labels = list(labels)
    name = "+".join(re.sub(r"[^\w.\-]+", "_", x) for x in labels)
    if len(name) > limit:
        name = name[:limit - 9].rstrip("+_") + "-" + hashlib.sha256("+".join(labels).encode()).hexdigest()[:8]
    return name


def write_tables(rows: list[dict], out: Path, labels: Iterable[str], stem: str = "compare") -> list[Path]:
    """``<stem>.{md,tex,csv}`` (the latest table in ``out``) and the same under the name of
    the method set, ``<stem>-<labels>.{md,tex,csv}``: a later compare with other methods
    replaces ``compare.md`` but never the earlier set's own table."""
    from .report import tables

    written = []
    for name in (stem, f"{stem}-{_set_name(labels)}"):
        for ext, text in (("md", tables.to_markdown(rows, with_caption=True)), ("tex", tables.to_latex(rows)),
                          ("csv", tables.to_csv(rows))):
            p = out / f"{name}.{ext}"
            p.write_text(text)
            written.append(p)
    return written


def compare(cfg: Config, methods: dict[str, dict], seeds: list[int], out: Path,
            callbacks: Iterable[Callback] = (), log=print, select: str = "final",
            report: bool = True) -> tuple[list[dict], Path]:
    """Run every (method, seed) not already complete in ``out`` (extending finished runs
    to more rounds by the reuse rule above), then :func:`finish_grid`."""
    from .report import tables

    tables.parse_select(select)
    out = Path(out)
    groups: dict[str, list[Path]] = {}
    progress = OverallProgress(len(methods) * len(seeds))
    for label, method in methods.items():
        for seed in seeds:
            c = grid_config(cfg, method, seed, label)
            c.output.dir = str(out)
            d = run_dir_for(c)
            groups.setdefault(label, []).append(d)
            if is_complete(d, c.rounds):
                log(f"{progress.prefix('skip')} {label} seed {seed}: complete in {d}")
                progress.finished(ran=False)
                continue
            log(f"{progress.prefix()} {label} seed {seed} -> {d}{progress.eta()}")
            t0 = time.perf_counter()
            run(c, resume=True, callbacks=callbacks, run_dir=d)
            progress.finished(ran=True, seconds=time.perf_counter() - t0)
    rows = finish_grid(groups, out, "compare", select=select, report=report,
                       meta={"seeds": seeds, "methods": methods})
    return rows, out


def finish_grid(groups: dict[str, list[Path]], out: Path, stem: str, select: str = "final",
                report: bool = True, meta: Optional[dict] = None) -> list[dict]:
    """The end of every grid of runs (compare, sweep): one row per label (mean ± std over
    its runs) written by :func:`write_tables`, ``<stem>.json`` (which runs form each row;
    what ``protofl report`` reads) and, with ``report``, ``report.html``."""
    import json

    from .report import tables

    rows = tables.compare_rows(groups, select=select)
    out.mkdir(parents=True, exist_ok=True)
    write_tables(rows, out, groups, stem)
    (out / f"{stem}.json").write_text(json.dumps({
        **(meta or {}), "select": select,
        "groups": {label: [str(Path(d).relative_to(out)) if Path(d).is_relative_to(out) else str(d)
                           for d in dirs] for label, dirs in groups.items()}}, indent=1))
    if report:
        from .report.html import write_report

        write_report(out, select=select)
    return rows
