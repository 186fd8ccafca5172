"""Figures, tables and the HTML report: each test checks what a figure or table claims
(axis labels, legend entries, lines, bands, bold cells), on small run folders written by
hand (no training) or, where the engine is under test, on a few rounds of digits."""
import json
import math

import numpy as np
import pytest
import yaml

from protofl.cli import main
from protofl.report import plots, tables

from conftest import DIGITS, TIMING_KEYS


def fake_run(path, method="fedavg", seed=0, rounds=20, rows=None, counts=None, extra=None, cfg_extra=None):
    """A run folder as the engine writes it, with made-up numbers."""
    path.mkdir(parents=True)
    cfg = {"seed": seed, "rounds": rounds, "data": {"name": "digits"},
           "partition": {"name": "dirichlet", "num_clients": 4, "beta": 0.5},
           "algorithm": {"name": method}, "training": {"lr": 0.05},
           "output": {"dir": str(path.parent), "name": None}}
    for k, v in (cfg_extra or {}).items():
        sec, key = k.split(".")
        cfg.setdefault(sec, {})[key] = v
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    if rows is None:
        rng = np.random.default_rng(seed + len(method))
        rows = []
        for r in range(1, rounds + 1):
            row = {"round": r, "gm": 0.5 + 0.02 * r + 0.01 * rng.random(), "train_loss": 1.8 - 0.05 * r,
                   "bytes_up": 12_000_000 + r, "bytes_down": 12_000_000, "wall_s": 1.0, "pa": 0.6 + 0.01 * r}
            row.update((extra or {}).get(r, {}))
            rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"status": "complete", "rounds": rounds,
                                                   "rounds_completed": rows[-1]["round"], "final": rows[-1],
                                                   "mean_round_s": 1.0}))
    counts = np.array([[30, 0, 1, 2], [0, 5, 5, 0], [1, 1, 1, 1], [0, 0, 0, 40]]) if counts is None else counts
    (path / "clients.json").write_text(json.dumps({"num_clients": len(counts), "num_classes": counts.shape[1],
                                                   "train_counts": counts.tolist(), "class_names": None}))
    return path


def lines_by_label(ax):
    return {ln.get_label(): ln for ln in ax.get_lines()}


# ---------------------------------------------------------------------------------------
# learning curves
# ---------------------------------------------------------------------------------------
def test_only_accuracies_are_scaled_to_percent_and_each_metric_has_its_unit(tmp_path):
    d = fake_run(tmp_path / "a")
    fig = plots.curves_figure({"fedavg": d}, ["gm", "train_loss", "bytes_up"])
    gm, loss, up = fig.axes[:3]
    # axes say in words what they show, with the unit; never the raw key
    assert gm.get_ylabel() == "global model accuracy, GM (%)" and loss.get_ylabel() == "training loss"
    assert up.get_ylabel() == "sent up per round (MB)"
    assert gm.get_lines()[0].get_ydata().max() == pytest.approx(100 * max(r["gm"] for r in plots.read_metrics(d)))
    assert loss.get_lines()[0].get_ydata().max() == pytest.approx(1.75)  # not 175
    assert up.get_lines()[0].get_ydata()[0] == pytest.approx(12.000001)  # MB, not % of bytes
    assert plots.metric_unit("pa_std") == (100.0, "% points") and plots.metric_unit("gm@logits")[1] == "%"
    assert plots.axis_label("proto_min_angle") == "smallest angle between classes (degrees)"
    assert plots.axis_label("pa_std") == "personal accuracy, PA: spread over clients (% points)"
    assert plots.axis_label("all_pm_v") == "personal accuracy, PM(V) (all clients, at the end) (%)"
    assert plots.axis_label("gm@logits") == "global model accuracy, GM (logits) (%)"
    assert plots.axis_label("some_new_key") == "some new key"  # a plug-in's own metric: still words


def test_sparse_metric_gets_markers_over_the_full_round_range(tmp_path):
    extra = {10: {"pm_v": 0.7}, 20: {"pm_v": 0.8}, 30: {"pm_v": 0.85}}
    d = fake_run(tmp_path / "a", rounds=30, extra=extra)
    fig = plots.curves_figure({"fedavg": d}, ["pm_v", "gm"])
    sparse, dense = fig.axes[:2]
    (line,) = sparse.get_lines()
    assert list(line.get_xdata()) == [10, 20, 30] and line.get_marker() == "o"
    lo, hi = sparse.get_xlim()
    assert lo <= 1 and hi >= 30  # the whole run, not 9.6..10.4
    assert dense.get_lines()[0].get_marker() in ("None", None, "")
    assert all(float(t).is_integer() for t in sparse.get_xticks())


def test_bands_take_their_lines_colour_and_say_what_they_are(tmp_path):
    runs = {"single": [fake_run(tmp_path / "s0", "fedavg")],
            "fednh": [fake_run(tmp_path / "n0", "fednh", 0), fake_run(tmp_path / "n1", "fednh", 1)],
            "local": [fake_run(tmp_path / "l0", "local", 0), fake_run(tmp_path / "l1", "local", 1)]}
    from matplotlib.colors import to_rgba

    fig = plots.curves_figure(runs, ["gm"])
    ax = fig.axes[0]
    lines = lines_by_label(ax)
    bands = ax.collections
    assert len(bands) == 2  # the single run has no band
    for band, label in zip(bands, ["fednh", "local"]):
        assert to_rgba(band.get_facecolor()[0], 1) == pytest.approx(to_rgba(lines[label].get_color(), 1))
    (legend,) = fig.legends
    assert "± 1 std" in legend.get_title().get_text()
    fig = plots.curves_figure(runs, ["gm"], band="minmax")
    assert "min-max" in fig.legends[0].get_title().get_text()
    band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    ys = np.array([[r["gm"] * 100 for r in plots.read_metrics(d)] for d in runs["fednh"]])
    assert band.max() == pytest.approx(ys.max()) and band.min() == pytest.approx(ys.min())


def test_one_legend_names_every_method_even_if_missing_from_a_panel(tmp_path):
    a = fake_run(tmp_path / "a", "fedavg")
    rows = [{"round": r, "gm": 0.5, "wall_s": 1.0} for r in range(1, 21)]  # no pa
    b = fake_run(tmp_path / "b", "fednh", rows=rows)
    fig = plots.curves_figure({"fedavg": a, "fednh": b}, ["pa", "gm"])
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fedavg", "fednh"]
    assert len(fig.axes[0].get_lines()) == 1 and len(fig.axes[1].get_lines()) == 2


def test_per_class_metric_draws_one_labelled_line_per_class(tmp_path):
    extra = {r: {"gm_per_class": [0.1 * c for c in range(10)]} for r in range(1, 21)}
    d = fake_run(tmp_path / "a", extra=extra)
    ax = plots.curves_figure({"fedavg": d}, ["gm_per_class"]).axes[0]
    assert [ln.get_label() for ln in ax.get_lines()] == [f"class {c}" for c in range(10)]
    assert len(ax.get_legend().get_texts()) == 10
    assert ax.get_lines()[3].get_ydata()[0] == pytest.approx(30.0)


def test_group_runs_labels_by_method_over_seeds(tmp_path):
    dirs = [fake_run(tmp_path / "fedavg-digits-s0-aaaa1111", "fedavg", 0),
            fake_run(tmp_path / "fedavg-digits-s1-bbbb2222", "fedavg", 1),
            fake_run(tmp_path / "x-fednh", "fednh", 0),
            fake_run(tmp_path / "y-fednh", "fednh", 0, cfg_extra={"training.lr": 0.1})]
    groups = plots.group_runs(dirs)
    assert set(groups) == {"fedavg", "fednh(training.lr=0.05)", "fednh(training.lr=0.1)"}
    assert len(groups["fedavg"]) == 2


def test_cli_plot_groups_runs_by_method_and_can_plot_a_compare_folder(tmp_path, capsys):
    for s in (0, 1):
        fake_run(tmp_path / "cmp" / f"avg-s{s}", "fedavg", s)
    fake_run(tmp_path / "cmp" / "nh-s0", "fednh", 0)
    out = tmp_path / "c.png"
    assert main(["plot", str(tmp_path / "cmp"), "--metrics", "gm,pa", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fedavg: 2 run(s)" in text and "fednh: 1 run(s)" in text and out.stat().st_size > 5000
    assert main(["plot", *(str(p) for p in sorted((tmp_path / "cmp").iterdir())), "--by", "run",
                 "--out", str(out)]) == 0
    assert "avg-s0: 1 run(s)" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragments", [
    (["{tmp}/nope"], ["no such folder", "run-a"]),
    (["{tmp}/run-a", "--metrics", "gm,nonsense"], ["'nonsense'", "available:", "train_loss"]),
    (["{tmp}"], []),  # a folder of runs is fine
])
def test_cli_plot_missing_folder_or_metric_exits_2_with_one_line(tmp_path, capsys, args, fragments):
    fake_run(tmp_path / "run-a")
    code = main(["plot", *(a.format(tmp=tmp_path) for a in args), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    if not fragments:
        assert code == 0
        return
    assert code == 2 and err.count("\n") == 1, err
    assert all(f in err for f in fragments), err
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------
# partitions
# ---------------------------------------------------------------------------------------
def test_partition_heatmap_integer_ticks_class_names_and_log_scale():
    from matplotlib.colors import LogNorm

    counts = np.array([[500, 0, 3], [1, 2, 0], [0, 0, 7], [4, 4, 4], [0, 9, 0]])
    fig = plots.partition_figure(counts, class_names=["cat", "dog", "frog"])
    ax = fig.axes[0]
    assert ax.get_xlabel() == "class" and ax.get_ylabel() == "client"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["cat", "dog", "frog"]
    assert all(float(t).is_integer() for t in ax.get_yticks())
    im = ax.get_images()[0]
    assert isinstance(im.norm, LogNorm)  # one big cell does not wash out the rest
    assert fig.axes[1].get_ylabel().startswith("samples (log")
    im = plots.partition_figure(counts, scale="client").axes[0].get_images()[0]
    assert np.asarray(im.get_array()).sum(1) == pytest.approx(np.ones(5))


def test_partition_with_many_clients_is_stacked_bars_of_bounded_size():
    counts = np.random.default_rng(0).integers(0, 50, size=(100, 10))
    fig = plots.partition_figure(counts)
    ax = fig.axes[0]
    w, h = fig.get_size_inches()
    assert w <= 14 and h <= 4.5  # not a 660x1620 strip
    assert ax.get_xlabel() == "client" and ax.get_ylabel() == "samples"
    assert len(ax.patches) == 100 * 10
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [str(c) for c in range(10)]
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_cli_partition_names_the_classes_and_takes_kind(tmp_path, capsys):
    out = tmp_path / "p.png"
    assert main(["partition", str(DIGITS), "--out", str(out), "--kind", "bars", "--scale", "client"]) == 0
    assert out.stat().st_size > 3000 and "figure:" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------
def test_select_final_best_last_k_and_seconds_without_start_up():
    rows = [{"round": r, "gm": g, "pa_std": s, "wall_s": w}
            for r, g, s, w in [(1, 0.5, 0.3, 9.0), (2, 0.9, 0.1, 1.0), (3, 0.7, 0.2, 2.0)]]
    assert tables.select_value(rows, "gm", "final") == 0.7
    assert tables.select_value(rows, "gm", "best") == 0.9
    assert tables.select_value(rows, "pa_std", "best") == 0.1  # lower is better for a spread
    assert tables.select_value(rows, "gm", "last:2") == pytest.approx(0.8)
    assert tables.select_value(rows, "gm", "last:10") == pytest.approx(0.7)
    assert tables.select_value(rows, "pm_v", "final") is None
    assert tables.seconds_per_round(rows) == pytest.approx(1.5)  # round 1's 9 s left out
    from protofl.config import ConfigError

    with pytest.raises(ConfigError, match="last:K"):
        tables.select_value(rows, "gm", "last:0")


def test_table_one_seed_no_spread_ga_not_repeated_best_in_bold(tmp_path):
    a = fake_run(tmp_path / "a", "fedavg", rows=[{"round": 1, "gm": 0.8, "ga": 0.8, "pa": 0.9, "wall_s": 1}])
    b = fake_run(tmp_path / "b", "fedprox", rows=[{"round": 1, "gm": 0.7, "ga": 0.7, "pa": 0.95, "wall_s": 1}])
    rows = tables.compare_rows({"fedavg": [a], "fedprox": [b]})
    md = tables.to_markdown(rows)
    assert "±" not in md and "GA" not in md  # one seed; GA = GM for both
    assert "| fedavg | **80.00** | 90.00 |" in md and "| fedprox | 70.00 | **95.00** |" in md
    c = fake_run(tmp_path / "c", "local", rows=[{"round": 1, "ga": 0.6, "pa": 0.97, "wall_s": 1}])
    rows = tables.compare_rows({"fedavg": [a], "local": [c]})
    md = tables.to_markdown(rows)
    assert "GA (%)" in md and "= GM" in md and "60.00" in md
    tex = tables.to_latex(rows)
    assert "\\toprule" in tex and "\\textbf{97.00}" in tex and "\\%" in tex
    csv = tables.to_csv(rows).splitlines()
    assert csv[0].startswith("method,gm_mean,gm_std") and csv[1].startswith("fedavg,0.800000,,")


def test_table_two_seeds_mean_and_sample_std(tmp_path):
    ds = [fake_run(tmp_path / f"s{s}", rows=[{"round": 1, "gm": g, "wall_s": 1}]) for s, g in ((0, 0.8), (1, 0.9))]
    (row,) = tables.compare_rows({"fedavg": ds})
    assert row["gm"] == pytest.approx((0.85, math.sqrt(0.005)))
    assert "85.00 ± 7.07" in tables.to_markdown([row])


def test_methods_entry_sets_any_config_key():
    from protofl.api import grid_config, parse_methods
    from protofl.config import ConfigError, load_config

    m = parse_methods("fast=fedavg(training.lr=0.1;participation.p=0.5),prox=fedprox(mu=0.1),fedavg")
    cfg = load_config(DIGITS)
    c = grid_config(cfg, m["fast"], 1, "fast")
    assert c.training.lr == 0.1 and c.participation.p == 0.5 and c.seed == 1 and c.algorithm.name == "fedavg"
    assert grid_config(cfg, m["fedavg"], 1, "fedavg").training.lr == cfg.training.lr
    assert grid_config(cfg, m["prox"], 0, "prox").algorithm.params["mu"] == 0.1
    with pytest.raises(ConfigError, match="--seeds"):
        parse_methods("fedavg(seed=3)")
    with pytest.raises(ConfigError, match="training.nope"):
        grid_config(cfg, parse_methods("fedavg(training.nope=1)")["fedavg"], 0, "fedavg")


def test_compare_keeps_earlier_tables_and_extended_runs_equal_fresh_ones(tmp_path, capsys):
    """The reuse rule: a compare with more rounds continues the finished runs; the result
    equals a fresh run of that length. A later compare with fewer methods keeps the
    earlier table under its method set's name."""
    import torch

    base = ["compare", str(DIGITS), "partition.num_clients=4", "participation.fraction=1.0", "eval.personal_every=3"]
    ext, fresh = tmp_path / "ext", tmp_path / "fresh"
    opts = ["--seeds", "0", "--quiet", "--out"]
    assert main([*base, "rounds=2", *opts, str(ext), "--methods", "fedavg,fast=fedavg(training.lr=0.1)"]) == 0
    first = (ext / "compare.md").read_text()
    assert "| fast |" in first and (ext / "compare.tex").exists() and (ext / "report.html").exists()
    assert main([*base, "rounds=4", *opts, str(ext), "--methods", "fedavg"]) == 0
    assert main([*base, "rounds=4", *opts, str(fresh), "--methods", "fedavg"]) == 0
    assert (ext / "compare-fedavg+fast.md").read_text() == first  # not dropped
    assert "| fast |" not in (ext / "compare.md").read_text()
    (e,), (f,) = [list(p.glob("fedavg-s0-*")) for p in (ext, fresh)]
    assert e.name == f.name
    we, wf = torch.load(e / "model.pt"), torch.load(f / "model.pt")
    assert all(torch.equal(we[k], wf[k]) for k in wf)
    re_, rf = plots.read_metrics(e), plots.read_metrics(f)
    assert [r["round"] for r in re_] == [1, 2, 3, 4]
    for a, b in zip(re_, rf):
        a = {k: v for k, v in a.items() if k not in TIMING_KEYS}
        b = {k: v for k, v in b.items() if k not in TIMING_KEYS}
        extra = set(a) - set(b)
        # the old last round (2) carries the full evaluation every last round gets, and the
        # evaluation of every client after the last round (all_*, eval.final_all_clients)
        extra = {k for k in extra if not k.startswith("all_")}
        assert not extra or (a["round"] == 2 and extra <= {"pm_v", "pm_l", "acc", "pm_v_std", "pm_l_std",
                                                           "acc_std", "pa_clients"}), extra
        assert {k: a[k] for k in b} == b


def test_methods_that_depend_on_total_rounds_are_never_extended(monkeypatch, tmp_path):
    from protofl.algorithms import ALGORITHMS
    from protofl.api import grid_config, parse_methods
    from protofl.config import load_config

    cfg = load_config(DIGITS)
    m = parse_methods("fedavg")["fedavg"]
    assert grid_config(cfg, m, 0, "fedavg").output.name == grid_config(cfg.replace(rounds=5), m, 0, "fedavg").output.name
    monkeypatch.setattr(ALGORITHMS.get("fedavg"), "uses_total_rounds", True)
    a, b = grid_config(cfg, m, 0, "fedavg"), grid_config(cfg.replace(rounds=5), m, 0, "fedavg")
    assert a.output.name != b.output.name and b.output.name.endswith("-R5")


def test_no_method_reads_the_total_number_of_rounds_without_declaring_it():
    """The reuse rule holds only while methods depend on the round index alone."""
    import inspect

    from protofl.algorithms import ALGORITHMS

    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        src = inspect.getsource(inspect.getmodule(cls))
        assert "info.rounds" not in src or cls.uses_total_rounds, name


# ---------------------------------------------------------------------------------------
# geometry logs and the report
# ---------------------------------------------------------------------------------------
def test_class_geometry_on_hand_computed_vectors():
    from protofl.metrics import class_geometry

    angle, cos = class_geometry(np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [0.0, 0.0]]))
    assert angle == pytest.approx(45.0)
    assert cos[0][1] == 0.0 and cos[0][2] == pytest.approx(math.sqrt(0.5), abs=1e-5) and cos[1][1] == 1.0
    assert cos[3] == [None] * 4 and cos[0][3] is None  # a class without a vector
    assert class_geometry(np.array([[1.0, 0.0], [0.0, 0.0]]))[0] is None


def test_prototype_methods_log_geometry_and_clients_pa(digits_cfg):
    from protofl.api import run

    rows = run(digits_cfg("rounds=2", "algorithm.name=fednh", "eval.personal_every=2")).rows
    assert all(0 < r["proto_min_angle"] <= 180 for r in rows)
    cos = np.array(rows[-1]["proto_cos"], dtype=float)
    assert "proto_cos" not in rows[0] and cos.shape == (10, 10) and np.diag(cos) == pytest.approx(np.ones(10))
    assert len(rows[-1]["pa_clients"]) == rows[-1]["evaluated_clients"]
    assert np.mean([v for _, v in rows[-1]["pa_clients"]]) == pytest.approx(rows[-1]["pa"])
    rows = run(digits_cfg("rounds=1", "algorithm.name=fedavg")).rows
    assert not any(k.startswith("proto_") for k in rows[0])


def test_report_on_a_run_folder_and_a_compare_folder_is_self_contained(tmp_path, capsys):
    import re

    a = fake_run(tmp_path / "cmp" / "a", "fedavg", extra={20: {"gm_per_class": [0.5, 0.6, 0.7, 0.8],
                                                                "pa_clients": [[0, 0.9], [1, 0.7]]}})
    fake_run(tmp_path / "cmp" / "b", "fednh", extra={10: {"proto_min_angle": 90.0},
                                                     20: {"proto_min_angle": 84.3, "proto_cos": [[1, 0.1], [0.1, 1]]}})
    assert main(["report", str(a)]) == 0
    page = (a / "report.html").read_text()
    assert "<h2>Results</h2>" in page and "Per-class accuracy" in page and "Fairness" in page
    assert "Class prototypes" not in page  # fedavg has none
    assert main(["report", str(tmp_path / "cmp"), "--select", "last:5"]) == 0
    page = (tmp_path / "cmp" / "report.html").read_text()
    for section in ("Results", "Learning curves", "Communication", "Class prototypes", "Partition", "Configuration"):
        assert f"<h2>{section}" in page, section
    assert "mean of the last 5 evaluations" in page
    assert len(re.findall(r'src="data:image/png;base64,', page)) >= 6
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from a network
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no such folder" in capsys.readouterr().err


CHROMIUM = "/usr/bin/chromium"


def test_report_renders_in_headless_chromium(tmp_path):
    """A real browser opens report.html offline and draws it: the screenshot is not blank.
    Skipped only where chromium is missing outside CI (.ci/run installs it)."""
    import os
    import shutil
    import subprocess

    from PIL import Image

    exe = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if exe is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("chromium is missing under CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium not installed (apt-get install chromium)")
    # many settings that differ between the methods, with long names and values: the table
    # of them must still fit the page (it used to grow one column per setting)
    wide = {f"algorithm.a_rather_long_parameter_name_{i}": [0.125 * i] * 6 for i in range(12)}
    for s in (0, 1):
        fake_run(tmp_path / "cmp" / f"a{s}", "fedavg", s, extra={20: {"gm_per_class": [0.5, 0.6, 0.7, 0.8]}})
        fake_run(tmp_path / "cmp" / f"b{s}", "fednh", s, extra={20: {"proto_cos": [[1, 0.1], [0.1, 1]]}},
                 cfg_extra=wide)
    assert main(["report", str(tmp_path / "cmp")]) == 0
    report = tmp_path / "cmp" / "report.html"
    probe = tmp_path / "probe.html"  # the page plus a script that writes what the browser measured
    probe.write_text(report.read_text().replace("</body>", "<pre id='measured'></pre><script>"
                     "const e=document.documentElement;document.getElementById('measured').textContent="
                     "'scroll='+e.scrollWidth+' client='+e.clientWidth+' tables='+"
                     "Math.max(...[...document.querySelectorAll('table')].map(t=>t.getBoundingClientRect().right));"
                     "</script></body>"))
    common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1400"]
    proc = subprocess.run([*common, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    import re

    m = re.search(r"scroll=(\d+) client=(\d+) tables=([\d.]+)", proc.stdout)
    assert m, proc.stderr[-2000:]
    scroll, client, right = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert scroll <= client and right <= client, m.group(0)  # nothing wider than the window
    png = tmp_path / "shot.png"
    proc = subprocess.run([*common, f"--screenshot={png}", report.as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert png.exists(), proc.stderr[-2000:]
    img = Image.open(png).convert("RGB")
    assert img.size == (1000, 1400)
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is None or len(colors) > 50  # text, tables and figures, not one blank colour
    # the figures were drawn: a good share of the page is neither white nor near-white
    px = np.asarray(img, dtype=np.int16)
    assert (px.min(axis=2) < 200).mean() > 0.02


def test_seeds_that_logged_a_metric_on_different_rounds_are_all_drawn(tmp_path):
    """Under dropout a round where nobody arrived has no personalized metrics: the mean
    uses the seeds that have a value, instead of dropping the round for all."""
    a = fake_run(tmp_path / "a", seed=0, rounds=30, extra={10: {"pm_v": 0.5}, 20: {"pm_v": 0.7}})
    b = fake_run(tmp_path / "b", seed=1, rounds=30, extra={10: {"pm_v": 0.6}, 30: {"pm_v": 0.9}})
    ax = plots.curves_figure({"fedavg": [a, b]}, ["pm_v"]).axes[0]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [10, 20, 30]
    assert line.get_ydata() == pytest.approx([55.0, 70.0, 90.0])


def test_demo_tells_its_story_from_its_own_runs_and_ends_with_the_report(tmp_path, capsys):
    from protofl.demo import demo

    rows = demo(tmp_path / "demo", rounds=3, progress=False, seeds=(0,))
    out = capsys.readouterr().out
    assert [r["method"] for r in rows] == ["fedavg", "rebafl"]
    assert "probability 0.1" in out and "change per round" in out and "mean of the last 10 evaluations" in out
    assert (tmp_path / "demo" / "report.html").exists() and (tmp_path / "demo" / "demo.png").exists()
    lines = out.rstrip().splitlines()  # it ends with what to try next
    tail = lines[lines.index("Next:"):]
    assert len(tail) <= 8 and any("protofl list" in x for x in tail) and any("report.html" in x for x in tail)
    page = (tmp_path / "demo" / "report.html").read_text()
    assert "Stability of the global model over the last 2 rounds" in page and "probability p = 0.1" in page


def test_demo_says_how_to_reach_protofl_when_its_folder_is_not_on_path(tmp_path, monkeypatch):
    """`make demo` runs .venv/bin/protofl without activating the environment."""
    import sys

    from protofl.demo import next_steps

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "protofl").write_text("#!/bin/sh\n")
    (bin_dir / "protofl").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    lines = next_steps(tmp_path / "runs" / "demo")
    assert lines[0] == "Next:" and "run `source .venv/bin/activate` first (or call .venv/bin/protofl" in lines[1]
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # activated: nothing to say about it
    assert not any("activate" in x for x in next_steps(tmp_path / "runs" / "demo"))


def test_report_figures_per_class_fairness_and_cosine_say_what_they_show(tmp_path):
    from protofl.report import html

    groups = {
        "fedavg": [fake_run(tmp_path / f"a{s}", "fedavg", s, extra={20: {"gm_per_class": [0.2, 0.4, 0.6, 0.8 + 0.1 * s],
                                                                         "pa_clients": [[0, 0.5], [3, 0.7]]}})
                   for s in (0, 1)],
        "fednh": [fake_run(tmp_path / "n0", "fednh", extra={20: {"gm_per_class": [1.0, 0.0, 0.5, 0.5],
                                                                 "pa_clients": [[1, 0.9]]}})]}
    ax = html.per_class_figure(groups, ["a", "b", "c", "d"]).axes[0]
    assert ax.get_ylabel() == "accuracy (%)" and ax.get_xlabel() == "class"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fedavg", "fednh"]
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 8 and heights[3] == pytest.approx(85.0) and heights[4] == pytest.approx(100.0)
    ax = html.fairness_figure(groups).axes[0]
    assert ax.get_ylabel() == "PA of a client (%)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fedavg", "fednh"]
    pts = [c.get_offsets()[:, 1] for c in ax.collections]
    assert sorted(pts[0]) == pytest.approx([50, 50, 70, 70]) and list(pts[1]) == pytest.approx([90])
    S = np.array([[1.0, -0.5], [-0.5, 1.0]])
    fig = plots.cosine_heatmap_figure({"fednh": S}, ["x", "y"])
    assert fig.axes[0].get_title() == "fednh" and fig.axes[-1].get_ylabel() == "cosine similarity"
    assert np.asarray(fig.axes[0].get_images()[0].get_array()) == pytest.approx(S)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["x", "y"]


def test_resume_with_other_rounds_is_refused_for_methods_that_depend_on_them(monkeypatch, digits_cfg):
    from protofl.algorithms import ALGORITHMS
    from protofl.api import run
    from protofl.config import ConfigError

    cfg = digits_cfg("rounds=1", "partition.num_clients=4")
    run(cfg, resume=True)
    monkeypatch.setattr(ALGORITHMS.get("fedavg"), "uses_total_rounds", True)
    with pytest.raises(ConfigError, match="depends on the total number of rounds"):
        run(cfg.replace(rounds=2), resume=True)


def test_a_cosine_run_is_never_extended_to_more_rounds(digits_cfg, tmp_path):
    """A cosine schedule's lr at round r reads the total rounds: resuming a finished 2-round
    run with rounds=4 is refused, and a compare with 4 rounds beside the 2-round run runs
    afresh (its folder is per number of rounds) and equals a fresh 4-round run."""
    from protofl import api
    from protofl.config import ConfigError

    cfg = digits_cfg("rounds=2", "partition.num_clients=4", "training.schedule=cosine", "training.min_lr=0.001",
                     "output.name=cos")
    api.run(cfg)
    with pytest.raises(ConfigError, match="training.schedule: cosine depends on the total number of rounds"):
        api.run(cfg.replace(rounds=4), resume=True)
    assert not api.extendable(cfg) and api.extendable(cfg.replace(**{"training.schedule": "exponential"}))
    methods = api.parse_methods("fedavg")
    api.compare(cfg, methods, [0], tmp_path / "cmp", log=lambda m: None)
    rows4, _ = api.compare(cfg.replace(rounds=4), methods, [0], tmp_path / "cmp", log=lambda m: None)
    fresh = api.run(cfg.replace(rounds=4, **{"output.name": "fresh"}))
    lrs = [r["lr"] for r in fresh.rows]
    assert lrs[1] == pytest.approx(0.001 + (0.05 - 0.001) * (1 + math.cos(math.pi / 4)) / 2)  # round 2 of 4
    assert rows4[0]["gm"][0] == pytest.approx(fresh.rows[-1]["gm"])
    assert len(list((tmp_path / "cmp").glob("fedavg-s0-*-R*"))) == 2  # one folder per number of rounds


def test_plot_refuses_a_matrix_metric_with_one_line(tmp_path, capsys):
    fake_run(tmp_path / "a", extra={20: {"proto_cos": [[1, 0], [0, 1]]}})
    assert main(["plot", str(tmp_path / "a"), "--metrics", "proto_cos", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "'proto_cos' is not a number" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------
# what a report and a compare folder say: once, within bounds, no duplicates
# ---------------------------------------------------------------------------------------
def test_accuracy_bands_stay_within_0_and_100_and_a_loss_band_above_0(tmp_path):
    rows = lambda top, loss: [{"round": r, "gm": top, "train_loss": loss} for r in range(1, 21)]  # noqa: E731
    runs = {"fedavg": [fake_run(tmp_path / "a", rows=rows(1.0, 0.01)), fake_run(tmp_path / "b", seed=1,
                                                                                rows=rows(0.8, 0.5))]}
    fig = plots.curves_figure(runs, ["gm", "train_loss"])
    gm_band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    loss_band = fig.axes[1].collections[0].get_paths()[0].vertices[:, 1]
    # mean 90 %, sample std 14.1 points: 104.1 % would be drawn without the clip
    assert gm_band.max() == pytest.approx(100.0) and gm_band.min() == pytest.approx(90 - 100 * 0.2 / math.sqrt(2))
    assert loss_band.min() == pytest.approx(0.0)  # 0.255 - 0.346 < 0: a loss cannot be negative


def test_a_metric_evaluated_every_k_rounds_is_markers_not_a_line(tmp_path):
    def rows(shift):  # eval.every=2: GM on even rounds only
        return [{"round": r, "train_loss": 1.0 / r, **({"gm": 0.5 + r / 100 + shift} if r % 2 == 0 else {})}
                for r in range(1, 21)]

    a, b = fake_run(tmp_path / "a", rows=rows(0.0)), fake_run(tmp_path / "b", seed=1, rows=rows(0.1))
    gm, loss = plots.curves_figure({"fedavg": [a, b]}, ["gm", "train_loss"]).axes[:2]
    (line,) = gm.get_lines()
    assert list(line.get_xdata()) == list(range(2, 21, 2))
    assert line.get_marker() == "o" and line.get_linestyle() == "None"  # no line through the odd rounds
    assert loss.get_lines()[0].get_linestyle() == "-"  # logged every round: a line
    (bars,) = gm.collections  # the spread over seeds: one bar per logged round, not a band between them
    segments = bars.get_segments()
    assert [s[0][0] for s in segments] == list(range(2, 21, 2)) and all(s[0][0] == s[1][0] for s in segments)


def test_report_shows_the_stability_table_and_the_participation_and_says_the_band_once(tmp_path):
    """The demo's finding in its report: per seed, how far GM moves from round to round."""
    from protofl.report import html

    def run(name, seed, gms):
        rows = [{"round": r, "gm": g, "train_loss": 0.5} for r, g in enumerate(gms, start=1)]
        return fake_run(tmp_path / "cmp" / name, "fedavg" if name[0] == "a" else "rebafl", seed, rows=rows,
                        cfg_extra={"participation.p": 0.1, "participation.fraction": 1.0})

    # 12 rounds: the window is the last 10; seed 0 swings 50 <-> 70 (20 points a round)
    run("a0", 0, [0.5, 0.7] * 6)
    run("a1", 1, [0.6] * 12)
    run("b0", 0, [0.8] * 11 + [0.81])
    assert main(["report", str(tmp_path / "cmp")]) == 0
    page = (tmp_path / "cmp" / "report.html").read_text()
    assert "update arrives with probability p = 0.1, redrawn every round (client dropout)" in page
    assert "<h2>Stability of the global model over the last 10 rounds</h2>" in page
    assert "<tr><td>fedavg</td><td>20.0 / 0.0 (10.0)</td><td>50 / 60 (55.0)</td>" \
           "<td>70 / 60 (65.0)</td><td>60.0 / 60.0 (60.0)</td></tr>" in page
    assert "<tr><td>rebafl</td><td>0.1</td><td>80</td><td>81</td><td>80.1</td></tr>" in page
    assert page.count("± 1 sample std over seeds") == 1  # said once, for every figure
    fig = plots.curves_figure({"x": [tmp_path / "cmp" / "a0", tmp_path / "cmp" / "a1"]}, ["gm"], say_band=False)
    assert fig.legends[0].get_title().get_text() == ""  # the report's figures do not repeat it
    assert html.BAND == "std"


def test_demo_png_and_the_report_draw_the_same_band():
    from protofl import demo
    from protofl.report import html

    assert demo.BAND == html.BAND


def test_a_compare_writes_each_table_once(tmp_path):
    """compare.md is the latest table; an earlier method set's table is kept under its own
    name, and no two files in the folder hold the same table."""
    from protofl.api import finish_grid

    def grid(*methods):
        groups = {m: [fake_run(tmp_path / "out" / f"{m}-s0-{len(methods):08x}", m)]
                  if not (tmp_path / "out" / f"{m}-s0-{len(methods):08x}").exists()
                  else [tmp_path / "out" / f"{m}-s0-{len(methods):08x}"] for m in methods}
        finish_grid(groups, tmp_path / "out", "compare", report=False)
        tables_ = sorted(p.name for p in (tmp_path / "out").glob("compare*.md"))
        texts = [(tmp_path / "out" / n).read_text() for n in tables_]
        assert len(set(texts)) == len(texts), tables_  # no identical duplicates
        return tables_

    assert grid("fedavg", "fednh") == ["compare.md"]
    first = (tmp_path / "out" / "compare.md").read_text()
    assert grid("local") == ["compare-fedavg+fednh.md", "compare.md"]
    assert (tmp_path / "out" / "compare-fedavg+fednh.md").read_text() == first
    assert sorted(p.name for p in (tmp_path / "out").glob("compare-fedavg+fednh.*")) == [
        "compare-fedavg+fednh.csv", "compare-fedavg+fednh.md", "compare-fedavg+fednh.tex"]
    assert grid("fedavg", "fednh") == ["compare-local.md", "compare.md"]  # back to the first set: its old copy goes
    assert grid("fedavg", "fednh") == ["compare-local.md", "compare.md"]  # the same again: nothing new


def test_participation_text_says_how_clients_are_drawn():
    from protofl.report.html import participation_text

    fixed = {"partition": {"num_clients": 10}, "participation": {"fraction": 0.5}}
    assert participation_text(fixed).startswith("a fraction 0.5 of the 10 clients is asked each round")
    poisson = {"partition": {"num_clients": 10}, "participation": {"fraction": 0.25, "sampling": "poisson"}}
    text = participation_text(poisson)  # ceil(0.25 * 10) = 3 expected: q = 0.3, not "a fraction 0.25"
    assert text.startswith("each of the 10 clients is asked with probability q = 0.3 each round, independently")
    assert "3 expected, a round may ask nobody" in text and "fraction" not in text
    per_round = {"partition": {"num_clients": 10}, "participation": {"clients_per_round": 4, "sampling": "poisson"}}
    assert "q = 0.4" in participation_text(per_round)
