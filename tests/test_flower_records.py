"""protofl <-> Flower without any network: the record mapping, the ClientApp and the
Flower executor over a loopback Grid whose SuperNodes are ClientApp calls in this process.

Every message crosses Flower's own wire format (deflate -> bytes -> inflate), so what is
checked here is what a SuperLink would carry.
"""
import math

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from protofl.algorithms import ALGORITHMS  # noqa: E402
from protofl.engine.client import ClientOutput  # noqa: E402
from protofl.engine.executor import ClientTask, SequentialExecutor  # noqa: E402
from protofl.engine.simulation import Simulation  # noqa: E402
from protofl.engine.train import NonFiniteLossError  # noqa: E402
from protofl.flower import client_app  # noqa: E402
from protofl.flower.executor import FlowerExecutor  # noqa: E402
from protofl.flower.project import config_from_run, partition_of, run_config_for  # noqa: E402
from protofl.flower.records import (  # noqa: E402
    array_to_tensor, content_to_output, content_to_task, load_state, output_to_content,
    record_to_recorddict, recorddict_to_record, save_state, task_to_content, tensor_to_array)
from protofl.messages import Record  # noqa: E402

from conftest import DIGITS, strip_timing  # noqa: E402


def wire(obj):
    """Flower's serialization round trip: every nested object deflated to bytes and back."""
    contents = {oid: o.deflate() for oid, o in get_all_nested_objects(obj).items()}
    return inflate_object_from_contents(obj.object_id, contents)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return a.numel() == 0 or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------------------------
# the mapping
# ---------------------------------------------------------------------------------------
TENSORS = {
    "w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # non-contiguous (3, 2)
    "nan": torch.tensor([float("nan"), float("inf"), -0.0, 1e-38]),
    "f64": torch.tensor([[1 / 3]], dtype=torch.float64),
    "f16": torch.tensor([65504.0, 1e-4], dtype=torch.float16),
    "bf16": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16),  # no NumPy dtype: raw bytes
    "counts": torch.tensor([0, 5, 2**40], dtype=torch.int64),
    "i8": torch.tensor([-128, 127], dtype=torch.int8),
    "u8": torch.tensor([255], dtype=torch.uint8),
    "mask": torch.tensor([True, False]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "empty_bf16": torch.zeros(0, dtype=torch.bfloat16),
    "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
}


def test_tensors_keep_dtype_shape_and_every_bit():
    for name, t in TENSORS.items():
        back = array_to_tensor(wire(ArrayRecord({"x": tensor_to_array(t)}))["x"])
        assert same_bits(back, t), name
    # a gradient-carrying tensor is sent detached
    g = torch.ones(2, requires_grad=True) * 3
    assert not array_to_tensor(tensor_to_array(g)).requires_grad


def test_record_roundtrip_is_one_to_one():
    rec = Record(arrays=dict(TENSORS), metrics={"n": 7, "loss": 0.25, "big": 2**53 + 1, "neg": -3},
                 config={"flag": True, "off": False, "name": "proto", "k": 3, "tau": 0.5})
    rd = wire(record_to_recorddict(rec))
    assert set(rd) == {"arrays", "metrics", "config"}
    assert isinstance(rd["arrays"], ArrayRecord) and isinstance(rd["config"], ConfigRecord)
    back = recorddict_to_record(rd)
    assert list(back.arrays) == list(rec.arrays)  # key order kept
    assert all(same_bits(back.arrays[k], rec.arrays[k]) for k in rec.arrays)
    # numbers keep their type: an int stays an int, a bool stays a bool (not 1)
    assert back.metrics == rec.metrics
    assert [type(v) for v in back.metrics.values()] == [int, float, int, int]
    assert back.config == rec.config
    assert [type(v) for v in back.config.values()] == [bool, bool, str, int, float]
    assert back.nbytes() == rec.nbytes()
    assert back.num_samples is None


def test_weights_groups_and_the_sample_count_map_to_their_own_records():
    w = {"body.0.weight": torch.randn(4, 3), "head.weight": torch.randn(2, 4)}
    rec = Record(weights=w, arrays={"proto": torch.randn(2, 4), "c": {"body.0.weight": torch.randn(4, 3)}},
                 metrics={"loss": 0.5}, num_samples=12)
    rd = wire(record_to_recorddict(rec))
    assert set(rd) == {"weights", "arrays", "arrays/c", "metrics", "config"}
    assert all(isinstance(rd[k], ArrayRecord) for k in ("weights", "arrays", "arrays/c"))
    assert dict(rd["metrics"]) == {"loss": 0.5, "num-examples": 12}  # Flower's typed sample count
    back = recorddict_to_record(rd)
    assert list(back.weights) == list(w) and all(same_bits(back.weights[k], w[k]) for k in w)
    assert same_bits(back.arrays["proto"], rec.arrays["proto"])
    assert same_bits(back.arrays["c"]["body.0.weight"], rec.arrays["c"]["body.0.weight"])
    assert back.metrics == {"loss": 0.5} and back.num_samples == 12
    assert back.nbytes() == rec.nbytes()
    with pytest.raises(ValueError, match="num-examples"):
        record_to_recorddict(Record(metrics={"num-examples": 3}))


def test_task_and_output_contents():
    shared = Record(weights={"fc.weight": torch.randn(3, 2)}, metrics={"lr": 0.1}, config={"phase": "warmup"})
    own = Record(arrays={"c": {"fc.weight": torch.randn(3, 2)}})
    task = ClientTask(cid=4, rnd=7, shared=shared, own=own, state=Record(), evaluate=True, full_test=False)
    back = content_to_task(wire(task_to_content(task)))
    assert (back.cid, back.rnd, back.evaluate, back.full_test) == (4, 7, True, False)
    assert back.state is None  # client state never travels: it stays in the node's Context
    msg = back.msg  # the broadcast and the client's own part, in one message
    assert torch.equal(msg.weights["fc.weight"], shared.weights["fc.weight"]) and msg.config == shared.config
    assert torch.equal(msg.arrays["c"]["fc.weight"], own.arrays["c"]["fc.weight"])

    out = ClientOutput(reply=Record(arrays={"p": torch.ones(2, 3)}, metrics={"n": 12}),
                       state=Record(arrays={"h": torch.zeros(1)}),
                       eval={"acc": 0.5, "pm_v": 0.75}, train={"loss": 1.25, "steps": 3, "samples": 40})
    got = content_to_output(wire(output_to_content(out)))
    assert torch.equal(got.reply.arrays["p"], out.reply.arrays["p"]) and got.reply.metrics == {"n": 12}
    assert got.eval == out.eval and got.train == out.train and got.state is None
    assert type(got.train["steps"]) is int


def test_state_in_context_none_is_not_empty():
    state = RecordDict()
    assert load_state(state) is None
    save_state(state, Record())  # an empty state is a state
    assert load_state(wire(state)) == Record()
    save_state(state, Record(arrays={"head": torch.full((2,), 3.0)}, config={"seen": True}))
    got = load_state(wire(state))
    assert torch.equal(got.arrays["head"], torch.full((2,), 3.0)) and got.config == {"seen": True}
    save_state(state, None)  # like the engine's store: None removes it
    assert load_state(state) is None and len(state) == 0


def test_metric_must_be_a_number_not_a_bool():
    out = ClientOutput(reply=Record(), state=None, eval={"acc": True})
    with pytest.raises(TypeError):
        output_to_content(out)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_messages_cross_flower_unchanged(name, digits_cfg, tmp_path):
    """One round of each registered method: its real messages, replies and states survive the mapping."""
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=1", "partition.num_clients=3",
                     "participation.fraction=1.0", "training.steps=1", "eval.personal=false")
    seen = []

    class Recording(SequentialExecutor):
        def run(self, tasks):
            outs = super().run(tasks)
            seen.extend((t.msg, o.reply, o.state) for t, o in zip(tasks, outs))
            return outs

    Simulation(cfg, run_dir=tmp_path, executor_factory=lambda sim: Recording(sim.runtime, 1)).run()
    assert len(seen) == 3
    for records in seen:
        for rec in records:
            if rec is None:
                continue
            back = recorddict_to_record(wire(record_to_recorddict(rec)))
            assert sorted(back.arrays) == sorted(rec.arrays) and list(back.weights) == list(rec.weights)
            got = dict(back.tensors())
            assert list(got) == [k for k, _ in back.tensors()] and got.keys() == dict(rec.tensors()).keys()
            assert all(same_bits(got[k], t.cpu()) for k, t in rec.tensors())
            assert back.metrics == rec.metrics and back.config == rec.config
            assert back.num_samples == rec.num_samples


# ---------------------------------------------------------------------------------------
# the ClientApp and the executor over a loopback Grid
# ---------------------------------------------------------------------------------------
class LoopbackGrid:
    """A Grid whose SuperNodes are calls of the real ClientApp in this process.

    Messages and replies cross Flower's wire format; each node keeps its own Context
    (run config, node config, state) between messages as a SuperNode does. Messages for
    a node in ``down`` wait in its queue (a node cut off, still listed online) until
    ``revive`` delivers them.
    """

    def __init__(self, run_config, partitions, num_partitions):
        self.contexts = {1000 + p: Context(run_id=77, node_id=1000 + p, state=RecordDict(), run_config=run_config,
                                           node_config={"partition-id": p, "num-partitions": num_partitions})
                         for p in partitions}
        self.down: set[int] = set()
        self.queued: dict[int, list[Message]] = {}
        self.pushed: list[tuple[str, int]] = []  # (message type, node)
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def _deliver(self, m: Message) -> None:
        node = m.metadata.dst_node_id
        received = Message(content=wire(m.content), metadata=m.metadata)
        try:
            reply = client_app.app(received, self.contexts[node])
        except Exception as e:  # flwr-clientapp turns an exception into an error reply
            reply = Message(Error(code=0, reason=repr(e)), reply_to=received)
        self.replies[m.metadata.message_id] = (
            reply if reply.has_error() else Message(content=wire(reply.content), metadata=reply.metadata))

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id  # what the real Grid does on push
            ids.append(m.metadata.message_id)
            node = m.metadata.dst_node_id
            self.pushed.append((m.metadata.message_type, node))
            if node in self.down:
                self.queued.setdefault(node, []).append(m)
            else:
                self._deliver(m)
        return ids

    def revive(self, node):
        self.down.discard(node)
        for m in self.queued.pop(node, []):
            self._deliver(m)

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


@pytest.fixture
def task_identity():
    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 77, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old


def loopback_sim(cfg, run_dir, partitions=None, **executor_kw):
    grid = LoopbackGrid(run_config_for(cfg), range(cfg.partition.num_clients) if partitions is None else partitions,
                        cfg.partition.num_clients)
    box = {}

    def factory(sim):
        box["ex"] = FlowerExecutor(grid, sim.fed.num_clients, poll_interval=0.0, log=lambda m: None, **executor_kw)
        return box["ex"]

    return Simulation(cfg, run_dir=run_dir, executor_factory=factory), grid, box


def test_a_false_divergence_report_concerns_its_sender_only(digits_cfg, tmp_path, task_identity):
    """A node that answers every train message with "my training diverged", naming another
    client and round: under on_nonfinite: drop its own reply is withdrawn and the run ends
    complete; under stop the run stops naming that node's client, not the one it named."""
    from protofl.flower.records import ERROR_KEY

    hostile = 1001  # the node of client 1

    class Lying(LoopbackGrid):
        def _deliver(self, m):
            if m.metadata.dst_node_id == hostile and m.metadata.message_type == "train":
                err = RecordDict({ERROR_KEY: ConfigRecord({"type": "NonFiniteLossError", "round": 99, "cid": 0,
                                                           "value": 1.0})})
                self.replies[m.metadata.message_id] = Message(content=wire(err), reply_to=m)
                return
            super()._deliver(m)

    for mode in ("drop", "stop"):
        cfg = digits_cfg("rounds=2", "partition.num_clients=3", "participation.fraction=1.0",
                         f"training.on_nonfinite={mode}", "eval.final_all_clients=false")
        grid = Lying(run_config_for(cfg), range(3), 3)
        sim = Simulation(cfg, run_dir=tmp_path / mode, executor_factory=lambda s: FlowerExecutor(
            grid, s.fed.num_clients, poll_interval=0.0, log=lambda m: None, stop_on_nonfinite=mode == "stop"))
        if mode == "drop":
            res = sim.run()
            assert res.summary["status"] == "complete" and [r["rejected"] for r in res.rows] == [1, 1]
            assert all(r["rejected_reasons"][0].startswith("client 1:") for r in res.rows)
        else:
            with pytest.raises(NonFiniteLossError) as e:
                sim.run()
            assert (e.value.rnd, e.value.cid) == (1, 1)  # the server's round and the sender, not (99, 0)


def test_a_node_claiming_a_served_client_or_answering_garbage_changes_nothing(digits_cfg, tmp_path, task_identity):
    """A fourth node that claims client 0 while client 0's node is online is refused; a
    node that answers the server's query with garbage is ignored; the run equals the one
    without them."""
    from protofl.flower.client_app import NODE_KEY

    cfg = digits_cfg("rounds=2", "partition.num_clients=3", "participation.fraction=1.0",
                     "eval.final_all_clients=false")

    class Crowded(LoopbackGrid):
        def __init__(self, *a):
            super().__init__(*a)
            for node in (2000, 2001):  # the impostor and the babbler: contexts of their own
                self.contexts[node] = Context(run_id=77, node_id=node, state=RecordDict(),
                                              run_config=self.contexts[1000].run_config,
                                              node_config={"partition-id": 0, "num-partitions": 3})

        def _deliver(self, m):
            if m.metadata.dst_node_id == 2001:  # garbage for any message
                self.replies[m.metadata.message_id] = Message(
                    content=wire(RecordDict({NODE_KEY: ConfigRecord({"partition-id": "zero"})})), reply_to=m)
                return
            super()._deliver(m)

    logs: list[str] = []
    grid = Crowded(run_config_for(cfg), range(3), 3)
    sim = Simulation(cfg, run_dir=tmp_path / "crowded", executor_factory=lambda s: FlowerExecutor(
        grid, s.fed.num_clients, poll_interval=0.0, log=logs.append))
    res = sim.run()
    ref, _, _ = loopback_sim(cfg, tmp_path / "plain")
    want = ref.run()
    assert res.summary["status"] == "complete"
    assert strip_timing(res.rows) == strip_timing(want.rows)
    assert not any(node == 2000 for kind, node in grid.pushed if kind == "train")  # never given client 0's work
    assert any("node 2000 claims client 0" in line and "refused" in line for line in logs)
    assert any("node 2001 answered the query with something else" in line for line in logs)


@pytest.mark.parametrize("bind", [False, True])
def test_a_late_clients_id_is_taken_over_only_without_binding(bind, digits_cfg, tmp_path, task_identity):
    """Client 2's node is cut off after round 1; an impostor node claims client 2 in round 2.
    Without ``bind_clients`` (no authentication: a restarted node has a new id) it takes the
    late client over; with it (authenticated ids) its claim is refused and logged, the
    impostor is never asked again, and client 2's own node, back after round 3, serves it."""
    cfg = digits_cfg("algorithm.name=fedavg", "rounds=4", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.steps=1", "eval.personal=false")
    grid = LoopbackGrid(run_config_for(cfg), range(3), 3)
    impostor = Context(run_id=77, node_id=2000, state=RecordDict(), run_config=grid.contexts[1000].run_config,
                       node_config={"partition-id": 2, "num-partitions": 3})
    logs: list[str] = []
    box = {}

    def factory(s):
        box["ex"] = FlowerExecutor(grid, s.fed.num_clients, poll_interval=0.0, round_timeout=0.2, log=logs.append,
                                   discovery_timeout=5, bind_clients=bind)
        return box["ex"]

    class Hijack:
        def on_start(self, info): ...
        def on_end(self, summary): ...

        def on_round(self, row):
            if row["round"] == 1:
                grid.down.add(1002)  # client 2's node stops answering ...
            if row["round"] == 2:
                grid.contexts[2000] = impostor  # ... and, once it is late, another node claims client 2
            if row["round"] == 3:
                grid.revive(1002)

    sim = Simulation(cfg, run_dir=tmp_path / str(bind), executor_factory=factory)
    sim.user_callbacks.append(Hijack())
    rows = sim.run().rows
    trained = [node for kind, node in grid.pushed if kind == "train"]
    if bind:
        assert box["ex"].node_of[2] == 1002 and 2000 not in trained
        assert any("node 2000 claims client 2, which is bound to node 1002" in line and "refused" in line
                   for line in logs)
        assert sum(node == 2000 for kind, node in grid.pushed if kind == "query") == 1  # asked once, then never
        assert [(r["arrived"], r["lost"]) for r in rows] == [(3, 0), (2, 1), (2, 1), (3, 0)]
    else:  # what docs/deploy.md says a node can do without authentication
        assert box["ex"].node_of[2] == 2000 and 2000 in trained
        assert any("client 2 is now served by node 2000" in line for line in logs)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_on_flowers_clientapp_equals_in_process(name, digits_cfg, tmp_path, task_identity):
    # the real ClientApp on three loopback nodes: every message and reply crosses Flower's
    # wire format, each node keeps its client's state in its own Context between the rounds
    # (2 steps a round: the transport and the state are the point, not the training)
    cfg = digits_cfg(f"algorithm.name={name}", "rounds=2", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.steps=2", "eval.final_all_clients=false")
    ref = Simulation(cfg, run_dir=tmp_path / "ref").run()
    sim, grid, box = loopback_sim(cfg, tmp_path / "flower", discovery_timeout=5)
    got = sim.run()
    assert box["ex"].node_of == {0: 1000, 1: 1001, 2: 1002}
    assert strip_timing(got.rows) == strip_timing(ref.rows)
    assert all(r["lost"] == 0 and r["arrived"] == 3 for r in got.rows)


def test_config_travels_in_the_run_config(digits_cfg):
    cfg = digits_cfg("algorithm.name=fedprox", "algorithm.mu=0.3", "partition.num_clients=3")
    rc = run_config_for(cfg, round_timeout=30)
    assert rc["round-timeout"] == 30.0 and isinstance(rc["protofl-config"], str)
    back = config_from_run(rc)
    assert back.fingerprint() == cfg.fingerprint() and back.algorithm.params == cfg.algorithm.params
    assert back.algorithm.params["mu"] == 0.3
    assert back.to_yaml() == cfg.to_yaml()
    # machine-specific settings come from the node config
    here = config_from_run(rc, {"data-root": "/elsewhere", "device": "cuda:1", "partition-id": 1})
    assert (here.data.root, here.execution.device) == ("/elsewhere", "cuda:1")
    assert partition_of({"partition-id": 2, "num-partitions": 3}, 3) == 2
    from protofl.config import ConfigError

    for bad in ({}, {"partition-id": 3}, {"partition-id": 0, "num-partitions": 4}):
        with pytest.raises(ConfigError):
            partition_of(bad, 3)


def test_crashed_node_is_lost_then_skipped_then_readmitted(digits_cfg, tmp_path, task_identity):
    cfg = digits_cfg("algorithm.name=fedavg", "rounds=4", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.steps=1", "eval.personal=false")
    sim, grid, box = loopback_sim(cfg, tmp_path, round_timeout=0.2, discovery_timeout=5)

    class Crash:  # node 1002 (client 2) is cut off after round 1 and comes back after round 3
        def on_start(self, info): ...
        def on_end(self, summary): ...

        def on_round(self, row):
            if row["round"] == 1:
                grid.down.add(1002)
            if row["round"] == 2:
                grid.pushed.clear()
            if row["round"] == 3:
                assert ("train", 1002) not in grid.pushed  # skipped at once, not waited for
                assert ("query", 1002) in grid.pushed  # but asked whether it is back
                grid.revive(1002)  # answers the stale round-2 task (ignored) and the query

    sim.user_callbacks.append(Crash())
    rows = sim.run().rows
    assert [(r["arrived"], r["lost"]) for r in rows] == [(3, 0), (2, 1), (2, 1), (3, 0)]
    assert all(math.isfinite(r["train_loss"]) for r in rows) and box["ex"].lost_total == 2


def test_node_that_leaves_mid_round_is_not_waited_for(digits_cfg, tmp_path, task_identity, monkeypatch):
    monkeypatch.setattr(FlowerExecutor, "LIVENESS_EVERY", 0.05)
    cfg = digits_cfg("algorithm.name=fedavg", "rounds=2", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.steps=1", "eval.personal=false")
    sim, grid, box = loopback_sim(cfg, tmp_path, round_timeout=60, discovery_timeout=5)
    listed = grid.get_node_ids
    state = {"calls": 0}

    def get_node_ids():  # in round 2, node 1002 is listed when the round starts, then leaves
        ids = listed()
        if 1002 in grid.down:
            state["calls"] += 1
            if state["calls"] > 1:
                ids.remove(1002)
        return ids

    grid.get_node_ids = get_node_ids

    class Cut:
        def on_start(self, info): ...
        def on_end(self, summary): ...

        def on_round(self, row):
            grid.down.add(1002)

    sim.user_callbacks.append(Cut())
    rows = sim.run().rows
    assert [(r["arrived"], r["lost"]) for r in rows] == [(3, 0), (2, 1)]
    assert ("train", 1002) in grid.pushed[-3:]  # it was sent the task ...
    assert rows[1]["wall_s"] < 30  # ... and not waited for until the 60 s timeout


def test_missing_partition_counts_as_lost(digits_cfg, tmp_path, task_identity):
    cfg = digits_cfg("algorithm.name=fedavg", "rounds=1", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.steps=1", "eval.personal=false")
    sim, grid, box = loopback_sim(cfg, tmp_path, partitions=[0, 2], discovery_timeout=0.2)
    row = sim.run().rows[0]
    assert (row["arrived"], row["lost"]) == (2, 1) and 1 not in box["ex"].node_of


def test_client_exception_is_lost_and_divergence_stops_the_run(digits_cfg, tmp_path, task_identity):
    cfg = digits_cfg("algorithm.name=fedavg", "rounds=1", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.steps=1", "eval.personal=false")
    sim, grid, box = loopback_sim(cfg, tmp_path / "a", discovery_timeout=5)
    real_app = client_app.app

    def sabotage(msg, ctx):
        if msg.metadata.message_type == "train" and ctx.node_id == 1001:
            raise RuntimeError("out of memory")
        return real_app(msg, ctx)

    client_app.app = sabotage
    try:
        row = sim.run().rows[0]
    finally:
        client_app.app = real_app
    assert (row["arrived"], row["lost"]) == (2, 1)

    bad = digits_cfg("algorithm.name=fedavg", "rounds=1", "partition.num_clients=3", "participation.fraction=1.0",
                     "training.lr=1e30", "training.steps=3", "eval.personal=false")
    sim, _, _ = loopback_sim(bad, tmp_path / "b", discovery_timeout=5)
    with pytest.raises(NonFiniteLossError):
        sim.run()


# ---------------------------------------------------------------------------------------
# the generated Flower App and the process commands
# ---------------------------------------------------------------------------------------
def test_generated_app_passes_flowers_validation(tmp_path):
    import tomli
    from flwr.common.config import validate_config

    from protofl.cli import main

    assert main(["flower", "app", str(DIGITS), "algorithm.name=fedprox", "partition.num_clients=3",
                 "--round-timeout", "42", "--out", str(tmp_path / "app")]) == 0
    conf = tomli.loads((tmp_path / "app" / "pyproject.toml").read_text())
    ok, errors, _ = validate_config(conf, check_module=True, project_dir=tmp_path / "app")
    assert ok, errors  # components resolve to protofl's ServerApp and ClientApp
    rc = conf["tool"]["flwr"]["app"]["config"]
    assert rc["round-timeout"] == 42.0
    cfg = config_from_run(rc)
    assert cfg.algorithm.name == "fedprox" and cfg.partition.num_clients == 3


def test_process_commands_carry_protofl_settings(tmp_path):
    from flwr.common.config import parse_config_args

    from protofl.flower.launch import (FLOWER_ENV, flower_env, superlink_command, supernode_command,
                                       throwaway_certificates)

    link = superlink_command("127.0.0.1", 9100)
    assert "--disable-runtime-dependency-installation" in link and "--insecure" in link
    node = supernode_command("10.0.0.5:9100", 2, 5, port=9200, node_config={"data-root": "/data x"})
    conf = node[node.index("--node-config") + 1]
    assert parse_config_args([conf]) == {"partition-id": 2, "num-partitions": 5, "data-root": "/data x"}
    assert "--insecure" in node
    env = flower_env({"PATH": "/usr/bin"})
    assert all(env[k] == v for k, v in FLOWER_ENV.items()) and env["PATH"].endswith("/usr/bin")
    certs = throwaway_certificates(tmp_path)
    tls_link = superlink_command("127.0.0.1", 9100, certs)
    assert "--insecure" not in tls_link and str(certs.server_key) in tls_link
    tls_node = supernode_command("127.0.0.1:9100", 0, 3, root_certificates=certs.ca_cert)
    assert "--insecure" not in tls_node and str(certs.ca_cert) in tls_node
    # the server certificate is signed by the CA and names the host
    from cryptography import x509

    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)


def test_supernodes_get_one_long_lived_clientapp_process_by_default(monkeypatch):
    import sys

    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    import protofl.flower.cli as flower_cli
    from protofl.cli import main
    from protofl.flower.launch import LocalDeployment, node_command, supernode_command

    cmd = node_command("10.0.0.5:9100", 1, 3, port=9200)
    assert cmd[:3] == [sys.executable, "-m", "protofl.flower.node"]
    cut = cmd.index("--")
    assert cmd[cut - 2:cut] == ["--runtime-api-address", "127.0.0.1:9200"]  # where the SuperNode serves it
    node = cmd[cut + 1:]
    assert node[0].endswith("flower-supernode")
    args = _parse_args_run_supernode().parse_args(node[1:])  # Flower's own parser takes it
    assert (args.isolation, args.host, args.port, args.insecure) == ("process", "127.0.0.1", 9200, True)
    plain = node_command("10.0.0.5:9100", 1, 3, port=9200, isolation="subprocess")
    assert plain == supernode_command("10.0.0.5:9100", 1, 3, port=9200)
    assert _parse_args_run_supernode().parse_args(plain[1:]).isolation == "subprocess"
    with pytest.raises(ValueError):
        node_command("10.0.0.5:9100", 1, 3, isolation="thread")
    with pytest.raises(ValueError):
        LocalDeployment("unused", 3, isolation="thread")
    # `protofl flower supernode` execs exactly that
    seen = []
    monkeypatch.setattr(flower_cli, "_exec", lambda c: seen.append(c) or 0)
    base = ["flower", "supernode", "--superlink", "10.0.0.5:9100", "--partition-id", "1", "--num-partitions", "3",
            "--port", "9200", "--insecure"]
    assert main(base) == 0 and main(base + ["--isolation", "subprocess"]) == 0
    assert seen == [cmd, plain]


def test_flower_log_lines_are_plain_outside_a_terminal(monkeypatch):
    import logging

    from protofl.flower.project import plain_flower_logs, plain_text

    assert plain_text("\x1b[32mINFO \x1b[0m:  round 1") == "INFO :  round 1"
    handlers = [h for h in logging.getLogger("flwr").handlers if hasattr(h, "colored")]
    assert handlers
    monkeypatch.setattr(handlers[0], "colored", True)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    plain_flower_logs()
    assert all(not h.colored for h in handlers)
    record = logging.LogRecord("flwr", logging.INFO, __file__, 1, "round 1", None, None)
    assert "\x1b[" not in handlers[0].format(record)



def test_node_supervisor_starts_a_refused_supernode_again_until_let_in_or_out_of_time(tmp_path):
    """``python -m protofl.flower.node`` around a stand-in SuperNode that Flower's SuperLink
    refuses twice ("Failed to activate SuperNode", exit 1: a restarted node whose old session
    still counts as online), then lets in: started again until it runs, its output relayed;
    with no time left (``--rejoin-wait``) a refusal is final."""
    import subprocess
    import sys

    from protofl.flower.launch import free_port

    lives = tmp_path / "lives"
    refused_until = tmp_path / "refused-until"
    script = (f"import pathlib, sys, time\np = pathlib.Path({str(lives)!r})\n"
              "n = int(p.read_text()) if p.exists() else 0\np.write_text(str(n + 1))\n"
              f"if n < int(pathlib.Path({str(refused_until)!r}).read_text()):\n"
              "    print('ERROR :     Exit Code: 305\\n[code: 2004] Failed to activate SuperNode.', flush=True)\n"
              "    sys.exit(1)\n"
              "print('INFO :      SuperNode ID: 42', flush=True)\ntime.sleep(0.5)\nsys.exit(3)\n")

    def supervise(wait: str) -> subprocess.CompletedProcess:
        lives.unlink(missing_ok=True)
        return subprocess.run([sys.executable, "-m", "protofl.flower.node", "--runtime-api-address",
                               f"127.0.0.1:{free_port()}", "--rejoin-wait", wait, "--", sys.executable, "-c",
                               script], capture_output=True, text=True, timeout=120)

    refused_until.write_text("2")
    res = supervise("60")
    assert res.returncode == 3 and lives.read_text() == "3", res.stdout + res.stderr
    assert res.stderr.count("refused to activate this SuperNode") == 2, res.stderr
    assert res.stdout.count("Failed to activate SuperNode") == 2 and "SuperNode ID: 42" in res.stdout
    refused_until.write_text("99")
    res = supervise("1")  # the next try would start after the window: the refusal stands
    assert res.returncode == 1 and lives.read_text() == "1", res.stdout + res.stderr
