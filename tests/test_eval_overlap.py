"""``execution.overlap_eval``: round t's global model evaluated while round t+1 trains.

* the pipeline (rows in order, checkpoints wait for their row, callbacks that must see a row
  at once switch it off, a kill drops only rows no checkpoint counts): with an in-process
  executor that defers its evaluations the same way the pool does, fast;
* the pool (worker processes): metrics rows bit-identical with the overlap on and off, with
  1 and 2 workers, for a method with a global model and personalized evaluation on the full
  test set.
"""
import pickle

import pytest

from protofl.engine.callbacks import Callback
from protofl.engine.backends import local_executor
from protofl.engine.executor import SequentialExecutor
from protofl.engine.simulation import METRICS, Simulation, read_rows

from conftest import strip_timing


class _Later:
    def __init__(self, sim, state, log):
        self.sim, self.payload, self.log = sim, pickle.dumps(state), log

    def result(self):
        self.log.append(("eval", pickle.loads(self.payload).__class__.__name__))
        return self.sim.evaluate_global(pickle.loads(self.payload))


class DeferringExecutor(SequentialExecutor):
    """In-process clients; global evaluations deferred until asked for, as in the pool."""

    defers_eval = True

    def __init__(self, sim, log):
        super().__init__(sim.runtime, 1)
        self.sim, self.log = sim, log

    def run(self, tasks):
        self.log.append(("round", tasks[0].rnd if tasks else None))
        return super().run(tasks)

    def evaluate_later(self, state):
        self.log.append(("later", None))
        return _Later(self.sim, state, self.log)


class Rows(Callback):
    def __init__(self, log, immediate, stop_at=None):
        self.log, self.immediate, self.stop_at = log, immediate, stop_at

    def on_round(self, row):
        self.log.append(("row", row["round"]))
        if row["round"] == self.stop_at:
            raise KeyboardInterrupt


def deferred_run(cfg, run_dir, immediate=False, stop_at=None, resume=False):
    log = []
    sim = Simulation(cfg, callbacks=[Rows(log, immediate, stop_at)], run_dir=run_dir,
                     executor_factory=lambda s: DeferringExecutor(s, log))
    return sim.run(resume=resume), log


def test_pipeline_rows_in_order_and_identical(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=5", "output.checkpoint_every=3", "algorithm.name=fednh",
                     "eval.final_all_clients=false")
    ref = Simulation(cfg, run_dir=tmp_path / "ref").run()  # sequential: no overlap
    res, log = deferred_run(cfg, tmp_path / "on")
    assert strip_timing(res.rows) == strip_timing(ref.rows)
    assert [list(r) for r in res.rows] == [list(r) for r in ref.rows]  # same keys, same order
    assert strip_timing(read_rows(tmp_path / "on" / METRICS)) == strip_timing(ref.rows)
    # rounds 1, 2, 4 overlap; 3 (checkpoint) and 5 (last) wait for their own row
    events = [e for e in log if e[0] != "eval"]
    assert events == [("round", 1), ("later", None), ("round", 2), ("later", None), ("row", 1),
                      ("round", 3), ("row", 2), ("row", 3), ("round", 4), ("later", None),
                      ("round", 5), ("row", 4), ("row", 5)]


def test_immediate_callback_sees_each_row_before_the_next_round(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=3", "eval.final_all_clients=false")
    res, log = deferred_run(cfg, tmp_path / "run", immediate=True)
    assert ("later", None) not in log
    assert log == [("round", 1), ("row", 1), ("round", 2), ("row", 2), ("round", 3), ("row", 3)]
    assert len(res.rows) == 3


def test_no_overlap_when_switched_off(digits_cfg, tmp_path):
    res, log = deferred_run(digits_cfg("rounds=3", "execution.overlap_eval=false"), tmp_path / "run")
    assert ("later", None) not in log and [r["round"] for r in res.rows] == [1, 2, 3]


def test_kill_with_a_pending_row_resumes_to_the_same_rows(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=6", "output.checkpoint_every=4")
    ref = Simulation(cfg, run_dir=tmp_path / "ref").run()
    d = tmp_path / "run"
    # row 2 arrives after round 3 trained; killed then, the run has no checkpoint yet, so
    # the resume starts over from round 1 (and rewrites metrics.jsonl)
    with pytest.raises(KeyboardInterrupt):
        deferred_run(cfg, d, stop_at=2)
    with pytest.raises(KeyboardInterrupt):  # row 5 arrives after round 6 trained: checkpoint 4 holds
        deferred_run(cfg, d, stop_at=5, resume=True)
    assert [r["round"] for r in read_rows(d / METRICS)] == [1, 2, 3, 4, 5]
    resumed, log = deferred_run(cfg, d, resume=True)
    assert log[0] == ("round", 5)  # from the checkpoint of round 4, not of round 6
    assert strip_timing(resumed.rows) == strip_timing(ref.rows)
    assert strip_timing(read_rows(d / METRICS)) == strip_timing(ref.rows)


def test_failing_round_still_writes_the_previous_row(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=4", "output.checkpoint_every=0")

    class Boom(DeferringExecutor):
        def run(self, tasks):
            if tasks and tasks[0].rnd == 3:
                raise RuntimeError("boom")
            return super().run(tasks)

    sim = Simulation(cfg, callbacks=[Rows([], False)], run_dir=tmp_path / "run",
                     executor_factory=lambda s: Boom(s, []))
    with pytest.raises(RuntimeError):
        sim.run()
    rows = read_rows(tmp_path / "run" / METRICS)
    assert [r["round"] for r in rows] == [1, 2] and "gm" in rows[1]


def counting_factory(calls):
    def factory(sim):
        ex = local_executor(sim)
        later = ex.evaluate_later
        ex.evaluate_later = lambda state: calls.append(1) or later(state)
        return ex
    return factory


def test_pool_overlap_bit_identical(digits_cfg, tmp_path):
    # FedNH: a global model, and personalized models evaluated on the full test set every
    # round. (test_speed_invariance compares 2 workers, overlap on by default, with the
    # sequential runs of FedProto, FedNH, ReBaFL and MP-FedCL too.)
    cfg = digits_cfg("rounds=3", "algorithm.name=fednh", "eval.personal_every=1")
    off = Simulation(cfg.replace(**{"execution.workers": 2, "execution.overlap_eval": False}),
                     run_dir=tmp_path / "off").run()
    for workers in (1, 2):
        calls = []
        on = Simulation(cfg.replace(**{"execution.workers": workers}), run_dir=tmp_path / f"on{workers}",
                        executor_factory=counting_factory(calls)).run()
        assert len(calls) == 2  # rounds 1 and 2 ran in the pool; 3 is the last
        assert strip_timing(on.rows) == strip_timing(off.rows), workers
