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

from typing import Any


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


class DataFileError(InputError, ValueError):
    """A dataset file exists but is damaged or is not the file it claims to be."""


class CheckpointError(InputError, ValueError):
    """No readable checkpoint to resume from."""


class OutputDirError(InputError, OSError):
    """The run folder cannot be created or written."""


class WriteError(OSError):
    """A file of a run could not be written (disk full, permissions, a vanished folder).

    The message says which file, why, and what is kept: the run's last checkpoint, from
    which ``--resume`` continues once the cause is fixed.
    """


def one_line(text: str, limit: int = 400) -> str:
    """Collapse a message to one line (library messages such as zlib's or YAML's span several)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
