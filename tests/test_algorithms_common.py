"""The shared check suite: every registered method must pass it.

Runs each method for 2 rounds on configs/digits.yaml (as `protofl run ... algorithm.name=<m>
rounds=2` does) and checks the messages, determinism and metrics.
"""
import math

import pytest
import torch

from protofl.algorithms import ALGORITHMS
from protofl.engine.simulation import Simulation
from protofl.messages import Record

from conftest import record_run, strip_timing, worker_path_executor


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_two_rounds_on_digits(name, digits_cfg, tmp_path):
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2")
    _, res, seen = record_run(cfg, tmp_path / "a")
    assert res.summary["status"] == "complete" and len(res.rows) == 2
    algo = ALGORITHMS.get(name)
    for row in res.rows:
        assert row["arrived"] > 0 and math.isfinite(row["train_loss"])
        # an honest client's reply passes the server's checks (engine/validate.py)
        assert row["rejected"] == 0, row.get("rejected_reasons")
        assert ("gm" in row) == algo.has_global_model
        assert 0.0 <= row["pa"] <= 1.0
    for key in ("pm_v", "pm_l", "acc", "ga"):  # full-test personalized metrics: the last round
        assert 0.0 <= res.rows[-1][key] <= 1.0, (key, res.rows[-1][key])
    # messages, replies and client states are transport-agnostic Records
    assert seen
    for _, _, msg, reply, state in seen:
        assert isinstance(msg, Record) and isinstance(reply, Record)
        assert state is None or isinstance(state, Record)
        for rec in (msg, reply):
            assert all(isinstance(v, torch.Tensor) for v in rec.arrays.values())
    # same seed -> identical results, also through the process workers' code path (the
    # method shipped and every task and reply pickled, two stand-in workers, largest client
    # first); tests/test_speed_invariance.py runs real worker processes
    again = Simulation(cfg, run_dir=tmp_path / "b", executor_factory=worker_path_executor).run()
    assert strip_timing(again.rows) == strip_timing(res.rows)
