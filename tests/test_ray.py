"""The Ray backend on a real 2-node Ray cluster on this machine (127.0.0.1 only).

The cluster fixture starts a head and a worker node (``ray start``, one CPU each, each with
its own ``--temp-dir`` under the test's tmp folder, or a short folder of the system temp dir
when that one is too deep for Ray's Unix sockets; :class:`LocalRayCluster`) and stops
every process they started by PID: the processes of the two ``ray start`` process groups,
their descendants, and anything naming the temp dir or the head's port (Ray's
client-server proxy does not name the temp dir). Never ``ray stop``: it would stop every
Ray cluster on the machine.

Run alone with ``pytest -m ray tests/test_ray.py``. The raylet-kill test runs last: it
leaves the cluster with one node.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

from protofl.config import ConfigError, load_config  # noqa: E402
from protofl.engine.callbacks import Callback  # noqa: E402
from protofl.testing.ray_cluster import LocalRayCluster, free_port, ray_env  # noqa: E402
from protofl.engine.simulation import Simulation, read_rows  # noqa: E402

from conftest import DIGITS, strip_timing  # noqa: E402

pytestmark = pytest.mark.ray

PROTOFL = [sys.executable, "-m", "protofl"]
# `protofl ARGS` whose driver kills itself (SIGKILL) when round 3's row is out, after the
# checkpoint of round 2
DIE_IN_ROUND_3 = """
import os, signal, sys
from protofl.cli import main
from protofl.engine.callbacks import Callback
from protofl.engine.simulation import Simulation

class Die(Callback):
    def on_round(self, row):
        if row["round"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

init = Simulation.__init__
Simulation.__init__ = lambda self, cfg, callbacks=(), *a, **k: init(self, cfg, [*callbacks, Die()], *a, **k)
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalRayCluster(tmp_path_factory.mktemp("ray"), nodes=2, cpus=1, fast_failure_detection=True)
    try:
        yield c.start()
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        c.stop()
        assert not c.processes()


@pytest.fixture(scope="module")
def driver(cluster):
    """This test process as a driver of the cluster, for the in-process runs."""
    import warnings

    import ray

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(address=cluster.address, log_to_driver=False, logging_level=40)
    yield cluster
    ray.shutdown()


def digits(tmp_path, *overrides):
    return load_config(DIGITS, ["partition.num_clients=4", "participation.fraction=1.0", "rounds=2",
                                "training.epochs=1", f"output.dir={tmp_path}", "output.progress=false",
                                "execution.threads=1", "execution.workers=0", *overrides])


def ray_overrides(cluster, *more):
    return ["execution.backend=ray", f"execution.address={cluster.address}", *more]


METHODS = {
    "fedavg": ["algorithm.name=fedavg", "model.hidden=[512]"],  # 128 KiB weights: shipped by reference
    "fedproto-hetero": ["algorithm.name=fedproto", "model.per_client={hidden: [[32], [64]]}"],
    "local": ["algorithm.name=local"],  # a personal model per client: per-client state
}


# -- no cluster needed ------------------------------------------------------------------------------
def test_a_deep_root_gets_short_node_folders_for_rays_sockets():
    import shutil
    import tempfile
    from pathlib import Path

    from protofl.testing.ray_cluster import SOCKET_PATH_MAX, SOCKET_TAIL

    base = Path(tempfile.mkdtemp())  # the system temp dir: shallower than pytest's tmp_path
    try:
        shallow = base / "c"
        room = SOCKET_PATH_MAX - len(SOCKET_TAIL) - len(str(shallow.resolve()))
        if room < 0:
            pytest.skip("this machine's temporary folder is itself too deep")
        assert LocalRayCluster(shallow).node_dir(0) == shallow / "h"  # fits: under root, as asked
        deep = LocalRayCluster(base / "c" / ("d" * room))  # one character too deep
        assert deep.nodes_root != deep.root and deep.nodes_root.is_dir()
        assert len(str(deep.node_dir(0)) + SOCKET_TAIL[2:]) <= SOCKET_PATH_MAX
        deep.stop()  # nothing was started; the short folder goes
        assert not deep.nodes_root.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_ray_config_errors_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="explicitly"):
        load_config(DIGITS, ["execution.backend=ray", "execution.address=auto"])
    with pytest.raises(ConfigError, match="host:port"):
        load_config(DIGITS, ["execution.backend=ray", "execution.address=localhost"])
    with pytest.raises(ConfigError, match="needs backend: ray"):
        load_config(DIGITS, ["execution.state=cluster"])
    with pytest.raises(ConfigError, match="execution backend"):
        load_config(DIGITS, ["execution.backend=dask"])
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"pip install 'protofl\[ray\]'"):
        load_config(DIGITS, ["execution.backend=ray"])


def test_bad_address_fails_in_one_line_exit_2_within_30_s(tmp_path):
    t0 = time.monotonic()
    res = subprocess.run([*PROTOFL, "run", str(DIGITS), "execution.backend=ray",
                          f"execution.address=127.0.0.1:{free_port()}", f"output.dir={tmp_path}", "--quiet"],
                         capture_output=True, text=True, timeout=60, env=ray_env())
    assert res.returncode == 2, res.stderr
    assert time.monotonic() - t0 < 30
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "execution.address" in lines[0] and "no Ray cluster" in lines[0], res.stderr


def test_shared_tensors_are_put_once_per_round_and_land_in_order():
    import torch

    from protofl.engine.ray_executor import SHARE_BYTES, _land, _ship
    from protofl.messages import Record

    class FakeRay:  # the object store as a dict
        def __init__(self):
            self.store = {}

        def put(self, v):
            self.store[len(self.store)] = v
            return len(self.store) - 1

        def get(self, refs):
            return [self.store[r] for r in refs]

    ray, cache = FakeRay(), {}
    big, small = torch.randn(SHARE_BYTES // 4), torch.randn(3)
    msgs = [Record({"a": small + k, "w": big, "b": small}, {"n": k}, {"c": "x"}) for k in range(5)]
    shipped = [_ship(ray, m, cache) for m in msgs]
    assert len(ray.store) == 1  # the shared weights: one put for five clients
    for m, s in zip(msgs, shipped):
        got = _land(ray, s)
        assert list(got.arrays) == ["a", "w", "b"] and got.metrics == m.metrics and got.config == m.config
        assert all(torch.equal(got.arrays[k], m.arrays[k]) for k in m.arrays)
    assert _ship(ray, Record({"b": small}), cache).arrays["b"] is small  # small messages go as they are


# -- on the 2-node cluster -----------------------------------------------------------------------------
def test_ray_equals_sequential_on_two_nodes(driver, tmp_path):
    # fedavg and fedproto: state on the driver, data shipped; local: its personal models kept
    # in the cluster, the data loaded by each node
    for name, state, data in (("fedavg", "driver", "ship"), ("fedproto-hetero", "driver", "ship"),
                              ("local", "cluster", "node")):
        method = METHODS[name]
        ref = Simulation(digits(tmp_path, *method), run_dir=tmp_path / f"{name}-seq").run()
        cfg = digits(tmp_path, *method, *ray_overrides(driver, f"execution.state={state}", f"execution.data={data}"))
        res = Simulation(cfg, run_dir=tmp_path / f"{name}-ray").run()
        assert strip_timing(res.rows) == strip_timing(ref.rows), name
        ex = res.summary["execution"]
        assert ex["backend"] == "ray" and ex["actors"] == 2 and ex["nodes"] == 2, ex
        assert len(ex["tasks_per_node"]) == 2 and ex["retried"] == ex["lost"] == 0, ex  # both nodes ran tasks
        assert sorted(json.loads((tmp_path / f"{name}-ray" / "summary.json").read_text())) == sorted(ref.summary)


@pytest.mark.long  # every method: about 3 s each on the cluster; the default run covers 3 here, and
# every method through the workers' code path, which Ray's actors share (ClientRuntime.run)
def test_every_method_on_the_cluster_equals_sequential(driver, tmp_path):
    from protofl.algorithms import ALGORITHMS

    failed = {}
    for name in ALGORITHMS.names():
        method = [f"algorithm.name={name}", "training.steps=2", "eval.final_all_clients=false"]
        ref = Simulation(digits(tmp_path, *method), run_dir=tmp_path / f"{name}-seq").run()
        res = Simulation(digits(tmp_path, *method, *ray_overrides(driver)), run_dir=tmp_path / f"{name}-ray").run()
        ex = res.summary["execution"]
        if strip_timing(res.rows) != strip_timing(ref.rows) or ex["nodes"] != 2:
            failed[name] = ex
    assert not failed, failed


def test_driver_killed_then_resumed_with_cluster_state(cluster, tmp_path):
    method = METHODS["fedproto-hetero"]
    ref = Simulation(digits(tmp_path, *method, "rounds=4"), run_dir=tmp_path / "seq").run()
    args = [*PROTOFL, "run", str(DIGITS), "partition.num_clients=4", "participation.fraction=1.0", "rounds=4",
            "training.epochs=1", f"output.dir={tmp_path}", "output.name=ray", "output.checkpoint_every=1",
            "execution.threads=1", *method, *ray_overrides(cluster, "execution.state=cluster"), "--quiet"]
    metrics = tmp_path / "ray" / "metrics.jsonl"
    # the driver dies (SIGKILL) in round 3, after round 2's checkpoint: killed from inside, at
    # a known round, since a poll from outside lost the race to a fast machine (all 4 rounds
    # done between two polls)
    first = subprocess.run([sys.executable, "-c", DIE_IN_ROUND_3, *args[len(PROTOFL):]], capture_output=True, text=True,
                           timeout=180, env=ray_env())
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    assert len(read_rows(metrics)) == 3
    res = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=180, env=ray_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert strip_timing(read_rows(metrics)) == strip_timing(ref.rows)
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["execution"]["nodes"] == 2


def test_second_node_raylet_killed_mid_run_still_equal(driver, tmp_path):
    """Runs last: the worker node does not come back."""
    method = METHODS["fedavg"]
    ref = Simulation(digits(tmp_path, *method, "rounds=3"), run_dir=tmp_path / "seq").run()

    class KillAfterRound1(Callback):
        def on_round(self, row):
            if row["round"] == 1:
                os.kill(driver.raylet(1), signal.SIGKILL)

    cfg = digits(tmp_path, *method, "rounds=3", *ray_overrides(driver))
    res = Simulation(cfg, run_dir=tmp_path / "ray", callbacks=[KillAfterRound1()]).run()
    assert strip_timing(res.rows) == strip_timing(ref.rows)
    ex = res.summary["execution"]
    assert res.summary["status"] == "complete" and ex["retried"] >= 1 and ex["lost"] == 0, ex
