"""The command line: exit codes, one-line errors, an end-to-end run."""
import json
import os
import subprocess
import sys

import pytest

from protofl.cli import main

from conftest import DIGITS, REPO


def test_run_three_rounds_end_to_end(tmp_path, capsys):
    code = main(["run", str(DIGITS), "rounds=3", f"output.dir={tmp_path}", "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "3 rounds" in out and "gm=" in out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize("args, fragment", [
    (["training.lr=-1"], "training.lr=-1.0: must be > 0"),
    (["algorithm.name=nope"], "known: "),
    (["model.name=nope"], "unknown model 'nope'"),
    (["partition.num_clients=5000"], "more clients than samples"),
    (["data.name=mnist", "data.root=/nonexistent"], "train-images-idx3-ubyte.gz"),
    (["partition.beta=0.001", "partition.num_clients=30", "partition.min_size=40"], "beta"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, fragment):
    code = main(["run", str(DIGITS), *args, f"output.dir={tmp_path}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err and err.count("\n") == 1, err


def test_missing_config_file(capsys):
    assert main(["run", "no-such.yaml"]) == 2
    assert "file not found" in capsys.readouterr().err


def test_diverged_run_exits_3(tmp_path, capsys):
    code = main(["run", str(DIGITS), "rounds=3", "training.lr=1e6", "training.momentum=0.99",
                 f"output.dir={tmp_path}", "--quiet"])
    assert code == 3
    assert "training diverged" in capsys.readouterr().err


def test_list_and_partition(tmp_path, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "digits" in out and "dirichlet" in out and "conv2cifar" in out
    datasets = next(line for line in out.splitlines() if line.startswith("datasets:"))
    assert "hf:<repo>" in datasets  # the families of names are listed too
    assert "torchvision:<name>" in next(line for line in out.splitlines() if line.startswith("models:"))
    png = tmp_path / "heat.png"
    assert main(["partition", str(DIGITS), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.exists() and png.stat().st_size > 1000
    assert "client" in out and out.count("\n") > 10


def test_compare_runs_grid_and_skips_complete_runs(tmp_path, capsys):
    args = ["compare", str(DIGITS), "rounds=2", "--methods", "fedavg,prox=fedprox(mu=0.1)",
            "--seeds", "0,1", "--out", str(tmp_path), "--quiet"]
    assert main(args) == 0
    table = (tmp_path / "compare.md").read_text()
    assert "| fedavg |" in table and "| prox |" in table and "±" in table
    assert (tmp_path / "compare.csv").read_text().startswith("method,gm_mean,gm_std")
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().err.count("[skip ") == 4


def test_compare_and_sweep_share_one_rule_for_a_run_that_has_ended(tmp_path, capsys):
    """A run that diverged is a result of its config: compare (like sweep) does not run it
    again, leaves it out of the table, names it and exits 3; run --resume says so too."""
    wild = ["compare", str(DIGITS), "rounds=3", "training.lr=1e6", "training.momentum=0.99", "--methods",
            "fedavg", "--seeds", "0,1", "--out", str(tmp_path / "cmp"), "--quiet"]
    assert main(wild) == 3
    err = capsys.readouterr().err
    assert err.count("[diverged]") == 2 and "2 run(s) diverged and are left out of the table" in err
    meta = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert len(meta["diverged"]) == 2 and meta["groups"] == {}  # named, never averaged in
    assert main(wild) == 3  # again: nothing is retrained; both are named as ended
    err = capsys.readouterr().err
    assert err.count("[skip ") == 2 and err.count(": diverged in ") == 2 and "[diverged]" not in err
    run_dir = tmp_path / "cmp" / meta["diverged"][0]
    assert main(["run", str(run_dir / "config.yaml"), "--resume", f"output.dir={tmp_path / 'cmp'}",
                 f"output.name={run_dir.name}"]) == 3
    assert "diverged in an earlier run" in capsys.readouterr().err


def test_python_m_protofl_works():
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    out = subprocess.run([sys.executable, "-m", "protofl", "list"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "methods:" in out.stdout


def test_switching_a_component_drops_its_old_parameters(tmp_path, capsys):
    from protofl.config import load_config

    cfg = load_config(DIGITS, ["partition.name=iid"])  # digits.yaml sets beta and min_size
    assert cfg.partition.name == "iid" and cfg.partition.params == {}
    assert cfg.partition.num_clients == 10  # the section's own keys stay
    cfg = load_config(DIGITS, ["model.name=lenet5"])  # digits.yaml sets hidden, feature_dim
    assert cfg.model.name == "lenet5" and "hidden" not in cfg.model.params
    # parameters of the new component given on the same line stay, in either order
    cfg = load_config(DIGITS, ["partition.classes_per_client=2", "partition.name=pathological"])
    assert cfg.partition.params["classes_per_client"] == 2 and "beta" not in cfg.partition.params
    cfg = load_config(DIGITS, ["algorithm.name=fedprox", "algorithm.mu=0.3"])
    assert cfg.algorithm.params["mu"] == 0.3
    # the same name again keeps the config's parameters
    assert load_config(DIGITS, ["partition.name=dirichlet"]).partition.params["beta"] == 0.5
    code = main(["run", str(DIGITS), "rounds=1", "partition.name=iid", f"output.dir={tmp_path}", "--quiet"])
    assert code == 0, capsys.readouterr().err


def test_unavailable_device_exits_2_listing_available_ones(tmp_path, capsys):
    from protofl.config import available_devices

    dev = f"cuda:{len(available_devices()) + 3}"
    code = main(["run", str(DIGITS), f"execution.device={dev}", f"output.dir={tmp_path}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "execution.device" in err and "available: cpu" in err


def test_overrides_may_follow_the_options(tmp_path, capsys):
    code = main(["run", str(DIGITS), f"output.dir={tmp_path}", "--quiet", "rounds=2", "output.name=after"])
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "after" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    with pytest.raises(SystemExit):  # anything else unknown is still an error
        main(["run", str(DIGITS), "--quiet", "--no-such-flag"])


# ---------------------------------------------------------------------------------------
# --resume: a finished run is complete, not resumed; the newest of several runs is taken
# ---------------------------------------------------------------------------------------
def test_resume_of_a_finished_run_says_it_is_complete_and_how_to_extend_it(tmp_path, capsys):
    args = ["run", str(DIGITS), "rounds=2", "partition.num_clients=4", f"output.dir={tmp_path}", "--quiet"]
    assert main(args) == 0
    (run_dir,) = tmp_path.iterdir()
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"{run_dir} is already complete (2 of 2 rounds): nothing to do" in out, out
    hint = f"protofl run {DIGITS} partition.num_clients=4 output.dir={tmp_path} --resume rounds=4"
    assert hint in out and "resuming" not in out
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # no work, nothing rewritten
    assert main(parse_hint(hint, "--quiet")) == 0  # the hint works: 2 more rounds
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]


def parse_hint(hint, *extra):
    import shlex

    argv = shlex.split(hint)
    assert argv[0] == "protofl"
    return [*argv[1:], *extra]


def test_resume_picks_the_newest_of_several_runs_of_a_config(tmp_path, capsys):
    args = ["run", str(DIGITS), "rounds=2", "partition.num_clients=4", f"output.dir={tmp_path}", "--quiet"]
    assert main(args) == 0 and main(args) == 0  # a second run of the same config gets <name>-1
    first, second = sorted(tmp_path.iterdir(), key=lambda p: len(p.name))
    assert second.name == first.name + "-1"
    # the first folder was written last (e.g. it was resumed after the second was made)
    newer = max(p.stat().st_mtime for p in second.iterdir()) + 60
    for p in first.iterdir():
        os.utime(p, (newer, newer))
    capsys.readouterr()
    assert main([*args, "--resume", "rounds=3"]) == 0
    cap = capsys.readouterr()
    assert f"2 runs of this config in {tmp_path}: resuming the newest, {first.name}" in cap.err
    assert f"3 rounds -> {first}" in cap.out
    assert len((second / "metrics.jsonl").read_text().splitlines()) == 2  # the older one untouched


def test_resume_with_fewer_rounds_than_done_is_one_line(tmp_path, capsys):
    args = ["run", str(DIGITS), "rounds=3", "partition.num_clients=4", f"output.dir={tmp_path}", "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--resume", "rounds=2"]) == 2
    err = capsys.readouterr().err
    assert "has already run 3 rounds" in err and err.count("\n") == 1, err
