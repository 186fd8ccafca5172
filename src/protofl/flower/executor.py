"""The Flower execution backend: a round's ClientTasks go to SuperNodes over a Grid.

The engine's round loop (``Simulation``) runs unchanged inside the ServerApp; only the
executor differs. For each ClientTask it sends one ``train`` message -- the method's
Record and the task's round/cid/flags (``records.task_to_content``) -- to the SuperNode
serving that client id, and turns the replies back into ClientOutputs, in task order.
A task whose reply does not come back within ``round_timeout`` (node gone, crashed,
slow) gives ``None``: the engine then aggregates the others and records it as ``lost``.

Which node serves which client is learnt by asking: every node that shows up in
``grid.get_node_ids()`` gets a ``query`` message and answers with its ``partition-id``.
Discovery waits (up to ``discovery_timeout``) for one node per client before round 1;
afterwards nodes it has not heard of yet (a restarted SuperNode joins with a new node id)
are asked at the start of every round and every few seconds while a round waits for
replies, without waiting for the answers: a node that joins during round r serves its
client again from round r+1.

A node that missed a round's deadline, answered with an error, or left
``get_node_ids()`` during the round (stopped, or Flower saw no heartbeat) is *late*: its
client's tasks give ``None`` at once in later rounds -- no second wait for a node that is
probably dead -- while a ``query`` goes to it every round; its first answer makes it a
participant again.

Which node may serve a client (``bind_clients``):

* off (the default; for SuperLinks without SuperNode authentication, where a restarted
  SuperNode gets a new node id): a second node claiming a client whose node is online
  and answering is refused; a claim on a late client (its node stopped answering or
  left) takes it over -- how a restarted node comes back. A client id is then the
  node's own word: any node that reaches the SuperLink can claim a late client.
* on (run setting ``bind-clients``; ``protofl flower local --auth`` sets it): for
  SuperLinks with SuperNode authentication, where a node's id is its registered key's and
  a restarted node keeps it. The first node to answer for a client owns it for the rest
  of the run; any other node's claim is refused and logged, whether the owner is
  answering, late or gone; the owner's key restarted elsewhere is the owner.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, cast

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from ..engine.client import ClientOutput
from ..messages import Record
from ..engine.executor import ClientTask, Executor
from ..engine.train import NonFiniteLossError
from .client_app import NODE_KEY, RUN_KEY
from .project import CONFIG_KEY
from .records import ERROR_KEY, RUN_INFO_KEY, content_to_output, task_to_content

TRAIN, QUERY = "train", "query"


class FlowerExecutor(Executor):
    LIVENESS_EVERY = 2.0  # seconds between checks that the nodes waited for are still online

    def __init__(self, grid: Grid, num_clients: int, *, round_timeout: float = 600.0,
                 discovery_timeout: float = 120.0, poll_interval: float = 0.5,
                 log: Callable[[str], None] = print, config_text: str = "",
                 run_info: Optional[dict] = None, stop_on_nonfinite: bool = True,
                 bind_clients: bool = False) -> None:
        self.grid, self.K = grid, num_clients
        self.bind_clients = bind_clients  # a client's first node owns it for the run (module docstring)
        # training.on_nonfinite: stop (a client's report that its training diverged stops the
        # run, as in process) or drop (the report withdraws that client's reply, nothing more)
        self.stop_on_nonfinite = stop_on_nonfinite
        # the run's protofl config, sent with every query: a node whose runtime gave the
        # ClientApp an empty run config (flwr.simulation.run_simulation) learns it from there
        self.config_text = config_text
        self.run_info = run_info  # sent with every train message (node_state.py: which state a node uses)
        self.round_timeout, self.poll = float(round_timeout), float(poll_interval)
        # a message outlives the wait for it a little, then the SuperLink drops it
        self.ttl = self.round_timeout + max(60.0, discovery_timeout)
        self.log = log
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.cid_of: dict[int, int] = {}  # node id -> client id (-1: serves no client of this run)
        self.late: set[int] = set()  # client ids skipped until their node answers a query
        self.queries: dict[str, int] = {}  # open query message id -> node id
        self.lost_total = 0
        self._discover(float(discovery_timeout))

    # -- node map ----------------------------------------------------------------------------
    def _send_queries(self, group: str) -> set[int]:
        """Ask unknown and late nodes which client they serve; returns the online node ids."""
        online = set(self.grid.get_node_ids())
        asked = set(self.queries.values())
        targets = [n for n in sorted(online) if n not in asked
                   and (n not in self.cid_of or self.cid_of[n] in self.late)]
        if targets:
            msgs = [Message(self._query_content(), dst_node_id=n, message_type=QUERY, group_id=group,
                            ttl=self.ttl) for n in targets]
            for n, mid in zip(targets, self.grid.push_messages(msgs)):
                if mid:
                    self.queries[mid] = n
        return online

    def _query_content(self) -> RecordDict:
        if not self.config_text:
            return RecordDict()
        return RecordDict({RUN_KEY: ConfigRecord({CONFIG_KEY: self.config_text})})

    def describe(self) -> dict:
        return {"backend": "flower", "nodes": len(self.node_of)}

    def _on_query_reply(self, node: int, reply: Message) -> None:
        if reply.has_error():
            self.log(f"[flower] node {node} did not answer the query ({reply.error.reason})")
            return  # asked again next round if it is still online
        try:
            info = cast("Mapping[str, Any]", reply.content[NODE_KEY])  # checked: a malformed one raises
            cid, n = int(info["partition-id"]), int(info["num-partitions"])
        except Exception as e:  # noqa: BLE001 - a malformed answer: that node's problem, not the run's
            self.log(f"[flower] node {node} answered the query with something else ({type(e).__name__}): ignored")
            self.cid_of[node] = -1
            return
        if not 0 <= cid < self.K or n not in (-1, self.K):
            self.log(f"[flower] node {node} serves partition-id={cid} num-partitions={n}; this run has "
                     f"{self.K} clients: ignored")
            self.cid_of[node] = -1
            return
        old = self.node_of.get(cid)
        if old is not None and old != node and self.bind_clients:
            # authenticated ids: the owner's key is the client's, whether its node answers or not
            self.log(f"[flower] node {node} claims client {cid}, which is bound to node {old} for this run: "
                     "refused (not asked again)")
            self.cid_of[node] = -1
            return
        if old is not None and old != node and cid not in self.late and old in set(self.grid.get_node_ids()):
            # the client's node is online and answering: a second node claiming its id is
            # refused (asked again each round). A node restarted after a crash takes over at
            # once: its client went late when the old node stopped answering
            self.log(f"[flower] node {node} claims client {cid}, which node {old} serves and answers: refused")
            return
        if old is not None and old != node:
            self.log(f"[flower] client {cid} is now served by node {node} "
                     f"(was node {old}, which left or stopped answering)")
            self.cid_of[old] = -1
        self.node_of[cid], self.cid_of[node] = node, cid
        self.late.discard(cid)

    def _pull(self, ids: list[str]) -> list[Message]:
        return list(self.grid.pull_messages(ids)) if ids else []

    def _collect_queries(self) -> None:
        for reply in self._pull(list(self.queries)):
            node = self.queries.pop(reply.metadata.reply_to_message_id, None)
            if node is not None:
                self._on_query_reply(node, reply)

    def _discover(self, timeout: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            self._send_queries("discovery")
            self._collect_queries()
            if len(self.node_of) == self.K or time.monotonic() > deadline:
                break
            time.sleep(self.poll)
        missing = [c for c in range(self.K) if c not in self.node_of]
        if missing:
            self.log(f"[flower] after {timeout:.0f} s no SuperNode serves client(s) {missing}: their tasks "
                     "count as lost until one joins")
        self.log(f"[flower] client -> node: {dict(sorted(self.node_of.items()))} "
                 f"(discovery {time.monotonic() - t0:.1f} s)")

    def _content(self, task: ClientTask) -> RecordDict:
        rd = task_to_content(task)
        if self.run_info:
            rd[RUN_INFO_KEY] = ConfigRecord(dict(self.run_info))
        return rd

    # -- a round -----------------------------------------------------------------------------
    def run(self, tasks: list[ClientTask]) -> list[Optional[ClientOutput]]:
        out: list[Optional[ClientOutput]] = [None] * len(tasks)
        if not tasks:
            return out
        rnd = tasks[0].rnd
        self._collect_queries()  # a late node that answered since the last round is back
        online = self._send_queries(str(rnd))
        chosen = [(i, t) for i, t in enumerate(tasks)
                  if t.cid in self.node_of and self.node_of[t.cid] in online and t.cid not in self.late]
        msgs = [Message(self._content(t), dst_node_id=self.node_of[t.cid], message_type=TRAIN,
                        group_id=str(t.rnd), ttl=self.ttl) for _, t in chosen]
        waiting: dict[str, tuple[int, int]] = {}  # train message id -> (task index, node id)
        for (i, t), mid in zip(chosen, self.grid.push_messages(msgs) if msgs else []):
            if mid:
                waiting[mid] = (i, self.node_of[t.cid])
        deadline = time.monotonic() + self.round_timeout
        next_check = time.monotonic() + self.LIVENESS_EVERY
        while True:
            for reply in self._pull(list(waiting) + list(self.queries)):
                rid = reply.metadata.reply_to_message_id
                if rid in self.queries:
                    self._on_query_reply(self.queries.pop(rid), reply)
                    continue
                if rid not in waiting:
                    continue
                i, _ = waiting.pop(rid)
                t = tasks[i]
                if reply.has_error():  # crashed ClientApp, node unavailable, message expired
                    self.log(f"[flower] round {rnd}: client {t.cid} failed: {reply.error.reason}")
                    self.late.add(t.cid)
                elif ERROR_KEY in reply.content:
                    # a client's word that its training diverged concerns its own reply only:
                    # the round and the client are the server's, whatever the report names
                    try:
                        value = float(cast("Mapping[str, Any]", reply.content[ERROR_KEY])["value"])
                    except Exception:  # noqa: BLE001 - a malformed report
                        value = float("nan")
                    if self.stop_on_nonfinite:
                        raise NonFiniteLossError(rnd, t.cid, value)
                    out[i] = ClientOutput(reply=Record(), state=None,
                                          rejected=f"non-finite training loss ({value}) reported")
                else:
                    try:
                        out[i] = content_to_output(reply.content)
                    except Exception as e:  # a reply that is not a protofl Record at all
                        out[i] = ClientOutput(reply=Record(), state=None,
                                              rejected=f"malformed reply ({type(e).__name__}: {e})")
            if not waiting or time.monotonic() > deadline:
                break
            if time.monotonic() > next_check:  # a node that left (stopped, heartbeats missed) won't reply
                # ... and one that joined (a restarted SuperNode) is asked now: readmitted next round
                online = self._send_queries(str(rnd))
                for mid, (i, node) in list(waiting.items()):
                    if node not in online:
                        self.log(f"[flower] round {rnd}: client {tasks[i].cid}'s node {node} left")
                        self.late.add(tasks[i].cid)
                        del waiting[mid]
                next_check = time.monotonic() + self.LIVENESS_EVERY
                continue
            time.sleep(self.poll)
        for i, _ in waiting.values():  # no reply in time: skip this client until it answers a query
            self.late.add(tasks[i].cid)
        lost = [t.cid for t, o in zip(tasks, out) if o is None]
        if lost:
            self.lost_total += len(lost)
            self.log(f"[flower] round {rnd}: no reply from client(s) {lost}")
        return out

    def close(self) -> None:
        pass
