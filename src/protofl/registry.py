"""Name -> component registries: one line per method, dataset, model, partitioner.

Third-party packages add components without editing protofl through entry points, in
the groups ``protofl.algorithms``, ``protofl.models``, ``protofl.datasets`` and
``protofl.partitioners`` (the entry point's name is the registry name)::

    [project.entry-points."protofl.algorithms"]
    my_method = "my_package.my_method:MyMethod"

They are loaded the first time a name is not found or the names are listed, in every
process (worker processes and Flower clients included). A plugin that fails to import
is reported by name and left out; it does not break protofl.

A *family* of names that another library resolves, such as ``torchvision:<name>``, is
registered once with :meth:`Registry.add_prefix`; ``protofl list`` shows its usage line.
"""
from __future__ import annotations

import warnings
from importlib.metadata import entry_points
from typing import Callable, cast, Generic, Iterator, Optional, TypeVar

from .errors import InputError

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
        self._prefixes: dict[str, tuple[Callable[[str], T], str]] = {}

    def load_plugins(self, reload: bool = False) -> None:
        """Register the components of the installed packages' entry points (once)."""
        if self._plugins_loaded and not reload:
            return
        self._plugins_loaded = True

        for ep in entry_points(group=cast(str, self.group)):  # a None group (reload=True) selects none
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

    def add_prefix(self, prefix: str, resolve: Callable[[str], T], usage: str) -> None:
        """Names ``<prefix><rest>`` resolve to ``resolve(rest)``, which raises
        :class:`UnknownNameError` for a ``rest`` it does not know; ``usage`` says how to use
        the family (``protofl list``)."""
        if prefix in self._prefixes:
            raise ValueError(f"{self.kind} prefix {prefix!r} registered twice")
        self._prefixes[prefix] = (resolve, usage)

    def usages(self) -> list[str]:
        """The usage lines of the families of names (:meth:`add_prefix`)."""
        return [usage for _, usage in self._prefixes.values()]

    def _family(self, name: str) -> Optional[str]:
        return next((p for p in self._prefixes if name.startswith(p)), None)

    def get(self, name: str) -> T:
        prefix = self._family(name)
        if prefix is not None:
            return self._prefixes[prefix][0](name[len(prefix):])
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
        if isinstance(name, str) and self._family(name) is not None:
            try:
                self.get(name)
            except (UnknownNameError, InputError):  # an unknown name, or its library is missing
                return False
            return True
        if name not in self._items:
            self.load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
