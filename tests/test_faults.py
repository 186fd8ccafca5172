"""Fault injection: what a careless or hostile user, or a failing machine, does to a run.

Each case asserts the exit code, that protofl says what happened in at most three lines
(no traceback), and that nothing was lost: the files that should stay are intact, and a
``--resume`` afterwards gives the uninterrupted run's results. Cases covered elsewhere
and not repeated here:

* a run stopped mid-way, then resumed (bit-identical): tests/test_engine.py; a Ray
  driver killed with SIGKILL mid-run, then resumed: tests/test_ray.py;
* a truncated checkpoint when no generation is readable, resuming with another config,
  divergence, damaged data files, a bad client: tests/test_reliability.py;
* a real Flower deployment whose SuperNode (and ServerApp) is killed with SIGKILL in
  round 3 of 4, restarted, and resumed to the uninterrupted run's metrics:
  tests/test_flower_resume.py::test_killed_serverapp_and_supernode_resume_to_the_uninterrupted_result;
  SuperNodes killed and restarted during a run, every loss accounted for:
  tests/test_flower_soak.py (both ``-m flower``);
* the README's commands without the tracker extras: tests/test_readme.py.
"""
import enum
import errno
import json
import os
import random
import shutil
import signal
import sys
from collections import namedtuple
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from protofl.algorithms import ALGORITHMS
from protofl.algorithms.base import WeightsState
from protofl.algorithms.fedavg import FedAvg
from protofl.cli import main
from protofl.engine import checkpoint
from protofl.engine.checkpoint import previous_generation

from conftest import DIGITS, TIMING_KEYS

# a small run: 4 clients, a checkpoint every round
BASE = ["partition.num_clients=4", "training.epochs=1", "output.checkpoint_every=1"]


def cli(capsys, *args):
    """``protofl run digits ...`` in this process: (exit code, stdout, stderr)."""
    code = main(["run", str(DIGITS), *BASE, *args, "--quiet"])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def short(err: str, most: int = 3) -> str:
    """The error output, checked to be at most ``most`` lines and no traceback."""
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= most and "Traceback" not in err, err
    return err


def rows(run_dir):
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_weights(a, b) -> bool:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture
def fresh(tmp_path, capsys):
    """The uninterrupted run of ``rounds`` rounds (memoized per round count): its folder."""
    done = {}

    def make(rounds: int, *extra):
        key = (rounds, *extra)
        if key not in done:
            code, _, err = cli(capsys, f"rounds={rounds}", *extra, f"output.dir={tmp_path / 'fresh'}",
                               f"output.name=r{len(done)}")
            assert code == 0, err
            done[key] = tmp_path / "fresh" / f"r{len(done)}"
        return done[key]

    return make


# ---------------------------------------------------------------------------------------
# 1. a full disk during a checkpoint
# ---------------------------------------------------------------------------------------
def torch_writer_failing_at_round(rnd: int):
    """``torch.save`` as it fails on a full disk: some bytes reach the file, then its zip
    writer raises RuntimeError (not OSError) -- measured on a 64 KB tmpfs with torch 2.13."""
    save = checkpoint.torch.save

    def writer(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("round") == rnd:
            f.write(b"PK\x03\x04" + bytes(60))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(obj, f, *a, **kw)

    return writer


def free_space(monkeypatch, free: int) -> None:
    usage = shutil.disk_usage

    def disk_usage(path):
        u = usage(path)
        return type(u)(u.total, u.total - free, free)

    monkeypatch.setattr("protofl.errors.shutil.disk_usage", disk_usage)


def test_a_full_disk_in_torchs_zip_writer_is_the_io_line_and_resume_loses_nothing(tmp_path, monkeypatch,
                                                                                  capsys, fresh):
    args = ["rounds=5", f"output.dir={tmp_path}", "output.name=r"]
    monkeypatch.setattr(checkpoint.torch, "save", torch_writer_failing_at_round(4))
    free_space(monkeypatch, 12 * 1024)
    code, _, err = cli(capsys, *args)
    assert code == 4, err
    short(err, 1)
    assert "I/O error on " + str(tmp_path / "r" / "checkpoint.pt") in err, err
    assert "the disk is full, 12.3 kB free" in err and "checkpoint of round 3 is kept" in err, err  # 12,288 bytes
    assert "bug" not in err
    d = tmp_path / "r"
    assert torch.load(d / "checkpoint.pt", weights_only=False)["round"] == 3  # intact
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]  # no partial file left
    monkeypatch.undo()  # room again
    code, _, err = cli(capsys, *args, "--resume")
    assert code == 0, err
    assert rows(d) == rows(fresh(5)) and same_weights(d / "model.pt", fresh(5) / "model.pt")


def test_a_runtime_error_with_room_on_the_disk_is_still_a_bug(tmp_path, monkeypatch, capsys):
    """The free space decides: torch's error with room left is not a full disk."""
    monkeypatch.setattr(checkpoint.torch, "save", torch_writer_failing_at_round(2))
    free_space(monkeypatch, 50 * 2**30)
    code, _, err = cli(capsys, "rounds=3", f"output.dir={tmp_path}")
    assert code == 1 and "this is a bug" in short(err, 2) and "unexpected pos" in err, err


def test_any_failed_write_checks_the_free_space(tmp_path, monkeypatch):
    """An error that does not say 'no space' (EIO, a quota) on a full disk says it is full."""
    from protofl.errors import os_error_text

    free_space(monkeypatch, 0)
    assert os_error_text(OSError(errno.EIO, "Input/output error", str(tmp_path / "x"))) == \
        "Input/output error (the disk is full, 0 B free)"
    free_space(monkeypatch, 2**30)
    assert os_error_text(OSError(errno.EACCES, "Permission denied", str(tmp_path))) == "Permission denied"


def _run_in_a_small_tmpfs(mnt, size_kb: int, argv: list, out, report) -> None:
    """In a forked child: a private mount namespace (and a user namespace when not root),
    a tmpfs of ``size_kb`` at ``mnt``, ``protofl argv`` there; the run folder is copied to
    ``out`` and (exit code, stderr) written to ``report`` before the mount goes away."""
    import contextlib
    import ctypes
    import io

    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUSER, MS_REC, MS_PRIVATE = 0x20000, 0x10000000, 0x4000, 0x40000

    def check(ret: int, what: str) -> None:
        if ret != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    try:
        uid, gid = os.getuid(), os.getgid()
        check(libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if uid else 0)), "unshare")
        if uid:  # map this user to root inside, as `unshare -r` does
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")  # none leaks out
        check(libc.mount(b"tmpfs", str(mnt).encode(), b"tmpfs", 0, f"size={size_kb}k".encode()), "mount tmpfs")
    except OSError as e:
        report.write_text(json.dumps({"skip": str(e)}))
        os._exit(0)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        shutil.copytree(mnt / "r", out)
        report.write_text(json.dumps({"code": code, "err": err.getvalue()}))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
        report.write_text(json.dumps({"code": None, "err": err.getvalue() + repr(e)}))
    os._exit(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a tmpfs in a Linux namespace")
def test_a_real_full_tmpfs(tmp_path, capsys, fresh):
    """The same on a real full file system: a tmpfs (in a private mount namespace of a
    forked child) that holds two checkpoint generations but not a third; the folder then
    moves to a disk with room, and --resume."""
    import multiprocessing as mp

    ref = fresh(4, "model.hidden=[256]")
    ck = (ref / "checkpoint.pt").stat().st_size
    small = sum(p.stat().st_size for p in ref.iterdir() if p.suffix != ".pt")
    size_kb = (small + 2 * ck + ck // 2) // 4096 * 4 + 4
    mnt, out, report = tmp_path / "mnt", tmp_path / "out", tmp_path / "report.json"
    mnt.mkdir()
    argv = ["run", str(DIGITS), *BASE, "rounds=4", "model.hidden=[256]", f"output.dir={mnt}", "output.name=r", "--quiet"]
    child = mp.get_context("fork").Process(target=_run_in_a_small_tmpfs, args=(mnt, size_kb, argv, out, report))
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
    assert report.exists(), f"the child ended with {child.exitcode} and no report"
    got = json.loads(report.read_text())
    if "skip" in got:
        pytest.skip(f"cannot mount a tmpfs here ({got['skip']})")
    err = got["err"]
    assert got["code"] == 4, err
    short(err)
    assert "checkpoint.pt: No space left on device (the disk is full" in err, err
    assert "checkpoint of round" in err and "is kept" in err and "--resume" in err, err
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no partial file left
    code, _, err = cli(capsys, "rounds=4", "model.hidden=[256]", f"output.dir={tmp_path}", "output.name=out",
                       "--resume")
    assert code == 0, err
    assert rows(out) == rows(ref) and same_weights(out / "model.pt", ref / "model.pt")


# ---------------------------------------------------------------------------------------
# 2. a YAML alias bomb
# ---------------------------------------------------------------------------------------
@contextmanager
def at_most(seconds: int):
    """Fail instead of hanging (the bomb ran for minutes before): not a timing check."""
    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def bomb(levels: int = 9) -> str:
    lines = ["seed: 0", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\nrounds: 2\n"


def test_a_yaml_alias_bomb_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())  # 10 lines, 387 million values once expanded
    with at_most(60):
        code = main(["run", str(path), f"output.dir={tmp_path / 'runs'}"])
    err = short(capsys.readouterr().err, 1)
    assert code == 2 and "alias bomb" in err and "line 6" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_yaml_alias_bomb_in_an_override_or_a_recursive_alias_is_refused(tmp_path, capsys):
    nested = "{a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], " \
             "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], " \
             "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d, *d]}"
    with at_most(60):
        assert main(["run", str(DIGITS), f"model.per_client={nested}", f"output.dir={tmp_path}"]) == 2
    err = short(capsys.readouterr().err, 1)
    assert "model.per_client=" in err and "alias bomb" in err, err
    (tmp_path / "loop.yaml").write_text("seed: 0\ntraining: &t {lr: 0.1, again: *t}\n")
    assert main(["run", str(tmp_path / "loop.yaml")]) == 2
    assert "recursive structure" in short(capsys.readouterr().err, 1)


def test_aliases_within_the_budget_still_work(tmp_path):
    from protofl.config import load_config

    (tmp_path / "anchors.yaml").write_text(
        "rounds: 2\ndata: {name: digits}\npartition: {name: iid, num_clients: 2}\nalgorithm: {name: fedproto}\n"
        "model: {name: mlp, hidden: &h [32], per_client: {hidden: [*h, *h]}}\n")
    cfg = load_config(tmp_path / "anchors.yaml")
    assert cfg.model.params["hidden"] == [32] and cfg.model.per_client == {"hidden": [[32], [32]]}


# ---------------------------------------------------------------------------------------
# 3. names that become paths stay inside output.dir
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "a\\b", "x\x01y", "n" * 256])
def test_a_run_name_that_would_leave_the_output_folder_is_refused(name, tmp_path, capsys):
    out = tmp_path / "deep" / "runs"
    before = set(tmp_path.rglob("*"))
    code, _, err = cli(capsys, "rounds=1", f"output.dir={out}", f"output.name={name}")
    assert code == 2 and "output.name=" in short(err, 1), err
    assert set(tmp_path.rglob("*")) == before  # nothing written anywhere


def test_compare_and_sweep_labels_name_folders_inside_the_output_folder(tmp_path):
    from protofl import api
    from protofl.config import ConfigError, load_config
    from protofl.engine.simulation import run_dir_for
    from protofl.sweeps import parse_grid, plan

    out = tmp_path / "deep" / "out"
    cfg = load_config(DIGITS, [*BASE, "rounds=1", f"output.dir={out}"])
    with pytest.raises(ConfigError, match=r"output.name='\.\./\.\./esc-s0-"):  # only the CLI's parser forbids '/'
        api.compare(cfg, {"../../esc": {"algorithm": {"name": "fedavg"}, "config": {}}}, [0], out, log=print)
    assert not out.exists()
    with pytest.raises(ConfigError, match="expected \\[label=\\]name"):
        api.parse_methods("../x=fedavg")
    (label, method), = api.parse_methods("..=fedavg").items()  # '..' is a label the parser takes
    d = run_dir_for(api.grid_config(cfg, method, 0, label))
    assert d.parent == out and d.name.startswith("..-s0-")  # '..-s0-<fingerprint>': one folder name
    runs = plan(cfg, parse_grid(["output.experiment=../../esc,a/b"]), [0], out / "sweep")
    assert [r.dir.parent for r in runs] == [out / "sweep"] * 2, [r.dir for r in runs]
    assert [r.dir.name.split("-s0-")[0] for r in runs] == ["experiment=.._.._esc", "experiment=a_b"]


# ---------------------------------------------------------------------------------------
# 4. a checkpoint someone else wrote is loaded without running code
# ---------------------------------------------------------------------------------------
class Payload:
    """What a hostile file holds: unpickling it runs Python code (it writes ``flag``)."""

    def __init__(self, flag) -> None:
        self.flag = flag

    def __reduce__(self):
        return exec, (f"open({str(self.flag)!r}, 'w').write('ran')",)


def plant(path, flag, obj=None) -> None:
    """Put the payload into the torch file ``path`` (beside what it held), and check that
    loading it the old way would have run the code."""
    data = torch.load(path, weights_only=False) if obj is None else obj  # our own file: trusted
    if isinstance(data, dict):
        data["note"] = Payload(flag)
    else:
        data = {"state": data, "note": Payload(flag)}
    torch.save(data, path)
    torch.load(path, weights_only=False)
    assert flag.read_text() == "ran"  # the payload is live ...
    flag.unlink()  # ... and the tests below check it never runs


@pytest.mark.parametrize("which", ["latest", "previous"])
def test_resume_refuses_a_checkpoint_that_would_run_code(which, tmp_path, capsys):
    args = [f"output.dir={tmp_path}", "output.name=r"]
    assert cli(capsys, "rounds=3", *args)[0] == 0
    ck, flag = tmp_path / "r" / "checkpoint.pt", tmp_path / "flag"
    if which == "latest":
        plant(ck, flag)
    else:  # the latest is damaged: the fallback generation is the hostile one
        plant(previous_generation(ck), flag)
        ck.write_bytes(ck.read_bytes()[:300])
    code, _, err = cli(capsys, "rounds=4", *args, "--resume")
    assert code == 2, err
    short(err, 2 if which == "previous" else 1)
    assert "refusing to load" in err and "builtins.exec" in err and "could run code" in err, err
    assert not flag.exists()


def test_resume_refuses_a_client_state_file_that_would_run_code(tmp_path, capsys):
    args = ["algorithm.name=fedper", "execution.state_memory_mb=0.001", "participation.fraction=1.0",
            f"output.dir={tmp_path}", "output.name=r"]
    assert cli(capsys, "rounds=3", *args)[0] == 0
    files = sorted((tmp_path / "r" / "client_state").iterdir())
    assert files, "no client state spilled to disk"
    flag = tmp_path / "flag"
    for f in files:
        plant(f, flag)
    code, _, err = cli(capsys, "rounds=4", *args, "--resume")
    assert code == 2 and "refusing to load" in short(err) and "client_state" in err, err
    assert not flag.exists()


def test_a_flower_node_refuses_a_state_file_that_would_run_code(tmp_path):
    from protofl.errors import UnsafeCheckpointError
    from protofl.flower.node_state import NodeStateStore
    from protofl.messages import Record

    st = NodeStateStore(tmp_path, "key", partition_id=0, checkpoint_every=1)
    st.save(1, 7, Record(arrays={"w": torch.ones(2)}))
    flag = tmp_path / "flag"
    plant(next(st.dir.iterdir()), flag)
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        st.load(2, 7, base_round=0)
    assert not flag.exists()


def test_a_cifar_batch_that_would_run_code_is_refused(tmp_path, capsys):
    """Not a checkpoint but a downloaded file that is a pickle too: CIFAR's python batches."""
    import pickle

    d = tmp_path / "data" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    flag = tmp_path / "flag"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (d / name).write_bytes(pickle.dumps({b"data": Payload(flag), b"labels": [0]}, protocol=2))
    code = main(["run", str(DIGITS), "data.name=cifar10", "model.name=cnn_cifar", "rounds=1", f"output.dir={tmp_path}",
                 "--data-dir", str(tmp_path / "data"), "--quiet"])
    err = short(capsys.readouterr().err, 1)
    assert code == 2 and "builtin__.exec, which a CIFAR batch never holds" in err and "data_batch_1" in err, err
    assert not flag.exists()


def test_a_cifar_tarball_whose_batch_would_run_code_is_refused(tmp_path, capsys, published):
    """The published tarball, read without unpacking it: its batches go through the same guard.
    (Such a tarball is not the published one, so the checksum check stops it first; here it
    is pinned as if it were, so that the reader's own guard is what refuses it.)"""
    import io
    import pickle
    import tarfile

    (tmp_path / "data" / "cifar10").mkdir(parents=True)
    flag = tmp_path / "flag"
    with tarfile.open(tmp_path / "data" / "cifar10" / "cifar-10-python.tar.gz", "w:gz") as tf:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            raw = pickle.dumps({b"data": Payload(flag), b"labels": [0]}, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    args = ["run", str(DIGITS), "data.name=cifar10", "model.name=cnn_cifar", "rounds=1", f"output.dir={tmp_path}",
            "--data-dir", str(tmp_path / "data"), "--quiet"]
    assert main(args) == 2 and "is not the published file" in short(capsys.readouterr().err, 1)
    published("cifar10", tmp_path / "data")
    code = main(args)
    err = short(capsys.readouterr().err, 1)
    assert code == 2 and "which a CIFAR batch never holds" in err and "cifar-10-python.tar.gz" in err, err
    assert not flag.exists()


class Phase(enum.Enum):
    WARM = "warm"
    MAIN = "main"


@dataclass
class PhasedState(WeightsState):
    phase: Phase = Phase.WARM  # an Enum: allowed through allow_in_checkpoints only


Step = namedtuple("Step", "round phase")  # a named tuple: found like a dataclass


class Phased(FedAvg):
    """A method defined outside protofl (as a plugin or a notebook would): its state
    dataclass is found in its module, its Enum has to be allowed."""

    name = "phased"

    def server_init(self, ctx) -> PhasedState:
        return PhasedState(ctx.init_weights())

    def aggregate(self, state, rnd, replies, ctx) -> PhasedState:
        return PhasedState(super().aggregate(state, rnd, replies, ctx).weights, Phase.MAIN if rnd >= 2 else Phase.WARM)


def test_a_new_methods_state_types_are_allowed_without_a_list_to_edit(tmp_path, monkeypatch, capsys, fresh):
    monkeypatch.setitem(ALGORITHMS._items, "phased", Phased)
    monkeypatch.setattr(checkpoint, "_ALLOWED", set())
    types = checkpoint.checkpoint_types()
    assert PhasedState in types and Step in types and Phase not in types
    from protofl.algorithms.fednh import FedNHState
    from protofl.algorithms.rebafl import ReBaFLState
    from protofl.messages import Record

    assert {FedNHState, ReBaFLState, Record, WeightsState} <= set(types)
    assert torch.nn.Module not in types and Payload not in types  # a class, not a data type
    args = ["algorithm.name=phased", f"output.dir={tmp_path}", "output.name=r"]
    assert cli(capsys, "rounds=2", *args)[0] == 0
    code, _, err = cli(capsys, "rounds=3", *args, "--resume")
    assert code == 2 and "test_faults.Phase" in short(err, 1), err  # not yet allowed: refused, named
    checkpoint.allow_in_checkpoints(Phase)
    code, _, err = cli(capsys, "rounds=3", *args, "--resume")
    assert code == 0, err
    # (round 2 was the last round of the first run, with a last round's extra evaluations)
    ref = fresh(3, "algorithm.name=phased")
    assert rows(tmp_path / "r")[2:] == rows(ref)[2:] and same_weights(tmp_path / "r" / "model.pt", ref / "model.pt")


# ---------------------------------------------------------------------------------------
# Ctrl-C at a random round; a damaged newest checkpoint; a Flower node killed mid-write
# ---------------------------------------------------------------------------------------
def test_ctrl_c_at_a_random_round_then_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys, fresh):
    from protofl.engine.simulation import Simulation

    seed = random.randrange(2**32)
    at = random.Random(seed).randrange(1, 6)  # the round whose training Ctrl-C interrupts
    run_round = Simulation.run_round

    def interrupted(self, rnd, *a, **kw):
        if rnd == at:
            raise KeyboardInterrupt
        return run_round(self, rnd, *a, **kw)

    monkeypatch.setattr(Simulation, "run_round", interrupted)
    args = ["rounds=6", "output.checkpoint_every=2", f"output.dir={tmp_path}", "output.name=r"]
    code, _, err = cli(capsys, *args)
    assert code == 130 and short(err, 1).strip() == "protofl: interrupted", (seed, at, err)
    assert len(rows(tmp_path / "r")) == at - 1, (seed, at)  # every finished round's row is there
    monkeypatch.undo()
    code, _, err = cli(capsys, *args, "--resume")
    assert code == 0, (seed, at, err)
    ref = fresh(6, "output.checkpoint_every=2")
    assert rows(tmp_path / "r") == rows(ref), (seed, at)
    assert same_weights(tmp_path / "r" / "model.pt", ref / "model.pt"), (seed, at)


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_generation(tmp_path, capsys, fresh):
    args = [f"output.dir={tmp_path}", "output.name=r"]
    assert cli(capsys, "rounds=4", *args)[0] == 0
    ck = tmp_path / "r" / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[: len(ck.read_bytes()) // 2])  # cut short: round 4 is lost
    code, _, err = cli(capsys, "rounds=6", *args, "--resume")
    assert code == 0, err
    assert "checkpoint.pt" in short(err, 1) and "previous generation checkpoint.prev.pt (round 3)" in err, err
    assert rows(tmp_path / "r") == rows(fresh(6))


def _node_killed_while_writing_round_3(root) -> None:
    """A SuperNode's ClientApp that trains rounds 1, 2 and is killed (SIGKILL) while it
    writes its state after round 3 (half the file is on disk)."""
    from protofl.flower.node_state import NodeStateStore
    from protofl.messages import Record

    st = NodeStateStore(root, "key", partition_id=0, checkpoint_every=1)
    for r in (1, 2):
        st.save(r, 7, Record(arrays={"w": torch.full((4,), float(r))}))
    save = torch.save

    def killed(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 half a state")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = killed
    st.save(3, 7, Record(arrays={"w": torch.full((4,), 3.0)}))
    torch.save = save


def test_a_flower_node_killed_while_writing_its_state_restarts_from_its_last_round(tmp_path):
    import multiprocessing as mp

    from protofl.flower.node_state import NodeStateStore
    from protofl.messages import Record

    p = mp.get_context("fork").Process(target=_node_killed_while_writing_round_3, args=(tmp_path,))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    st = NodeStateStore(tmp_path, "key", partition_id=0, checkpoint_every=1)  # the restarted node
    assert [f.name for f in st.dir.iterdir() if f.name.startswith(".")], "no partial file: the kill came too late"
    state, rnd = st.load(3, 7, base_round=0)  # round 3 again: from the state after round 2
    assert rnd == 2 and torch.equal(state.arrays["w"], torch.full((4,), 2.0))
    st.save(3, 7, Record(arrays={"w": torch.full((4,), 3.5)}))
    assert sorted(f.name for f in st.dir.iterdir()) == ["r000001-7.pt", "r000002-7.pt", "r000003-7.pt"]  # partial gone
