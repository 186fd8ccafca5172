"""protofl messages <-> Flower records, 1:1.

A Flower ``RecordDict`` holds named records. One :class:`~protofl.messages.Record` becomes
these entries of a RecordDict under a prefix::

    Record.weights        -> "<prefix>weights"         ArrayRecord  (the model, by state-dict key)
    Record.arrays         -> "<prefix>arrays"          ArrayRecord  (one Array per tensor)
    a group arrays[g]     -> "<prefix>arrays/<g>"      ArrayRecord  (SCAFFOLD's control variate, ...)
    Record.metrics        -> "<prefix>metrics"         MetricRecord (int / float)
    Record.num_samples    -> "num-examples" in it      (Flower's typed sample count of a reply)
    Record.config         -> "<prefix>config"          ConfigRecord (str / int / float / bool)

and a missing ``"<prefix>arrays"`` entry means "no Record" (``None``), which is how a
client without persistent state is told apart from one with an empty state.

Tensors travel as NumPy ``.npy`` bytes (Flower's own ``numpy.ndarray`` serialization, so
any Flower tool can read them), which keeps dtype, shape and every bit of the values.
Dtypes NumPy has no equivalent for (``bfloat16``, ...) travel as their raw bytes with the
torch dtype name (``stype = "protofl.torch-raw"``). Key order is kept.

What else crosses the wire:

* server -> client (message type ``train``): the method's Record plus a ConfigRecord
  ``"task"`` with the round, client id and evaluation flags of the engine's ClientTask;
* client -> server: the reply Record plus two MetricRecords, ``"eval"`` (personalized
  metrics) and ``"train"`` (loss, steps, samples, seconds) of the engine's ClientOutput,
  and, when local training diverged, a ConfigRecord ``"error"`` that makes the server
  raise the same :class:`~protofl.engine.train.NonFiniteLossError` the in-process
  engine raises;
* the client's persistent state is stored in the node's ``Context.state`` under the
  prefix ``"state."``; it never travels.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Union, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..engine.client import ClientOutput
from ..engine.executor import ClientTask
from ..messages import Record, Scalar, Setting

if TYPE_CHECKING:
    from flwr.app.typing import MetricRecordValues

NUMPY_STYPE = "numpy.ndarray"  # Flower's SType.NUMPY
NUM_EXAMPLES = "num-examples"  # the reply's sample count, the key Flower's strategies weight by
GROUP = "/"  # "<prefix>arrays/<group>": a named group of a Record's arrays
RAW_STYPE = "protofl.torch-raw"
STATE_PREFIX = "state."
TASK_KEY, EVAL_KEY, TRAIN_KEY, ERROR_KEY = "task", "eval", "train", "error"
REJECTED_KEY = "rejected"  # the client withdrew its reply (training.on_nonfinite: drop)
RUN_INFO_KEY = "run"  # server -> client: the run folder's key and the round the ServerApp started from (node_state.py)


# ---------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------
def tensor_to_array(t: torch.Tensor) -> Array:
    """A Flower Array holding exactly ``t`` (dtype, shape, values); moved to the CPU."""
    t = t.detach().cpu().resolve_conj().resolve_neg()
    try:
        return Array(t.numpy())
    except TypeError:  # no NumPy dtype (bfloat16, float8, ...): ship the raw bytes
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return Array(dtype=str(t.dtype), shape=tuple(t.shape), stype=RAW_STYPE, data=raw)


def array_to_tensor(a: Array) -> torch.Tensor:
    if a.stype == NUMPY_STYPE:
        return torch.from_numpy(a.numpy())  # np.load gives a fresh, writable array
    if a.stype == RAW_STYPE:
        dtype = getattr(torch, a.dtype.removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"unknown torch dtype {a.dtype!r} in a {RAW_STYPE} array")
        if not a.data:
            return torch.empty(a.shape, dtype=dtype)
        return torch.frombuffer(bytearray(a.data), dtype=torch.uint8).view(dtype).reshape(a.shape)
    raise TypeError(f"cannot convert an Array with stype {a.stype!r} to a tensor")


# ---------------------------------------------------------------------------------------
# Record <-> RecordDict entries
# ---------------------------------------------------------------------------------------
def _number(v: Union[float, np.number[Any], np.bool_]) -> int | float:
    # bool is an int to Python but not a number here (Record rejects it too)
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"a metric must be int or float, got {type(v).__name__}")
    return int(v) if isinstance(v, (int, np.integer)) else float(v)


def _arrays(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: tensor_to_array(v) for k, v in tensors.items()})


def put_record(rd: RecordDict, rec: Record, prefix: str = "") -> RecordDict:
    """Store ``rec`` in ``rd`` under ``prefix``; returns ``rd``."""
    if NUM_EXAMPLES in rec.metrics:
        raise ValueError(f"a Record's metric may not be named {NUM_EXAMPLES!r} (Flower's sample count)")
    rd[prefix + "arrays"] = _arrays({k: v for k, v in rec.arrays.items() if not isinstance(v, dict)})
    for g, v in rec.arrays.items():
        if isinstance(v, dict):
            rd[prefix + "arrays" + GROUP + g] = _arrays(v)
    if rec.weights:
        rd[prefix + "weights"] = _arrays(rec.weights)
    metrics: dict[str, MetricRecordValues] = {k: _number(v) for k, v in rec.metrics.items()}
    if rec.num_samples is not None:
        metrics[NUM_EXAMPLES] = int(rec.num_samples)
    rd[prefix + "metrics"] = MetricRecord(metrics)
    rd[prefix + "config"] = ConfigRecord(dict(rec.config))
    return rd


def get_record(rd: RecordDict, prefix: str = "") -> Optional[Record]:
    """The Record stored under ``prefix``, or None when there is none."""
    if prefix + "arrays" not in rd:
        return None
    # the entries put_record wrote: ArrayRecords, numbers in the MetricRecord, settings in the ConfigRecord
    groups = {k[len(prefix + "arrays" + GROUP):]: {n: array_to_tensor(a) for n, a in cast(ArrayRecord, v).items()}
              for k, v in rd.items() if k.startswith(prefix + "arrays" + GROUP)}
    arrays = {k: array_to_tensor(a) for k, a in cast(ArrayRecord, rd[prefix + "arrays"]).items()}
    weights = {k: array_to_tensor(a) for k, a in cast(ArrayRecord, rd.get(prefix + "weights", ArrayRecord())).items()}
    metrics = dict(cast("Mapping[str, Scalar]", rd.get(prefix + "metrics", MetricRecord())))
    n = metrics.pop(NUM_EXAMPLES, None)
    return Record(arrays={**arrays, **groups}, metrics=metrics,
                  config=dict(cast("Mapping[str, Setting]", rd.get(prefix + "config", ConfigRecord()))),
                  weights=weights, num_samples=None if n is None else int(n))


def drop_record(rd: RecordDict, prefix: str = "") -> None:
    for key in [k for k in rd.keys() if k.startswith(prefix + "arrays" + GROUP)]:
        rd.pop(key, None)
    for part in ("arrays", "weights", "metrics", "config"):
        rd.pop(prefix + part, None)


def record_to_recorddict(rec: Record) -> RecordDict:
    return put_record(RecordDict(), rec)


def recorddict_to_record(rd: RecordDict) -> Record:
    rec = get_record(rd)
    if rec is None:
        raise KeyError("the RecordDict holds no protofl Record (no 'arrays' entry)")
    return rec


# ---------------------------------------------------------------------------------------
# the engine's ClientTask / ClientOutput as message contents
# ---------------------------------------------------------------------------------------
def task_to_content(task: ClientTask) -> RecordDict:
    """Server -> client: the method's message and the task's round/cid/flags."""
    rd = record_to_recorddict(task.msg)
    rd[TASK_KEY] = ConfigRecord({"round": int(task.rnd), "cid": int(task.cid),
                                 "evaluate": bool(task.evaluate), "full_test": bool(task.full_test)})
    return rd


def content_to_task(rd: RecordDict) -> ClientTask:
    """The ClientTask of a ``train`` message; its ``state`` is the node's business (None)."""
    t = cast("Mapping[str, int]", rd[TASK_KEY])  # task_to_content's ints and bools
    return ClientTask(cid=int(t["cid"]), rnd=int(t["round"]), shared=recorddict_to_record(rd), own=None, state=None,
                      evaluate=bool(t["evaluate"]), full_test=bool(t["full_test"]))


def output_to_content(out: ClientOutput) -> RecordDict:
    """Client -> server: the reply Record and the eval / train numbers."""
    rd = record_to_recorddict(out.reply)
    rd[EVAL_KEY] = MetricRecord({k: _number(v) for k, v in out.eval.items()})
    rd[TRAIN_KEY] = MetricRecord({k: _number(v) for k, v in out.train.items()})
    if out.rejected:
        rd[REJECTED_KEY] = ConfigRecord({"reason": out.rejected})
    return rd


def content_to_output(rd: RecordDict) -> ClientOutput:
    """The engine's ClientOutput; ``state`` is None (it stays in the node's Context)."""
    rejected = rd.get(REJECTED_KEY)
    return ClientOutput(reply=recorddict_to_record(rd), state=None,
                        eval=dict(cast("Mapping[str, float]", rd.get(EVAL_KEY, MetricRecord()))),
                        train=dict(cast("Mapping[str, float]", rd.get(TRAIN_KEY, MetricRecord()))),
                        rejected=None if rejected is None else str(rejected["reason"]))


# ---------------------------------------------------------------------------------------
# per-client persistent state in Context.state
# ---------------------------------------------------------------------------------------
def load_state(state: RecordDict) -> Optional[Record]:
    return get_record(state, STATE_PREFIX)


def save_state(state: RecordDict, rec: Optional[Record]) -> None:
    """Replace the client's state in ``Context.state`` (None removes it, as the engine's store does)."""
    drop_record(state, STATE_PREFIX)
    if rec is not None:
        put_record(state, rec, STATE_PREFIX)
