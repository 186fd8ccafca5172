"""Configs as files: YAML plus dotted ``key=value`` overrides, the command line's
shortcuts, the example configs shipped in the package, the defaults as YAML.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import yaml

from ..errors import ConfigError
from ..packaged_configs import resolve_config_path
from .coerce import load_yaml, YAMLAliasError
from .schema import apply_overrides, check_here, Config, from_dict, parse_override, switch_components


def yaml_problem(e: "yaml.YAMLError") -> str:
    """YAML's multi-line message as one line: 'line L, column C: problem'."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    return where + " ".join(str(problem).split())


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """YAML file (or the bare name of a packaged config, e.g. ``"digits"``) + dotted overrides."""
    raw: dict = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            raw = load_yaml(path.read_text(encoding="utf-8")) or {}
        except YAMLAliasError as e:
            raise ConfigError("CONFIG", str(path), f"refused: {yaml_problem(e)}") from None
        except yaml.YAMLError as e:
            raise ConfigError("CONFIG", str(path), f"not valid YAML: {yaml_problem(e)}") from None
        except UnicodeDecodeError:
            raise ConfigError("CONFIG", str(path), "not a text file (a YAML config was expected)") from None
        except OSError as e:  # a folder, a file without read permission
            raise ConfigError("CONFIG", str(path), f"cannot be read: {e.strerror or e}") from None
    ov = dict(parse_override(o) for o in (overrides or []))
    if not isinstance(raw, dict):
        raise ConfigError("CONFIG", str(path), "expected a mapping at the top level")
    cfg = from_dict(apply_overrides(switch_components(raw, ov), ov))
    check_here(cfg)
    return cfg


def config_from_args(args: Any) -> Config:
    """The config of a command line: ``args.config`` + ``args.overrides``, plus the
    shortcut flags ``--data-dir``, ``--quiet`` and ``--workers`` where the command has them
    (shared by ``protofl`` and ``protofl flower``)."""
    overrides = list(getattr(args, "overrides", None) or [])
    if getattr(args, "data_dir", None):
        overrides.append(f"data.root={args.data_dir}")
    if getattr(args, "quiet", False):
        overrides.append("output.progress=false")
    if getattr(args, "workers", None) is not None:
        overrides.append(f"execution.workers={args.workers}")
    return load_config(args.config, overrides)


def defaults_yaml(width: int = 92) -> str:
    """The resolved default config (every component's parameters included) as YAML.

    One line per section (flow style, wrapped at ``width``), values aligned, so that it
    reads as a table, e.g. in the README; every key of every section, the data's
    augmentation and checks included; ``yaml.safe_load`` gives back ``to_dict(complete=True)``.
    """
    d = load_config().to_dict(complete=True)

    def flow(v: Any) -> str:
        return yaml.safe_dump(v, default_flow_style=True, width=math.inf).strip().removesuffix("\n...")

    pad = max(len(k) for k in d) + 2
    lines = []
    for key, value in d.items():
        head = f"{key}:".ljust(pad)
        if not isinstance(value, dict):
            lines.append(head + flow(value))
            continue
        items = [f"{k}: {flow(v)}" for k, v in value.items()]
        line = head + "{"
        for i, item in enumerate(items):
            piece = item + ("}" if i == len(items) - 1 else ",")
            if len(line) + 1 + len(piece) > width and not line.endswith("{"):
                lines.append(line)
                line = " " * (pad + 1) + piece
            else:
                line += ("" if line.endswith("{") else " ") + piece
        lines.append(line)
    return "\n".join(lines) + "\n"
