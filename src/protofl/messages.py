"""Transport-agnostic message container.

Everything that crosses the client/server boundary, and every piece of per-client
persistent state, is a :class:`Record`. Its parts map 1:1 onto a Flower ``RecordDict``
(``protofl/flower/records.py``):

* ``weights`` -> an ``ArrayRecord``   model weights, by state-dict key
* ``arrays``  -> ``ArrayRecord`` s    named tensors; a value that is a dict of tensors is a
  named group (SCAFFOLD's control variate ``arrays["c"]``), its own ArrayRecord
* ``metrics`` -> ``MetricRecord``     numbers (losses, accuracies)
* ``config``  -> ``ConfigRecord``     settings (flags, strings)
* ``num_samples``                     a reply's n_k, the client's training-set size: the
  engine attaches it (Flower's ``num-examples``); None on messages and states

Neither side ever sees the other's Python objects: a client gets a Record, returns a
Record; the server likewise. That is what lets the in-process engine, the process-pool
executor and Flower carry the same algorithm code unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import torch

Scalar = Union[int, float]
Setting = Union[str, int, float, bool]
Arrays = dict[str, Union[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class Record:
    arrays: Arrays = field(default_factory=dict)
    metrics: dict[str, Scalar] = field(default_factory=dict)
    config: dict[str, Setting] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    num_samples: Optional[int] = None

    def __post_init__(self) -> None:
        for k, v in self.weights.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"Record.weights[{k!r}] must be a torch.Tensor, got {type(v).__name__}")
        for k, a in self.arrays.items():
            group = a if isinstance(a, dict) else {"": a}
            for name, t in group.items():
                if not isinstance(t, torch.Tensor):
                    where = f"[{k!r}]" + (f"[{name!r}]" if name else "")
                    raise TypeError(f"Record.arrays{where} must be a torch.Tensor or a dict of them, "
                                    f"got {type(t).__name__}")
        for k, m in self.metrics.items():
            if isinstance(m, bool) or not isinstance(m, (int, float)):
                raise TypeError(f"Record.metrics[{k!r}] must be int or float, got {type(m).__name__}")
        for k, c in self.config.items():
            if not isinstance(c, (str, int, float, bool)):
                raise TypeError(f"Record.config[{k!r}] must be str/int/float/bool, got {type(c).__name__}")
        if self.num_samples is not None and (isinstance(self.num_samples, bool)
                                             or not isinstance(self.num_samples, int)):
            raise TypeError(f"Record.num_samples must be an int, got {type(self.num_samples).__name__}")

    # -- helpers -----------------------------------------------------------------------
    def array(self, name: str) -> torch.Tensor:
        """The array ``name``, a tensor (KeyError when absent, TypeError when it is a group).
        A method reads what its ``check_reply`` asked for (``expect_arrays``) this way."""
        a = self.arrays[name]
        if isinstance(a, dict):
            raise TypeError(f"Record.arrays[{name!r}] is a group, not one tensor")
        return a

    def group(self, name: str) -> dict[str, torch.Tensor]:
        """The group ``name``, a dict of tensors (KeyError when absent, TypeError when it is
        one tensor)."""
        g = self.arrays[name]
        if not isinstance(g, dict):
            raise TypeError(f"Record.arrays[{name!r}] is one tensor, not a group")
        return g

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, named by where it is: ``weights/<key>``, ``<name>``, ``<group>/<key>``."""
        for k, t in self.weights.items():
            yield f"weights/{k}", t
        for k, v in self.arrays.items():
            if isinstance(v, dict):
                for name, t in v.items():
                    yield f"{k}/{name}", t
            else:
                yield k, v

    def map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> "Record":
        """A record of the same shape with every tensor replaced by ``fn(name, tensor)``
        (names as :meth:`tensors` gives them); numbers and settings are copied."""
        arrays = {k: ({n: fn(f"{k}/{n}", t) for n, t in v.items()} if isinstance(v, dict) else fn(k, v))
                  for k, v in self.arrays.items()}
        return Record(arrays, dict(self.metrics), dict(self.config),
                      {k: fn(f"weights/{k}", t) for k, t in self.weights.items()}, self.num_samples)

    def to(self, device: Union[str, torch.device]) -> "Record":
        """The same record with its tensors on ``device`` (this record itself when they are
        all there already)."""
        device = torch.device(device)
        if all(t.device == device for _, t in self.tensors()):
            return self
        return self.map(lambda _, t: t.to(device))

    def merged(self, own: Optional["Record"]) -> "Record":
        """This record (a round's broadcast) with ``own`` (what one client alone receives)
        added; a name in both is an error (a method's two halves disagree)."""
        if own is None:
            return self
        for part in ("weights", "arrays", "metrics", "config"):
            both = getattr(self, part).keys() & getattr(own, part).keys()
            if both:
                raise ValueError(f"configure and configure_client both send {part} {sorted(both)}")
        return Record({**self.arrays, **own.arrays}, {**self.metrics, **own.metrics},
                      {**self.config, **own.config}, {**self.weights, **own.weights}, self.num_samples)

    def nbytes(self) -> int:
        """Payload size: tensor bytes plus 8 bytes per number and the UTF-8 size of settings."""
        size = sum(t.numel() * t.element_size() for _, t in self.tensors())
        size += 8 * (len(self.metrics) + (self.num_samples is not None))
        size += sum(len(str(v).encode()) for v in self.config.values())
        return size


# -- schema checks a method's ``check_reply`` uses ------------------------------------------
def expect_arrays(reply: Record, *names: str) -> Optional[str]:
    """For a method's ``check_reply``: each named array is present, as a tensor (the other
    checks here skip an absent array, so a method whose aggregate reads it asks for it)."""
    if all(isinstance(reply.arrays.get(n), torch.Tensor) for n in names):
        return None
    quoted = [repr(n) for n in names]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
    return f"the reply must carry the array{'s' if len(names) > 1 else ''} {listed}"


def expect_shapes(reply: Record, **shapes: tuple[int, ...]) -> Optional[str]:
    """For a method's ``check_reply``: each named array, when present, has this shape
    (``-1`` matches any size along that dimension)."""
    for name, shape in shapes.items():
        t = reply.arrays.get(name)
        if t is None or isinstance(t, dict):
            continue
        if t.dim() != len(shape) or any(s not in (-1, n) for s, n in zip(shape, t.shape)):
            return f"array {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
    return None


def expect_indices(reply: Record, name: str, bound: int, unique: bool = False) -> Optional[str]:
    """For a method's ``check_reply``: integer array ``name``, when present, indexes [0, bound)
    (and, with ``unique``, names each index at most once)."""
    t = reply.arrays.get(name)
    if t is None or isinstance(t, dict) or t.numel() == 0:
        return None
    if t.is_floating_point() or int(t.max()) >= bound or int(t.min()) < 0:
        return f"array {name!r} holds values outside the class indices 0..{bound - 1}"
    if unique and len(torch.unique(t)) != t.numel():
        return f"array {name!r} names a class more than once"
    return None
