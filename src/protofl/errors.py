"""Errors the user can fix: the CLI prints one line for each and exits with code 2.

Every such error derives from :class:`InputError`; its message names the file, key or
value at fault and what would be accepted. Anything else that escapes is a bug.
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


def one_line(text: str, limit: int = 400) -> str:
    """Collapse a message to one line (library messages such as zlib's or YAML's span several)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
