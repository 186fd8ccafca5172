"""Atomic writes: a reader never sees a half-written checkpoint or result file; and
loads that never run code a file brings with it.

Checkpoints (and the client-state files beside them, and a Flower node's state files)
are read with ``torch.load(weights_only=True)``: only tensors, plain Python values and the
types :func:`checkpoint_types` allows are rebuilt. Those are derived, not listed: every
dataclass and named tuple that the module of a registered method (built-in, a plugin's,
or one defined in a notebook) defines or imports from its own package, the modules of its
base classes included, plus :class:`~protofl.messages.Record`, the client-state store's
file references and numpy arrays. A type a method keeps in its state that is neither
(an ``Enum``, a plain class) is added with :func:`allow_in_checkpoints`. Anything else
in a file, e.g. a pickle that would call ``os.system``, is refused before loading, with
one line that names it (:class:`~protofl.errors.UnsafeCheckpointError`).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Optional, overload, TypeVar

import torch

from ..errors import CheckpointError, disk_full, one_line, UnsafeCheckpointError


def _atomic(path: Path, write: Callable[[BinaryIO], object], before_replace: Optional[Callable[[], None]] = None,
            sync: bool = True) -> None:
    """Write ``path`` through a temporary file in the same folder, then rename it into place.

    A write that fails (a full disk, a kill) leaves ``path`` as it was and no temporary
    file behind; the OSError it raises names ``path``. A writer that fails another way
    on a full disk (``torch.save``'s zip writer raises ``RuntimeError("... unexpected
    pos ...")``) is turned into ``OSError(ENOSPC)`` naming ``path``: the free space is
    checked while the partial file still fills the disk. ``before_replace`` runs once the
    new content is safely on disk (``sync``: flushed to the device, not only to the page
    cache), just before the rename (the checkpoint's rotation).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException as e:
        full = not isinstance(e, OSError) and isinstance(e, Exception) and disk_full(path.parent)
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write() names no file
            e.filename = str(path)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise


def save_torch(path: Path, obj: Any, sync: bool = True) -> None:
    _atomic(path, lambda f: torch.save(obj, f), sync=sync)


# -- what a checkpoint may hold ------------------------------------------------------------
_ALLOWED: set[type] = set()  # added by allow_in_checkpoints
_T = TypeVar("_T", bound=type)


@overload
def allow_in_checkpoints(cls: _T, /) -> _T: ...


@overload
def allow_in_checkpoints(*types: type) -> Optional[type]: ...


def allow_in_checkpoints(*types: type) -> Optional[type]:
    """Allow ``types`` in checkpoints, beyond the dataclasses and named tuples found by
    :func:`checkpoint_types`; usable as a class decorator (``@allow_in_checkpoints``). The
    module that calls it must be imported before a checkpoint is loaded: a method's own
    module, or a plugin's, is (the registry imports it)."""
    _ALLOWED.update(types)
    return types[0] if len(types) == 1 else None


def _is_data_type(obj: Any) -> bool:
    """A dataclass or a named tuple: types whose rebuilding only sets fields."""
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or (issubclass(obj, tuple)
                                                                         and hasattr(obj, "_fields")))


def _numpy_globals() -> list[Any]:
    """What torch needs to rebuild numpy arrays and scalars (a method may keep numpy arrays
    in its state, e.g. FeSEM's cluster assignment): rebuilding them only copies bytes.
    Under both numpy 2's names and numpy 1's (``numpy.core``: a checkpoint written before
    an upgrade)."""
    import numpy as np

    mod = np._core if hasattr(np, "_core") else np.core
    dtypes = [getattr(np.dtypes, n) for n in dir(getattr(np, "dtypes", None)) if n.endswith("DType")]
    rebuild = [mod.multiarray._reconstruct, mod.multiarray.scalar]
    return [*rebuild, *((f, f"numpy.core.multiarray.{f.__name__}") for f in rebuild), np.ndarray, np.dtype, *dtypes]


def checkpoint_types() -> list[Any]:
    """Every type a protofl checkpoint may hold besides tensors and plain Python values.

    Derived from the registered methods (plugins loaded), so that a new method's state
    dataclass is allowed without a list to edit: for each method class, the modules of
    the classes in its MRO, and in each the dataclasses and named tuples it defines or
    imports from its own top-level package (so ``from .states import MyState`` counts and
    a third-party import does not). Plus :class:`~protofl.messages.Record`, numpy arrays
    and the types of :func:`allow_in_checkpoints` (the store's
    :class:`~protofl.engine.store.Spilled` among them).
    """
    from ..algorithms import ALGORITHMS
    from ..messages import Record

    found: set[Any] = {Record, *_ALLOWED}
    for name in ALGORITHMS.names():  # every method that loaded (a broken plugin is left out)
        for klass in getattr(ALGORITHMS.get(name), "__mro__", ()):
            module = sys.modules.get(getattr(klass, "__module__", ""))
            if module is None or klass is object:
                continue
            top = module.__name__.split(".")[0]
            found.update(v for v in vars(module).values()
                         if _is_data_type(v) and v.__module__.split(".")[0] == top)
    return [*found, *_numpy_globals()]


def load_torch(path: Path, types: Optional[Iterable[Any]] = None) -> Any:
    """``torch.load`` of a file this or another protofl wrote, on the CPU, rebuilding only
    tensors, plain values and ``types`` (default :func:`checkpoint_types`).

    A file that names anything else (a function that a pickle would call, a class of
    another package) is refused before anything in it is loaded:
    :class:`~protofl.errors.UnsafeCheckpointError` names the file and what it holds.
    ``weights_only=True`` refuses the same again while loading.
    """
    allowed = list(checkpoint_types() if types is None else types)
    with torch.serialization.safe_globals(allowed):
        try:
            foreign = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not a zip / damaged: torch.load below says why
            foreign = []
        if foreign:
            raise UnsafeCheckpointError(
                f"refusing to load {path}: it holds {', '.join(sorted(foreign)[:3])}"
                f"{' and more' if len(foreign) > 3 else ''}, which no protofl checkpoint holds "
                f"(loading it could run code); nothing in it was loaded")
        return torch.load(path, map_location="cpu", weights_only=True)


def previous_generation(path: Path) -> Path:
    """``checkpoint.pt`` -> ``checkpoint.prev.pt``: the generation before the latest."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_checkpoint(path: Path, obj: Any) -> None:
    """Write a new checkpoint generation and keep the one before it.

    The new generation is written to a temporary file first; only once it is complete
    on disk does the latest file move to ``<name>.prev.pt`` and the new one take its
    name. A write that fails (a full disk) therefore leaves both generations as they
    were, and a kill between the two renames leaves the previous generation, which
    :func:`load_checkpoint` falls back to.
    """
    path = Path(path)

    def rotate() -> None:
        if path.exists():
            os.replace(path, previous_generation(path))

    _atomic(path, lambda f: torch.save(obj, f), before_replace=rotate)


def load_checkpoint(path: Path, warn: Callable[[str], None] = print) -> Optional[Any]:
    """The latest readable checkpoint generation, or None when there is none at all.

    A damaged (or missing) latest file falls back to the previous generation with a
    warning; if no generation can be read, :class:`~protofl.errors.CheckpointError` says
    which file is damaged and that the run can restart without ``--resume``.
    """
    path = Path(path)
    prev = previous_generation(path)
    damaged: list[str] = []
    types = checkpoint_types()
    for p in (path, prev):
        if not p.exists():
            continue
        try:
            obj = load_torch(p, types)
            if not isinstance(obj, dict) or "round" not in obj:
                raise ValueError("not a protofl checkpoint")
        except UnsafeCheckpointError as e:  # not damaged but foreign: trust no generation of it
            raise UnsafeCheckpointError(f"cannot resume: {e}; start the run again without --resume "
                                        "in a folder of your own") from None
        except Exception as e:  # truncated zip, bad pickle, wrong file: try the older one
            damaged.append(f"{p} ({one_line(e, 120)})")
            continue
        if damaged:
            warn(f"protofl: warning: checkpoint {damaged[0]} is damaged; resuming from the previous "
                 f"generation {p.name} (round {obj['round']})")
        return obj
    if damaged:
        raise CheckpointError(f"cannot resume: checkpoint {'; '.join(damaged)} cannot be read and no earlier "
                              f"generation is readable; start the run again without --resume")
    return None


def save_json(path: Path, obj: Any) -> None:
    _atomic(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=False, default=_jsonable).encode()))


def save_text(path: Path, text: str) -> None:
    _atomic(path, lambda f: f.write(text.encode()))


def _jsonable(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
