"""Errors the user can fix, and failures of the machine a run cannot help.

Every error the user can fix derives from :class:`InputError`; its message names the
file, key or value at fault and what would be accepted; the CLI prints it as one line and
exits with code 2. A file that cannot be written in the middle of a run (a full disk, a
folder that went away) is a :class:`WriteError`: the CLI prints one line that also says
what was kept (the last checkpoint) and exits with code 4. Anything else that escapes is
a bug: the CLI says so in two lines, and ``--debug`` (or ``PROTOFL_DEBUG=1``) shows the
traceback.

Every class here survives pickling (a sweep's runs raise them in worker processes).
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional


class InputError(Exception):
    """Bad input (config, data file, checkpoint, output folder): one line, exit code 2."""


class ConfigError(InputError, ValueError):
    """A config value is invalid: names the dotted key, the value and what is accepted."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}: {allowed}")

    def __reduce__(self):  # rebuilt from its three parts, not from the message
        return (type(self), (self.key, self.value, self.allowed))


def require(cond: bool, key: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` for ``key=value`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(key, value, allowed)


# a size setting (a batch, a count of generated samples, a layer's width) is allocated at its
# value: one above every dataset's and model's would ask for memory no machine has (1e12
# samples: terabytes), so sizes are bounded where they are read
MAX_SIZE = 1 << 20


def require_size(obj: Any, section: str, *keys: str, lower: int = 1, limit: int = MAX_SIZE) -> None:
    """Each ``obj.<key>`` (None allowed: the setting's own default) is in [lower, limit]."""
    for key in keys:
        v = getattr(obj, key)
        require(v is None or lower <= v <= limit, f"{section}.{key}", v, f"must be in [{lower}, {limit:,}]")


class DataFileError(InputError, ValueError):
    """A dataset file exists but is damaged or is not the file it claims to be."""


class CheckpointError(InputError, ValueError):
    """No readable checkpoint to resume from."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint (or state file) holds something no protofl file holds: it is not loaded."""


class OutputDirError(InputError, OSError):
    """The run folder cannot be created or written."""


class WriteError(OSError):
    """A file of a run could not be written (disk full, permissions, a vanished folder).

    The message says which file, why, and what is kept: the run's last checkpoint, from
    which ``--resume`` continues once the cause is fixed.
    """


def one_line(text: object, limit: int = 400) -> str:
    """Collapse a message to one line (library messages such as zlib's or YAML's span several)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# -- a full disk ---------------------------------------------------------------------------
FULL_BELOW = 1 << 20  # bytes: a write that failed with less free than this failed for room


def disk_free(path: str | os.PathLike) -> Optional[int]:
    """The bytes an unprivileged writer may still use on the disk of ``path`` (of its
    nearest existing folder); None when that cannot be told."""
    p = Path(path)
    for folder in (p, *p.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def disk_full(path: str | os.PathLike) -> bool:
    """Whether the disk of ``path`` has (almost) no room left: checked when a write fails
    with an error that does not say so itself (torch's zip writer raises RuntimeError)."""
    free = disk_free(path)
    return free is not None and free < FULL_BELOW


def human_bytes(n: Optional[int]) -> str:
    """A byte count for people, in decimal units (1 MB = 10^6 bytes), as downloads show it."""
    if n is None:
        return "size unknown"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def os_error_text(e: OSError) -> str:
    """Why a read or write failed, in words; a full disk says so with its free space
    (checked for every failed write: a quota or a nearly full disk reports other errors)."""
    why = e.strerror or str(e)
    where = e.filename or "."
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)) or disk_full(where):
        free = disk_free(where)
        room = f", {human_bytes(free)} free" if free is not None else ""
        return f"{why} (the disk is full{room})"
    return why


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (``kill``, ``timeout``, systemd, SLURM, Kubernetes) end this
    process as Ctrl-C does: a ``KeyboardInterrupt`` unwinds the ``with`` blocks and
    ``finally`` clauses above, so a run keeps its last checkpoint, a sweep stops its worker
    processes and a local Flower deployment stops everything it started (a SIGTERM used to
    leave the SuperLink and every SuperNode running, holding their ports). Main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread only)
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
