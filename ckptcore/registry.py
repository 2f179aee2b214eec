"""Adapters, found lazily through the ``ckptcore.adapters`` entry-point group.

An adapter turns one framework's objects into a :class:`~ckptcore.TrainingState`
and back.  The whole contract::

    class Adapter(Protocol):
        name: str                                    # "keras", "paddle"
        def handles(self, obj: object) -> bool: ...  # must not import the framework
        def capture(self, **objects) -> TrainingState: ...
        def restore(self, state: TrainingState, **objects) -> RestoreReport: ...

A package registers one under ``[project.entry-points."ckptcore.adapters"]``
(``keras = "ckptcore_keras:ADAPTER"``).  Entry points are read only when a
framework object is first handed to ckptcore, and an adapter module must not
import its framework at import time, so ``import ckptcore`` stays light.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from .errors import AdapterNotFoundError
from .state import RestoreReport, TrainingState

__all__ = ["Adapter", "adapter_for", "get_adapter", "available_adapters"]

GROUP = "ckptcore.adapters"
# Install hints for the adapters this distribution ships, in the spirit of fsspec's registry.
_HINTS = {
    "keras": "pip install 'ckptcore[keras]'",
    "paddle": "pip install 'ckptcore[paddle]'",
}

_lock = threading.Lock()
_loaded: dict[str, Adapter] | None = None


@runtime_checkable
class Adapter(Protocol):
    name: str

    def handles(self, obj: object) -> bool: ...

    def capture(self, **objects: Any) -> TrainingState: ...

    def restore(self, state: TrainingState, **objects: Any) -> RestoreReport: ...


def _load() -> dict[str, Adapter]:
    global _loaded
    with _lock:
        if _loaded is None:
            found: dict[str, Adapter] = {}
            for ep in entry_points(group=GROUP):
                try:
                    found[ep.name] = ep.load()
                except ImportError:  # a broken or partial install must not break the others
                    continue
            _loaded = found
        return _loaded


def available_adapters() -> list[str]:
    """Names of the adapters installed in this environment."""
    return sorted(_load())


def get_adapter(name: str) -> Adapter:
    """The adapter registered as ``name`` (e.g. ``"keras"``)."""
    adapters = _load()
    if name not in adapters:
        hint = _HINTS.get(name, f"install a package that registers it under {GROUP!r}")
        raise AdapterNotFoundError(f"no ckptcore adapter named {name!r} is installed; {hint}")
    return adapters[name]


def adapter_for(obj: object) -> Adapter:
    """The adapter that handles ``obj`` (a model), chosen by asking each installed adapter."""
    for adapter in _load().values():
        if adapter.handles(obj):
            return adapter
    mod = type(obj).__module__.split(".")[0]
    hint = _HINTS.get(mod, "")
    raise AdapterNotFoundError(
        f"no installed ckptcore adapter handles objects of type {type(obj).__module__}.{type(obj).__qualname__}"
        + (f"; {hint}" if hint else f"; installed adapters: {sorted(_load()) or 'none'}"))
