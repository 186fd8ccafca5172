"""Sweeps: grid x seeds, skipping finished runs by fingerprint, resuming cut runs, in parallel."""
import csv
import re

import pytest

from protofl.config import ConfigError
from protofl.engine.callbacks import Callback
from protofl.api import split_top_level
from protofl.sweeps import parse_grid, plan, sweep

from conftest import DIGITS


def test_grid_parsing():
    assert split_top_level("0.01,0.05") == ["0.01", "0.05"]
    assert split_top_level("[64,64],[128]") == ["[64,64]", "[128]"]
    assert parse_grid(["training.lr=0.01,0.05", "model.hidden=[64,64],[128]", "algorithm.name=fedavg,fednh"]) == {
        "training.lr": [0.01, 0.05], "model.hidden": [[64, 64], [128]], "algorithm.name": ["fedavg", "fednh"]}
    with pytest.raises(ConfigError):
        parse_grid(["training.lr"])


def test_plan_switches_components_and_names_runs_by_the_whole_config(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=2")
    grid = parse_grid(["partition.name=iid,dirichlet", "algorithm.name=fedavg,fedprox"])
    runs = plan(cfg, grid, [0, 1], tmp_path)
    assert len(runs) == 8 and len({r.dir for r in runs}) == 8
    iid = [r for r in runs if r.cfg.partition.name == "iid"]
    assert all("beta" not in r.cfg.partition.params for r in iid)  # the old partitioner's params went
    assert runs[0].label == "partition=iid algorithm=fedavg" and runs[0].seed == 0 and runs[1].seed == 1
    # the number of rounds is part of a sweep run's identity (a longer sweep is not "finished")
    longer = plan(digits_cfg("rounds=3"), grid, [0, 1], tmp_path)
    assert not {r.dir for r in runs} & {r.dir for r in longer}
    with pytest.raises(ConfigError, match="grid point"):
        plan(cfg, parse_grid(["algorithm.mu=0.1,0.2"]), [0], tmp_path)  # fedavg has no mu


class _Interrupt(Callback):
    def on_round(self, row):
        if row["round"] == 2:  # after round 1's checkpoint
            raise KeyboardInterrupt


def test_sweep_skips_finished_and_resumes_cut_runs(digits_cfg, tmp_path):
    import protofl

    cfg = digits_cfg("rounds=2", "output.checkpoint_every=1")
    grid = parse_grid(["training.lr=0.01,0.05"])
    # a run killed in its second round (round 1 checkpointed) ...
    cut = plan(cfg, grid, [0], tmp_path)[1]
    with pytest.raises(KeyboardInterrupt):
        protofl.run(cut.cfg, resume=True, run_dir=cut.dir, callbacks=[_Interrupt()])
    lines = []
    rows, out, failed = sweep(cfg, grid, [0], tmp_path, jobs=1, log=lines.append)
    assert not failed and [r["method"] for r in rows] == ["lr=0.01", "lr=0.05"]
    assert any(ln.startswith("[resume 2/2] lr=0.05") for ln in lines), lines
    assert (out / "sweep.md").read_text().count("| lr=") == 2
    # ... continued from its checkpoint to the end
    from protofl.engine.simulation import read_rows

    assert [r["round"] for r in read_rows(cut.dir / "metrics.jsonl")] == [1, 2]
    lines.clear()
    rows2, _, _ = sweep(cfg, grid, [0], tmp_path, jobs=1, log=lines.append)
    # (one seed: the std is NaN, which != itself; compare the rows as text)
    assert [ln[:7] for ln in lines] == ["[skip 1", "[skip 2"] and repr(rows2) == repr(rows)


def test_sweep_runs_in_parallel_numbers_runs_uniquely_and_equals_one_at_a_time(tmp_path, capsys):
    from protofl.cli import main

    args = ["sweep", str(DIGITS), "rounds=1", "partition.num_clients=4", "--grid", "algorithm.name=fedavg,local",
            "--seeds", "0,1"]
    assert main([*args, "--jobs", "2", "--out", str(tmp_path / "par")]) == 0
    cap = capsys.readouterr()
    assert "4 runs, 2 at a time (this process and 1 worker process)" in cap.err
    assert "| algorithm=fedavg |" in cap.out and "| algorithm=local |" in cap.out
    starts = re.findall(r"^\[run (\d)/4\]", cap.err, re.M)
    assert sorted(starts) == ["1", "2", "3", "4"], cap.err  # each run has its own number, once
    done = re.findall(r"^\[done (\d)/4\] run (\d)/4 (\S+) seed (\d): gm=", cap.err, re.M)
    assert sorted(d for d, *_ in done) == ["1", "2", "3", "4"]  # d-th run to end ...
    assert sorted(k for _, k, *_ in done) == ["1", "2", "3", "4"], cap.err  # ... names which run it was
    runs = {k: (label, seed) for k, label, seed in re.findall(r"^\[run (\d)/4\] (\S+) seed (\d)", cap.err, re.M)}
    assert all(runs[k] == (label, seed) for _, k, label, seed in done)
    # the same grid one run at a time: the same table, bit for bit
    assert main([*args, "--jobs", "1", "--out", str(tmp_path / "seq")]) == 0
    def table(folder):  # all but the seconds per round
        with open(tmp_path / folder / "sweep.csv") as f:
            return [{k: v for k, v in row.items() if k != "s_per_round"} for row in csv.DictReader(f)]

    assert table("par") == table("seq")


def test_default_jobs_count_each_runs_own_workers_and_threads(digits_cfg, tmp_path, monkeypatch):
    import os

    from protofl.sweeps import cores_per_run, default_jobs

    def jobs(cpus, *overrides, n=12):
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        cfg = digits_cfg(*overrides)  # 10 clients, 5 a round
        return cores_per_run(cfg), default_jobs(plan(cfg, {"training.lr": [0.01 * (i + 1) for i in range(n)]},
                                                     [0], tmp_path))

    assert jobs(2, "execution.workers=0", "execution.threads=1") == (1, 2)
    assert jobs(2, "execution.workers=0", "execution.threads=0") == (2, 1)  # torch's default: every core
    assert jobs(2, "execution.workers=auto") == (2, 1)  # one worker per core: the run fills the machine
    assert jobs(8, "execution.workers=auto") == (5, 1)  # one per client of a round
    assert jobs(8, "execution.workers=2") == (2, 4)
    assert jobs(8, "execution.workers=0", "execution.threads=2") == (2, 4)
    assert jobs(8, "execution.workers=0", "execution.threads=1", n=3) == (1, 3)  # never more than runs


@pytest.mark.parametrize("args", [
    ["sweep", "--grid", "training.lr=0.01,0.05", "model.name=mlp,lenet5"],  # the 2nd model cannot take 8x8
    ["sweep", "--grid", "training.lr=0.01,-1"],
    ["sweep", "--grid", "partition.name=pathological", "partition.classes_per_client=2,11"],
    ["compare", "--methods", "fedavg,nosuch"],
    ["compare", "--methods", "fedavg,fedgela", "model.name=mlp2d"],  # an ETF of 10 classes needs 9 dims
])
def test_every_grid_point_is_checked_before_the_first_run(args, tmp_path, monkeypatch, capsys):
    from protofl import api
    from protofl.cli import main

    started = []
    monkeypatch.setattr(api.Simulation, "run", lambda self, **kw: started.append(self.cfg))
    cmd, *rest = args
    assert main([cmd, str(DIGITS), "rounds=1", "--seeds", "0,1", "--out", str(tmp_path / "out"), *rest]) == 2
    err = capsys.readouterr().err
    assert err.startswith("protofl: error: invalid config") and err.count("\n") == 1, err
    assert not started and not (tmp_path / "out").exists()  # not one run, not even the folder


def test_a_worker_pays_only_with_an_idle_core_and_enough_work_left():
    from protofl.sweeps import worker_pays

    # 11 runs of 1.3 s left (14.3 s), a 3 s start-up: worth it with a core idle ...
    assert worker_pays(11, 1.3, 3.0, idle_cores=1.0, cores=1)
    assert not worker_pays(11, 1.3, 3.0, idle_cores=0.5, cores=1)  # ... not when others use it
    assert not worker_pays(2, 1.3, 3.0, idle_cores=2.0, cores=1)  # 2.6 s left < 2 x 3 s start-up
    assert not worker_pays(11, 1.3, 3.0, idle_cores=1.0, cores=2)  # a run that needs 2 cores
    assert worker_pays(11, 1.3, 3.0, idle_cores=1.5, cores=2)


@pytest.mark.parametrize("idle", [0.0, 2.0])
def test_by_default_a_worker_process_starts_only_when_it_pays(idle, digits_cfg, tmp_path, monkeypatch):
    from protofl import sweeps

    monkeypatch.setattr(sweeps, "default_jobs", lambda runs: 2)  # as on 2 cores with 1-core runs
    monkeypatch.setattr(sweeps, "startup_estimate", lambda: 0.01)
    monkeypatch.setattr(sweeps.IdleCores, "sample", lambda self: idle)
    monkeypatch.setattr(sweeps._SharedQueue, "POLL_S", 0.05)
    cfg = digits_cfg("rounds=2", "partition.num_clients=4")
    grid = parse_grid(["training.lr=0.01,0.02,0.03,0.04"])
    lines = []
    rows, _, failed = sweep(cfg, grid, [0], tmp_path / "auto", log=lines.append)
    assert not failed and lines[0].startswith("[sweep] 4 runs, up to 2 at a time")
    started = [ln for ln in lines if ln.startswith("[sweep] worker process 1 starts")]
    assert bool(started) == (idle > 0), lines  # a busy machine: everything here, no start-up paid
    assert sorted(re.findall(r"^\[run (\d)/4\]", "\n".join(lines), re.M)) == ["1", "2", "3", "4"]
    seq, _, _ = sweep(cfg, grid, [0], tmp_path / "seq", jobs=1, log=lambda m: None)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("s_per_round", "cpu_per_round")}  # noqa: E731
                        for r in rs]
    assert repr(strip(rows)) == repr(strip(seq))


def test_sigterm_stops_a_sweep_and_its_worker_processes(tmp_path):
    """`protofl sweep --jobs 2` killed with SIGTERM stops as Ctrl-C does: its worker
    process gets the interrupt too, and nothing of the sweep is left running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    def children(pid: int) -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as fh:
                        if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                            out.append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
        return out

    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "protofl", "sweep", str(DIGITS), "rounds=200", "--grid",
                             "training.lr=0.01,0.02,0.03,0.04", "--jobs", "2", "--out", str(tmp_path / "sw"),
                             "execution.workers=0", "--quiet"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list((tmp_path / "sw").rglob("metrics.jsonl"))) < 2:
            time.sleep(0.3)  # both runs under way: this process's and the worker's
        workers = children(proc.pid)
        assert workers and len(list((tmp_path / "sw").rglob("metrics.jsonl"))) >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130  # as Ctrl-C: interrupted
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
            time.sleep(0.3)
        assert not [p for p in workers if os.path.exists(f"/proc/{p}")]
    finally:
        if proc.poll() is None:
            proc.kill()
