"""Real Flower processes on 127.0.0.1: a SuperLink, three SuperNodes, ``flwr run``.

Slow (Flower's processes poll every few seconds; with ``subprocess`` isolation every
message also starts a ClientApp process): run alone with ``pytest -m flower
tests/test_flower_deploy.py``. Every process is started by
:class:`~protofl.flower.launch.LocalDeployment` (or the test itself) and stopped by its
PID when the ``with`` block, the fixture or the test ends, whatever happens.
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography")

from protofl.algorithms import ALGORITHMS  # noqa: E402
from protofl.config import load_config  # noqa: E402
from protofl.engine.simulation import Simulation, read_rows  # noqa: E402
from protofl.flower.launch import LocalDeployment, _group_alive, flower_env, free_port  # noqa: E402

from conftest import DIGITS, REPO, TIMING_KEYS  # noqa: E402

pytestmark = pytest.mark.flower

# the prototype methods of the issue, as soon as they are registered
METHODS = [m for m in ("fednh", "fedproto") if m in ALGORITHMS.names()] or ["fedavg"]


def digits(tmp_path, *overrides):
    """configs/digits.yaml with 3 clients, all of them every round, 1 thread per process."""
    return load_config(DIGITS, ["partition.num_clients=3", "participation.fraction=1.0",
                                f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1",
                                *overrides])


def run_rows(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, read_rows(run_dir / "metrics.jsonl")


def assert_close(got, want, tol=1e-5, where=""):
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, tol, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, (int, float)) and (math.isnan(want) and math.isnan(got)
                                                  or abs(got - want) <= tol), (where, got, want)
    else:
        assert got == want, (where, got, want)


def test_subprocess_isolation_still_works(tmp_path):
    """Flower's default: one flwr-clientapp process per message, no protofl worker."""
    cfg = digits(tmp_path, "algorithm.name=fedavg", "rounds=1", "training.epochs=1")
    ref = Simulation(cfg, run_dir=tmp_path / "in-process").run()
    with LocalDeployment(tmp_path / "deployment", num_nodes=3, isolation="subprocess") as dep:
        res = dep.submit(cfg, tmp_path / "flower", timeout=300, round_timeout=150)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "[protofl]" in res.stdout and "\x1b[" not in res.stdout  # the streamed logs: no colour codes in a pipe
    summary, rows = run_rows(tmp_path / "flower")
    assert summary["status"] == "complete" and rows[0]["arrived"] == 3, res.stdout[-3000:]
    for key in set(ref.rows[0]) - TIMING_KEYS:
        assert_close(rows[0][key], ref.rows[0][key], where=key)
    log = (tmp_path / "deployment" / "supernode-0.log").read_text(errors="replace")
    assert "[protofl worker]" not in log and "[protofl node]" not in log, log[-2000:]
    assert "Start `flwr-clientapp` process" in log, log[-2000:]


def test_node_supervisor_restarts_its_worker_and_exits_with_the_supernode(tmp_path):
    """``python -m protofl.flower.node`` around a stand-in SuperNode that exits with 3 after 8 s."""
    fake_node = [sys.executable, "-c", "import time; time.sleep(8); raise SystemExit(3)"]
    cmd = [sys.executable, "-m", "protofl.flower.node", "--runtime-api-address", f"127.0.0.1:{free_port()}",
           "--", *fake_node]
    log = tmp_path / "node.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=flower_env(), start_new_session=True)

    def workers():
        return [int(p) for p in re.findall(r"ClientApp worker pid (\d+) \(", log.read_text(errors="replace"))]

    def wait_for(cond, timeout):
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.1)
        return cond()

    try:
        assert wait_for(lambda: len(workers()) == 1, 10), log.read_text()
        os.kill(workers()[0], signal.SIGKILL)  # a crashed ClientApp process
        assert wait_for(lambda: len(workers()) == 2, 15), log.read_text()
        assert proc.wait(timeout=40) == 3, log.read_text()  # the SuperNode's exit status
        # the second worker was stopped with it: nothing of the group is left
        assert wait_for(lambda: not _group_alive(proc.pid), 10), log.read_text()
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


# last in the module: the module-scoped deployment lives from its first use to the end of the
# module, and its idle processes would otherwise poll beside every later test
@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with LocalDeployment(tmp_path_factory.mktemp("flower"), num_nodes=3) as dep:
        yield dep


@pytest.mark.parametrize("name", METHODS)
def test_flower_run_equals_in_process_simulation(name, deployment, tmp_path):
    cfg = digits(tmp_path, f"algorithm.name={name}", "rounds=2")
    ref = Simulation(cfg, run_dir=tmp_path / "in-process").run()
    res = deployment.submit(cfg, tmp_path / "flower", timeout=300, round_timeout=150)
    assert res.returncode == 0, res.stdout[-3000:]
    summary, rows = run_rows(tmp_path / "flower")
    assert summary["status"] == "complete" and len(rows) == 2, res.stdout[-3000:]
    # the run folder has the simulation's layout
    assert {p.name for p in (tmp_path / "in-process").iterdir()} == {p.name for p in (tmp_path / "flower").iterdir()}
    for got, want in zip(rows, ref.rows):
        assert got["lost"] == 0 and got["arrived"] == 3
        assert set(got) == set(want)
        for key in set(want) - TIMING_KEYS:
            assert_close(got[key], want[key], where=f"round {want['round']} {key}")
    # each SuperNode's messages all ran in its one long-lived ClientApp worker
    for k in range(3):
        log = (deployment.workdir / f"supernode-{k}.log").read_text(errors="replace")
        assert len(re.findall(r"ClientApp worker pid \d+ \(", log)) == 1, log[-2000:]
        assert len(re.findall(r"\[protofl worker\] task \d+ \(run \d+\) done", log)) >= 3, log[-2000:]
        assert "failed in" not in log and "Start `flwr-clientapp` process" not in log, log[-2000:]


def _processes_naming(text: str) -> list[int]:
    """PIDs whose command line names ``text`` (a deployment's own folder) or that run in it."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    named = text.encode() in fh.read()
                if named or os.readlink(f"/proc/{d}/cwd").startswith(text):
                    pids.append(int(d))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_a_local_deployment_and_everything_it_started(tmp_path):
    """`protofl flower local` killed with SIGTERM (kill, timeout, SLURM) stops its SuperLink
    and SuperNodes as Ctrl-C does: nothing of it is left running."""
    work = tmp_path / "work"
    env = dict(os.environ, **flower_env(), PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "protofl", "flower", "local", str(DIGITS), "rounds=200",
                             "partition.num_clients=2", f"output.dir={tmp_path / 'runs'}", "--workdir", str(work),
                             "--timeout", "300"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "runs").rglob("metrics.jsonl")):
            time.sleep(0.5)  # running: the SuperLink, both SuperNodes and a round or more
        assert list((tmp_path / "runs").rglob("metrics.jsonl")), proc.stderr.read().decode()[-2000:] if proc.poll() \
            is not None else "no round within 120 s"
        assert _processes_naming(str(work))  # the deployment's processes name its folder
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _processes_naming(str(work)):
            time.sleep(0.5)
        assert _processes_naming(str(work)) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _processes_naming(str(work)):
            os.kill(pid, signal.SIGKILL)
