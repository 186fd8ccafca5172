"""One hostile client over real Flower processes: a SuperLink, three honest SuperNodes and
one whose ClientApp process (tests/hostile_worker.py) alters every reply of its own, one
misbehaviour a round. The run must end complete, name the hostile client in every round's
rejections, blame nobody else, and give the honest clients exactly the results of an
in-process run in which the hostile client's replies never arrived."""
import sys

import pytest

pytest.importorskip("flwr")

from protofl.engine.executor import SequentialExecutor  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402
from protofl.flower.launch import LocalDeployment, free_port, supernode_command  # noqa: E402

from conftest import REPO, TIMING_KEYS  # noqa: E402
from hostile_worker import PLAN  # noqa: E402
from test_flower_deploy import assert_close, digits, run_rows  # noqa: E402

pytestmark = pytest.mark.flower
HOSTILE = 3
# what the server says of each round's hostile reply (engine/validate.py, flower/executor.py)
REASONS = {"accuracy": "evaluation 'pa' is not an accuracy", "nan-loss": "training number 'loss' is not a finite",
           "false-divergence": "non-finite training loss (1.0) reported",
           "scaled-update": "more than 1000 x the round's median update norm",
           "huge-weights": "moved by more than float32 can measure"}


class WithHostile(LocalDeployment):
    """Client HOSTILE's SuperNode runs tests/hostile_worker.py as its ClientApp process."""

    def start_node(self, partition_id, *args, **kwargs):
        if partition_id != HOSTILE or args or kwargs:
            return super().start_node(partition_id, *args, **kwargs)
        port = free_port()
        node = self._spawn(supernode_command(self.address, partition_id, self.num_nodes, port=port,
                                             node_config=self.node_config, isolation="process"),
                           "hostile", "flwr-home-hostile")
        worker = self._spawn([sys.executable, str(REPO / "tests" / "hostile_worker.py"), "--runtime-api-address",
                              f"127.0.0.1:{port}", "--parent-pid", str(node.pid)], "hostile-worker", "flwr-home-hostile")
        self.nodes.append(node)
        self._others.append(worker)
        return node


class Without(SequentialExecutor):
    """In process: the same run with client HOSTILE's replies lost."""

    def __init__(self, runtime):
        super().__init__(runtime, 1)

    def run(self, tasks):
        return [None if t.cid == HOSTILE else o for t, o in zip(tasks, super().run(tasks))]


def test_one_hostile_client_is_named_and_changes_nothing_for_the_others(tmp_path):
    cfg = digits(tmp_path, "algorithm.name=fedavg", "partition.num_clients=4", f"rounds={len(PLAN)}",
                 "training.epochs=1", "training.on_nonfinite=drop", "eval.final_all_clients=false")
    want = Simulation(cfg, run_dir=tmp_path / "in-process", executor_factory=lambda s: Without(s.runtime)).run()
    with WithHostile(tmp_path / "deployment", num_nodes=4) as dep:
        res = dep.submit(cfg, tmp_path / "flower", timeout=300, round_timeout=60)
    assert res.returncode == 0, res.stdout[-3000:]
    summary, rows = run_rows(tmp_path / "flower")
    worker_log = (tmp_path / "deployment" / "hostile-worker.log").read_text(errors="replace")
    assert summary["status"] == "complete" and len(rows) == len(PLAN), (res.stdout[-3000:], worker_log[-2000:])
    for r, kind in zip(rows, PLAN):  # named, every round, for what it did that round
        assert r["rejected"] == 1 and len(r["rejected_reasons"]) == 1, (kind, r["rejected_reasons"])
        reason = r["rejected_reasons"][0]
        assert reason.startswith(f"client {HOSTILE}:") and REASONS[kind] in reason, (kind, reason)
    assert "client 0" not in " ".join(line for line in res.stdout.splitlines() if "[flower]" in line)
    drop = TIMING_KEYS | {"lost", "rejected", "rejected_reasons"}
    for got, ref in zip(rows, want.rows):  # the honest clients' results, untouched
        assert set(got) - drop == set(ref) - drop
        for key in set(ref) - drop:
            assert_close(got[key], ref[key], where=f"round {ref['round']} {key}")
