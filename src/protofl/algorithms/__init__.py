"""The methods. Each module of this package registers its method classes with
``@register`` (``base.py``); importing the package imports every module in it, so adding a
method is one new module (and its test), no edit here."""
from __future__ import annotations

import importlib
import pkgutil

from .base import ALGORITHMS, Algorithm, ClientResult, TaskInfo, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ALGORITHMS", "Algorithm", "ClientResult", "TaskInfo", "register"]
