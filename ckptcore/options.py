"""Options that travel together, as small frozen dataclasses.

:class:`Backup` describes one backup tier of a :class:`~ckptcore.CheckpointManager` (a second
root each committed step is replicated to) and :class:`Lease` the writer lease every tier's
lock uses on object stores.  The manager and the framework callbacks take the same objects::

    mgr = ckptcore.CheckpointManager(
        "/fast/run1", keep=3,
        backup=ckptcore.Backup("s3://bucket/run1", keep=ckptcore.KeepEvery(1000)),
        lease=ckptcore.Lease(seconds=60, heartbeat=15))

Values are checked when the object is made (``TypeError``/``ValueError`` naming the field), so a
wrong option fails at the line that wrote it, before anything is locked or written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .policies import as_policy

__all__ = ["Backup", "Lease"]


def _seconds(value: Any, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Lease({name}=...) takes seconds as a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"Lease({name}={value!r}): need a finite number of seconds > 0")


@dataclass(frozen=True)
class Lease:
    """The writer lease on object stores (docs/RELIABILITY.md, "The writer lock").

    Args:
        seconds: How long an unrenewed lease stays valid before another writer may take the
            root over (default 30 s, ``CKPTCORE_LEASE_SECONDS``).
        heartbeat: How often a live writer renews it (default 10 s,
            ``CKPTCORE_HEARTBEAT_SECONDS``; at most a third of ``seconds`` when only ``seconds``
            is given); must be below ``seconds``.
    """

    seconds: float | None = None
    heartbeat: float | None = None

    def __post_init__(self) -> None:
        _seconds(self.seconds, "seconds")
        _seconds(self.heartbeat, "heartbeat")
        if self.seconds is not None and self.heartbeat is not None and \
                not self.heartbeat < self.seconds:
            raise ValueError(f"Lease(seconds={self.seconds}, heartbeat={self.heartbeat}): the "
                             "heartbeat must renew the lease before it expires (heartbeat < "
                             "seconds, e.g. seconds=30, heartbeat=10)")


@dataclass(frozen=True)
class Backup:
    """One backup tier: a second root (any fsspec URL, e.g. a bucket) each committed step is
    replicated to in the background (docs/RELIABILITY.md, "Backup tiers").

    Args:
        url: The backup root; must be another location than the manager's root.
        keep: The backup's own retention (as the manager's ``keep``); None keeps every replica.
        storage_options: Passed to fsspec for ``url``.
        dedup: Store replicas as content-addressed objects shared between steps (default), so
            unchanged tensors are not uploaded again; False writes plain copies.
        keep_unreplicated: Local retention never deletes a step whose replica in this backup is
            not committed yet (default); False lets it (a slow or failing bucket then loses
            those steps).
    """

    url: str
    keep: Any = None
    storage_options: Mapping[str, Any] | None = None
    dedup: bool = True
    keep_unreplicated: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, (str, os.PathLike)):
            raise TypeError(f"Backup(url=...) takes a URL or path, got {type(self.url).__name__}")
        as_policy(self.keep)  # a wrong policy fails here, not at the first replication
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError("Backup(storage_options=...) takes a mapping, got "
                            f"{type(self.storage_options).__name__}")
        for name in ("dedup", "keep_unreplicated"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Backup({name}=...) takes True or False, got "
                                f"{getattr(self, name)!r}")

    def __hash__(self) -> int:  # storage_options is a mapping: hash what identifies the tier
        return hash((os.fspath(self.url), self.dedup, self.keep_unreplicated))


# Keyword spellings of CheckpointManager before these options existed: accepted for one release
# with a DeprecationWarning naming the new spelling.
_LEGACY = {"lease_seconds": "lease=Lease(seconds=...)",
           "heartbeat_seconds": "lease=Lease(heartbeat=...)",
           "backup_keep": "backup=Backup(url, keep=...)",
           "backup_storage_options": "backup=Backup(url, storage_options=...)",
           "backup_dedup": "backup=Backup(url, dedup=...)",
           "keep_unreplicated": "backup=Backup(url, keep_unreplicated=...)"}


def resolve(backup: Any, lease: Lease | None, legacy: Mapping[str, Any],
            stacklevel: int = 3) -> tuple[list[Backup], Lease]:
    """The manager's ``backup=`` and ``lease=`` as a list of :class:`Backup` and a
    :class:`Lease`, folding in the old keyword spellings (each warned once per call)."""
    import warnings

    unknown = sorted(set(legacy) - set(_LEGACY))
    if unknown:
        raise TypeError(f"CheckpointManager() got unexpected keyword argument(s) {unknown}")
    for name in legacy:
        warnings.warn(f"CheckpointManager({name}=...) is deprecated; use {_LEGACY[name]}",
                      DeprecationWarning, stacklevel=stacklevel)
    if lease is not None and not isinstance(lease, Lease):
        raise TypeError(f"lease= takes a ckptcore.Lease, got {type(lease).__name__}")
    lease = lease or Lease()
    if "lease_seconds" in legacy or "heartbeat_seconds" in legacy:
        lease = Lease(seconds=legacy.get("lease_seconds", lease.seconds),
                      heartbeat=legacy.get("heartbeat_seconds", lease.heartbeat))
    if backup is None:
        if any(k.startswith("backup_") for k in legacy):
            raise ValueError("backup_keep and backup_storage_options need backup=URL")
        return [], lease
    items = [backup] if isinstance(backup, (str, os.PathLike, Backup)) else list(backup)
    specs = []
    for item in items:
        if isinstance(item, (str, os.PathLike)):
            item = Backup(os.fspath(item),
                          keep=legacy.get("backup_keep"),
                          storage_options=legacy.get("backup_storage_options"),
                          dedup=legacy.get("backup_dedup", True),
                          keep_unreplicated=legacy.get("keep_unreplicated", True))
        elif not isinstance(item, Backup):
            raise TypeError(f"backup= takes a URL, a ckptcore.Backup or a list of them, got "
                            f"{type(item).__name__}")
        elif any(k.startswith("backup_") or k == "keep_unreplicated" for k in legacy):
            raise ValueError("give the backup's options in Backup(...), not as backup_* keywords")
        specs.append(item)
    return specs, lease
