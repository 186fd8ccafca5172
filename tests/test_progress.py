"""Progress: a short bar on terminals, plain log lines elsewhere, percent everywhere."""
import io
import logging

from protofl.engine.callbacks import ProgressBar, RoundLogger, progress_callback, short_metrics

from conftest import DIGITS

ROW = {"round": 1, "train_loss": 0.51234, "gm": 0.76891, "gm@head": 0.7, "pm_v": 0.8, "pm_l": 0.81,
       "pa": 0.80123, "ga": 0.76891, "lr": 0.05, "selected": 5, "arrived": 5}


def test_short_metrics_are_percent_and_fixed():
    assert short_metrics(ROW) == {"loss": "0.512", "gm": "76.89%", "pa": "80.12%"}
    # no global model: gm falls back to ga; a metric missing from a row keeps its last value
    assert short_metrics({"ga": 0.5, "train_loss": 1.0}, {"pa": "10.00%"}) == \
        {"pa": "10.00%", "loss": "1.000", "gm": "50.00%"}


def test_bar_stays_short_whatever_the_row_holds():
    buf = io.StringIO()
    bar = ProgressBar(file=buf)
    bar.on_start({"name": "fednh-cifar10-dirichlet100-s0-0123abcd-with-a-long-name", "rounds": 200,
                  "start_round": 1})
    for r in range(1, 4):
        bar.on_round({**ROW, "round": r, **{f"extra_metric_{i}": 0.5 for i in range(20)}})
    bar.on_end({})
    last = buf.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "gm=76.89%" in last and "pm_v" not in last and "extra" not in last
    assert len(last) <= 120, last


def test_no_terminal_means_one_log_line_per_round(digits_cfg, tmp_path, caplog):
    import protofl

    assert isinstance(progress_callback(True), RoundLogger)  # pytest's stderr is not a TTY
    assert progress_callback(False) is None
    cfg = digits_cfg("rounds=3", "output.progress=true", "output.log_every=2")
    with caplog.at_level(logging.INFO, logger="protofl"):
        protofl.run(cfg)
    first, *lines = [r.getMessage() for r in caplog.records if r.name == "protofl"]
    assert first.endswith(": 3 rounds on cpu (sequential executor)")  # where the run trains, first
    assert [ln.split(": ")[0].split()[-1] for ln in lines] == ["2/3", "3/3"], lines
    assert "gm=" in lines[-1] and "%" in lines[-1] and "s/round" in lines[-1]


def test_compare_shows_overall_progress(tmp_path, capsys):
    from protofl.cli import main

    assert main(["compare", str(DIGITS), "rounds=1", "--methods", "fedavg", "--seeds", "0,1",
                 "--out", str(tmp_path), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "[run 1/2]" in err and "[run 2/2]" in err and "ETA" in err.split("[run 2/2]")[1].splitlines()[0]


def test_a_protofl_line_prints_once_when_a_library_configures_the_root_logger_later():
    """A module-level ``logging.warning`` in a library (dp-accounting's dependencies do it)
    configures the root logger; the handler protofl added for itself owns its lines, so
    they do not print a second time through the root's."""
    import subprocess
    import sys

    code = ("import logging\n"
            "from protofl.engine.callbacks import ensure_log_handler\n"
            "ensure_log_handler()\n"
            "logging.warning('a library speaks')\n"
            "logging.getLogger('protofl').warning('protofl speaks')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.count("protofl speaks") == 1 and "a library speaks" in err, err
