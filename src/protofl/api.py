"""The Python API the CLI calls.

```python
import protofl
cfg = protofl.load_config("digits", ["algorithm.name=fedprox", "rounds=5"])
result = protofl.run(cfg)
print(result.summary["final"]["gm"])
```
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from .algorithms import ALGORITHMS
from .config import apply_overrides, check_here, Config, from_dict, parse_override
from .config.coerce import check_path_component
from .data.build import build_federated
from .data.datasets import load_configured
from .data.features import make_scenario
from .engine.callbacks import Callback, OverallProgress
from .engine.checkpoint import save_json, save_text
from .engine.privacy import check_privacy
from .engine.server import ServerContext
from .engine.simulation import run_dir_for, RunResult, Simulation
from .engine.task import model_mismatch, Task
from .engine.train import NonFiniteLossError
from .errors import ConfigError, one_line
from . import run_folder
from .run_folder import CHECKPOINT, COMPLETE, DIVERGED, finished, METRICS, read_rows, read_summary, SUMMARY
from .report import tables
from .report.html import write_report


def fresh_dir(cfg: Config) -> Path:
    """The config's run folder, or the first free ``<name>-N`` beside it (never overwrite),
    claimed by creating it: of two runs started at once with the same name, each gets a
    folder of its own (``mkdir`` succeeds for one of them only)."""
    from .errors import OutputDirError

    base = run_dir_for(cfg)
    d, n = base, 1
    while True:
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            d.mkdir()
            return d
        except FileExistsError:  # another run's (or one being started right now)
            pass
        except OSError as e:
            raise OutputDirError(f"cannot write the run folder {d}: {e.strerror or e} "
                                 f"(set output.dir to a writable folder)") from None
        d = base.with_name(f"{base.name}-{n}")
        n += 1


def _last_written(d: Path) -> float:
    """When a run folder's run last wrote (its metrics, checkpoint or summary)."""
    times = [p.stat().st_mtime for p in (d / METRICS, d / CHECKPOINT, d / SUMMARY) if p.exists()]
    return max(times) if times else d.stat().st_mtime


def newest_run_dir(cfg: Config, log: Optional[Callable[[str], None]] = None) -> Path:
    """The folder ``--resume`` continues: the config's run folder, or, when several runs of
    this config sit beside it (``<name>``, ``<name>-1``, ... by :func:`fresh_dir`), the one
    written last. An explicit ``output.name`` is taken as it is."""
    base = run_dir_for(cfg)
    if cfg.output.name or not base.parent.is_dir():
        return base
    pattern = re.compile(re.escape(base.name) + r"(-\d+)?")
    runs = [d for d in base.parent.iterdir() if d.is_dir() and pattern.fullmatch(d.name) and any(d.iterdir())]
    if len(runs) <= 1:
        return runs[0] if runs else base
    newest = max(runs, key=lambda d: (_last_written(d), d.name))
    (log or _stderr)(f"protofl: {len(runs)} runs of this config in {base.parent}: resuming the newest, {newest.name}")
    return newest


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def run(cfg: Config, resume: bool = False, callbacks: Iterable[Callback] = (),
        run_dir: Optional[Path] = None, log: Optional[Callable[[str], None]] = None) -> RunResult:
    """Run one simulation.

    ``resume=True`` continues the run folder of this config from its last checkpoint (or
    starts it; of several runs of the config, the one written last); a run already
    complete there is returned as it is, without any work (``RunResult.already_complete``).
    Otherwise a fresh folder is used and existing results are kept. Before any work,
    :func:`check_task` builds what the run needs (data, partition, model, method) without
    training, so an impossible combination stops at once with a
    :class:`~protofl.errors.ConfigError`.
    """
    check_here(cfg)
    task = None
    if run_dir is None and not resume:
        task = check_task(cfg)  # before the folder is claimed: a refused run leaves nothing behind
        run_dir = fresh_dir(cfg)
    elif run_dir is None:
        run_dir = newest_run_dir(cfg, log)
    run_dir = Path(run_dir)
    if resume:
        summary = read_summary(run_dir)
        if summary is not None and not extendable(cfg) and summary.get("rounds") != cfg.rounds:
            raise ConfigError("rounds", cfg.rounds, f"{total_rounds_dependence(cfg)} depends on the total number "
                              f"of rounds, so its run of {summary.get('rounds')} rounds in {run_dir} cannot be "
                              "resumed with another")
        done = ended(run_dir, cfg.rounds, cfg.fingerprint())
        if done is not None:  # complete, diverged or stopped: running it again gives the same run
            return RunResult(run_dir, read_rows(run_dir / METRICS), done, already_complete=True)
    return Simulation(cfg, callbacks=callbacks, run_dir=run_dir, task=task or check_task(cfg)).run(resume=resume)


def is_complete(run_dir: Path, rounds: int) -> bool:
    """Whether the run has all its ``rounds`` rounds: what a table reads as a result (a
    run that diverged or stopped has ended, :func:`ended`, but is not a full result)."""
    s = read_summary(run_dir)
    return s is not None and s.get("status") == COMPLETE and s.get("rounds_completed") == rounds


def ended(run_dir: Path, rounds: int, fingerprint: Optional[str] = None) -> Optional[dict]:
    """The one rule for "this run is done" (``run --resume``, ``compare``, ``sweep``,
    ``reproduce``): the summary of the run when it is a run of ``rounds`` rounds (and of
    the config ``fingerprint``, where given) that is complete, diverged before its last
    round (a NaN/inf loss) or stopped at its privacy target (:func:`protofl.run_folder.finished`):
    running it again gives the same run. Else None. Whether its results enter a table is
    the table's rule: a diverged run is named there, never averaged in."""
    s = finished(Path(run_dir))
    if s is None or s.get("rounds") != rounds:
        return None
    return s if fingerprint is None or s.get("fingerprint") == fingerprint else None


# ---------------------------------------------------------------------------------------
# up-front checks: every impossible combination stops before any work
# ---------------------------------------------------------------------------------------
@contextmanager
def _random_state_kept():
    """The global random streams (torch, numpy, random) as they were on entry, on exit."""
    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


def check_task(cfg: Config, datasets: Optional[dict] = None) -> Task:
    """Build everything a run of ``cfg`` builds before its first round, without training,
    and return it (:class:`~protofl.engine.task.Task`: the run then uses it, nothing is
    built twice; the initial server state is kept for a fresh run).

    :func:`~protofl.config.from_dict` has checked every name, key and value on its own;
    this checks how the components meet, where only the data can tell: the partition
    against the dataset (classes, samples, natural users), the model against the input
    shape and type (each client's architecture is built and computes class scores for two
    training samples), and the method against the model (its ``__init__``, ``adapt_model``
    and ``server_init``, e.g. FedGELA's simplex ETF needs feature_dim >= C - 1). Each
    failure is a :class:`~protofl.errors.ConfigError` naming the key; the global random
    streams are left as they were. ``datasets``: a cache of loaded datasets (a grid checks
    many configs on the same data).
    """
    with _random_state_kept():
        task = Task.build(cfg, build_federated(cfg, _dataset_for(cfg, datasets)))
        ds, algo = task.fed.dataset, task.algorithm
        x = ds.normalize(ds.x_train[:2])
        models = task.models("cpu")
        archs = {repr(sorted(kw.items())): kw for kw in (task.arch(k) for k in range(task.fed.num_clients))}
        for kw in archs.values():
            try:
                model = models.get(kw).eval()
            except (ValueError, RuntimeError) as e:  # this client's architecture, or the method's change to it
                if isinstance(e, ConfigError):
                    raise
                raise model_mismatch(cfg, ds, one_line(e, 300), kw) from e
            try:
                with torch.inference_mode():
                    model(x)
            except Exception as e:  # e.g. an MLP on token ids: the first batch would fail the same way
                raise model_mismatch(cfg, ds, f"model {cfg.model.name!r} cannot compute on these inputs "
                                     f"({one_line(e, 200)})", kw) from e
            finally:
                model.train()  # the run uses this model object: as built
        try:
            task.initial_state = algo.server_init(ServerContext(task))
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError("algorithm.name", cfg.algorithm.name,
                              f"cannot start with model {cfg.model.name!r}: {one_line(e, 300)}") from e
        check_privacy(cfg, algo, models.get(task.arch(0)))  # what privacy.mode can cover here
    return task


def _dataset_for(cfg: Config, datasets: Optional[dict]):
    """The loaded dataset of ``cfg`` from ``datasets`` (loading it there on a miss; one
    dataset is kept at a time), or None: without a cache, or for a feature scenario that
    builds its own data."""
    if datasets is None:
        return None
    scenario = make_scenario(cfg.features.name, cfg.features.params)
    if scenario is not None and scenario.builds_dataset:
        return None
    key = json.dumps([cfg.data.name, cfg.data.root, cfg.data.params, cfg.seed], sort_keys=True, default=str)
    if key not in datasets:
        datasets.clear()
        datasets[key] = load_configured(cfg)
    return datasets[key]


def check_runs(runs: Iterable[tuple[str, Config]]) -> None:
    """:func:`check_task` for every (label, config) of a grid, before its first run: a typo
    or an impossible grid point costs seconds, not the runs before it. Identical tasks
    are checked once and each dataset is loaded once (configs are taken in data order)."""
    def data_key(item):
        c = item[1]
        return json.dumps([c.data.name, c.data.root, c.data.params, c.seed], sort_keys=True, default=str)

    datasets: dict = {}
    seen: set[str] = set()
    for label, c in sorted(runs, key=data_key):
        key = c.fingerprint(ignore=("output", "execution"))
        if key in seen:
            continue
        seen.add(key)
        try:
            check_task(c, datasets)
        except ConfigError as e:
            raise ConfigError(e.key, e.value, f"{e.allowed} (run {label}, seed {c.seed})") from e


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
# (lr * lr_decay^(r-1), or its step schedule) and every registered method depend on the
# round index only. The one visible difference: the old last round carries the evaluation
# that every last round gets (PM(V)/PM(L) when ``eval.personal_every`` would have skipped
# it). Two things depend on the total, and their runs are kept per number of rounds and
# never extended: ``training.schedule: cosine`` (its lr at round r reads ``rounds``), and a
# method whose updates do (it sets ``Algorithm.uses_total_rounds = True``).
# ``tests/test_report.py`` checks an extended run against a fresh one.
# ---------------------------------------------------------------------------------------
def total_rounds_dependence(cfg: Config) -> Optional[str]:
    """What in ``cfg`` depends on the total number of rounds (so that a finished run of it
    cannot be continued to more rounds): ``"training.schedule: cosine"`` or the method's
    name; None when nothing does."""
    if cfg.training.schedule == "cosine":
        return "training.schedule: cosine"
    if ALGORITHMS.get(cfg.algorithm.name).uses_total_rounds:
        return cfg.algorithm.name
    return None


def extendable(cfg: Config) -> bool:
    """Whether a finished run of ``cfg`` may be continued to more rounds (see the reuse rule)."""
    return total_rounds_dependence(cfg) is None


def grid_config(cfg: Config, method: dict, seed: int, label: str) -> Config:
    raw = cfg.to_dict()
    base = raw["algorithm"] if raw["algorithm"]["name"] == method["algorithm"]["name"] else {}
    raw["algorithm"] = {**base, **method["algorithm"]}  # the config's params count for its own method
    raw["seed"] = seed
    raw["output"] = {**raw["output"], "name": None}
    c = from_dict(apply_overrides(raw, method.get("config", {})))
    c.output.name = f"{label}-s{seed}-{c.fingerprint()}"
    if not extendable(c):
        c.output.name += f"-R{c.rounds}"
    check_path_component("output.name", c.output.name)  # the label names a folder: it must stay one
    return c


def _set_name(labels: Iterable[str], limit: int = 60) -> str:
    """A file-name-safe name for a set of method labels, e.g. ``fedavg+prox``."""
    labels = list(labels)
    name = "+".join(re.sub(r"[^\w.\-]+", "_", x) for x in labels)
    if len(name) > limit:
        name = name[:limit - 9].rstrip("+_") + "-" + hashlib.sha256("+".join(labels).encode()).hexdigest()[:8]
    return name


def write_tables(rows: list[dict], out: Path, labels: Iterable[str], stem: str = "compare",
                 note: str = "") -> list[Path]:
    """``<stem>.{md,tex,csv}``: the table of the latest grid in ``out``.

    A later grid with another set of methods must not lose the earlier set's table, and
    no two files may hold the same table: when ``out`` holds the table of another set,
    that table first moves to ``<stem>-<its labels>.{md,tex,csv}``; an older copy under
    this set's own name is superseded and removed.
    """
    labels = list(labels)
    written, meta = [], out / f"{stem}.json"
    try:
        before = list(json.loads(meta.read_text())["groups"]) if meta.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        before = None  # unreadable: the table beside it cannot be named, so it is simply replaced
    exts = ("md", "tex", "csv")
    if before is not None and before != labels:
        for ext in exts:
            if (out / f"{stem}.{ext}").exists():
                os.replace(out / f"{stem}.{ext}", out / f"{stem}-{_set_name(before)}.{ext}")
    md = tables.to_markdown(rows, with_caption=True) + (f"\n{note}\n" if note else "")
    for ext, text in (("md", md), ("tex", tables.to_latex(rows)), ("csv", tables.to_csv(rows))):
        (out / f"{stem}-{_set_name(labels)}.{ext}").unlink(missing_ok=True)
        p = out / f"{stem}.{ext}"
        save_text(p, text)
        written.append(p)
    return written


def compare(cfg: Config, methods: dict[str, dict], seeds: list[int], out: Path,
            callbacks: Iterable[Callback] = (), log=print, select: str = "final",
            report: bool = True, diverged: Optional[list] = None) -> tuple[list[dict], Path]:
    """Run every (method, seed) that has not ended in ``out`` (:func:`ended`, the rule
    ``sweep`` follows too; finished runs are extended to more rounds by the reuse rule
    above), then :func:`finish_grid`. A run that diverged (now or before) is left out of
    the table and logged; ``diverged``, a list, receives its (label, seed, folder)."""
    tables.parse_select(select)
    out = Path(out)
    # every (method, seed) is resolved and checked before the first run starts
    planned: list[tuple[str, int, Config, Path]] = []
    for label, method in methods.items():
        for seed in seeds:
            try:
                c = grid_config(cfg, method, seed, label)
            except ConfigError as e:
                raise ConfigError(e.key, e.value, f"{e.allowed} (--methods entry {label})") from e
            c.output.dir = str(out)
            planned.append((label, seed, c, run_dir_for(c)))
    check_runs((label, c) for label, _, c, d in planned if ended(d, c.rounds) is None)
    groups: dict[str, list[Path]] = {}
    bad: list = [] if diverged is None else diverged
    progress = OverallProgress(len(planned))
    for label, seed, c, d in planned:
        done = ended(d, c.rounds)
        if done is not None:
            how = done.get("status")
            log(f"{progress.prefix('skip')} {label} seed {seed}: {how} in {d}"
                + (f" ({done.get('error')})" if how != "complete" else ""))
            progress.finished(ran=False)
        else:
            log(f"{progress.prefix()} {label} seed {seed} -> {d}{progress.eta()}")
            t0 = time.perf_counter()
            try:
                done = run(c, resume=True, callbacks=callbacks, run_dir=d).summary
            except NonFiniteLossError as e:  # its summary says diverged: a result of its config
                done = {"status": DIVERGED, "error": str(e)}
                log(f"[diverged] {label} seed {seed}: {e}")
            progress.finished(ran=True, seconds=time.perf_counter() - t0)
        if done.get("status") == DIVERGED:
            bad.append((label, seed, d))
        else:
            groups.setdefault(label, []).append(d)
    rows = finish_grid(groups, out, "compare", select=select, report=report,
                       meta={"seeds": seeds, "methods": methods, "diverged": [_in(out, d) for _, _, d in bad]}, log=log)
    return rows, out


def _in(out: Path, d: Path) -> str:
    """A run folder as a grid's json names it: relative to the grid's folder when inside it."""
    return str(Path(d).relative_to(out)) if Path(d).is_relative_to(out) else str(d)


def finish_grid(groups: dict[str, list[Path]], out: Path, stem: str, select: str = "final",
                report: bool = True, meta: Optional[dict] = None, log=None) -> list[dict]:
    """The end of every grid of runs (compare, sweep): one row per label (mean ± std over
    its runs) written by :func:`write_tables`, ``<stem>.json`` (which runs form each row;
    what ``protofl report`` reads) and, with ``report``, ``report.html``. A run that
    collapsed (:func:`protofl.run_folder.collapsed`: its final accuracy at chance) is no
    result: it is left out of its row, named under the table and in ``<stem>.json``
    (``collapsed``), and logged."""
    kept: dict[str, list[Path]] = {}
    collapsed: dict[str, str] = {}
    for label, dirs in groups.items():
        for d in dirs:
            why = run_folder.collapsed(d)
            if why is None:
                kept.setdefault(label, []).append(d)
                continue
            collapsed[_in(out, d)] = f"{label}: {why}"
            if log is not None:
                log(f"[collapsed] {label}: {d}: {why}; left out of the table")
    groups = kept
    rows = tables.compare_rows(groups, select=select)
    out.mkdir(parents=True, exist_ok=True)
    note = ("Left out, no result: " + "; ".join(f"{d} ({why})" for d, why in collapsed.items()) + "."
            if collapsed else "")
    write_tables(rows, out, groups, stem, note)
    save_json(out / f"{stem}.json", {
        **(meta or {}), "select": select, **({"collapsed": collapsed} if collapsed else {}),
        "groups": {label: [_in(out, d) for d in dirs] for label, dirs in groups.items()}})
    if report and groups:  # every run diverged: no report of nothing (the runs are named)
        write_report(out, select=select)
    return rows
