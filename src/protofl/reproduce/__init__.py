"""``protofl reproduce``: a seed paper's table in one command, ours beside theirs.

    protofl reproduce list
    protofl reproduce fednh-table1 --scale cpu --data-dir DATA [--data paper|substitute] [--seeds 3,4] [key=value ...]
    protofl reproduce index --write benchmarks/RESULTS.md
    protofl reproduce fednh-table1 --records benchmarks/reproductions/records/fednh-table1/cpu --no-run

A table is data (``reproduce/tables/<name>.yaml``, :mod:`protofl.reproduce.spec`): the
paper's numbers with their source, and the grid that rebuilds them at three scales. The
grid runs on the sweep machinery (resumable, finished runs skipped, ``--jobs`` at once;
:mod:`protofl.reproduce.run`); the outputs are written by :mod:`protofl.reproduce.render`;
the verdicts of the paper's claims come from paired tests over the seeds fixed for the
scale in the table file (:mod:`protofl.reproduce.stats`, which says exactly what "shown",
"not shown", "contradicted" and "not comparable" mean); ``--seeds`` adds exploratory seeds,
listed apart and never in a verdict.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from .render import write_all
from .run import collect, data_missing, default_data, execute, Plan, plan, records_carried, Results, row_labels
from .spec import all_specs, DATA, get_spec, SCALES, TableSpec

__all__ = ["DATA", "SCALES", "Plan", "Results", "TableSpec", "all_specs", "collect", "data_missing", "default_data",
           "execute", "get_spec", "plan", "records_carried", "reproduce", "row_labels"]


def reproduce(name: str, scale: str = "cpu", seeds: Optional[list[int]] = None,
              overrides: Optional[list[str]] = None, out: Optional[Path] = None, jobs: Optional[int] = None,
              log: Callable[[str], None] = print, run: bool = True,
              data: Optional[str] = None, records: Optional[Path] = None) -> tuple[Results, list[Path], list]:
    """Run (or reuse) every run of table ``name`` at ``scale`` and write its outputs.

    ``seeds``: exploratory seeds besides the scale's own. ``data``: paper | substitute
    (None: :func:`default_data`'s choice, its reason logged). Returns (results, files
    written, failed runs). ``run=False`` only collects the runs already finished (the
    table then marks the missing ones).
    """
    spec = get_spec(name)
    if data is None:
        data, why = default_data(spec, scale, overrides)
        if why:
            log(why)
    p = plan(spec.variant(data), scale, seeds, overrides, out, records)
    with records_carried(p):
        failed = execute(p, jobs=jobs, log=log) if run else []
    res = collect(p)
    return res, write_all(res), failed
