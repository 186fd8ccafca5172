"""Command line: ``protofl {run,compare,sweep,reproduce,partition,demo,list,data,configs,plot,report,flower} ...``.

Exit codes: 0 success; 1 a bug in protofl (two lines; ``--debug`` shows the traceback);
2 bad input (config, names, missing or damaged data, a combination of components that
cannot work, impossible partition, unusable arguments); 3 training diverged (NaN/inf
loss); 4 a file could not be read or written (a full disk, permissions; what was kept is
said); 130 interrupted. Every error is at most three lines, never a traceback, unless
``--debug`` is given or ``PROTOFL_DEBUG=1`` is set.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

EXIT_BUG = 1
EXIT_BAD_INPUT = 2
SELECT_HELP = ("which value of a run the table reports: final (default), best (the best evaluation, "
               "chosen on the test set) or last:K (mean of the last K evaluations)")
EXIT_DIVERGED = 3
EXIT_IO = 4
DEBUG_ENV = "PROTOFL_DEBUG"


def _summary_line(summary: dict) -> str:
    from .metrics import METRIC_INFO, summary_metrics

    f = summary.get("final", {})
    parts = [f"{k}={100 * f[k]:.2f}%" if METRIC_INFO[k].unit == "accuracy" else f"{k}={f[k]:.4g}"
             for k in summary_metrics() if isinstance(f.get(k), (int, float))]
    if "epsilon" in f:  # privacy.*: the privacy spent, at privacy.delta
        parts.append(f"epsilon={f['epsilon']:.2f}" + (" (not private: seeded noise)" if f.get("privacy_seeded")
                                                      else ""))
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------
def cmd_run(args) -> int:
    from . import api
    from .config import config_from_args

    cfg = config_from_args(args)
    result = api.run(cfg, resume=args.resume)
    status = result.summary.get("status")
    if result.already_complete and status == "diverged":  # it diverges again in the same round
        print(f"{result.dir} diverged in an earlier run ({result.summary.get('rounds_completed')} of {cfg.rounds} "
              f"rounds; {result.summary.get('error')}): nothing to do; the same config diverges again",
              file=sys.stderr)
        return EXIT_DIVERGED
    if result.already_complete and status == "complete":
        print(f"{result.dir} is already complete ({cfg.rounds} of {cfg.rounds} rounds): nothing to do. "
              + _extend_hint(args, cfg))
    elif result.already_complete:  # stopped at its privacy target
        print(f"{result.dir} ended earlier ({status}): nothing to do.")
    print(f"{cfg.algorithm.name}: {result.summary['rounds_completed']} rounds -> {result.dir}")
    if result.summary.get("status") == "stopped":  # privacy.target_epsilon reached
        print(result.summary["error"])
    print(_summary_line(result.summary))
    from .engine.store import usage_line

    state = usage_line(result.summary.get("client_state"))
    if state:
        print(state)
    return 0


def _extend_hint(args, cfg) -> str:
    """How to continue a complete run to more rounds: the same command with ``rounds=N``."""
    from .api import total_rounds_dependence

    more = 2 * cfg.rounds
    reason = total_rounds_dependence(cfg)
    if reason is not None:
        return (f"{reason} depends on the total number of rounds, so a longer run starts afresh: "
                f"the same command with rounds={more} and without --resume")
    kept = [o for o in (args.overrides or []) if not o.startswith("rounds=")]
    return "To extend it, resume with more rounds: " + " ".join(
        ["protofl run", args.config, *kept, "--resume", f"rounds={more}"])


def cmd_compare(args) -> int:
    from . import api
    from .config import config_from_args
    from .report import tables

    cfg = config_from_args(args)
    methods = api.parse_methods(args.methods or cfg.algorithm.name)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.out) if args.out else Path(cfg.output.dir) / "compare"
    diverged: list = []
    rows, out = api.compare(cfg, methods, seeds, out, log=lambda m: print(m, file=sys.stderr),
                            select=args.select, diverged=diverged)
    print(tables.to_markdown(rows, with_caption=True))
    print(f"tables: {out / 'compare.md'} (.tex, .csv beside it)"
          + (f"; report: {out / 'report.html'}" if (out / "report.html").exists() else ""))
    if diverged:
        print(f"protofl: {len(diverged)} run(s) diverged and are left out of the table: "
              + ", ".join(f"{label} seed {seed}" for label, seed, _ in diverged), file=sys.stderr)
        return EXIT_DIVERGED
    return 0


def cmd_sweep(args) -> int:
    from . import api
    from .config import config_from_args
    from .report import tables
    from .records import carried
    from .sweeps import parse_grid, plan, sweep

    cfg = config_from_args(args)
    grid = parse_grid(args.grid or [])
    methods = api.parse_methods(args.methods) if args.methods else None
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else [cfg.seed]
    out = Path(args.out) if args.out else Path(cfg.output.dir) / "sweep"
    records = Path(args.records) if args.records else None
    folders = [r.dir.relative_to(out) for r in plan(cfg, grid, seeds, out, methods)] if records else []
    with carried(records, out, folders):
        rows, out, failed = sweep(cfg, grid, seeds, out, methods=methods, jobs=args.jobs,
                                  log=lambda m: print(m, file=sys.stderr))
    print(tables.to_markdown(rows))
    print(f"table: {out / 'sweep.md'} and {out / 'sweep.csv'}")
    if failed:
        print(f"protofl: {len(failed)} run(s) diverged and are left out of the table: "
              + ", ".join(f"{r.label} seed {r.seed}" for r in failed), file=sys.stderr)
        return EXIT_DIVERGED
    return 0


def cmd_reproduce(args) -> int:
    from . import reproduce as R
    from .reproduce.render import list_text

    if args.table == "list":
        print(list_text(R.all_specs()))
        print("runs: settings x methods x the scale's seeds (docs/reproduce.md)")
        return 0
    if args.table == "quotes":
        from .errors import ConfigError
        from .reproduce.pages import fill_quotes

        files = sorted(Path(args.docs).rglob("*.md")) if Path(args.docs).is_dir() else [Path(args.docs)]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError("--docs", args.docs, "not a markdown file or a folder of them")
        stale = []
        for f in files:
            text = f.read_text(encoding="utf-8")
            new = fill_quotes(text, Path.cwd(), str(f))
            if new != text:
                stale.append(f)
                if args.write:
                    f.write_text(new, encoding="utf-8")
        verb = "written" if args.write else "stale"
        for f in stale:
            print(f"{verb}: {f}")
        return 1 if stale and not args.write else 0
    if args.table == "index":
        from .errors import ConfigError
        from .reproduce.render import index_text, write_index

        pages = Path(args.pages)
        if not pages.is_dir():
            raise ConfigError("--pages", args.pages, "not a folder of reproduction pages")
        if args.write is True:
            raise ConfigError("--write", None, "index: the file whose index block to replace, e.g. "
                              "benchmarks/RESULTS.md")
        also = tuple(Path(a) for a in (args.also or []))
        missing = [a for a in also if not a.is_file()]
        if missing:
            raise ConfigError("--also", str(missing[0]), "not a page")
        if args.write:
            write_index(pages, Path(args.write), R.all_specs(), also)
            print(f"written: the index block of {args.write}")
        else:
            sys.stdout.write(index_text(pages, R.all_specs(), Path.cwd(), also))
        return 0
    overrides = list(args.overrides or [])
    if args.data_dir:
        overrides.append(f"data.root={args.data_dir}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else None
    spec = R.get_spec(args.table)
    data = args.data
    if data is None:  # the paper's data where it is present, else the substitute (and say so)
        data, why = R.default_data(spec, args.scale, overrides)
        if why:
            print(why, file=sys.stderr)
    p = R.plan(spec.variant(data), args.scale, seeds, overrides, Path(args.out) if args.out else None,
               Path(args.records) if args.records else None)
    if args.dry_run:
        from .reproduce.render import filled_from, planned_configs

        print(f"data: {p.spec.runs_on} ({filled_from(p.spec.dataset, planned_configs(p))})")
        to_fetch = R.data_missing(p)
        if to_fetch:
            print("to fetch on first use: " + ", ".join(f"{n} into {root}" for n, root, _ in to_fetch))
        for sp in p.settings:
            print(f"{sp.setting.label}: {len(sp.runs)} runs, {sp.cfg.rounds} rounds -> {sp.out}")
            for r in sp.runs:
                split = sp.part_of(r).split
                print(f"  {r.label} seed {r.seed}{f' ({split.id})' if split else ''}: {r.dir.name}")
        print(f"{p.num_runs} runs in all")
        return 0
    only = R.row_labels(p, args.methods) if args.methods else None
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    with R.records_carried(p, log):
        failed = [] if args.no_run else R.execute(p, jobs=args.jobs, log=log, methods=only)
    from .reproduce.render import write_all

    files = write_all(R.collect(p))
    sys.stdout.write(files[0].read_text())
    print(f"written: {', '.join(str(f) for f in files)}")
    if failed:
        print(f"protofl: {len(failed)} run(s) diverged and are left out of the table", file=sys.stderr)
        return EXIT_DIVERGED
    return 0


def cmd_partition(args) -> int:
    import numpy as np

    from .config import config_from_args
    from .data.build import build_federated
    from .report.plots import partition_heatmap

    cfg = config_from_args(args)
    fed = build_federated(cfg)
    counts = fed.class_counts()
    C = counts.shape[1]
    width = max(5, len(str(int(counts.max()))) + 1)
    print(f"{cfg.data.name}: {fed.num_clients} clients, {C} classes, partition {cfg.partition.name} "
          f"{cfg.partition.params}")
    print("client".rjust(6) + "".join(str(c).rjust(width) for c in range(C)) + "total".rjust(8) + "  classes")
    for k, row in enumerate(counts):
        print(str(k).rjust(6) + "".join(str(int(v)).rjust(width) for v in row) + str(int(row.sum())).rjust(8)
              + f"  {int((row > 0).sum())}")
    sizes = counts.sum(1)
    print(f"samples per client: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}; "
          f"local test sizes: min {min(map(len, fed.test_idx))}, max {max(map(len, fed.test_idx))}")
    out = Path(args.out) if args.out else Path(cfg.output.dir) / f"partition-{cfg.data.name}-{cfg.partition.name}.png"
    partition_heatmap(counts, out, title=f"{cfg.data.name} / {cfg.partition.name} ({fed.num_clients} clients)",
                      class_names=fed.dataset.class_names, kind=args.kind, scale=args.scale)
    print(f"figure: {out}")
    return 0


def cmd_list(args) -> int:
    from .algorithms import ALGORITHMS
    from .data.datasets import DATASETS, HF_USAGE
    from .data.features import FEATURES
    from .data.partition import PARTITIONERS
    from .models import MODELS

    from .algorithms.base import by_family

    print("methods:")
    for family, names in by_family(ALGORITHMS.names()).items():
        print(f"  {family}: {', '.join(names)}")
    for title, reg in (("datasets", DATASETS), ("models", MODELS), ("partitioners", PARTITIONERS),
                       ("feature scenarios", FEATURES)):
        print(f"{title}: {', '.join(reg.names() + reg.usages() + ([HF_USAGE] if reg is DATASETS else []))}")
    return 0


def cmd_data(args) -> int:
    from .data import fetch as F
    from .data.catalog import CATALOG
    from .data.datasets import COMPOSITE, dataset_parts, DATASETS, resolve_root

    root = resolve_root(args.root)
    what = args.data_command
    # a composite dataset (digit5) is its parts, each fetched and verified on its own
    args.names = [part for n in getattr(args, "names", None) or [] for part in dataset_parts(n)]
    if what == "list":
        print(f"data root: {root} (--root, ${'PROTOFL_DATA'}, else ~/.cache/protofl/data)")
        for name in [*CATALOG, *[n for n in DATASETS.names() if n not in CATALOG]]:
            src = CATALOG.get(name)
            if name in COMPOSITE:
                parts = dataset_parts(name)
                have = sum(F.status(CATALOG[n], root).readable for n in parts)
                print(f"{name}: {', '.join(parts)} pooled; each fetched and verified on its own (`protofl data fetch "
                      f"{name}` fetches them all); present: {have} of {len(parts)}")
                continue
            if src is None:
                builtin = {"spiral": "generated in memory", "digits": "bundled with scikit-learn"}
                print(f"{name}: {builtin.get(name, 'not in protofl catalog (a plugin dataset): place it by hand')}; "
                      "nothing to fetch")
                continue
            st = F.status(src, root)
            fetchable = "fetchable" if src.fetchable else f"not fetchable: {src.not_fetchable}"
            print(f"{name}: {src.title}, {src.size_text}; present: {st.present}; checksums: {st.checksums}; "
                  f"{fetchable}")
            pinned = f"checksums from {src.checksum_from}" if src.checksum_from else "no pinned checksums"
            print(f"    source: {src.homepage}; {pinned}; license: {src.license}")
            if not src.fetchable:
                print(f"    by hand: {src.how_to_place(root)}")
        return 0
    if what == "fetch":
        for name in args.names:
            src = F.get_source(name)
            folder = F.fetch(src, root, mirrors=args.mirror or (), download=True)
            print(f"{name}: {len(src.files)} file(s) present and verified in {folder}")
        return 0
    # verify
    names = args.names or [n for n in CATALOG]
    sources = [F.get_source(n) for n in names]
    bad = []
    for src, st in F.verify(sources, root):
        if st.present == "no" and not args.names:
            continue
        print(f"{src.name}: present: {st.present}; checksums: {st.checksums}")
        if st.ok is False:
            bad.append(f"{src.name} ({st.checksums.split(': ', 1)[-1]})")
    if bad:
        print(f"protofl: error: files that are not the published ones: {', '.join(bad)}; fetch them again "
              f"(protofl data fetch NAME) or copy the right files there", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def cmd_configs(args) -> int:
    from .packaged_configs import config_description, packaged_config, packaged_configs

    what = args.configs_command or "list"
    if what == "list":
        configs = packaged_configs()
        if not configs:
            print("protofl: error: no example configs installed (an incomplete installation?)", file=sys.stderr)
            return EXIT_BAD_INPUT
        width = max(map(len, configs))
        for name, path in configs.items():
            print(f"{name.ljust(width)}  {config_description(path)}")
    elif what == "show":
        sys.stdout.write(packaged_config(args.name).read_text())
    elif what == "path":
        print(packaged_config(args.name))
    elif what == "defaults":
        from .config import defaults_yaml

        sys.stdout.write(defaults_yaml())
    return 0


def cmd_plot(args) -> int:
    from .report.plots import curves, expand_runs, group_runs

    dirs = expand_runs(args.runs)
    runs = group_runs(dirs) if args.by == "method" else {d.name: [d] for d in dirs}
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    out = curves(runs, Path(args.out), metrics=metrics, band=args.band)
    print(f"plot: {out} ({', '.join(f'{k}: {len(v)} run(s)' for k, v in runs.items())})")
    return 0


def cmd_report(args) -> int:
    from .report.html import write_report

    out = write_report(Path(args.dir), Path(args.out) if args.out else None, select=args.select)
    print(f"report: {out}")
    return 0


def cmd_demo(args) -> int:
    from .demo import demo

    demo(Path(args.out), rounds=args.rounds, progress=not args.quiet)
    return 0


# ---------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: what is wrong and where the help is (argparse's
    own prints the whole usage, many lines for ``run``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


DEBUG_HELP = f"on an error, also print the full traceback (for bug reports; or set {DEBUG_ENV}=1)"


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    p = Parser(prog="protofl", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"protofl {__version__}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp, optional_config: bool = False):
        sp.add_argument("config", nargs=None if not optional_config else "?",
                        help="YAML config file, or the name of a packaged config (`protofl configs`)")
        sp.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.lr=0.05")
        sp.add_argument("--data-dir", help="data root (default: $PROTOFL_DATA, then ~/.cache/protofl/data)")

    sp = sub.add_parser("run", help="run one simulation")
    with_config(sp)
    sp.add_argument("--resume", action="store_true", help="continue this config's run from its last checkpoint")
    sp.add_argument("--workers", help="worker processes (one thread each); 0 = sequential; auto (default)")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("compare", help="run methods x seeds and tabulate final metrics (mean ± std)")
    with_config(sp)
    sp.add_argument("--methods", help='e.g. "fedavg,fedprox(mu=0.1),uh=fednh(rho=1.0)"')
    sp.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    sp.add_argument("--out", help="output folder (default <output.dir>/compare)")
    sp.add_argument("--workers", help="worker processes per run (0 = sequential, auto)")
    sp.add_argument("--select", default="final", help=SELECT_HELP)
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_compare)

    sp = sub.add_parser("sweep", help="run a grid of config values x seeds (parallel, resumable) and tabulate")
    with_config(sp)
    sp.add_argument("--grid", nargs="+", metavar="KEY=V1,V2",
                    help="dotted keys with comma-separated values, e.g. training.lr=0.01,0.05 algorithm.name=fedavg,fednh")
    sp.add_argument("--methods", help="cross the grid with methods, as in compare: \"fedavg,fedprox(mu=0.1)\"")
    sp.add_argument("--seeds", help="comma-separated seeds (default: the config's seed)")
    sp.add_argument("--jobs", type=int, help="runs at once (default: up to the CPU count / the cores one run keeps "
                    "busy; a worker process starts only when a core is idle and the runs left outweigh its start-up)")
    sp.add_argument("--out", help="output folder (default <output.dir>/sweep)")
    sp.add_argument("--records", help="a folder of run records (docs/reproduce.md): its finished runs are not run "
                                      "again, and every run finished is added to it")
    sp.add_argument("--workers", help="worker processes per run (0 = sequential, auto)")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_sweep)

    sp = sub.add_parser("reproduce", help="rebuild a seed paper's table: ours beside the paper's, with verdicts",
                        description="`protofl reproduce list` shows the tables; `protofl reproduce TABLE` runs "
                        "its grid (resumable; finished runs are reused) and writes table.md, table.csv and "
                        "report.html.")
    sp.add_argument("table", help="a table name from `protofl reproduce list`; list; index (the index of "
                                  "published pages, from the verdicts each page carries); or quotes (the verdict "
                                  "blocks of the docs, filled from the pages: --docs, --write)")
    sp.add_argument("overrides", nargs="*", help="dotted key=value overrides for every run, e.g. execution.device=cuda")
    sp.add_argument("--scale", choices=("smoke", "cpu", "paper"), default="cpu",
                    help="smoke (minutes), cpu (a 2-core machine; the default) or paper (the paper's rounds, "
                    "clients and epochs)")
    sp.add_argument("--seeds", help="comma-separated exploratory seeds, run besides the scale's own (fixed in the "
                                  "table file; the verdicts use exactly those): shown apart, never in a verdict")
    sp.add_argument("--methods", help="comma-separated row labels to run (default: every row); the table "
                                      "still shows every finished run")
    sp.add_argument("--jobs", type=int, help="runs at once (default: CPU count / cores one run uses)")
    sp.add_argument("--out", help="output folder (default <output.dir>/reproduce/TABLE/SCALE; on the paper's data "
                                  "<output.dir>/reproduce/TABLE/paper-data/SCALE)")
    sp.add_argument("--records", help="run records (each finished run's summary, metrics, config and partition, "
                                      "without checkpoints or machine paths; docs/reproduce.md), one file "
                                      "(*.jsonl.gz, e.g. benchmarks/reproductions/records/TABLE-SCALE.jsonl.gz) or "
                                      "a folder: the runs finished there are not run again, and every run finished "
                                      "here is added to it")
    sp.add_argument("--data-dir", help="data root (default: $PROTOFL_DATA, then ~/.cache/protofl/data)")
    sp.add_argument("--data", choices=("paper", "substitute"),
                    help="paper: the paper's own datasets (fetched when missing), models and augmentation; "
                    "substitute: the data the table runs without them (e.g. Fashion-MNIST for CIFAR-10). "
                    "Default: paper when its datasets are present under the data root, else substitute (one line "
                    "says so); the same runs for a table on the paper's data already (docs/reproduce.md)")
    sp.add_argument("--dry-run", action="store_true", help="list the runs and their folders, run nothing")
    sp.add_argument("--no-run", action="store_true", help="only tabulate the runs already finished")
    sp.add_argument("--pages", default="benchmarks/reproductions",
                    help="index: the folder of published pages (default benchmarks/reproductions)")
    sp.add_argument("--write", nargs="?", const=True, default=None,
                    help="index: replace the index block of this file (e.g. benchmarks/RESULTS.md) instead of "
                    "printing it; quotes: rewrite the stale verdict blocks (without: name them, exit 1)")
    sp.add_argument("--also", action="append",
                    help="index: another page that carries its verdicts (e.g. benchmarks/comparison/fmnist.md); "
                    "repeatable")
    sp.add_argument("--docs", default="docs",
                    help="quotes: a markdown file or a folder of them (default docs), run from the repository root")
    sp.set_defaults(func=cmd_reproduce)

    sp = sub.add_parser("partition", help="print per-client class counts and save a heatmap")
    with_config(sp)
    sp.add_argument("--out", help="figure path (PNG, SVG or PDF)")
    sp.add_argument("--kind", choices=("auto", "heatmap", "bars"), default="auto",
                    help="heatmap, or stacked bars per client (auto: bars from 40 clients on)")
    sp.add_argument("--scale", choices=("log", "client", "linear"), default="log",
                    help="colour scale: log counts (default), per-client shares, or linear counts")
    sp.set_defaults(func=cmd_partition)

    sp = sub.add_parser("demo", help="a short demo: FedAvg vs ReBaFL under client dropout on scikit-learn's digits (no download)")
    sp.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    sp.add_argument("--rounds", type=int, default=None, help="rounds per method (default: the demo's own)")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("list", help="registered methods, datasets, models, partitioners, feature scenarios")
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("data", help="the datasets: list them, fetch one (with checksums), verify the files",
                        description="`protofl data list` shows every dataset (source, size, license, present, "
                        "checksums); `protofl data fetch NAME` downloads and verifies one; `protofl data verify "
                        "[NAME]` re-checks the files present. Details: docs/data.md.")
    dsub = sp.add_subparsers(dest="data_command", required=True)
    root_help = "data root (default: $PROTOFL_DATA, then ~/.cache/protofl/data)"
    dp = dsub.add_parser("list", help="every dataset: source, size, license, present?, checksums verified?")
    dp.add_argument("--root", help=root_help)
    dp = dsub.add_parser("fetch", help="download datasets into the data root and verify their checksums")
    dp.add_argument("names", nargs="+", metavar="NAME")
    dp.add_argument("--root", help=root_help)
    dp.add_argument("--mirror", action="append", metavar="URL",
                    help="a mirror (base URL laid out like the data root) tried first; repeatable")
    dp = dsub.add_parser("verify", help="re-read the files present and compare them with the published checksums")
    dp.add_argument("names", nargs="*", metavar="NAME")
    dp.add_argument("--root", help=root_help)
    sp.set_defaults(func=cmd_data)

    sp = sub.add_parser("configs", aliases=["config"],
                        help="the example configs shipped with protofl, and the defaults",
                        description="Without a subcommand: list the packaged example configs. "
                        "`protofl run NAME` runs one (a file of that name in the current folder wins).")
    csub = sp.add_subparsers(dest="configs_command")
    csub.add_parser("list", help="one line per packaged config (the default)")
    cp = csub.add_parser("show", help="print a packaged config, e.g. `protofl configs show digits > my.yaml`")
    cp.add_argument("name")
    cp = csub.add_parser("path", help="where a packaged config is installed")
    cp.add_argument("name")
    csub.add_parser("defaults", help="every config key with its default value (YAML)")
    sp.set_defaults(func=cmd_configs)

    sp = sub.add_parser("plot", help="learning curves of run folders")
    sp.add_argument("runs", nargs="+", help="run folders, or folders of runs (e.g. a compare folder)")
    sp.add_argument("--metrics", default="gm", help="comma-separated metrics (default gm)")
    sp.add_argument("--by", choices=("method", "run"), default="method",
                    help="method (default): one line per method, mean over its seeds; run: one line per folder")
    sp.add_argument("--band", choices=("std", "minmax"), default="std",
                    help="shaded band over seeds: ± 1 sample std (default) or min-max")
    sp.add_argument("--out", default="curves.png")
    sp.set_defaults(func=cmd_plot)

    sp = sub.add_parser("report", help="one self-contained report.html for a run or compare folder")
    sp.add_argument("dir", help="a run folder or a compare folder")
    sp.add_argument("--out", help="output path (default DIR/report.html)")
    sp.add_argument("--select", default="final", help=SELECT_HELP)
    sp.set_defaults(func=cmd_report)

    from .flower.cli import add_flower_parser  # imports flwr only when a flower command runs

    add_flower_parser(sub)
    _debug_after_commands(p)
    return p


def _debug_after_commands(parser: argparse.ArgumentParser) -> None:
    """``--debug`` also after a command, at any depth (``protofl run digits --debug``,
    ``protofl flower local digits --debug``); SUPPRESS keeps a command's default from
    hiding a ``--debug`` given before it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in {id(x): x for x in action.choices.values()}.values():  # aliases share a parser
                sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
                _debug_after_commands(sp)


# The error classes are imported only when an exception is matched (an except clause's
# expression is evaluated then), so `--version` and `configs` do not import torch.
def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from .errors import InputError
    from .registry import UnknownNameError

    return InputError, UnknownNameError


def _diverged_error() -> type[BaseException]:
    from .engine.train import NonFiniteLossError

    return NonFiniteLossError


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Like ``parse_args``, but ``key=value`` overrides may also follow the options
    (``protofl run digits --quiet rounds=2``): argparse stops collecting positionals at
    the first option, so the ones after it come back as unknown and are added here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = [*(args.overrides or []), *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def debug_wanted(args: Optional[argparse.Namespace] = None) -> bool:
    """``--debug`` on the command line, or ``PROTOFL_DEBUG`` set to anything but 0/false/no."""
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no")


def _fail(code: int, *lines: str, debug: bool = False) -> int:
    """Print an error (at most three lines) and return the exit code; with ``debug``, the
    traceback of the exception being handled comes first."""
    if debug:
        import traceback

        traceback.print_exc()
    from .errors import one_line

    for line in lines[:3]:
        print(one_line(line, 1000), file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    debug = debug_wanted(args)
    from .errors import terminate_as_interrupt

    try:
        with terminate_as_interrupt():  # SIGTERM / SIGHUP: as Ctrl-C (checkpoints kept, children stopped)
            return args.func(args)
    except _bad_input_errors() as e:  # config, names, data files, checkpoints, output folder, reports
        return _fail(EXIT_BAD_INPUT, f"protofl: error: {e}", debug=debug)
    except _diverged_error() as e:
        return _fail(EXIT_DIVERGED, f"protofl: training diverged: {e}; the last good checkpoint is kept",
                     debug=debug)
    except KeyboardInterrupt:
        print("protofl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `protofl configs | head -3`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # the machine, not the input: a full disk, a folder that went away
        from .errors import os_error_text

        what = f"{os_error_text(e)}: {e.filename}" if e.strerror and e.filename else str(e)
        return _fail(EXIT_IO, f"protofl: error: {what}", debug=debug)
    except Exception as e:  # noqa: BLE001 - anything else is a bug: say so in two lines
        return _fail(EXIT_BUG, f"protofl: internal error: {type(e).__name__}: {e}",
                     f"protofl: this is a bug; run the command again with --debug (or {DEBUG_ENV}=1) for the "
                     "traceback and report it with the command", debug=debug)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
