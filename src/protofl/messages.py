"""Transport-agnostic message container.

Everything that crosses the client/server boundary, and every piece of per-client
persistent state, is a :class:`Record`: three flat dictionaries that map 1:1 onto a
Flower ``RecordDict``:

* ``arrays``  -> ``ArrayRecord``   named tensors (model weights, prototypes, counts)
* ``metrics`` -> ``MetricRecord``  numbers (sample counts, losses, accuracies)
* ``config``  -> ``ConfigRecord``  settings (flags, strings)

Neither side ever sees the other's Python objects: a client gets a Record, returns a
Record; the server likewise. That is what lets the in-process engine, the process-pool
executor and Flower carry the same algorithm code unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch

# the prefix of model weights in messages and replies: ``w.<state-dict key>`` (the engine
# checks them against what was sent, logs the weight diversity of the replies' models, ...)
WEIGHTS = "w."
WEIGHTS_PATTERN = WEIGHTS + "*"  # the glob of a reply's weights (``Algorithm.reply_arrays``)

Scalar = Union[int, float]
Setting = Union[str, int, float, bool]


@dataclass
class Record:
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, Scalar] = field(default_factory=dict)
    config: dict[str, Setting] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k, v in self.arrays.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"Record.arrays[{k!r}] must be a torch.Tensor, got {type(v).__name__}")
        for k, v in self.metrics.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"Record.metrics[{k!r}] must be int or float, got {type(v).__name__}")
        for k, v in self.config.items():
            if not isinstance(v, (str, int, float, bool)):
                raise TypeError(f"Record.config[{k!r}] must be str/int/float/bool, got {type(v).__name__}")

    # -- helpers -----------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The model weights the record carries (its ``w.*`` arrays, prefix stripped)."""
        return self.subarrays(WEIGHTS)

    def subarrays(self, prefix: str) -> dict[str, torch.Tensor]:
        """The arrays whose key starts with ``prefix`` (prefix stripped)."""
        n = len(prefix)
        return {k[n:]: v for k, v in self.arrays.items() if k.startswith(prefix)}

    def to(self, device: Union[str, torch.device]) -> "Record":
        """The same record with its arrays on ``device`` (this record itself when they are
        all there already): the engine moves messages and client state to the training
        device and replies back to the CPU."""
        device = torch.device(device)
        if all(v.device == device for v in self.arrays.values()):
            return self
        return Record({k: v.to(device) for k, v in self.arrays.items()}, dict(self.metrics), dict(self.config))

    def nbytes(self) -> int:
        """Payload size: tensor bytes plus 8 bytes per number and the UTF-8 size of settings."""
        size = sum(t.numel() * t.element_size() for t in self.arrays.values())
        size += 8 * len(self.metrics)
        size += sum(len(str(v).encode()) for v in self.config.values())
        return size


def prefixed(prefix: str, arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in arrays.items()}


def weight_arrays(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model weights as message arrays (``w.<key>``): the inverse of :meth:`Record.weights`."""
    return prefixed(WEIGHTS, weights)


# -- schema checks a method's ``check_reply`` uses ------------------------------------------
def expect_shapes(reply: Record, **shapes: tuple) -> Optional[str]:
    """For a method's ``check_reply``: each named array, when present, has this shape
    (``-1`` matches any size along that dimension)."""
    for name, shape in shapes.items():
        t = reply.arrays.get(name)
        if t is None:
            continue
        if t.dim() != len(shape) or any(s not in (-1, n) for s, n in zip(shape, t.shape)):
            return f"array {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
    return None


def expect_indices(reply: Record, name: str, bound: int) -> Optional[str]:
    """For a method's ``check_reply``: integer array ``name``, when present, indexes [0, bound)."""
    t = reply.arrays.get(name)
    if t is None or t.numel() == 0:
        return None
    if t.is_floating_point() or int(t.max()) >= bound:
        return f"array {name!r} holds values outside the class indices 0..{bound - 1}"
    return None
