"""Adapters, found lazily through the ``ckptcore.adapters`` entry-point group.

An adapter turns one framework's objects into a :class:`~ckptcore.TrainingState` and back; its
contract is :class:`ckptcore.adapter.Adapter`.  A package registers one under
``[project.entry-points."ckptcore.adapters"]`` (``name = "package:ADAPTER"``).  Entry points are
read only when a framework object is first handed to ckptcore, and an adapter module must not
import its framework at import time, so ``import ckptcore`` stays light.

This is the one module of the core that names frameworks: the install hints below, in the spirit
of fsspec's registry of known implementations.
"""

from __future__ import annotations

import inspect
import logging
import threading
from importlib.metadata import entry_points

from ._contract import Adapter
from .errors import AdapterNotFoundError

__all__ = ["Adapter", "adapter_for", "get_adapter", "available_adapters", "install_hint"]

GROUP = "ckptcore.adapters"
# Install hints for the adapters this distribution ships, in the spirit of fsspec's registry.
_HINTS = {
    "keras": "pip install 'ckptcore[keras]'",
    "paddle": "pip install 'ckptcore[paddle]'",
    "jax": "pip install 'ckptcore[jax]'",
}

CONTRACT = ("name", "capture_views", "handles", "capture", "restore", "dialect", "formats", "demo")
"""The members every adapter declares (see :class:`ckptcore.adapter.Adapter`)."""
_log = logging.getLogger("ckptcore")
_lock = threading.Lock()
_loaded: dict[str, Adapter] | None = None
_broken: dict[str, str] = {}  # adapters whose entry point failed to load: name -> why


def declares(obj: object, member: str) -> bool:
    """Whether ``obj`` has ``member`` (one of :data:`CONTRACT`), without running a property."""
    # getattr_static: looking must not run a property (an adapter's dialect imports a module).
    try:
        inspect.getattr_static(obj, member)
    except AttributeError:
        return False
    return True


def _load() -> dict[str, Adapter]:
    global _loaded
    with _lock:
        if _loaded is None:
            found: dict[str, Adapter] = {}
            for ep in entry_points(group=GROUP):
                try:
                    adapter = ep.load()
                    missing = [m for m in CONTRACT if not declares(adapter, m)]
                    if missing:
                        raise TypeError(f"{ep.value} lacks {', '.join(missing)} of the adapter contract")
                    found[ep.name] = adapter
                except Exception as e:  # noqa: BLE001 - one broken adapter must not break the others
                    _broken[ep.name] = f"{type(e).__name__}: {e}"
                    _log.warning("ckptcore adapter %r (%s) failed to load and is skipped: %s",
                                 ep.name, ep.value, _broken[ep.name])
            _loaded = found
        return _loaded


def available_adapters() -> list[str]:
    """Names of the adapters installed in this environment."""
    return sorted(_load())


def get_adapter(name: str) -> Adapter:
    """The adapter registered as ``name`` (e.g. ``"keras"``)."""
    adapters = _load()
    if name not in adapters:
        if name in _broken:
            raise AdapterNotFoundError(f"the ckptcore adapter {name!r} is installed but failed to "
                                       f"load: {_broken[name]}")
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


def install_hint(name: str) -> str:
    """One line saying how to install the adapter (and its framework) called ``name``.

    Example:
        >>> from ckptcore.registry import install_hint
        >>> install_hint("paddle")
        "pip install 'ckptcore[paddle]'"
    """
    return _HINTS.get(name, f"install {name} and a package that registers a ckptcore adapter "
                            f"for it under the {GROUP!r} entry points")
