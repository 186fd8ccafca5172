"""The example configs shipped inside the package (``src/protofl/configs/*.yaml``).

Below everything else (it reads file names and comment lines only), so that
``protofl configs`` answers without importing torch or the library.
"""
from __future__ import annotations

from pathlib import Path

from .errors import ConfigError

PACKAGED_CONFIGS = Path(__file__).resolve().parent / "configs"


def packaged_configs() -> dict[str, Path]:
    """Name (file stem) -> path of every example config shipped with the package."""
    return {p.stem: p for p in sorted(PACKAGED_CONFIGS.glob("*.yaml"))}


def config_description(path: Path) -> str:
    """A config file's first comment line (its one-line summary), '' if it has none."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def packaged_config(name: str) -> Path:
    """The packaged config called ``name`` (``digits`` or ``digits.yaml``)."""
    configs = packaged_configs()
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem not in configs:
        raise ConfigError("CONFIG", name, "no packaged config of that name; packaged: "
                          + ", ".join(configs))
    return configs[stem]


def resolve_config_path(path: str | Path) -> Path:
    """An existing file wins (a pipe too: ``<(...)``, a FIFO); otherwise a bare name (no
    folder) names a packaged config."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return p
    if p.is_dir():
        raise ConfigError("CONFIG", str(path), "is a folder, not a config file")
    if len(p.parts) == 1 and p.suffix in ("", ".yaml"):
        try:
            return packaged_config(p.name)
        except ConfigError:
            pass
    raise ConfigError("CONFIG", str(path), "file not found, and not the name of a packaged config "
                      "(`protofl configs` lists them)")
