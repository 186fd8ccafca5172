"""The round loop: determinism across backends, resume, participation, failures, bytes."""
import json

import numpy as np
import pytest
import torch

from protofl import run
from protofl.engine.callbacks import Callback
from protofl.engine.simulation import Simulation
from protofl.engine.train import NonFiniteLossError
from protofl.models import num_params

from conftest import kill_and_resume, strip_timing


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sequential_and_process_workers_give_identical_results(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=3")
    seq = run(cfg, run_dir=tmp_path / "seq")
    par = run(cfg.replace(**{"execution.workers": 2}), run_dir=tmp_path / "par")
    assert strip_timing(seq.rows) == strip_timing(par.rows)
    assert same_weights(seq.server_state.weights, par.server_state.weights)


@pytest.mark.long  # stateful methods in real workers by default: fedproto (test_speed_invariance.py),
# fedrep and ditto (test_personalization.py); every method through the workers' code path in
# test_algorithms_common.py
def test_stateful_method_identical_with_workers(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=3", "algorithm.name=local")
    seq = run(cfg, run_dir=tmp_path / "seq")
    par = run(cfg.replace(**{"execution.workers": 2}), run_dir=tmp_path / "par")
    assert strip_timing(seq.rows) == strip_timing(par.rows)



@pytest.mark.parametrize("method", ["fedavg", "local"])
def test_resume_after_kill_is_bit_identical(digits_cfg, tmp_path, method):
    cfg = digits_cfg("rounds=5", "output.checkpoint_every=2", f"algorithm.name={method}")
    full, resumed = kill_and_resume(cfg, tmp_path, after=3)  # last checkpoint: round 2
    assert [r["round"] for r in resumed.rows] == [1, 2, 3, 4, 5]
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2, 3, 4, 5]
    if method == "fedavg":
        assert same_weights(resumed.server_state.weights, full.server_state.weights)


def test_resume_refuses_a_different_config(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=2")
    run(cfg, run_dir=tmp_path / "r")
    with pytest.raises(ValueError, match="different config"):
        Simulation(cfg.replace(**{"training.lr": 0.2}), run_dir=tmp_path / "r").run(resume=True)


def test_resume_extends_a_finished_run(digits_cfg, tmp_path):
    short = run(digits_cfg("rounds=2"), run_dir=tmp_path / "r")
    longer = Simulation(digits_cfg("rounds=4"), run_dir=tmp_path / "r").run(resume=True)
    full = run(digits_cfg("rounds=4"), run_dir=tmp_path / "full")
    # round 2 was the last round of the short run (it has extra full-test metrics)
    assert longer.rows[:2] == short.rows
    assert [r["gm"] for r in longer.rows] == [r["gm"] for r in full.rows]
    assert strip_timing(longer.rows[2:]) == strip_timing(full.rows[2:])
    assert same_weights(longer.server_state.weights, full.server_state.weights)


def test_nan_loss_stops_with_round_and_client_and_keeps_checkpoint(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=6", "output.checkpoint_every=1", "training.lr=1e6", "training.momentum=0.99")
    d = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError) as err:
        Simulation(cfg, run_dir=d).run()
    msg = str(err.value)
    assert f"round {err.value.rnd}" in msg and f"client {err.value.cid}" in msg
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "diverged" and "non-finite" in summary["error"]
    if err.value.rnd > 1:  # the checkpoint of the last good round is intact and loadable
        ck = torch.load(d / "checkpoint.pt", weights_only=False)
        assert ck["round"] == err.value.rnd - 1
        assert all(torch.isfinite(v).all() for v in ck["server_state"].weights.values()
                   if v.is_floating_point())


def test_p_zero_means_no_update_arrives(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=2", "participation.p=0.0")
    res = run(cfg, run_dir=tmp_path / "p0")
    assert all(r["arrived"] == 0 for r in res.rows)
    sim = Simulation(cfg, run_dir=tmp_path / "init")
    init = sim.algorithm.server_init(sim.server)
    assert same_weights(res.server_state.weights, init.weights)  # the global model never moved


def test_bytes_are_real_message_sizes(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=1")
    res = run(cfg, run_dir=tmp_path / "b")
    sim = Simulation(cfg, run_dir=tmp_path / "x")
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.init_weights().values())
    row = res.rows[0]
    assert row["bytes_down"] == row["selected"] * model_bytes
    assert row["bytes_up"] == row["arrived"] * (model_bytes + 8)  # + the sample count (num_samples)
    assert num_params(sim.server.shared_model()) * 4 == model_bytes


def test_sampling_fraction_and_eval_schedule(digits_cfg, tmp_path):
    cfg = digits_cfg("rounds=4", "participation.fraction=0.3", "eval.every=3", "eval.personal=false")
    res = run(cfg, run_dir=tmp_path / "e")
    assert all(r["selected"] == 3 for r in res.rows)  # ceil(0.3 * 10)
    assert ["gm" in r for r in res.rows] == [False, False, True, True]  # every 3 + the last
    assert all("pm_v" not in r and "pa" not in r for r in res.rows)
    res = run(cfg.replace(**{"eval.every": 1, "eval.personal": True, "eval.personal_every": 2}),
              run_dir=tmp_path / "p")
    assert all("pa" in r for r in res.rows)  # PA with every evaluation
    assert ["pm_v" in r for r in res.rows] == [False, True, False, True]  # full test: every 2 + last


def test_run_dir_contents(digits_cfg, tmp_path):
    res = run(digits_cfg("rounds=2"), run_dir=tmp_path / "d")
    names = {p.name for p in res.dir.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoint.pt", "clients.json", "model.pt"} <= names
    clients = json.loads((res.dir / "clients.json").read_text())
    assert np.asarray(clients["train_counts"]).shape == (10, 10)
    summary = json.loads((res.dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["rounds_completed"] == 2
    assert summary["final"]["gm"] == res.rows[-1]["gm"]
    # the round's CPU time in this process (the clients train here: workers=0)
    assert all(isinstance(r["cpu_s"], float) and r["cpu_s"] > 0 for r in res.rows)


def test_fresh_runs_never_overwrite(digits_cfg):
    cfg = digits_cfg("rounds=1")
    a, b = run(cfg), run(cfg)
    assert a.dir != b.dir and a.dir.exists() and b.dir.exists()
    assert strip_timing(a.rows) == strip_timing(b.rows)


def test_runs_started_at_once_get_folders_of_their_own(digits_cfg):
    """Two runs of one config started together: each claims its folder (mkdir) before it
    writes, so neither writes into the other's."""
    import threading

    from protofl.api import fresh_dir

    cfg = digits_cfg("rounds=1", "output.name=same")
    got, start = [], threading.Barrier(8)

    def claim():
        start.wait()
        got.append(fresh_dir(cfg))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and {d.name for d in got} == {"same", *(f"same-{i}" for i in range(1, 8))}


class Boom(Callback):
    def on_round(self, row):
        if row["round"] == 2:
            raise RuntimeError("network down")


def test_any_other_error_is_recorded_as_failed(digits_cfg, tmp_path):
    with pytest.raises(RuntimeError):
        Simulation(digits_cfg("rounds=4"), callbacks=[Boom()], run_dir=tmp_path / "f").run()
    summary = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert summary["status"] == "failed" and "network down" in summary["error"]
    assert summary["rounds_completed"] == 2


def test_workers_auto_resolution(monkeypatch):
    from protofl.engine import executor

    monkeypatch.setattr(executor.os, "cpu_count", lambda: 4)
    assert executor.resolve_workers("auto", 10) == 4  # one per core
    assert executor.resolve_workers("auto", 3) == 3  # at most one per client of a round
    assert executor.resolve_workers("auto", 1) == 0  # a single client: no pool
    assert executor.resolve_workers(2, 10) == 2 and executor.resolve_workers(0, 10) == 0


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_the_broadcast_goes_to_the_device_once_per_round(digits_cfg, tmp_path, executor):
    """What the engine hands to the training device (counted on the CPU too): a round's
    broadcast once, whatever the number of clients; each client's own part and state."""
    cfg = digits_cfg("rounds=3", "participation.fraction=0.5", "eval.final_all_clients=false",
                     f"execution.executor={executor}")
    sim = Simulation(cfg, run_dir=tmp_path / "fedavg")
    res = sim.run()
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.init_weights().values())
    t = sim.runtime.transfers
    assert res.rows[0]["selected"] == 5 and t.records == 3  # FedAvg: one broadcast per round, no state
    assert t.bytes == 3 * model_bytes and t.copied == 0  # on the CPU nothing is copied
    ditto = Simulation(cfg.replace(**{"algorithm.name": "ditto"}), run_dir=tmp_path / "ditto")
    rows = ditto.run().rows
    t = ditto.runtime.transfers  # plus, per client, its personal model v_k (its state)
    assert t.records == 3 + sum(r["selected"] for r in rows) == 18
    assert t.bytes == 18 * model_bytes
