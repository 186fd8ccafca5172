"""The Flower ClientApp: one protofl client per SuperNode.

A SuperNode serves the client whose id is its node config's ``partition-id``. For a
``train`` message it does exactly what an in-process executor does for a ClientTask:
``ClientRuntime.run(cid, round, msg, state, evaluate, full_test)`` -- the same method
code, the same per-(round, client) random streams -- and replies with the method's
Record plus the eval/train numbers. The client's persistent state lives on the node, not
on the server: in ``Context.state`` (Flower keeps it between the run's messages) and, so
that it survives a SuperNode restart and follows a resumed ServerApp back to its
checkpoint round, in per-round files on the node's disk (:mod:`protofl.flower.node_state`).

The ClientRuntime is built from the run's protofl config (it travels in the run config)
and cached for the life of the process, keyed by the run id and the config text (a hit
does not even parse the YAML). protofl's SuperNodes run one long-lived ClientApp process
each (``--isolation process`` plus :mod:`protofl.flower.worker`), so a node imports
torch and builds its client's data once per run, not once per message; the worker calls
:func:`warm_up` at its start so that the imports are paid before the first message. Under
Flower's ``subprocess`` isolation every message gets a fresh process and the cache never
hits; ``build_federated`` is deterministic, so rebuilding gives the same partition every
time (it splits the full dataset, then uses one part).

A ``query`` message is answered with the node's partition-id and num-partitions: the
ServerApp uses it to map client ids to node ids. It also carries the run's protofl
config, which the node keeps in its ``Context.state``: a runtime that gives the ClientApp
an empty run config (``flwr.simulation.run_simulation``) works the same, because a node
is always queried before its first ``train`` message.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, cast

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from .project import config_from_run, CONFIG_KEY, NODE_OVERRIDES, partition_of, plain_flower_logs

NODE_KEY = "node"
RUN_KEY = "protofl-run"  # in a query's content and in the node's Context.state: the run's config

plain_flower_logs()  # colours only on a terminal
app = ClientApp()

_CACHE: dict[str, Any] = {}  # {"key": ..., "runtime": ClientRuntime, "cfg": Config}


def warm_up() -> None:
    """Pay a long-lived ClientApp process's one-time costs before its first message.

    Imports torch, the engine and the methods, and runs two SGD steps of a tiny model:
    torch initializes autograd and the optimizer lazily on first use (importing
    ``torch._dynamo``, about 1 s here). The global RNG is left as it was; results do
    not depend on it anyway (every client turn seeds its own streams).
    """
    from ..algorithms.base import cross_entropy
    from ..engine import client, simulation  # noqa: F401
    from ..engine.train import TrainSettings, fit
    from . import records  # noqa: F401

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        x, y = torch.randn(8, 4), torch.arange(8) % 2
        fit(model, x, y, loss=cross_entropy, extras={}, names=[k for k, _ in model.named_parameters()],
            settings=TrainSettings(lr=0.01, momentum=0.9, batch_size=4), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            model.eval()
            model(x).argmax(1)


def _runtime(context: Context):
    """The process's ClientRuntime for this run and node (built on the first message)."""
    nc = context.node_config
    run_config = dict(context.run_config)
    if not run_config.get(CONFIG_KEY) and RUN_KEY in context.state:  # learnt from the server's query
        run_config[CONFIG_KEY] = cast("Mapping[str, str]", context.state[RUN_KEY])[CONFIG_KEY]  # the config text
    key = (context.run_id, str(run_config.get(CONFIG_KEY, "")), tuple(str(nc.get(k, "")) for k in NODE_OVERRIDES))
    if _CACHE.get("key") != key:
        from ..engine.client import ClientRuntime
        from ..engine.task import Task

        _CACHE.clear()  # one run at a time: let the previous run's data go first
        cfg = config_from_run(run_config, nc)
        if cfg.execution.threads > 0:
            import torch

            torch.set_num_threads(cfg.execution.threads)
        _CACHE.update(key=key, runtime=ClientRuntime(Task.build(cfg)), cfg=cfg)
    return _CACHE["runtime"], _CACHE["cfg"]


def _disk_store(msg: Message, context: Context, cfg, pid: int):
    """The client's state on this node's disk (node_state.py), or None (Context.state only)."""
    from .node_state import store_for
    from .records import RUN_INFO_KEY

    return store_for(context.node_config, msg.content.get(RUN_INFO_KEY), pid, cfg.output.checkpoint_every)


NOISE_KEY = "protofl-noise-key"  # in Context.state when the node keeps no files (state-dir="off")


def _noise_key(context: Context, store) -> bytes:
    """This node's own noise key (privacy.noise: secret): in its state folder beside the
    client's state files (node_state.noise_key, mode 0600), or without one in the node's
    memory (``Context.state``: a restarted node then draws a new key)."""
    if store is not None:
        from .node_state import noise_key

        return noise_key(store.dir)
    if NOISE_KEY not in context.state:
        from ..engine.privacy import new_secret

        context.state[NOISE_KEY] = ConfigRecord({"key": new_secret()})
    return bytes(cast("Mapping[str, bytes]", context.state[NOISE_KEY])["key"])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Which client this node serves (no torch, no data: answered fast)."""
    if RUN_KEY in msg.content:  # the run's config, for runtimes that give an empty run config
        context.state[RUN_KEY] = ConfigRecord(dict(cast(ConfigRecord, msg.content[RUN_KEY])))
    nc = context.node_config
    info: dict[str, Any] = {"partition-id": int(nc.get("partition-id", -1)),
                            "num-partitions": int(nc.get("num-partitions", -1))}
    return Message(RecordDict({NODE_KEY: ConfigRecord(info)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from ..engine.train import NonFiniteLossError
    from .records import content_to_task, ERROR_KEY, load_state, output_to_content, RUN_INFO_KEY, save_state

    runtime, cfg = _runtime(context)
    pid = partition_of(context.node_config, cfg.partition.num_clients)
    task = content_to_task(msg.content)
    if task.cid != pid:  # the server's map is stale (e.g. a node restarted with another id)
        raise ValueError(f"this SuperNode serves client {pid}, the message is for client {task.cid}")
    store = _disk_store(msg, context, cfg, pid)
    state: Optional[Any] = (load_state(context.state) if store is None
                            else store.load(task.rnd, context.run_id,
                                            int(cast("Mapping[str, int]", msg.content[RUN_INFO_KEY])["base-round"]))[0])
    task.state = state
    if cfg.privacy.mode != "none" and cfg.privacy.noise == "secret":
        runtime.node_key = _noise_key(context, store)
    try:
        out = runtime.run(task)
    except NonFiniteLossError as e:
        # the in-process engine stops the run on a diverged client; tell the server so
        # it does the same, instead of counting the reply as lost
        err = RecordDict({ERROR_KEY: ConfigRecord({"type": "NonFiniteLossError", "round": e.rnd,
                                                   "cid": e.cid, "value": float(e.value)})})
        return Message(err, reply_to=msg)
    if not out.rejected:  # a withdrawn reply leaves the client's state as it was
        save_state(context.state, out.state)
        if store is not None:
            store.save(task.rnd, context.run_id, out.state)
    return Message(output_to_content(out), reply_to=msg)
