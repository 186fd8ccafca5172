"""One metric registry (protofl/metrics.py METRIC_INFO): a metric registered there, and
nowhere else, shows up in the CLI's summary line, the progress bar, the tables, the plots'
axes and the HTML report, with its label, unit and direction."""
import math

import pytest

from protofl import metrics as M
from protofl.engine.callbacks import short_metrics
from protofl.report import html, plots, tables

from test_report import fake_run


@pytest.fixture
def toy_metric():
    """'toy_acc': an accuracy (higher is better), a headline column, in the bar and the
    summary line; registered for the test only."""
    saved = dict(M.METRIC_INFO)
    M.register_metric(M.MetricInfo("toy_acc", "TOY", "toy accuracy, TOY", "accuracy", True, headline=True,
                                   short="toy", summary=True))
    yield "toy_acc"
    M.METRIC_INFO.clear()
    M.METRIC_INFO.update(saved)


def test_a_metric_registered_once_shows_up_everywhere(toy_metric, tmp_path):
    from protofl.cli import _summary_line

    assert "toy_acc" in M.headline_metrics() and ("toy_acc", "toy") in M.shown_metrics()
    # the CLI's summary line and the progress bar, in percent
    assert "toy_acc=42.00%" in _summary_line({"final": {"gm": 0.5, "toy_acc": 0.42}})
    assert short_metrics({"round": 1, "toy_acc": 0.42})["toy"] == "42.00%"
    # tables: a column with its label, in percent, the best in bold (higher is better)
    a = fake_run(tmp_path / "a", extra={r: {"toy_acc": 0.30} for r in range(1, 21)})
    b = fake_run(tmp_path / "b", method="fedprox", extra={r: {"toy_acc": 0.70} for r in range(1, 21)})
    rows = tables.compare_rows({"A": [a], "B": [b]})
    md = tables.to_markdown(rows)
    assert "TOY (%)" in md.splitlines()[0] and "**70.00**" in md and "30.00" in md
    assert "toy_acc_mean" in tables.to_csv(rows).splitlines()[0]
    # plots: its unit and words on the axis
    assert plots.metric_unit("toy_acc") == (100.0, "%")
    assert plots.axis_label("toy_acc_std") == "toy accuracy, TOY: spread over clients (% points)"
    # the report's comparison table
    page = html.build_report(tmp_path)
    assert "TOY (%)" in page and "<b>70.00" in page


def test_the_registry_gives_the_columns_labels_and_units_it_always_gave():
    assert M.headline_metrics() == ("gm", "pm_v", "pm_l", "pa", "ga", "cluster_purity", "epsilon")
    assert [tables.label(m) for m in ("pm_v", "pa_std", "all_pm_l", "all_acc", "epsilon", "cluster_purity")] == \
        ["PM(V)", "PA std", "PM(L) all", "acc all", "ε", "purity"]
    assert tables.plain("epsilon") and not tables.plain("cluster_purity") and not tables.plain("gm")
    assert tables.lower_is_better("pa_std") and tables.lower_is_better("train_loss") and not tables.lower_is_better("gm")
    units = {m: plots.metric_unit(m) for m in ("gm", "all_pa", "pa_std", "bytes_up", "train_s", "proto_min_angle",
                                               "arrived", "train_samples", "train_loss", "rejected", "bytes_new")}
    assert units == {"gm": (100.0, "%"), "all_pa": (100.0, "%"), "pa_std": (100.0, "% points"),
                     "bytes_up": (1e-6, "MB"), "train_s": (1.0, "s"), "proto_min_angle": (1.0, "degrees"),
                     "arrived": (1.0, "clients"), "train_samples": (1.0, "samples"), "train_loss": (1.0, ""),
                     "rejected": (1.0, ""), "bytes_new": (1e-6, "MB")}
    assert short_metrics({"train_loss": 0.51234, "gm": 0.7689, "pa": math.nan, "epsilon": 3.1}) == \
        {"loss": "0.512", "gm": "76.89%", "pa": "nan", "eps": "3.10"}
