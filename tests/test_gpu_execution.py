"""Device-resident data, the batched client executor, and (on a machine with a GPU) every
method on CUDA. The CPU tests compare the batched executor with the sequential one; the
``gpu`` tests are skipped where torch sees no CUDA device."""
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from protofl.algorithms.fedavg import FedAvg
from protofl.api import run
from protofl.config import ConfigError, load_config
from protofl.models import MODELS
from protofl.messages import Record
from protofl.models.base import FLModel

from conftest import DIGITS, REPO, StopAfter

ALL_CLIENTS = ["participation.fraction=1.0"]


def _tiny_bn_cnn(input_shape, num_classes):
    """Conv + BatchNorm + pooling on 8x8 digits: the layers the benchmark models use."""
    c = input_shape[0]
    body = nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 16), nn.ReLU())
    return FLModel(body, nn.Linear(16, num_classes), 16, num_classes, is_conv=True)


@pytest.fixture
def tiny_bn_cnn(monkeypatch):
    # registered for this test only: the registry's other users (test_models checks that
    # every registered model is covered) must not see it
    monkeypatch.setitem(MODELS._items, "tiny_bn_cnn", _tiny_bn_cnn)
    yield "tiny_bn_cnn"


def cfg_for(tmp_path, *overrides):
    # 4 clients of different sizes (Dirichlet), all sampled; 2 epochs of batch 24: clients
    # end their epochs on smaller batches and take different numbers of steps
    return load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1",
                                "rounds=2", "partition.num_clients=4", "partition.beta=0.2",
                                "training.batch_size=24", "eval.final_all_clients=false", *ALL_CLIENTS,
                                *overrides])


def both(cfg, tmp_path):
    seq = run(cfg.replace(**{"execution.executor": "sequential"}), run_dir=tmp_path / "seq")
    bat = run(cfg.replace(**{"execution.executor": "batched"}), run_dir=tmp_path / "bat")
    return seq, bat


def assert_close_runs(seq, bat, atol=1e-5):
    a, b = seq.server_state.weights, bat.server_state.weights
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(b[k], a[k], atol=atol, rtol=1e-4, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k  # BatchNorm's num_batches_tracked: the same steps
    for ra, rb in zip(seq.rows, bat.rows):
        assert ra["train_samples"] == rb["train_samples"]
        assert math.isclose(ra["train_loss"], rb["train_loss"], rel_tol=1e-5)
        assert abs(ra["gm"] - rb["gm"]) <= 1.0 / 450  # at most one test sample flips


def test_clients_differ_in_step_count_and_last_batch(tmp_path):
    """The setting below exercises clients that stop early and smaller last batches."""
    from protofl.data.build import build_federated

    fed = build_federated(cfg_for(tmp_path))
    sizes = [len(i) for i in fed.train_idx]
    assert len({math.ceil(n / 24) for n in sizes}) >= 3 and len({n % 24 for n in sizes} - {0}) >= 3


@pytest.mark.parametrize("extra", [
    [],  # FedAvg, MLP, SGD with momentum 0.9
    ["algorithm.name=fedprox", "algorithm.mu=0.1", "training.weight_decay=0.001", "training.clip_grad=1.0"],
    ["training.momentum=0", "training.steps=7", "training.lr_decay=0.9"],
    ["algorithm.name=fedlc"],  # logit adjustments: the client's counts stacked as its own tensor
    ["algorithm.name=fedrs"],
])
def test_batched_equals_sequential_mlp(tmp_path, extra):
    seq, bat = both(cfg_for(tmp_path, *extra), tmp_path)
    assert bat.summary["execution"]["executor"] == "batched"
    assert_close_runs(seq, bat)


class _DetachedBody(FedAvg):
    """A method whose loss does not reach the body: it trains the head on detached features."""

    name = "detached_body"

    async def client_update(self, msg, state, ctx):
        return self.result(await ctx.fit(msg.weights, self.head_loss), ctx)

    @staticmethod
    def head_loss(model, x, y, extras):
        return torch.nn.functional.cross_entropy(model.head(model.body(x).detach()), y)


@pytest.mark.parametrize("extra", [["training.weight_decay=0.01"],
                                   ["training.weight_decay=0.01", "training.optimizer=adam", "training.lr=0.01", "training.momentum=0"],
                                   ["training.weight_decay=0.01", "training.optimizer=adamw", "training.lr=0.01", "training.momentum=0"]])
def test_a_parameter_the_loss_does_not_reach_stays_put_on_both_executors(tmp_path, monkeypatch, extra):
    """torch.optim's rule: a parameter without a gradient is left alone (weight decay and
    momentum included). The sequential driver follows it through autograd; the batched one,
    whose vmap gives such a parameter zeros, must too (it finds the parameters its loss
    does not reach once per signature)."""
    from protofl.algorithms import ALGORITHMS

    monkeypatch.setitem(ALGORITHMS._items, "detached_body", _DetachedBody)
    seq, bat = both(cfg_for(tmp_path, "algorithm.name=detached_body", *extra), tmp_path)
    assert bat.summary["execution"]["executor"] == "batched"
    body = [k for k in seq.server_state.weights if k.startswith("body.")]
    head = [k for k in seq.server_state.weights if k.startswith("head.")]
    assert_close_runs(seq, bat)
    first = run(cfg_for(tmp_path, "algorithm.name=detached_body", "rounds=1", *extra), run_dir=tmp_path / "one")
    for r in (seq, bat):  # the body never moved (up to the average's rounding): weight decay did not reach it
        for k in body:
            torch.testing.assert_close(r.server_state.weights[k], first.server_state.weights[k], atol=1e-6, rtol=0,
                                       msg=k)
    assert any(not torch.equal(seq.server_state.weights[k], first.server_state.weights[k]) for k in head)


def test_batched_equals_sequential_conv_batchnorm(tmp_path, tiny_bn_cnn):
    # lr 0.01: at 0.05 this tiny BatchNorm net amplifies float rounding ~200x a round (chaotic)
    seq, bat = both(cfg_for(tmp_path, "rounds=3", "training.lr=0.01").replace(**{"model.name": tiny_bn_cnn}), tmp_path)
    assert bat.summary["execution"]["executor"] == "batched"
    assert_close_runs(seq, bat)
    rm = [k for k in seq.server_state.weights if k.endswith("running_var")]
    assert rm  # the BatchNorm statistics were trained and averaged, and they agree


def test_batched_in_chunks_equals_one_stack(tmp_path):
    cfg = cfg_for(tmp_path)
    one = run(cfg.replace(**{"execution.executor": "batched"}), run_dir=tmp_path / "one")
    two = run(cfg.replace(**{"execution.executor": "batched", "execution.batch_clients": 3}), run_dir=tmp_path / "two")
    assert_close_runs(one, two, atol=1e-6)


def test_a_plain_function_client_update_is_refused_at_class_creation():
    with pytest.raises(TypeError, match="async def"):
        class PlainFedAvg(FedAvg):  # noqa: F841 - the imperative form, retired
            name = "plain_fedavg"

            def client_update(self, msg, state, ctx):
                return None


class _Yields:
    """An awaitable that is not a protofl request (what ``asyncio.sleep(0)`` is to the engine)."""

    def __await__(self):
        yield None


class AwaitsSomethingElse(FedAvg):
    name = "awaits_something_else"

    async def client_update(self, msg, state, ctx):
        await _Yields()


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_awaiting_anything_but_a_request_is_the_same_clear_error_on_both_executors(tmp_path, monkeypatch, executor):
    from protofl.algorithms import ALGORITHMS

    monkeypatch.setitem(ALGORITHMS._items, AwaitsSomethingElse.name, AwaitsSomethingElse)
    cfg = cfg_for(tmp_path, f"algorithm.name={AwaitsSomethingElse.name}", "rounds=1")
    with pytest.raises(TypeError, match=r"client_update awaited NoneType; it may await ctx.fit\(...\) and "
                                        r"ctx.features\(...\) only"):
        run(cfg.replace(**{"execution.executor": executor}), run_dir=tmp_path / executor)


def test_heterogeneous_models_fall_back_with_a_note(tmp_path):
    cfg = cfg_for(tmp_path, "algorithm.name=fedproto", "rounds=1", "model.name=mlp",
                  "model.per_client={hidden: [[16], [24]]}")
    bat = run(cfg.replace(**{"execution.executor": "batched"}), run_dir=tmp_path / "bat")
    assert bat.summary["execution"]["executor"] == "sequential"
    assert "different architectures" in bat.summary["execution"]["executor_note"]


@pytest.mark.parametrize("name", ["scaffold", "rebafl", "fedrep", "moon", "fednh"])
def test_methods_batched_equal_sequential_with_batchnorm(tmp_path, tiny_bn_cnn, name):
    """Conv + BatchNorm through the stack for methods with gradient transforms, phases, extra
    forwards of other weights (MOON) and features (prototypes)."""
    cfg = cfg_for(tmp_path, f"algorithm.name={name}", "training.lr=0.01").replace(**{"model.name": tiny_bn_cnn})
    seq, bat = both(cfg, tmp_path)
    assert bat.summary["execution"]["executor"] == "batched"
    a = seq.server_state.weights if hasattr(seq.server_state, "weights") else {}
    for k, v in a.items():
        if v.is_floating_point():
            torch.testing.assert_close(bat.server_state.weights[k], v, atol=1e-5, rtol=1e-4, msg=k)
    for ra, rb in zip(seq.rows, bat.rows):
        assert ra["train_samples"] == rb["train_samples"]
        assert math.isclose(ra["train_loss"], rb["train_loss"], rel_tol=1e-4)


def test_auto_is_sequential_on_cpu(tmp_path):
    res = run(cfg_for(tmp_path, "rounds=1"), run_dir=tmp_path / "auto")
    assert "executor" not in res.summary["execution"] and res.summary["execution"]["backend"] == "local"


def test_cuda_without_a_gpu_is_a_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available") as e:
        cfg_for(tmp_path, "execution.device=cuda")  # load_config checks the machine
    assert "\n" not in str(e.value)


def test_device_data_path_on_cpu_is_the_loader_path(tmp_path):
    """The per-process device copy is the dataset itself on the CPU: a client's data is the
    normalized slice of the raw uint8 tensors, bit for bit, and nothing is copied."""
    from protofl.engine.simulation import Simulation

    sim = Simulation(cfg_for(tmp_path), run_dir=tmp_path / "r")
    rt, ds = sim.runtime, sim.fed.dataset
    assert rt.split("train")[0] is ds.x_train and ds.x_train.dtype == torch.uint8
    idx = torch.from_numpy(sim.fed.train_idx[2])
    x, y = rt.client_train_data(2)
    assert torch.equal(x, ds.normalize(ds.x_train[idx])) and torch.equal(y, ds.y_train[idx])
    tx, ty = rt.test_data
    assert torch.equal(tx, ds.normalize(ds.x_test)) and torch.equal(ty, ds.y_test)


def test_record_to_moves_arrays_and_keeps_the_rest():

    r = Record({"a": torch.ones(2)}, {"n": 3}, {"s": "x"})
    assert r.to("cpu") is r  # already there: no copy
    meta = r.to("meta")
    assert meta.arrays["a"].device.type == "meta" and meta.metrics == {"n": 3} and meta.config == {"s": "x"}
    assert r.arrays["a"].device.type == "cpu"


def test_checkpoint_tensors_load_on_the_cpu(tmp_path):
    """A checkpoint holds CPU tensors (server state and client states live there); loading
    maps any device to the CPU, so a run written on a GPU resumes on a CPU-only machine."""
    from protofl.engine.checkpoint import load_torch

    res = run(cfg_for(tmp_path, "rounds=1", "algorithm.name=fedper"), run_dir=tmp_path / "r")
    ck = load_torch(tmp_path / "r" / "checkpoint.pt")
    tensors = list(ck["server_state"].weights.values())
    tensors += [t for st in ck["client_states"].values() if st is not None for t in st.arrays.values()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert res.summary["status"] == "complete"


# ---------------------------------------------------------------------------------------
# on a GPU (skipped elsewhere): every registered method for 2 rounds, sequential and batched
# ---------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _methods():
    from protofl.algorithms import ALGORITHMS

    return sorted(ALGORITHMS.names())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("method", _methods())
def test_every_method_runs_on_cuda(tmp_path, method):
    from protofl.engine.checkpoint import load_torch

    cfg = load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "rounds=3",
                               "output.checkpoint_every=1", f"algorithm.name={method}", "execution.device=cuda"])
    with pytest.raises(KeyboardInterrupt):  # 2 rounds on the GPU, killed in round 3 (checkpoint: round 2)
        run(cfg, run_dir=tmp_path / "r", callbacks=[StopAfter(3)])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["execution"]["device"] == "cuda"
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["train_loss"]) for r in rows if r["train_samples"])
    assert all(math.isfinite(r["ga"]) for r in rows if "ga" in r)
    assert load_torch(tmp_path / "r" / "checkpoint.pt")["round"] == 2
    # the checkpoint written on the GPU resumes on the CPU
    rest = run(cfg.replace(**{"execution.device": "cpu"}), run_dir=tmp_path / "r", resume=True)
    assert rest.summary["status"] == "complete" and [r["round"] for r in rest.rows] == [1, 2, 3]


@pytest.mark.gpu
@needs_gpu
def test_batched_equals_sequential_on_cuda(tmp_path, tiny_bn_cnn):
    cfg = cfg_for(tmp_path, "execution.device=cuda", "training.lr=0.01").replace(**{"model.name": tiny_bn_cnn})
    seq, bat = both(cfg, tmp_path)
    assert_close_runs(seq, bat, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
def test_cpu_and_cuda_agree(tmp_path):
    cfg = cfg_for(tmp_path)
    cpu = run(cfg, run_dir=tmp_path / "cpu")
    gpu = run(cfg.replace(**{"execution.device": "cuda"}), run_dir=tmp_path / "gpu")
    assert_close_runs(cpu, gpu, atol=1e-4)


@pytest.mark.parametrize("pad", [True, False, "batchnorm"], ids=["padded", "grouped", "batchnorm"])
def test_compiled_whole_step_equals_eager_and_compiles_once(tmp_path, pad, monkeypatch):
    """execution.compile with torch.compile itself: the whole step (forward, backward,
    clipping, weight decay, the momentum update) compiled once for a 3-round run whose
    learning rate decays every round (the rate is an input of the step, not a constant of
    it), training what the eager stacks train up to float rounding. Clipping's norm fused
    into the in-place momentum update is what torch 2.13's CPU code generator failed on
    (the step returns the norms so that it compiles; without them this test fails). With
    BatchNorm (grouped: its statistics are the batch's) the compiled step updates the running
    statistics in place too."""
    from torch._dynamo.utils import counters

    extra = []
    if pad == "batchnorm":
        monkeypatch.setitem(MODELS._items, "tiny_bn_cnn", _tiny_bn_cnn)
        extra = ["model.name=tiny_bn_cnn", "training.lr=0.01"]
    cfg = cfg_for(tmp_path, "training.batch_size=16", "rounds=3", "partition.num_clients=6", "training.lr_decay=0.9",
                  "training.clip_grad=1.0", "training.weight_decay=0.001", *extra).replace(
        **{"execution.executor": "batched", "execution.pad_batches": pad is True})
    eager = run(cfg, run_dir=tmp_path / "eager")
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = run(cfg.replace(**{"execution.compile": True}), run_dir=tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] - before == 1
    assert_close_runs(eager, compiled)


@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_compiled_stacks_keep_their_slot_count_across_rounds(tmp_path, monkeypatch, decay):
    """A compiled step is compiled for one slot count. With execution.compile a signature's
    stacks keep the most slots chosen so far (as many as have clients), so later rounds reuse
    the compiled step where the eager stacks' count moves from round to round; a learning
    rate that decays from round to round (lr_decay, the papers' recipe) is no other step:
    one step is compiled for the run. torch.compile is the identity here: what is tested is
    the slot count the executor asks for and the steps it compiles."""
    from pathlib import Path

    from protofl.engine.backends import EXECUTORS
    from protofl.engine.simulation import Simulation

    def slots(compile_step: bool) -> list[int]:
        cfg = load_config(DIGITS, [f"output.dir={tmp_path}", "output.progress=false", "execution.threads=1",
                                   "rounds=6", "partition.num_clients=12", "partition.beta=0.2",
                                   "training.batch_size=8", "participation.fraction=0.5", "eval.every=100",
                                   "eval.final_all_clients=false", "output.checkpoint_every=0",
                                   "execution.executor=batched", f"execution.compile={compile_step}",
                                   f"training.lr_decay={decay}"])
        box = {}

        def factory(sim):
            box["ex"] = EXECUTORS.get(cfg.execution.backend)(sim)
            return box["ex"]

        Simulation(cfg, run_dir=Path(tmp_path) / str(compile_step), executor_factory=factory).run()
        return box["ex"].stats.slots

    compiled: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    from protofl.engine import batched

    made: list[batched.Stack] = []
    init = batched.Stack.__init__
    monkeypatch.setattr(batched.Stack, "__init__", lambda self, *a, **kw: made.append(self) or init(self, *a, **kw))
    eager = slots(False)
    assert len(made) == 6  # a stack of its own every round
    made.clear()
    kept = slots(True)
    assert eager == [4, 6, 5, 5, 4, 5]  # chosen per round from the sampled clients' sizes
    assert kept == [4, 6, 6, 6, 6, 6]  # the most so far: two shapes in six rounds
    assert len(compiled) == 1 and compiled[0]["dynamic"] is False  # one step for the run's signature
    # compiled: a stack's tensors kept from round to round of one slot count, at static addresses
    # for a CUDA graph (marked for torch.compile)
    assert [m.S for m in made] == [4, 6]
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for m in made for t in m.tensors())


# ---------------------------------------------------------------------------------------
# the slot schedule (engine/batched.py): pure functions on step counts
# ---------------------------------------------------------------------------------------
def test_plan_runs_every_client_step_once_in_order_in_one_slot():
    from protofl.engine.batched import plan_stack

    totals = [7, 3, 0, 5, 5, 1]
    B = 4
    sizes = [[B if (t + 1) % 3 else 2 for t in range(n)] for n in totals]  # a short batch every 3rd step
    rows = [np.arange(n * B).reshape(n, B) + 100 * j for j, n in enumerate(totals)]
    plan = plan_stack(totals, sizes, rows, slots=2)
    seen = {j: [] for j in range(len(totals))}
    flat = plan.rows
    for groups in plan.steps:
        in_step = []
        for g in groups:
            assert len(set(g.slots)) == len(g.slots) and all(sizes[j][t] == g.b for j, t in zip(g.jobs, g.t))
            got = flat[g.start:g.start + len(g.slots) * g.b].reshape(len(g.slots), g.b)
            for k, (j, t) in enumerate(zip(g.jobs, g.t)):
                assert np.array_equal(got[k], rows[j][t, :g.b])  # the client's own rows of that step
                seen[j].append(t)
            in_step += g.jobs
        assert len(in_step) == len(set(in_step)) <= 2  # a client is in one slot, at most 2 slots busy
    assert all(seen[j] == list(range(n)) for j, n in enumerate(totals))  # every step, in order
    assert plan.busy == sum(totals) and plan.slot_steps == 2 * len(plan.steps)
    loaded = [j for step in plan.loads for _, j in step]
    assert sorted(loaded) == [0, 1, 3, 4, 5] and loaded[:2] == [0, 3]  # longest first; none without steps
    finished = [j for step in plan.finishes for _, j in step]
    assert sorted(finished) == [0, 1, 3, 4, 5]


def test_a_filled_plan_steps_every_slot_at_every_step_and_the_free_ones_on_padding():
    """fill (padded stacks, for the compiled step's one shape): the same client-steps in the
    same order as the plan without it, each step one group of every slot, a slot that no
    client waits for stepping on padding rows (-1) for its last client, marked not live."""
    from protofl.engine.batched import plan_stack

    totals, B, S = [9, 2, 6, 0, 4, 7], 3, 3
    sizes = [[B] * n for n in totals]
    rows = [np.arange(n * B).reshape(n, B) + 100 * j for j, n in enumerate(totals)]
    plain, filled = plan_stack(totals, sizes, rows, S), plan_stack(totals, sizes, rows, S, fill=True)
    assert (filled.busy, filled.slot_steps, len(filled.steps)) == (plain.busy, plain.slot_steps, len(plain.steps))
    assert filled.loads == plain.loads and filled.finishes == plain.finishes
    seen = {j: [] for j in range(len(totals))}
    idle_steps = 0
    for groups in filled.steps:
        (g,) = groups
        assert g.whole and g.slots == list(range(S)) and g.b == B
        got = filled.rows[g.start:g.start + S * B].reshape(S, B)
        at = filled.index[g.at:g.at + 4 * S]
        assert list(at[:S]) == g.slots and list(at[S:2 * S]) == g.jobs and list(at[2 * S:3 * S]) == g.t
        live = at[3 * S:]
        assert g.idle == int((live == 0).sum())
        idle_steps += g.idle > 0
        for k, (j, t) in enumerate(zip(g.jobs, g.t)):
            if live[k]:
                assert np.array_equal(got[k], rows[j][t]) and totals[j] > 0
                seen[j].append(t)
            else:
                assert (got[k] == -1).all()  # padding only, for the slot's last client
    assert idle_steps == sum(sum(len(g.slots) for g in gs) < S for gs in plain.steps) > 0
    assert all(seen[j] == list(range(n)) for j, n in enumerate(totals))


def test_compiled_padded_stacks_take_every_step_in_one_shape(tmp_path, monkeypatch):
    """execution.compile on a padded stack: every step, the last ones with free slots
    included, goes through the compiled step (torch.compile is the identity here), and the
    run trains what the eager padded run trains: the free slots' losses count for no client,
    and their weights were handed back before they stepped on padding. With momentum,
    weight decay, clipping and a decaying learning rate (round 2 reuses round 1's step);
    SCAFFOLD (a gradient transform), FedGen (per-step extras) and augmentation (the free
    slots' rows take draws too)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    cases = [("fedavg", []), ("scaffold", []), ("fedgen", []), ("fedavg", ["data.augment={crop: 2, flip: true}"])]
    for i, (method, extra) in enumerate(cases):
        cfg = cfg_for(tmp_path, f"algorithm.name={method}", "training.weight_decay=0.001", "training.clip_grad=1.0",
                      "training.lr_decay=0.9", "partition.num_clients=6", *extra).replace(
            **{"execution.executor": "batched", "execution.pad_batches": True})
        eager, e = executor_of(cfg, tmp_path / f"{i}-eager")
        compiled, c = executor_of(cfg.replace(**{"execution.compile": True, "execution.batch_clients": 4}),
                                  tmp_path / f"{i}-compiled")
        assert e.stats.whole < e.stats.steps  # eager: the last steps hold fewer slots
        assert c.stats.whole == c.stats.steps and c.stats.busy < c.stats.slot_steps  # one shape, free slots in it
        assert_close_runs(eager, compiled)
        assert [r["train_samples"] for r in compiled.rows] == [r["train_samples"] for r in eager.rows]


def test_slot_count_ends_the_stack_with_its_longest_client():
    from protofl.engine.batched import choose_slots, makespan

    rng = np.random.default_rng(0)
    sizes = np.maximum(10, (rng.dirichlet([0.3] * 100) * 60_000).astype(int))  # MNIST Dir(0.3), 100 clients
    totals = [5 * int(np.ceil(n / 64)) for n in sizes]  # 5 epochs, batch 64
    S = choose_slots(totals, cap=1000)
    longest = max(totals)
    assert makespan(totals, S) <= longest * 1.05 + 1  # about the longest client's steps
    assert makespan(totals, S - 1) > longest * 1.05 + 1  # the fewest slots that do
    assert sum(totals) / (S * makespan(totals, S)) >= 0.9  # occupancy
    assert sum(totals) / (len(totals) * longest) < 0.5  # lockstep: one slot per client, most idle
    assert choose_slots(totals, cap=8) == 8  # memory caps it
    assert choose_slots([0, 0], cap=4) == 1


def test_batch_clients_sets_the_slot_count(tmp_path):
    cfg = cfg_for(tmp_path, "rounds=1").replace(**{"execution.executor": "batched", "execution.batch_clients": 2})
    res = run(cfg, run_dir=tmp_path / "two")
    assert res.summary["execution"]["slots"] == 2 and 0 < res.summary["execution"]["occupancy"] <= 1


# ---------------------------------------------------------------------------------------
# execution.device: auto (the default) takes a GPU when torch sees one
# ---------------------------------------------------------------------------------------
def test_device_auto_is_the_default_and_resolves_on_this_machine(monkeypatch):
    from protofl.engine.backends import use_batched

    cfg = load_config(DIGITS)
    assert cfg.execution.device == "auto" and cfg.execution.executor == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cfg.execution.torch_device == "cpu" and not use_batched(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cfg.execution.torch_device == "cuda" and use_batched(cfg)  # a GPU: the batched executor
    assert not use_batched(cfg.replace(**{"execution.workers": 2}))  # never with worker processes
    # where the run trains does not change its results: not in the fingerprint
    assert len({cfg.replace(**{"execution.device": d}).fingerprint() for d in ("auto", "cpu", "cuda")}) == 1


def test_without_cuda_auto_runs_on_the_cpu_and_the_first_line_says_so(tmp_path, caplog, monkeypatch):
    from protofl.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("INFO", logger="protofl"):  # the run's lines (on stderr without pytest)
        assert main(["run", str(DIGITS), "rounds=1", f"output.dir={tmp_path}"]) == 0
    first = caplog.records[0].getMessage()
    assert first.endswith(": 1 rounds on cpu (sequential executor)"), first
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["execution"] == {"backend": "local", "workers": 0, "threads": 1}


def test_an_epochs_batch_of_one_is_left_out_only_for_batchnorm():
    from protofl.engine.train import batch_rows, batch_sizes, epoch_batches, total_steps

    assert epoch_batches(65, 64) == [64, 1] and epoch_batches(65, 64, drop_single=True) == [64]
    assert epoch_batches(66, 64, drop_single=True) == [64, 2]  # two samples reach BatchNorm
    assert epoch_batches(1, 64, drop_single=True) == [] and total_steps(1, 64, 5, None, drop_single=True) == 0
    assert total_steps(1, 64, 5, 7, drop_single=True) == 0  # one sample: no step can take place
    assert total_steps(65, 64, 3, None) == 6 and total_steps(65, 64, 3, None, drop_single=True) == 3
    assert batch_sizes(5, 2, 5, drop_single=True) == [2, 2, 2, 2, 2]
    g, h = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    rows = batch_rows(5, 2, 4, g, drop_single=True)
    perms = [torch.randperm(5, generator=h).numpy() for _ in range(2)]  # the same draws, epoch by epoch
    assert rows.tolist() == [list(perms[0][:2]), list(perms[0][2:4]), list(perms[1][:2]), list(perms[1][2:4])]
    # without BatchNorm nothing changes: the sample alone is a step of its own
    g, h = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    perm = torch.randperm(5, generator=h).numpy()
    assert batch_rows(5, 2, 3, g).tolist() == [list(perm[:2]), list(perm[2:4]), [perm[4], 0]]


def _tiny_bn1d_mlp(input_shape, num_classes):
    """An MLP with BatchNorm1d: a batch of one has one value per channel, which PyTorch refuses."""
    d = int(np.prod(input_shape))
    body = nn.Sequential(nn.Flatten(), nn.Linear(d, 16), nn.BatchNorm1d(16), nn.ReLU())
    return FLModel(body, nn.Linear(16, num_classes), 16, num_classes)


@pytest.mark.parametrize("model", ["tiny_bn_cnn", "tiny_bn1d_mlp"])
def test_a_batch_of_one_never_reaches_batchnorm_on_either_executor(tmp_path, tiny_bn_cnn, monkeypatch, model):
    """A client whose epoch ends on one sample: BatchNorm's statistics of one sample are
    no statistics (BatchNorm1d raises "Expected more than 1 value per channel"); that
    sample sits out the epoch, on both executors alike."""
    from protofl.data.build import build_federated

    monkeypatch.setitem(MODELS._items, "tiny_bn1d_mlp", _tiny_bn1d_mlp)
    sizes = [len(i) for i in build_federated(cfg_for(tmp_path)).train_idx]
    B = sizes[0] - 1  # client 0's epoch ends on a batch of one
    assert B >= 2
    cfg = cfg_for(tmp_path, f"training.batch_size={B}", "training.lr=0.01").replace(**{"model.name": model})
    seq, bat = both(cfg, tmp_path)
    assert bat.summary["execution"]["executor"] == "batched"
    assert_close_runs(seq, bat)
    left_out = sum(n % B == 1 for n in sizes)
    assert all(r["train_samples"] == 2 * (sum(sizes) - left_out) for r in seq.rows)  # 2 epochs a round


# ---------------------------------------------------------------------------------------
# execution.pad_batches: steps of one shape
# ---------------------------------------------------------------------------------------
def test_masked_mean_is_the_mean_loss_of_the_real_rows_by_hand():
    """masked_mean on f(w) = mean_i (w . x_i - y_i)^2 over 3 rows, the third a padded row of
    weight 0: the value and gradient of the two real rows' mean, computed by hand."""
    from protofl.engine.train import masked_mean

    def loss(params, frozen, buffers, extras, x, y):
        return ((x @ params["w"] - y) ** 2).mean() + extras["c"] * 0  # a shared extra, unused

    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [100.0, 100.0]])  # row 2: padding, large on purpose
    y = torch.tensor([1.0, 2.0, -7.0])
    w = torch.tensor([0.5, 0.25])
    grads, value = masked_mean(loss)({"w": w}, {}, {}, {"c": torch.tensor(1.0)}, x, y, torch.tensor([0.5, 0.5, 0.0]))
    # residuals: 1*0.5 + 2*0.25 - 1 = 0; 3*0.5 - 0.25 - 2 = -0.75 -> mean of squares 0.28125
    assert math.isclose(float(value), 0.28125, rel_tol=1e-7)
    # gradient: mean_i 2 r_i x_i = (2*0*[1, 2] + 2*(-0.75)*[3, -1]) / 2 = [-2.25, 0.75]
    torch.testing.assert_close(grads["w"], torch.tensor([-2.25, 0.75]))


def executor_of(cfg, run_dir):
    """(result, the executor that ran it)."""
    from protofl.engine.backends import EXECUTORS
    from protofl.engine.simulation import Simulation

    box = {}

    def factory(sim):
        box["ex"] = EXECUTORS.get(cfg.execution.backend)(sim)
        return box["ex"]

    return Simulation(cfg, run_dir=run_dir, executor_factory=factory).run(), box["ex"]


def test_padded_stacks_take_one_step_per_stack_step_and_train_what_the_clients_would(tmp_path):
    """Short batches padded with masked rows: one step per stack step (not one per batch size),
    the same client-steps and samples, the numbers of the sequential run within float rounding;
    with momentum, weight decay, clipping, and a batch of one sample padded to a full one."""
    from protofl.data.build import build_federated

    sizes = [len(i) for i in build_federated(cfg_for(tmp_path)).train_idx]
    B = next(b for b in range(20, 40) if any(n % b == 1 for n in sizes))  # some client ends an epoch on 1 sample
    cfg = cfg_for(tmp_path, "algorithm.name=fedprox", "algorithm.mu=0.1", "training.weight_decay=0.001",
                  "training.clip_grad=1.0", f"training.batch_size={B}")
    cfg = cfg.replace(**{"execution.executor": "batched"})
    grouped, g = executor_of(cfg.replace(**{"execution.pad_batches": False}), tmp_path / "grouped")
    padded, p = executor_of(cfg.replace(**{"execution.pad_batches": True}), tmp_path / "padded")
    seq = run(cfg.replace(**{"execution.executor": "sequential"}), run_dir=tmp_path / "seq")
    assert grouped.summary["execution"]["padded"] is False and padded.summary["execution"]["padded"] is True
    assert (p.stats.busy, p.stats.slot_steps) == (g.stats.busy, g.stats.slot_steps)
    assert p.stats.steps == p.stats.slot_steps // max(p.stats.slots) < g.stats.steps  # one shape per stack step
    assert_close_runs(seq, padded)
    assert [r["train_samples"] for r in padded.rows] == [r["train_samples"] for r in seq.rows]


def test_batchnorm_and_sample_coupling_methods_are_not_padded(tmp_path, tiny_bn_cnn):
    """BatchNorm's batch statistics, and a loss that couples its samples (FedDecorr's
    correlation of the batch's features), would differ on a padded batch: such stacks step
    once per batch size, and the results stay those of the sequential run."""
    for name, extra in (("bn", ["training.lr=0.01", f"model.name={tiny_bn_cnn}"]), ("decorr", ["algorithm.name=feddecorr"])):
        cfg = cfg_for(tmp_path, "rounds=1", *extra).replace(**{"execution.pad_batches": True})
        seq, bat = both(cfg, tmp_path / name)
        assert bat.summary["execution"]["executor"] == "batched" and bat.summary["execution"]["padded"] is False
        assert_close_runs(seq, bat)


def test_pad_batches_auto_pads_on_a_gpu_only():
    cfg = load_config(DIGITS, [])
    assert cfg.execution.pad_batches == "auto"
    assert cfg.replace(**{"execution.device": "cpu"}).execution.pads is False
    assert cfg.replace(**{"execution.device": "cuda"}).execution.pads is True
    assert cfg.replace(**{"execution.device": "cpu", "execution.pad_batches": True}).execution.pads is True
    assert cfg.replace(**{"execution.device": "cuda", "execution.pad_batches": False}).execution.pads is False
    with pytest.raises(ConfigError, match="pad_batches"):
        load_config(DIGITS, ["execution.pad_batches=sometimes"])


@pytest.mark.parametrize("rows", [1, 600, 10**6])
def test_features_pass_holds_at_most_feature_rows_and_gives_each_client_its_own(monkeypatch, rows):
    """ctx.features in the batched executor: each client's model on its own samples, however
    the clients are cut into forwards of at most FEATURE_ROWS rows (1: one client at a time)."""
    from types import SimpleNamespace

    from torch.func import functional_call

    import protofl.engine.batched as batched

    limit = batched.FEATURE_ROWS
    assert f"at most {limit:,} rows" in (REPO / "docs" / "gpu.md").read_text()  # the limit docs/gpu.md states
    monkeypatch.setattr(batched, "FEATURE_ROWS", rows)
    g = torch.Generator().manual_seed(0)
    body = nn.Sequential(nn.Linear(5, 3), nn.Tanh())
    seen_rows = []
    real = batched.vmap

    def counting(fn):
        mapped = real(fn)
        return lambda w, xb: seen_rows.append(xb.shape[0] * xb.shape[1]) or mapped(w, xb)

    monkeypatch.setattr(batched, "vmap", counting)
    jobs, want = [], []
    for n in (0, 3, 300, 700, 1500, 257):
        w = {"body.0.weight": torch.randn(3, 5, generator=g), "body.0.bias": torch.randn(3, generator=g),
             "head.weight": torch.randn(2, 3, generator=g)}
        x = torch.randn(n, 5, generator=g)
        jobs.append(SimpleNamespace(features=SimpleNamespace(x=x, weights=w), ctx=SimpleNamespace(data=(x, None))))
        want.append(functional_call(body, {k[5:]: v for k, v in w.items() if k.startswith("body.")}, (x,)))
    fake = SimpleNamespace(runtime=SimpleNamespace(device=torch.device("cpu")))
    with torch.no_grad():
        got = batched.BatchedExecutor._part_features(fake, body, "body.", jobs)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert seen_rows and max(seen_rows) <= max(rows, 511)  # a client's batch (at most 2 x 256 - 1 rows) is never cut


def test_dp_sgd_steps_run_eagerly_under_compile(tmp_path, monkeypatch):
    """execution.compile leaves DP-SGD's steps eager: their width is the stack's largest
    Poisson batch, which differs from stack to stack (each would be a shape to compile); the
    compiled step is not even built, and the run completes."""
    called: list[str] = []

    def spy(fn, **kw):
        called.append("compiled")  # not even built
        return lambda *a: called.append("called") or fn(*a)

    monkeypatch.setattr(torch, "compile", spy)
    cfg = cfg_for(tmp_path, "privacy.mode=sample", "privacy.noise_multiplier=1.0", "privacy.clip=1.0").replace(
        **{"execution.executor": "batched", "execution.compile": True})
    res = run(cfg, run_dir=tmp_path / "dp")
    assert res.summary["status"] == "complete" and not called
