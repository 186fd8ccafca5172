"""Name -> component registries: one line per method, dataset, model, partitioner.

Third-party packages add components without editing protofl through entry points, in
the groups ``protofl.algorithms``, ``protofl.models``, ``protofl.datasets`` and
``protofl.partitioners`` (the entry point's name is the registry name)::

    [project.entry-points."protofl.algorithms"]
    fedavgm = "my_package.fedavgm:FedAvgM"

They are loaded the first time a name is not found or the names are listed, in every
process (worker processes and Flower clients included). A plugin that fails to import
is reported by name and left out; it does not break protofl.
"""
from __future__ import annotations

import warnings
from importlib.metadata import entry_points
from typing import Callable, Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised for a name that is not registered; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str, group: Optional[str] = None) -> None:
        self.kind = kind
        self.group = group  # the entry-point group of third-party components
        self._items: dict[str, T] = {}
        self._plugins_loaded = group is None
        self.plugin_errors: dict[str, str] = {}

    def load_plugins(self, reload: bool = False) -> None:
        """Register the components of the installed packages' entry points (once)."""
        if self._plugins_loaded and not reload:
            return
        self._plugins_loaded = True

        for ep in entry_points(group=self.group):
            if ep.name in self._items:
                continue  # built-in names win; a plugin cannot replace them
            try:
                obj = ep.load()
            except Exception as e:  # a broken plugin must not break protofl
                self.plugin_errors[ep.name] = f"{ep.value}: {type(e).__name__}: {e}"
                warnings.warn(f"protofl: {self.kind} plugin {ep.name!r} ({ep.value}) failed to load: "
                              f"{type(e).__name__}: {e}", stacklevel=2)
                continue
            self._items[ep.name] = obj

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        self.register(name)(obj)

    def get(self, name: str) -> T:
        if name not in self._items:
            self.load_plugins()
        try:
            return self._items[name]
        except KeyError:
            if name in self.plugin_errors:
                raise UnknownNameError(f"{self.kind} {name!r} failed to load: {self.plugin_errors[name]}") from None
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        self.load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        if name not in self._items:
            self.load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
