"""Pretrained weights from a local file: ``model.pretrained: <path>``.

The file is a state dict saved with ``torch.save`` and read with ``torch.load(...,
weights_only=True)`` (tensors only, no code runs). Three forms load:

* the whole model's, ``torch.save(model.state_dict(), path)``: keys ``body.*`` and
  ``head.*`` (the head may be left out: then only the body loads);
* the body's, ``torch.save(model.body.state_dict(), path)``: MP-FedCL's pretrained encoder;
* for a model split out of another network (``torchvision:<name>``), that network's own
  state dict: its head's keys (``fc.*``, ``classifier.6.*``, ...) load into the head.

Every key and shape is checked before anything is copied: a file that does not fit stops
the run in one line (exit 2) that names the first key at fault and both shapes, and the
model is left as it was built.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from ..errors import ConfigError, one_line
from .base import FLModel

KEY = "model.pretrained"
HOW = "save model.state_dict() or model.body.state_dict() with torch.save"


def read_state_dict(path: str | os.PathLike, key: str = KEY) -> dict[str, torch.Tensor]:
    """The tensors of the file at ``path``; a :class:`ConfigError` on ``key`` when there is no
    such file or it is not a state dict."""
    file = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(file):
        raise ConfigError(key, os.fspath(path), "is a folder, not a file of weights" if os.path.isdir(file)
                          else "no such file")
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file, another format, or pickled code
        why = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch's message has terminal bold in it
        found = re.search(r"Unsupported global: GLOBAL (\S+)", why)
        if found:  # a whole pickled object (a model, an optimizer) rather than its tensors
            raise ConfigError(key, os.fspath(path), f"holds a pickled {found.group(1)}, not only tensors (torch.load "
                              f"with weights_only=True runs no code); {HOW}") from None
        raise ConfigError(key, os.fspath(path), f"cannot be read as weights (torch.load with weights_only=True: "
                          f"{type(e).__name__}: {one_line(why, 200)})") from None
    if not isinstance(obj, Mapping) or not obj or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        what = f"a {type(obj).__name__}" if not isinstance(obj, Mapping) else (
            "an empty mapping" if not obj else f"a mapping with keys {', '.join(map(str, list(obj)[:5]))}")
        raise ConfigError(key, os.fspath(path), f"expected a state dict (parameter names -> tensors), got {what}; {HOW}")
    return dict(obj)


def model_keys(state: Mapping[str, torch.Tensor], model: FLModel) -> dict[str, str]:
    """model key -> file key: the file's keys as the model names them (the forms above)."""
    if any(k.startswith(("body.", "head.")) for k in state):
        return {k: k for k in state}
    head = f"{model.source_head}." if model.source_head else None
    return {(f"head.{k[len(head):]}" if head and k.startswith(head) else f"body.{k}"): k for k in state}


def load_pretrained(model: FLModel, path: str | os.PathLike, key: str = KEY) -> FLModel:
    """Load the weights of the file at ``path`` into ``model`` (in place; returned)."""
    state = read_state_dict(path, key)
    where = os.fspath(path)
    names = model_keys(state, model)
    target = model.state_dict()
    for mk, fk in names.items():
        if mk not in target:
            raise ConfigError(key, where, f"holds {fk!r}, which the model has no place for (its keys start "
                              f"{', '.join(list(target)[:3])}, ...); {HOW} of the same architecture")
    head = [k for k in target if k.startswith("head.")]
    given_head = [k for k in head if k in names]
    needed = [k for k in target if k.startswith("body.")] + (head if given_head else [])
    for mk in needed:
        if mk not in names:
            raise ConfigError(key, where, f"has no tensor for {mk!r} ({len(state)} tensors in the file); "
                              f"{HOW} of the same architecture")
    for mk in needed:  # in the model's order: the first mismatch named
        got, want = tuple(state[names[mk]].shape), tuple(target[mk].shape)
        if got != want:
            hint = (" (to load only the body into a model with another head, save model.body.state_dict())"
                    if mk.startswith("head.") else "")
            raise ConfigError(key, where, f"{names[mk]!r} has shape {got} in the file but {want} in the model{hint}")
    model.load_state_dict({mk: state[names[mk]] for mk in needed}, strict=False)  # all checked above
    return model
