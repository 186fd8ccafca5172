"""The server's check of every client reply before it can reach the aggregate.

In a deployment a client is another organization's machine: a reply may be broken
(a diverged client's NaN weights) or hostile (wrong shapes, inflated sample counts,
extra or huge arrays). :func:`check_reply` returns the reason to reject a reply, or
None; the engine then treats the reply as lost for that round (the ``rejected`` count
and ``rejected_reasons`` of the metrics row), so it never enters the aggregate and the
client's persistent state does not advance.

Checks, in order (the first failure is the reason):

1. every tensor (weights, arrays, groups) has a numeric dtype; floating ones hold only
   finite values; integer ones (class counts, sample counts) are >= 0;
2. every metric is a finite number; the sample count ``num_samples`` (Flower's
   ``num-examples``), when present, is a whole number in [0, the client's training-set size];
3. model weights (``Record.weights``) only for weights that were sent: the names are a
   subset of those sent, each with the shape and dtype it was sent with, and each update
   (reply - sent) with a finite L2 norm in float32 (values near 3e38 pass step 1 and would
   overflow the average);
4. the names of the arrays and groups match the method's
   :attr:`~protofl.algorithms.base.Algorithm.reply_arrays` patterns, when the method
   declares them (no extra keys);
5. the reply's size is at most ``4 x (model size) + 2 x (message sent) + 1 MiB`` (the
   largest honest reply, SCAFFOLD's weights and control variates, is 2 x the model);
6. the method's own :meth:`~protofl.algorithms.base.Algorithm.check_reply` (e.g. class
   indices within range, prototype dimensions).

Across the round (:func:`update_outliers`, after the checks above): with at least
``MIN_PEERS`` replies carrying a model update, a reply whose update's L2 norm (over all its
floating weights, reply - sent; or the group in which a method replies its update itself,
``Algorithm.update_group``: SCAFFOLD's Delta y_i, FedNova's d_i) is more than ``training.update_ratio_limit`` (default 1000)
times the median of the round's update norms (the lower middle one for an even count) is
rejected the same way. One hostile client
among three or more honest ones cannot move the median far, so it cannot hide a scaled-up
update behind its own number; honest clients' norms differ by their data and steps, by far
less than 1000x (benchmarks/update_norms.md measures every method). Not applied under
privacy (the clip bounds every update there, and a rejection would itself be a release)
nor to methods with per-client architectures (their norms are not comparable).

What a client says of itself beside its reply (:func:`check_report`) is checked too, and a
report that fails rejects the reply the same way (it never reaches a metrics row):

* its personalized models' evaluation: only ``acc``, ``pm_v``, ``pm_l``, ``pa`` (with an
  ``@name`` suffix for extra predictors) and ``pa:<its own feature group>``, each an
  accuracy in [0, 1] (``pm_v`` and ``pm_l`` may be NaN: undefined for a client without a
  class of its own);
* its training numbers: ``loss`` finite; ``seconds`` finite and >= 0; ``steps``,
  ``samples`` and the privacy spend ``dp_steps<i>``, ``dp_releases``, ``dp_labels`` whole
  numbers >= 0; the sampling rates ``dp_q<i>`` in (0, 1]; nothing else.
"""
from __future__ import annotations

import fnmatch
import math
import re
from typing import Any, Optional, Sequence

import torch

from ..messages import Record, expect_indices, expect_shapes  # noqa: F401 (re-exported)

SLACK_BYTES = 1 << 20


EVAL_NAME = re.compile(r"(acc|pm_v|pm_l|pa)(@[\w.-]+)?")
COUNTS = re.compile(r"steps|samples|dp_steps\d+|dp_releases|dp_labels")
RATE = re.compile(r"dp_q\d+")


def _real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_report(evaluation: Optional[dict[Any, Any]], training: Optional[dict[Any, Any]],
                 group: Optional[str] = None) -> Optional[str]:
    """The reason to reject what a client reports of itself (see above), or None.
    ``group``: the client's feature group, whose local accuracy it reports as ``pa:<group>``."""
    for name, v in (evaluation or {}).items():
        if not isinstance(name, str) or not (EVAL_NAME.fullmatch(name) or (group is not None and name == f"pa:{group}")):
            return f"evaluation {name!r} is not one the server asked for"
        # NaN only where it means undefined (pm_v, pm_l of a client without a class of its own);
        # acc and pa are over test sets that are never empty
        if not _real(v) or not (0.0 <= v <= 1.0 or (math.isnan(v) and name.startswith(("pm_v", "pm_l")))):
            return f"evaluation {name!r} is not an accuracy in [0, 1] ({v!r})"
    for name, v in (training or {}).items():
        if not isinstance(name, str):
            return f"training number {name!r} is not named by a string"
        if not _real(v) or not math.isfinite(v):
            return f"training number {name!r} is not a finite number ({v!r})"
        if COUNTS.fullmatch(name):
            if v < 0 or float(v) != int(v):
                return f"training number {name!r} is not a whole count ({v!r})"
        elif name == "seconds":
            if v < 0:
                return f"training number 'seconds' is negative ({v!r})"
        elif RATE.fullmatch(name):
            if not 0.0 < v <= 1.0:
                return f"training number {name!r} is not a sampling rate in (0, 1] ({v!r})"
        elif name != "loss":
            return f"training number {name!r} is not one the server knows"
    return None


MIN_PEERS = 3


def update_norm(reply: Record, sent: Record, group: Optional[str] = None) -> Optional[float]:
    """The L2 norm of a reply's model update, in float64: reply - sent over all floating
    weights, or, for a method that replies its update itself, the floating arrays of its
    ``group`` (``Algorithm.update_group``); None when the reply carries neither. One tensor
    at a time, summed where the reply lives (one wait for a GPU)."""
    if group is not None and isinstance(reply.arrays.get(group), dict):
        parts = (t.detach().double() for t in reply.arrays[group].values()
                 if torch.is_tensor(t) and t.is_floating_point() and t.numel())
    else:
        parts = (t.detach().double() - sent.weights[name].detach().to(t.device).double()
                 for name, t in reply.weights.items()
                 if name in sent.weights and t.is_floating_point() and t.numel())
    total = None
    for d in parts:
        sq = torch.dot(d.flatten(), d.flatten())
        total = sq if total is None else total + sq
    return None if total is None else math.sqrt(float(total))


def update_outliers(pairs: Sequence[tuple[int, Record, Record]], limit: float,
                    group: Optional[str] = None) -> dict[int, str]:
    """``{cid: reason}`` for the replies whose update norm exceeds ``limit`` x the round's median.

    ``pairs``: (client id, reply, message sent) of the round's replies that passed
    :func:`check_reply`; ``limit`` <= 0 turns the rule off; ``group``: see :func:`update_norm`.
    """
    norms = {cid: n for cid, reply, sent in pairs if (n := update_norm(reply, sent, group)) is not None}
    if limit <= 0 or len(norms) < MIN_PEERS:
        return {}
    median = float(torch.tensor(sorted(norms.values()), dtype=torch.float64).median())
    if median <= 0:  # most clients did not move the weights: no scale to judge by
        return {}
    return {cid: f"update norm {n:.4g} is more than {limit:g} x the round's median update norm ({median:.4g})"
            for cid, n in norms.items() if n > limit * median}


def reply_size_bound(model_bytes: int, sent: Record) -> int:
    return 4 * model_bytes + 2 * sent.nbytes() + SLACK_BYTES


def check_reply(reply: object, sent: Record, *, client_size: int, model_bytes: int,
                patterns: Optional[Sequence[str]] = None) -> Optional[str]:
    """The reason to reject ``reply`` (a client's answer to ``sent``), or None if it is acceptable."""
    if not isinstance(reply, Record):
        return f"not a Record ({type(reply).__name__})"
    for name, t in reply.tensors():
        if t.is_complex() or t.dtype == torch.bool:
            return f"array {name!r} has dtype {t.dtype}, not a real number type"
        if t.is_floating_point():
            if t.numel() and not bool(torch.isfinite(t).all()):
                return f"array {name!r} has non-finite values"
        elif t.numel() and int(t.min()) < 0:
            return f"array {name!r} has negative counts (min {int(t.min())})"
    for name, v in reply.metrics.items():
        if not math.isfinite(v):
            return f"metric {name!r} is not finite ({v})"
    n = reply.num_samples
    if n is not None and not 0 <= n <= client_size:
        return f"num_samples={n} is not a count in [0, {client_size}] (the client's training-set size)"
    for name, t in reply.weights.items():
        ref = sent.weights.get(name)
        if ref is None:
            return f"weight {name!r} is not one of the model weights sent to the client"
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
            return (f"weight {name!r} has shape {tuple(t.shape)} {t.dtype}, it was sent as "
                    f"{tuple(ref.shape)} {ref.dtype}")
        if t.is_floating_point() and t.numel():
            # finite values near float32's limit (3e38) would overflow the average into inf and
            # the next round would diverge on honest clients: the update's norm must be finite
            d = t.detach().float() - ref.detach().to(t.device).float()
            if not math.isfinite(float(torch.linalg.vector_norm(d))):
                return f"weight {name!r} moved by more than float32 can measure (values near {float(d.abs().max()):.3g})"
    if patterns is not None:
        extra = [k for k in reply.arrays if not any(fnmatch.fnmatchcase(k, p) for p in patterns)]
        if extra:
            return f"unexpected array(s) {', '.join(map(repr, extra[:3]))}; this method replies {list(patterns)}"
    size, bound = reply.nbytes(), reply_size_bound(model_bytes, sent)
    if size > bound:
        return f"reply of {size} bytes exceeds the bound of {bound} bytes"
    return None
