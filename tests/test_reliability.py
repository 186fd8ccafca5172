"""Bad input never gives a traceback; no single client can break or poison a run."""
import gzip
import json
import struct

import numpy as np
import pytest
import torch

from protofl.algorithms.base import cross_entropy
from protofl.algorithms.fedavg import FedAvg
from protofl.cli import main
from protofl.engine.checkpoint import previous_generation
from protofl.engine.executor import SequentialExecutor
from protofl.engine.simulation import Simulation
from protofl.engine.train import NonFiniteLossError
from protofl.engine.validate import check_reply
from protofl.messages import Record

from conftest import DIGITS, TIMING_KEYS, strip_timing


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file (uint8) of ``array``."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder, n_train=60, n_test=20):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(idx_bytes(rng.integers(0, 256, (n, 28, 28)))))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(idx_bytes(np.arange(n) % 10)))
    return folder


@pytest.fixture
def bad_files(tmp_path):
    """Damaged files for the table below."""
    files = {}
    root = tmp_path / "damaged"
    mnist = write_mnist(root / "mnist")
    f = mnist / "train-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes()[:200])  # cut short
    files["damaged_root"] = root
    garbage = write_mnist(tmp_path / "garbage" / "mnist")
    (garbage / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"<html>not found</html>"))
    files["garbage_root"] = garbage.parent
    (tmp_path / "bad.yaml").write_text("seed: 0\nrounds: [1\ntraining: {lr: 0.1}\n")
    files["bad_yaml"] = tmp_path / "bad.yaml"
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    files["list_yaml"] = tmp_path / "list.yaml"
    return files


BAD_INPUTS = [
    # (name, extra CLI args, fragment of the message)
    ("wrong type", ["training.lr=abc"], "training.lr"),
    ("wrong type of section", ["training=3"], "training"),
    ("out of range", ["participation.fraction=2"], "participation.fraction"),
    ("zero rounds", ["rounds=0"], "rounds"),
    ("unknown key", ["training.foo=1"], "training.foo"),
    ("unknown section", ["bogus.x=1"], "bogus"),
    ("unknown method", ["algorithm.name=nope"], "known: "),
    ("unknown dataset", ["data.name=nope"], "unknown dataset"),
    ("unknown method parameter", ["algorithm.nope=1"], "algorithm.nope"),
    ("bad override syntax", ["rounds"], "key=value"),
    ("missing data", ["data.name=mnist", "data.root={tmp}/empty"], "train-images-idx3-ubyte.gz"),
    # a file that is not the published one stops before it is read (test_fetch.py); read
    # anyway (data.verify=false), the loader's own checks name the damage
    ("files that fail their checksum", ["data.name=mnist", "data.root={damaged_root}"], "is not the published file"),
    ("truncated data file", ["data.name=mnist", "data.root={damaged_root}", "data.verify=false"], "damaged gzip file"),
    ("not an IDX file", ["data.name=mnist", "data.root={garbage_root}", "data.verify=false"], "not an IDX file"),
    ("unwritable output", ["output.dir=/proc/protofl-x"], "cannot write the run folder"),
    # components that cannot work together: caught before any work, with the key at fault
    ("model vs input size", ["partition.name=iid", "model.name=lenet5"], "needs inputs of at least 16x16"),
    ("image model on vectors", ["data.name=spiral", "model.name=lenet5"], "needs an image input_shape"),
    ("token model on images", ["model.name=lstm_shakespeare"], "needs a token input_shape"),
    ("method vs model", ["model.name=mlp2d", "algorithm.name=fedgela"], "feature_dim >= num_classes - 1"),
    ("natural partition without users", ["partition.name=natural"], "needs a dataset with natural users"),
    ("more classes per client than classes", ["partition.name=pathological", "partition.classes_per_client=12"],
     "number of classes"),
    ("a later client's architecture", ["algorithm.name=fedproto", "model.per_client={{hidden: [[32], [-5]]}}"],
     "the architecture of a client with {'hidden': [-5]}"),
    ("a later client's value type", ["algorithm.name=fedproto", "model.per_client={{hidden: [[32], x]}}"],
     "model.per_client[1].hidden"),
]


@pytest.mark.parametrize("name, args, fragment", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_cli_bad_input_table(name, args, fragment, tmp_path, bad_files, capsys):
    subst = {"tmp": tmp_path, **bad_files}
    args = [a.format(**subst) for a in args]
    out_dir = [] if any(a.startswith("output.dir") for a in args) else [f"output.dir={tmp_path}/runs"]
    code = main(["run", str(DIGITS), "rounds=1", *out_dir, *args, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err, err
    assert "Traceback" not in err and 1 <= err.count("\n") <= 3, err


@pytest.mark.parametrize("which, fragment", [("bad_yaml", "line 3, column 9"), ("list_yaml", "expected a mapping"),
                                             ("binary", "not a text file")])
def test_cli_bad_config_files(which, fragment, bad_files, tmp_path, capsys):
    (tmp_path / "binary.yaml").write_bytes(b"\x7fELF\x02\x01\x00\xff\xfe")  # not what its name claims
    path = tmp_path / "binary.yaml" if which == "binary" else bad_files[which]
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def test_a_model_that_cannot_compute_on_the_inputs_is_caught_before_any_work(tmp_path, monkeypatch, capsys):
    """An MLP builds for token inputs (it only flattens them) but its first batch would
    fail: the up-front check runs two samples through each client's model."""
    from protofl.data.dataset import Dataset
    from protofl.data.datasets import DATASETS

    def tokens(root, seed):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randint(0, 80, (60, 12), generator=g), torch.arange(60) % 4
        return Dataset("tokens", x, y, x[:20].clone(), y[:20].clone(), num_classes=4, kind="tokens")

    monkeypatch.setitem(DATASETS._items, "tokens", tokens)
    args = ["run", str(DIGITS), "data.name=tokens", "partition.name=iid", "partition.num_clients=3",
            f"output.dir={tmp_path}", "--quiet"]
    assert main([*args, "model.name=mlp"]) == 2
    err = capsys.readouterr().err
    assert "model.name='mlp'" in err and "cannot compute on these inputs" in err and err.count("\n") == 1, err
    assert "models that take them: lstm_shakespeare" in err  # and what would
    assert not any(tmp_path.iterdir())  # nothing was started
    assert main([*args, "model.name=lstm_shakespeare", "model.hidden=8", "model.num_layers=1", "rounds=1"]) == 0


def test_config_errors_survive_a_worker_process():
    """A sweep's runs raise in worker processes: the error must come back as itself."""
    import pickle

    from protofl.config import ConfigError
    from protofl.errors import WriteError

    e = pickle.loads(pickle.dumps(ConfigError("model.name", "lenet5", "too small")))
    assert isinstance(e, ConfigError) and (e.key, e.value, e.allowed) == ("model.name", "lenet5", "too small")
    assert str(e) == "invalid config: model.name='lenet5': too small"
    assert str(pickle.loads(pickle.dumps(WriteError("disk full")))) == "disk full"


# ---------------------------------------------------------------------------------------
# the machine fails: a write that raises loses nothing, and --resume continues
# ---------------------------------------------------------------------------------------
def test_a_failed_checkpoint_write_keeps_the_last_good_one_and_resume_continues(tmp_path, monkeypatch, capsys):
    import errno

    from protofl.engine import checkpoint

    save = checkpoint.torch.save

    def disk_full_at_round_4(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("round") == 4:
            f.write(b"PK\x03\x04 half a checkpoint")  # some bytes reach the disk, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *a, **kw)

    args = ["run", str(DIGITS), "rounds=6", "output.checkpoint_every=2", "partition.num_clients=4",
            f"output.dir={tmp_path}", "output.name=r", "--quiet"]
    monkeypatch.setattr(checkpoint.torch, "save", disk_full_at_round_4)
    assert main(args) == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "checkpoint.pt: No space left on device" in err and "checkpoint of round 2 is kept" in err, err
    assert "--resume" in err
    d = tmp_path / "r"
    assert torch.load(d / "checkpoint.pt", weights_only=False)["round"] == 2  # the last good one, intact
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]  # no half-written file left
    monkeypatch.setattr(checkpoint.torch, "save", save)  # the disk has room again
    assert main([*args, "--resume"]) == 0
    fresh = tmp_path / "fresh"
    assert main([*args[:-3], f"output.dir={fresh}", "output.name=r", "--quiet"]) == 0
    rows = [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
            for x in (d / "metrics.jsonl").read_text().splitlines()]
    want = [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
            for x in (fresh / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, 7)) and rows == want  # nothing lost, nothing different


def test_a_write_that_fails_before_any_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    from protofl.engine import callbacks

    def full(self, row):
        raise OSError(28, "No space left on device", str(self.path))

    monkeypatch.setattr(callbacks.JsonlWriter, "on_round", full)
    assert main(["run", str(DIGITS), "rounds=2", f"output.dir={tmp_path}", "--quiet"]) == 4
    err = capsys.readouterr().err
    assert "metrics.jsonl: No space left on device" in err and "no checkpoint was written yet" in err, err
    assert err.count("\n") == 1


def test_any_other_os_error_is_one_line_with_exit_4(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    assert main(["partition", str(DIGITS), "--out", str(blocker / "heat.png")]) == 4
    err = capsys.readouterr().err
    assert err.startswith("protofl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


# ---------------------------------------------------------------------------------------
# a bug: two lines; --debug or PROTOFL_DEBUG=1 shows the traceback
# ---------------------------------------------------------------------------------------
def test_a_bug_is_two_lines_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    from protofl import api

    def broken(*a, **kw):
        raise KeyError("an internal slip")

    monkeypatch.setattr(api, "run", broken)
    args = ["run", str(DIGITS), f"output.dir={tmp_path}", "--quiet"]
    monkeypatch.delenv("PROTOFL_DEBUG", raising=False)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err, err
    assert "internal error: KeyError" in err and "--debug" in err and "PROTOFL_DEBUG=1" in err
    for argv, env in (([*args, "--debug"], None), (["--debug", *args], None), (args, "1")):
        if env:
            monkeypatch.setenv("PROTOFL_DEBUG", env)
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "an internal slip" in err, err


def test_debug_shows_the_traceback_of_a_bad_input_too(tmp_path, capsys):
    args = ["run", str(DIGITS), "model.name=lenet5", f"output.dir={tmp_path}", "--quiet"]
    assert main(args) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main([*args, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("protofl: error: invalid config")


def test_unusable_arguments_are_one_line(capsys):
    for argv in (["run"], ["run", "digits", "--jobs", "2"], ["nosuch"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "--help" in err, err


# ---------------------------------------------------------------------------------------
# checkpoints: two generations, a damaged one falls back, never a traceback
# ---------------------------------------------------------------------------------------
def test_damaged_checkpoint_falls_back_to_the_previous_generation(digits_cfg, tmp_path, capsys):
    d = tmp_path / "r"
    Simulation(digits_cfg("rounds=4", "output.checkpoint_every=1"), run_dir=d).run()
    ck = d / "checkpoint.pt"
    assert previous_generation(ck).exists()
    ck.write_bytes(ck.read_bytes()[:300])  # the latest generation (round 4) is damaged
    resumed = Simulation(digits_cfg("rounds=6", "output.checkpoint_every=1"), run_dir=d).run(resume=True)
    assert "damaged" in capsys.readouterr().err
    fresh = Simulation(digits_cfg("rounds=6", "output.checkpoint_every=1"), run_dir=tmp_path / "f").run()
    assert strip_timing(resumed.rows) == strip_timing(fresh.rows)


def test_a_published_file_under_another_name_is_refused(tmp_path):
    from protofl.data.datasets import DataFileError, load_dataset
    from conftest import shared_data

    src = shared_data() / "fashion-mnist"
    if not (src / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("real Fashion-MNIST files not available")
    d = tmp_path / "mnist"
    d.mkdir()
    for f in src.glob("*.gz"):
        (d / f.name).symlink_to(f)
    with pytest.raises(DataFileError, match="it is fmnist's train-images-idx3-ubyte.gz, byte for byte"):
        load_dataset("mnist", tmp_path)
    with pytest.raises(DataFileError, match="it is fmnist's"):  # read anyway, the loader knows it too
        load_dataset("mnist", tmp_path, verify=False)


def test_no_readable_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    args = ["run", str(DIGITS), "rounds=2", f"output.dir={tmp_path}", "output.name=r"]
    assert main([*args, "--quiet"]) == 0
    for p in (tmp_path / "r" / "checkpoint.pt", previous_generation(tmp_path / "r" / "checkpoint.pt")):
        if p.exists():
            p.write_bytes(b"PK\x03\x04 not a checkpoint")
    capsys.readouterr()
    assert main([*args, "rounds=3", "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint" in err and "without --resume" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("forge", [
    lambda ck: ck.pop("fingerprint"),
    lambda ck: ck.update(fingerprint=["not", "a", "hash"]),
    lambda ck: ck.update(round="3"),
    lambda ck: ck.update(rows=-1),
    lambda ck: ck.pop("server_state"),
])
def test_a_forged_checkpoint_is_one_line_exit_2(tmp_path, capsys, forge):
    import torch

    args = ["run", str(DIGITS), "rounds=2", f"output.dir={tmp_path}", "output.name=r"]
    assert main([*args, "--quiet"]) == 0
    p = tmp_path / "r" / "checkpoint.pt"
    ck = torch.load(p, weights_only=False)
    forge(ck)
    torch.save(ck, p)
    capsys.readouterr()
    assert main([*args, "rounds=3", "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "has no valid" in err and "without --resume" in err and err.count("\n") == 1, err


def test_resume_with_another_config_is_one_line_exit_2(tmp_path, capsys):
    args = ["run", str(DIGITS), "rounds=2", f"output.dir={tmp_path}", "output.name=r"]
    assert main([*args, "--quiet"]) == 0
    capsys.readouterr()
    assert main([*args, "training.lr=0.2", "--quiet", "--resume"]) == 2
    assert "different config" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# the server's reply checks
# ---------------------------------------------------------------------------------------
SENT = Record(weights={"a": torch.zeros(2, 3), "b": torch.zeros(3)})


def reply(arrays=None, **weights):
    base = {"a": torch.ones(2, 3), "b": torch.ones(3)}
    base.update(weights)
    return Record(weights={k: v for k, v in base.items() if v is not None}, arrays=arrays or {}, num_samples=5)


@pytest.mark.parametrize("rec, fragment", [
    (reply(), None),
    (reply(b=None), None),  # a subset of the weights (e.g. the body only) is fine
    (reply(a=torch.full((2, 3), float("nan"))), "non-finite"),
    (reply(a=torch.ones(3, 2)), "shape"),
    (reply(a=torch.ones(2, 3, dtype=torch.float64)), "float64"),
    (reply(c=torch.ones(1)), "not one of the model weights"),
    (reply({"counts": torch.tensor([3, -1])}), "negative counts"),
    (reply({"group": {"x": torch.tensor([-2])}}), "negative counts"),  # inside a group too
    (reply({"extra": torch.ones(1)}), "unexpected array"),
    (Record(weights={"a": torch.ones(2, 3)}, num_samples=6), "num_samples=6"),
    (Record(weights={"a": torch.ones(2, 3)}, num_samples=-1), "num_samples=-1"),
    (Record(weights={"a": torch.ones(2, 3)}, metrics={"loss": float("inf")}), "not finite"),
    ("not a record", "not a Record"),
])
def test_check_reply_cases(rec, fragment):
    why = check_reply(rec, SENT, client_size=5, model_bytes=36, patterns=("counts", "group"))
    assert (why is None) if fragment is None else (fragment in why), why


def test_a_sample_count_is_a_whole_number():
    with pytest.raises(TypeError, match="num_samples must be an int"):
        Record(num_samples=2.5)


def test_check_reply_size_bound_without_declared_names():
    huge = Record(arrays={"p": torch.zeros(1 << 19)})  # 2 MiB, the bound is 4*36 + 2*36 + 1 MiB
    why = check_reply(huge, SENT, client_size=5, model_bytes=36, patterns=None)
    assert why is not None and "exceeds the bound" in why
    small = Record(arrays={"p": torch.zeros(10)})
    assert check_reply(small, SENT, client_size=5, model_bytes=36, patterns=None) is None


def test_expect_arrays_names_what_a_reply_lacks():
    from protofl.messages import expect_arrays
    full = Record(arrays={"a": torch.zeros(2), "b": torch.zeros(0), "g": {"w": torch.zeros(1)}})
    assert expect_arrays(full, "a", "b") is None  # an empty array is present
    assert expect_arrays(full, "c") == "the reply must carry the array 'c'"
    assert expect_arrays(full, "a", "c") == "the reply must carry the arrays 'a' and 'c'"
    # a group in an array's place is not the array
    assert expect_arrays(full, "a", "b", "g") == "the reply must carry the arrays 'a', 'b' and 'g'"


BAD = 3  # the client that misbehaves


class Corrupting(SequentialExecutor):
    """Client BAD's reply altered on its way to the server (a broken or hostile node)."""

    def __init__(self, runtime, kind):
        super().__init__(runtime, 1)
        self.kind = kind

    REPORTS = {  # what a client says of itself: its evaluation and its training numbers
        "accuracy 1e9": ("eval", "pa", 1e9), "nan accuracy": ("eval", "acc", float("nan")),
        "unknown evaluation": ("eval", "backdoor", 0.5), "nan loss": ("train", "loss", float("nan")),
        "negative samples": ("train", "samples", -3.0), "rate above 1": ("train", "dp_q0", 2.0),
    }

    def run(self, tasks):
        outs = super().run(tasks)
        for t, o in zip(tasks, outs):
            if t.cid == BAD and self.kind in self.REPORTS:
                where, key, value = self.REPORTS[self.kind]
                getattr(o, where)[key] = value
            elif t.cid == BAD:
                o.reply = self.corrupt(o.reply, t.msg)
        return outs

    def corrupt(self, r, sent):
        weights, arrays, n = dict(r.weights), dict(r.arrays), r.num_samples
        first = next(iter(weights))
        if self.kind == "nan":
            weights[first] = torch.full_like(weights[first], float("nan"))
        elif self.kind == "shape":
            weights[first] = torch.zeros(7, 7)
        elif self.kind == "negative count":
            n = -5
        elif self.kind == "extra key":
            arrays["backdoor"] = torch.ones(4)
        elif self.kind == "huge":
            arrays["huge"] = torch.zeros(1 << 22)
        elif self.kind == "3e38":  # finite, and the average would overflow
            weights[first] = torch.full_like(weights[first], 3e38)
        elif self.kind == "scaled update":  # every check of its own passes; absurd beside the others
            weights = {k: sent.weights[k] + 1e5 * (w - sent.weights[k]) for k, w in weights.items()}
        return Record(weights=weights, arrays=arrays, num_samples=n)


class Without(SequentialExecutor):
    """The same run with client BAD's reply lost: what a rejected reply must equal."""

    def run(self, tasks):
        return [None if t.cid == BAD else o for t, o in zip(tasks, super().run(tasks))]


def comparable(rows):
    drop = {"lost", "rejected", "rejected_reasons"}
    return [{k: v for k, v in r.items() if k not in drop} for r in strip_timing(rows)]


@pytest.fixture
def baseline(digits_cfg, tmp_path):
    # (no evaluation of every client after the run: it evaluates personal models, whatever
    # their replies were, so it would differ from a run where the client never answered)
    cfg = digits_cfg("rounds=3", "participation.fraction=1.0", "eval.final_all_clients=false")
    sim = Simulation(cfg, run_dir=tmp_path / "base", executor_factory=lambda s: Without(s.runtime, 1))
    return cfg, sim.run()


@pytest.mark.parametrize("kind", ["nan", "shape", "negative count", "extra key", "huge", "3e38",
                                  "scaled update", *Corrupting.REPORTS])
def test_a_bad_client_is_rejected_and_the_run_equals_the_run_without_it(kind, baseline, tmp_path, monkeypatch):
    cfg, base = baseline
    res = Simulation(cfg, run_dir=tmp_path / kind, executor_factory=lambda s: Corrupting(s.runtime, kind)).run()
    assert res.summary["status"] == "complete"
    assert [r["rejected"] for r in res.rows] == [1, 1, 1]
    assert all(r["rejected_reasons"][0].startswith(f"client {BAD}:") for r in res.rows)
    assert comparable(res.rows) == comparable(base.rows)
    for k, v in base.server_state.weights.items():
        assert torch.equal(res.server_state.weights[k], v), k


def test_an_update_absurd_against_the_rounds_others_is_rejected_by_the_stated_rule():
    from protofl.engine.validate import MIN_PEERS, update_norm, update_outliers

    sent = Record(weights={"w": torch.zeros(2), "b": torch.ones(1), "n": torch.tensor([5])})

    def moved(x):  # an update of L2 norm x: (0.6x, 0.8x) on w, b unchanged, an integer buffer ignored
        return Record(weights={"w": torch.tensor([0.6 * x, 0.8 * x]), "b": torch.ones(1), "n": torch.tensor([9])})

    assert update_norm(moved(5.0), sent) == pytest.approx(5.0)
    assert update_norm(Record(arrays={"p": torch.ones(3)}), sent) is None  # no weights, no update
    pairs = [(0, moved(1.0), sent), (1, moved(2.0), sent), (2, moved(3.0), sent), (3, moved(2000.0), sent)]
    # median of an even count: the lower middle (2.0); 2000 = 1000 x 2 is not more than the limit
    assert update_outliers(pairs, 1000.0) == {}
    pairs[3] = (3, moved(2000.5), sent)
    got = update_outliers(pairs, 1000.0)
    assert list(got) == [3] and "more than 1000 x the round's median update norm (2)" in got[3]
    assert update_outliers(pairs, 0.0) == {}  # off
    assert MIN_PEERS == 3 and update_outliers(pairs[2:], 1000.0) == {}  # two updates: no median to judge by
    still = [(k, moved(0.0), sent) for k in range(3)] + [pairs[3]]
    assert update_outliers(still, 1000.0) == {}  # the median update is zero: no scale
    # a method that replies its update itself (SCAFFOLD's dy): that group's norm
    delta = [(k, Record(arrays={"dy": {"w": torch.tensor([3.0 * x, 4.0 * x])}, "dc": {"w": torch.ones(2)}}), sent)
             for k, x in enumerate((1.0, 1.0, 1.0, 1e4))]
    assert update_norm(delta[3][1], sent, "dy") == pytest.approx(5e4)
    assert list(update_outliers(delta, 1000.0, "dy")) == [3] and update_outliers(delta, 1000.0) == {}
    from protofl.algorithms import ALGORITHMS

    assert (ALGORITHMS.get("scaffold").update_group, ALGORITHMS.get("fednova").update_group) == ("dy", "d")


def test_nonfinite_loss_stops_or_drops(baseline, digits_cfg, tmp_path, monkeypatch):
    cfg, base = baseline

    def nan_loss(model, x, y, extras):
        return torch.nn.functional.cross_entropy(model(x), y) * float("nan")

    def objective(self, msg, ctx):
        return (nan_loss if ctx.cid == BAD else cross_entropy), {}

    monkeypatch.setattr(FedAvg, "objective", objective)
    with pytest.raises(NonFiniteLossError):
        Simulation(cfg, run_dir=tmp_path / "stop").run()
    res = Simulation(cfg.replace(**{"training.on_nonfinite": "drop"}), run_dir=tmp_path / "drop").run()
    assert [r["rejected"] for r in res.rows] == [1, 1, 1]
    assert "non-finite training loss" in res.rows[0]["rejected_reasons"][0]
    assert comparable(res.rows) == comparable(base.rows)
