"""Type checking of YAML values against annotations and signatures.

YAML gives strings, numbers, lists and mappings; a config field or a component's
parameter has an annotation. :func:`coerce` turns the one into the other or raises a
:class:`~protofl.errors.ConfigError` naming the key, the value and the expected type.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from typing import Any, Literal, Optional, Union

import yaml

from ..errors import ConfigError

# -- YAML text -----------------------------------------------------------------------------
ALIAS_BUDGET = 100_000  # values aliases may add to a document: a real config adds a handful


class YAMLAliasError(yaml.constructor.ConstructorError):
    """A YAML document whose aliases (``*name``) expand to more than :data:`ALIAS_BUDGET`
    values (an "alias bomb": nine nested levels of nine aliases each are 387 million
    values from ten lines), or that contains itself."""


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing a document whose aliases expand too far.

    PyYAML builds an aliased value once and shares it, so loading is fast; everything
    after it that walks the value (validation, ``repr`` in an error message, a JSON
    fingerprint) walks every copy. The document's node graph is measured first, in time
    linear in its text: each repeated use of a node adds the node's whole expanded size.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, [0], set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int], extra: list[int], open_: set[int]) -> int:
    """The number of values ``node`` stands for once every alias is written out."""
    key = id(node)
    if key in open_:
        raise YAMLAliasError(None, None, "an alias refers to a value that contains it (a recursive "
                             "structure); write the values out", node.start_mark)
    if key in sizes:  # a repeated use: every value of it again
        extra[0] += sizes[key]
        if extra[0] > ALIAS_BUDGET:
            raise YAMLAliasError(None, None, f"its aliases expand the document by more than {ALIAS_BUDGET:,} "
                                 "values (an alias bomb?); write the values out", node.start_mark)
        return sizes[key]
    open_.add(key)
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(n, sizes, extra, open_) for n in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, sizes, extra, open_) + _expanded_size(v, sizes, extra, open_)
                       for k, v in node.value)
    else:
        size = 1
    open_.discard(key)
    sizes[key] = size
    return size


# -- names that become paths ------------------------------------------------------------------
def path_component_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be one folder or file name inside another folder, or None.

    A run name, a label that names a run folder, a setting's id: each must stay inside
    the folder it is joined to, so it may not be empty, ``.`` or ``..``, nor hold a path
    separator (``/``, or ``\\`` as on Windows), a control character, or more than 255
    bytes (the longest name file systems take).
    """
    if not isinstance(name, str) or not name.strip():
        return "a name is needed (one folder name)"
    if name in (".", ".."):
        return "must be a folder name, not . or .."
    bad = sorted({c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        return f"must be one folder name inside the output folder: no {shown} (no path separators or control characters)"
    if len(name.encode("utf-8")) > 255:
        return "must be at most 255 bytes long (one folder name)"
    return None


def check_path_component(key: str, name: Any) -> None:
    """A :class:`~protofl.errors.ConfigError` for ``key=name`` unless :func:`path_component_problem` is None."""
    why = path_component_problem(name)
    if why is not None:
        raise ConfigError(key, name, why)


# the settings where .inf has a meaning (no clipping, stated in config/sections.py); every
# other number must be finite (NaN never is)
INFINITE_ALLOWED = frozenset({"privacy.clip", "privacy.feature_clip"})
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = typing.get_args(tp)
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; int -> float widening and list -> tuple allowed."""
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for a in args:
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        finite = next((e for e in errors if e.allowed == "must be a finite number"), None)
        if finite is not None:  # a number, but not a finite one: say that, not "expected float or null"
            raise finite
        raise ConfigError(key, value, f"expected {_type_name(tp)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(key, value, f"expected {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, value, "expected null")
    if origin in (list, tuple, typing.Sequence, __import__("collections.abc").abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, f"expected a list ({_type_name(tp)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(key, value, f"expected {len(args)} items ({_type_name(tp)})")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        out = [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "expected a mapping")
        if args:
            return {k: coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, value, "expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and _NUMBER.match(value.strip()):  # YAML 1.1 reads 1e6 as a string
            number = float(value)
        else:
            raise ConfigError(key, value, "expected a number")
        if not math.isfinite(number) and not (number == math.inf and key in INFINITE_ALLOWED):
            raise ConfigError(key, value, "must be a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "expected a string")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(key, value, f"expected {_type_name(tp)}")


def check_kwargs(fn: Any, params: dict, section: str, skip: int = 0,
                 provided: tuple[str, ...] = (), own: tuple[str, ...] = (), component: str = "component") -> dict:
    """Validate ``params`` against the keyword parameters of ``fn`` after the first ``skip``.

    Unknown keys are rejected with the list of known ones, unless ``fn`` takes ``**kwargs``
    (a builder that passes them on to another library, e.g. ``torchvision:<name>``: that
    library checks them); values are type-checked against the annotations. Returns the
    coerced kwargs (only those given). Names in ``provided`` are supplied by the library
    (e.g. the natural partition's users). ``own``: the section's own keys (``data.augment``
    beside the loader's parameters), which an unknown key's message lists too, before the
    parameters of the ``component`` (a word: "dataset").
    """
    sig = inspect.signature(fn)
    plist = list(sig.parameters.values())[skip:]
    passes_on = any(p.kind == p.VAR_KEYWORD for p in plist)
    given_by_protofl = [p.name for p in list(sig.parameters.values())[:skip]]  # e.g. a model's num_classes
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # pragma: no cover - unresolved annotations: skip type checks
        hints = {}
    known = {p.name: p for p in plist
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in provided}
    out = {}
    for k, v in params.items():
        if k in given_by_protofl:
            raise ConfigError(f"{section}.{k}", v, "set by protofl, not a parameter")
        if k not in known and passes_on and k not in provided:
            out[k] = v
            continue
        if k not in known:
            theirs = ", ".join(sorted(known)) or "none"
            allowed = (f"{section}'s keys {', '.join(sorted(own))}; the {component}'s parameters: {theirs}"
                       if own else ", ".join(sorted(known)) or "no parameters")
            raise ConfigError(f"{section}.{k}", v, f"unknown parameter; allowed: {allowed}")
        out[k] = coerce(v, hints.get(k, Any), f"{section}.{k}")
    missing = [n for n, p in known.items() if p.default is inspect.Parameter.empty and n not in out]
    if missing:
        raise ConfigError(f"{section}.{missing[0]}", None, "required parameter is missing")
    # the resolved form: every parameter with its value, defaults included, so that the
    # saved config and the run fingerprint change when a default changes
    defaults = {n: plain(p.default) for n, p in known.items() if n not in out}
    return {**defaults, **out}


def plain(value: Any) -> Any:
    """Tuples -> lists (YAML/JSON friendly), recursively."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def check_dataclass(cls: type, params: dict, section: str) -> Any:
    """Build dataclass ``cls`` from ``params`` with type checks; unknown keys rejected."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for k, v in params.items():
        if k not in fields:
            allowed = ", ".join(sorted(fields)) or "no parameters"
            raise ConfigError(f"{section}.{k}", v, f"unknown key; allowed: {allowed}")
        kwargs[k] = coerce(v, hints[k], f"{section}.{k}")
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # a required field missing
        raise ConfigError(section, params, str(e)) from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(section)
    return obj
