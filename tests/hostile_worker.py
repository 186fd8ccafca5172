"""The ClientApp process of a hostile SuperNode (tests/test_flower_hostile.py).

It is protofl's own worker (``protofl.flower.worker``) serving protofl's own ClientApp,
except that every ``train`` reply is altered after the real ClientApp computed it, one
misbehaviour a round, in the order of ``PLAN`` (round r: ``PLAN[(r - 1) % len(PLAN)]``):

* ``accuracy``: its personalized accuracy reported as 1e9;
* ``nan-loss``: its training loss reported as NaN;
* ``false-divergence``: "my training diverged", naming client 0 and round 99;
* ``scaled-update``: its model update (reply - sent) multiplied by 1e6 -- every check of
  its own passes, only the round's other updates show it;
* ``huge-weights``: weights of 3e38 (finite; their average would overflow).

The query is answered honestly (the node serves its partition as declared).

    python tests/hostile_worker.py --runtime-api-address 127.0.0.1:PORT --parent-pid PID
"""
from __future__ import annotations

import sys

import torch
from flwr.app import ConfigRecord, Message
from flwr.clientapp import ClientApp

from protofl.flower import client_app, worker
from protofl.flower.records import (ERROR_KEY, TASK_KEY, content_to_output, output_to_content,
                                    recorddict_to_record)

PLAN = ("accuracy", "nan-loss", "false-divergence", "scaled-update", "huge-weights")

real_app = client_app.app


def corrupt(message: Message, reply: Message) -> Message:
    rnd = int(message.content[TASK_KEY]["round"])
    kind = PLAN[(rnd - 1) % len(PLAN)]
    out = content_to_output(reply.content)
    if kind == "accuracy":
        out.eval["pa"] = 1e9
    elif kind == "nan-loss":
        out.train["loss"] = float("nan")
    elif kind == "scaled-update":
        sent = recorddict_to_record(message.content).weights
        out.reply.weights = {k: sent[k] + 1e6 * (w - sent[k]) if w.is_floating_point() else w
                             for k, w in out.reply.weights.items()}
    elif kind == "huge-weights":
        out.reply.weights = {k: torch.full_like(w, 3e38) if w.is_floating_point() else w
                             for k, w in out.reply.weights.items()}
    content = output_to_content(out)
    if kind == "false-divergence":
        content[ERROR_KEY] = ConfigRecord({"type": "NonFiniteLossError", "round": 99, "cid": 0, "value": 1.0})
    return Message(content=content, reply_to=message)


hostile_app = ClientApp()


@hostile_app.query()
def query(message: Message, context) -> Message:
    return real_app(message=message, context=context)


@hostile_app.train()
def train(message: Message, context) -> Message:
    reply = real_app(message=message, context=context)
    return reply if reply.has_error() else corrupt(message, reply)


if __name__ == "__main__":
    # the worker loads the ClientApp named in the run's FAB ("protofl.flower.client_app:app")
    # from sys.modules: this process's module answers with the hostile one (only here: a test
    # importing PLAN must not change its own process's ClientApp)
    client_app.app = hostile_app
    sys.exit(worker.main())
