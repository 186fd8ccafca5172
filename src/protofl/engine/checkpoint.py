"""Atomic writes: a reader never sees a half-written checkpoint or result file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import CheckpointError, one_line


def _atomic(path: Path, write, before_replace: Optional[Callable[[], None]] = None) -> None:
    """Write ``path`` through a temporary file in the same folder, then rename it into place.

    A write that fails (a full disk, a kill) leaves ``path`` as it was and no temporary
    file behind; the OSError it raises names ``path``. ``before_replace`` runs once the
    new content is safely on disk, just before the rename (the checkpoint's rotation).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write() names no file
            e.filename = str(path)
        raise


def save_torch(path: Path, obj: Any) -> None:
    _atomic(path, lambda f: torch.save(obj, f))


def load_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


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
    for p in (path, prev):
        if not p.exists():
            continue
        try:
            obj = load_torch(p)
            if not isinstance(obj, dict) or "round" not in obj:
                raise ValueError("not a protofl checkpoint")
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
