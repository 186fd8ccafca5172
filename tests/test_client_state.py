"""Bounded client state (``execution.state_memory_mb``): the SpillStore's bookkeeping, and
runs that spill giving the same numbers as runs that do not (workers, resume)."""
import json

import pytest
import torch

from protofl import run
from protofl.cli import EXIT_BAD_INPUT, main
from protofl.engine.checkpoint import load_torch
from protofl.engine.simulation import Simulation
from protofl.engine.store import STATE_DIR, Spilled, SpillStore, usage_line
from protofl.messages import Record

from conftest import DIGITS, StopAfter, strip_timing

TINY = "execution.state_memory_mb=0.1"  # digits' MLP: a Ditto state is 68 kB, so 1 in memory


def state(value: float, n: int = 256) -> Record:  # 1 kB of float32
    return Record(arrays={"v": torch.full((n,), float(value))})


def files(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# ---------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------
def test_least_recently_used_states_spill_and_come_back(tmp_path):
    root = tmp_path / STATE_DIR
    s = SpillStore(2500, root)  # two 1 kB states fit
    for cid in range(3):
        s.put(cid, state(cid))
    assert files(root) == ["0.1.pkl"]  # the least recently used went to disk
    assert s.usage() == {"clients": 3, "memory_clients": 2, "memory_bytes": 2048, "disk_clients": 1,
                         "disk_bytes": 1024, "budget_bytes": 2500, "spill_writes": 1, "spill_reads": 0}
    assert s.get(1) is not None  # 1 is now the most recent: 2 is next out
    assert torch.equal(s.get(0).arrays["v"], torch.zeros(256))  # read back; 2 goes out
    assert s.reads == 1 and files(root) == ["0.1.pkl", "2.2.pkl"]
    # 0 came back clean: evicting it again writes nothing; a new state of it does
    s.put(3, state(3.0))  # evicts 1 (dirty) -> a file
    s.put(4, state(4.0))  # evicts 0, unchanged since read -> no write
    assert s.writes == 3 and files(root) == ["0.1.pkl", "1.3.pkl", "2.2.pkl"]
    s.put(0, state(10.0))  # in memory again, newer than 0.1.pkl
    s.put(5, state(5.0))
    s.put(6, state(6.0))  # 0 goes out again: a new file, the superseded one is deleted
    assert "0.1.pkl" not in files(root) and any(f.startswith("0.") for f in files(root))
    assert torch.equal(s.get(0).arrays["v"], torch.full((256,), 10.0))
    s.put(2, None)  # no state any more: its file goes
    assert not any(f.startswith("2.") for f in files(root)) and s.get(2) is None
    assert len(s) == 6


def test_clients_not_sampled_cost_nothing(tmp_path):
    s = SpillStore(0, tmp_path / STATE_DIR)  # budget 0: every state on disk
    for cid in range(50):
        s.put(cid, state(cid))
    writes = s.writes
    for _ in range(3):  # rounds touching clients 7 and 8 only
        for cid in (7, 8):
            s.put(cid, state(float(s.get(cid).arrays["v"][0]) + 1))
    assert s.reads == 6 and s.writes == writes + 6
    assert s.usage()["memory_bytes"] == 0 and s.usage()["disk_clients"] == 50


def test_no_limit_never_touches_the_disk(tmp_path):
    s = SpillStore(None, tmp_path / STATE_DIR)
    for cid in range(20):
        s.put(cid, state(cid))
    snap = s.snapshot()
    assert all(isinstance(v, Record) for v in snap.values()) and len(snap) == 20
    assert not (tmp_path / STATE_DIR).exists()


def test_checkpoint_holds_file_names_and_keeps_two_generations(tmp_path):
    root = tmp_path / STATE_DIR
    s = SpillStore(1500, root)  # one state in memory
    s.put(0, state(0.0))
    s.put(1, state(1.0))  # 0 -> 0.1.pkl
    snap1 = s.snapshot()  # 1 (dirty, in memory) is written too: the checkpoint names files only
    s.checkpointed()
    assert snap1 == {0: Spilled("0.1.pkl", 1024), 1: Spilled("1.2.pkl", 1024)}
    s.put(0, state(10.0))
    s.put(1, state(11.0))  # 0 -> 0.3.pkl; 0.1.pkl stays: the checkpoint names it
    assert files(root) == ["0.1.pkl", "0.3.pkl", "1.2.pkl"]
    snap2 = s.snapshot()
    s.checkpointed()
    assert snap2 == {0: Spilled("0.3.pkl", 1024), 1: Spilled("1.4.pkl", 1024)}
    s.put(0, state(20.0))
    s.put(1, state(21.0))
    s.snapshot()
    s.checkpointed()  # generation 1 is now two back: its files go
    assert "0.1.pkl" not in files(root) and "1.2.pkl" not in files(root)
    assert {"0.3.pkl", "1.4.pkl"} <= set(files(root))
    # resume from generation 2 in a new store: later files are deleted, states read back
    t = SpillStore(1500, root)
    t.restore(snap2)
    assert files(root) == ["0.3.pkl", "1.4.pkl"]
    assert float(t.get(0).arrays["v"][0]) == 10.0 and float(t.get(1).arrays["v"][0]) == 11.0
    t.put(1, state(31.0))
    t.put(2, state(32.0))  # new file names never collide with the restored ones
    assert len(set(files(root))) == len(files(root)) and "0.3.pkl" in files(root)


def test_usage_line_in_the_log_at_the_end(caplog):
    import logging

    from protofl.engine.callbacks import RoundLogger

    assert usage_line({"clients": 0}) is None
    usage = {"clients": 1200, "memory_clients": 200, "memory_bytes": 512 * 2**20, "disk_clients": 1000,
             "disk_bytes": 3 * 2**30, "budget_bytes": 512 * 2**20}
    line = usage_line(usage)
    assert line == ("client state: 1,200 clients; 512.0 MB in memory (200), 3.00 GB on disk (1,000); "
                    "memory budget 512.0 MB")
    with caplog.at_level(logging.INFO, logger="protofl"):
        RoundLogger().on_end({"client_state": usage})
        RoundLogger().on_end({"client_state": {"clients": 0}})
    assert [r.getMessage() for r in caplog.records] == [" " + line]


# ---------------------------------------------------------------------------------------
# runs: the same numbers whatever the budget
# ---------------------------------------------------------------------------------------
def ditto_v(sim):
    return {cid: sim.store.get(cid) for cid in range(10)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ditto", "scaffold"])
def test_spilling_gives_bit_identical_results(name, digits_cfg, tmp_path):
    """Unlimited vs a budget of about one state, sequential and with 2 worker processes."""
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=3", "training.epochs=1", "execution.state_memory_mb=null")
    ref = Simulation(cfg, run_dir=tmp_path / "ref")
    full = ref.run()
    assert full.summary["client_state"]["disk_bytes"] == 0
    for workers in (0, 2):
        sim = Simulation(cfg.replace(**{"execution.state_memory_mb": 0.1, "execution.workers": workers}),
                         run_dir=tmp_path / f"w{workers}")
        res = sim.run()
        assert strip_timing(res.rows) == strip_timing(full.rows)
        assert all(torch.equal(res.server_state.weights[k], full.server_state.weights[k])
                   for k in full.server_state.weights)
        u = res.summary["client_state"]
        assert u["spill_writes"] > 0 and u["spill_reads"] > 0 and u["memory_bytes"] <= 0.1 * 2**20
        assert u["clients"] == full.summary["client_state"]["clients"] > 0
        a, b = ditto_v(ref), ditto_v(sim)  # every client's final state, from memory or from disk
        assert a.keys() == b.keys()
        for cid in a:
            assert (a[cid] is None) == (b[cid] is None)
            if a[cid] is not None:
                assert dict(a[cid].tensors()).keys() == dict(b[cid].tensors()).keys()
                assert all(torch.equal(t, dict(b[cid].tensors())[k]) for k, t in a[cid].tensors())


@pytest.mark.slow
def test_resume_with_spilled_state_is_bit_identical(digits_cfg, tmp_path):
    cfg = digits_cfg("algorithm.name=ditto", "rounds=5", "training.epochs=1", "output.checkpoint_every=2",
                     "eval.final_all_clients=false", TINY)
    full = run(cfg, run_dir=tmp_path / "full")
    d = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):  # dies after round 3; last checkpoint: round 2
        Simulation(cfg, callbacks=[StopAfter(3)], run_dir=d).run()
    ck = load_torch(d / "checkpoint.pt")
    assert ck["round"] == 2 and ck["client_states"]
    assert all(isinstance(s, Spilled) for s in ck["client_states"].values())  # names, not states
    named = {s.file for s in ck["client_states"].values()}
    assert named <= set(files(d / STATE_DIR)) != named  # round 3 wrote more
    resumed = Simulation(cfg.replace(**{"execution.workers": 2}), run_dir=d).run(resume=True)
    assert strip_timing(resumed.rows) == strip_timing(full.rows)
    assert all(torch.equal(resumed.server_state.weights[k], full.server_state.weights[k])
               for k in full.server_state.weights)
    assert resumed.summary["client_state"]["clients"] == full.summary["client_state"]["clients"]


def test_fresh_run_and_cli_report_state(tmp_path, capsys):
    args = ["run", str(DIGITS), "algorithm.name=ditto", "rounds=2", "training.epochs=1", TINY,
            "eval.final_all_clients=false", f"output.dir={tmp_path}", "output.name=r", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    u = summary["client_state"]
    assert set(u) == {"clients", "memory_clients", "memory_bytes", "disk_clients", "disk_bytes", "budget_bytes",
                      "spill_writes", "spill_reads"}
    assert u["budget_bytes"] == int(0.1 * 2**20) and u["disk_clients"] >= u["clients"] - u["memory_clients"] > 0
    assert usage_line(u) in out
    stale = tmp_path / "r" / STATE_DIR / "99.999.pkl"
    stale.write_bytes(b"x")
    from protofl.config import load_config

    cfg = load_config(DIGITS, [a for a in args[2:] if a != "--quiet"] + ["output.progress=false"])
    Simulation(cfg, run_dir=tmp_path / "r").run()  # the same folder again, not resumed: a fresh store
    assert not stale.exists()


@pytest.mark.parametrize("value", ["-1", "abc"])
def test_bad_state_budget_exits_2_with_one_line(value, tmp_path, capsys):
    rc = main(["run", str(DIGITS), f"execution.state_memory_mb={value}", "rounds=1", f"output.dir={tmp_path}",
               "--quiet"])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "state_memory_mb" in err and len(err.splitlines()) == 1


def test_a_record_hands_out_an_array_or_a_group_as_what_it_is():
    r = Record(arrays={"proto": torch.ones(2), "c": {"w": torch.zeros(1)}})
    assert torch.equal(r.array("proto"), torch.ones(2)) and r.group("c").keys() == {"w"}
    with pytest.raises(TypeError, match="'c'.* is a group"):
        r.array("c")
    with pytest.raises(TypeError, match="'proto'.* is one tensor"):
        r.group("proto")
    with pytest.raises(KeyError):
        r.array("missing")
