"""Reading a checkpoint's manifest, and what it says (:class:`CheckpointInfo`), without its data.

The one manifest reader every layer above uses (loads, listings, replication, retention, gc,
scrub, diff): bounded by ``max_manifest_bytes``, validated by :class:`~ckptcore._manifest.Manifest`,
and, when there is no manifest, an error that says what the folder is instead (a run's root, the
leftovers of a save).  It stands below the load path (``api``) and the tiers.

A group save's ranks other than 0 describe the commit without reading the manifest: rank 0
sends them :func:`summary_of` it (a few hundred bytes), and :func:`info_from_summary` builds
their :class:`CheckpointInfo`, whose tensor and shard lists (and large ``data``/``metadata``)
are read from the manifest on first use, once (:class:`LazyManifest`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from . import _codec, _knobs, _steps
from ._manifest import MANIFEST_NAME, Manifest
from ._manifest4 import reader
from ._storage import Store
from .errors import CheckpointError, CheckpointNotFoundError, SchemaError
from .state import TrainingState

__all__ = ["CheckpointInfo", "TensorInfo", "inspect", "read_manifest", "read_manifest_bytes",
           "manifest_whole", "rows_fetch", "rows_reader",
           "info_of", "summary_of", "info_from_summary", "LazyManifest"]

log = logging.getLogger("ckptcore")


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One row of the tensor table: a whole tensor, or (format 3) one chunk of a sharded one,
    the block of ``shape`` at ``start`` of an array of ``global_shape`` (rows of one tensor
    share its ``name``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str
    checksum: int
    global_shape: tuple[int, ...] | None = None  # None: ``shape`` (a whole tensor)
    start: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What a checkpoint's manifest says, without reading any tensor data."""

    url: str
    format_version: int
    created: float
    step: int
    epoch: int
    framework: str | None
    framework_versions: Mapping[str, Any]
    sections: tuple[str, ...]
    tensors: tuple[TensorInfo, ...]
    nbytes: int
    shards: tuple[str, ...]
    writer: Mapping[str, Any]
    library: Mapping[str, Any]
    data: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # What the save recorded of its cost (the manifest's optional ``stats``; empty: none).
    stats: Mapping[str, Any] = field(default_factory=dict)
    # The run this checkpoint belongs to and where it came from (``ckptcore.lineage``); None
    # for a checkpoint written before ckptcore recorded it.
    lineage: Mapping[str, Any] | None = None


class LazyManifest:
    """The manifest of the checkpoint at ``store`` committed by writer ``writer_id``, read on
    first use (:meth:`get`), once: what a group save's other ranks read only if their
    ``CheckpointInfo`` is asked for its tensors.  By then the step may be gone (a rewind,
    retention) or replaced: :class:`CheckpointNotFoundError` then, never another checkpoint's
    tensors."""

    __slots__ = ("store", "writer_id", "_manifest", "_lock")

    def __init__(self, store: Store, writer_id: Any) -> None:
        self.store, self.writer_id = store, writer_id
        self._manifest: Manifest | None = None
        self._lock = threading.Lock()  # two threads asking first read it once

    @property
    def loaded(self) -> bool:
        return self._manifest is not None

    def get(self) -> Manifest:
        with self._lock:
            if self._manifest is None:
                self._manifest = self._read()
            return self._manifest

    def _read(self) -> Manifest:
        url = self.store.url
        log.debug("%s: reading the manifest on first use of a CheckpointInfo's lists", url)
        try:
            m = read_manifest(self.store)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{url}: the checkpoint this CheckpointInfo describes is gone (deleted since "
                f"it was saved), so its tensor list cannot be read: {e}") from e
        if m.writer.get("id") != self.writer_id:
            raise CheckpointNotFoundError(
                f"{url}: the checkpoint this CheckpointInfo describes (writer id "
                f"{self.writer_id!r}) was replaced by another (writer id "
                f"{m.writer.get('id')!r}) since it was saved; its tensor list is gone")
        return m

    def __reduce__(self) -> Any:  # copies and pickles: not the lock (nor what was read)
        return (LazyManifest, (self.store, self.writer_id))


def _manifest_of(source: Manifest | LazyManifest) -> Manifest:
    return source.get() if isinstance(source, LazyManifest) else source


def _unread(source: Manifest | LazyManifest) -> bool:
    """Whether showing ``source``'s lists would read the manifest (a repr does not)."""
    return isinstance(source, LazyManifest) and not source.loaded


class TensorInfos(Sequence[TensorInfo]):
    """``CheckpointInfo.tensors``: a read-only tuple-like of :class:`TensorInfo`, built on first
    use from the manifest's columns (a save of 10,000 tensors need not build 10,000 of them for
    an info nobody reads).  Equal to the tuple of the same entries.  Over a
    :class:`LazyManifest` (``count`` known), the manifest itself is read on first use; until
    then the repr says so instead of reading it."""

    __slots__ = ("_source", "_count", "_items")

    def __init__(self, source: Manifest | LazyManifest, count: int | None = None) -> None:
        self._source, self._count = source, count
        self._items: tuple[TensorInfo, ...] | None = None

    def _all(self) -> tuple[TensorInfo, ...]:
        if self._items is None:
            m = _manifest_of(self._source)
            t = m.tensors
            paths = [s.path for s in m.shards]
            self._items = tuple(
                TensorInfo(name=name, dtype=dtype, shape=shape, nbytes=n, shard=paths[j], checksum=c,
                           global_shape=t.global_shape(i) if t.chunked else shape,
                           start=t.chunk_start(i) if t.chunked else (0,) * len(shape))
                for i, (name, dtype, shape, n, j, c) in enumerate(zip(
                    t.names, t.dtype_names(), t.shapes, t.column("length"), t.column("shard"),
                    t.column("checksum"))))
        return self._items

    def __len__(self) -> int:
        if self._count is not None:
            return self._count
        return len(_manifest_of(self._source).tensors)

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorInfos):
            return self._all() == other._all()
        if isinstance(other, (tuple, list)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        if self._items is None and _unread(self._source):
            return f"<{len(self)} tensors, read from the manifest on first use>"
        return repr(self._all())


class ShardPaths(Sequence[str]):
    """``CheckpointInfo.shards`` of a group save's rank other than 0: the count at once, the
    paths read from the manifest on first use (:class:`LazyManifest`).  Equal to the tuple of
    the same paths."""

    __slots__ = ("_source", "_count")

    def __init__(self, source: LazyManifest, count: int) -> None:
        self._source, self._count = source, count

    def _all(self) -> tuple[str, ...]:
        return tuple(s.path for s in self._source.get().shards)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ShardPaths, tuple, list)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        if _unread(self._source):
            return f"<{self._count} shards, read from the manifest on first use>"
        return repr(self._all())


class LazySection(MappingABC):
    """``CheckpointInfo.data`` or ``.metadata`` too large for rank 0's summary (``_SUMMARY_MAX``):
    read from the manifest on first use, then a read-only mapping equal to the dict the section
    would have been."""

    __slots__ = ("_source", "_key")

    def __init__(self, source: LazyManifest, key: str) -> None:
        self._source, self._key = source, key

    def _all(self) -> dict:
        return _section(self._source.get(), self._key)

    def __getitem__(self, key: Any) -> Any:
        return self._all()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        if _unread(self._source):
            return f"<{self._key}, read from the manifest on first use>"
        return repr(self._all())


def _section(m: Manifest, key: str) -> dict:
    """The ``data`` or ``metadata`` section shown as a value: tensors in it are named, not
    loaded; a section that is not a map shows as ``{}``.  (``lineage``: the manifest's own.)"""
    if key == "lineage":
        return dict(m.lineage or {})
    named = _codec.substitute(m.tree.get(key),
                              lambda r: f"<tensor {m.tensors.logical_name(r.index)}>")
    return named if isinstance(named, dict) else {}


def info_of(url: str, m: Manifest) -> CheckpointInfo:
    tree = m.tree
    sections = tuple(k for k in TrainingState.SECTIONS
                     if tree.get(k) not in (None, {}, [], "") and k not in ("step", "epoch"))
    return CheckpointInfo(
        url=url, format_version=m.version, created=m.created,
        step=_codec.count_field(tree, "step"), epoch=_codec.count_field(tree, "epoch"),
        framework=m.framework.get("name"), framework_versions=m.framework.get("versions") or {},
        sections=sections, tensors=TensorInfos(m),  # type: ignore[arg-type]
        nbytes=m.tensors.nbytes(), shards=tuple(s.path for s in m.shards),
        writer=m.writer, library=m.library,
        data=_section(m, "data"), metadata=_section(m, "metadata"), stats=dict(m.stats or {}),
        lineage=m.lineage)


# A summary larger than this leaves ``data`` and ``metadata`` out (read on first use instead):
# rank 0 broadcasts it to every rank of a save, and a few KiB keeps that one small message.
_SUMMARY_MAX = 4096
_CORE = ("format_version", "created", "step", "epoch", "framework", "framework_versions",
         "sections", "nbytes", "writer", "library")


def summary_of(m: Manifest) -> bytes | None:
    """What a :class:`CheckpointInfo` of ``m`` shows but its tensor and shard lists (their
    counts instead), packed: the few hundred bytes rank 0 of a group save sends the other ranks
    (``_dist``), so that none of them reads the manifest back.  ``data`` and ``metadata`` are
    left out when they would make it larger than ``_SUMMARY_MAX`` bytes (read on first use then);
    None (every rank reads the manifest) if even the rest would be, which no writer of ours
    produces."""
    info = info_of("", m)
    out: dict[str, Any] = {k: getattr(info, k) for k in _CORE}
    out.update(tensors=len(m.tensors), shards=len(m.shards), stats=dict(m.stats or {}))
    try:
        size = len(_codec.pack_values(out))
    except (TypeError, ValueError) as e:  # a hand-made manifest's odd writer map, say
        log.info("summary of a commit: cannot be packed (%s: %s); the other ranks read the "
                 "manifest", type(e).__name__, e)
        return None
    if size > _SUMMARY_MAX:
        log.info("summary of a commit: %d bytes without data and metadata, over %d; the other "
                 "ranks read the manifest", size, _SUMMARY_MAX)
        return None
    for key in ("data", "metadata", "lineage"):
        if key == "lineage" and info.lineage is None:
            continue
        try:
            n = len(_codec.pack_values(getattr(info, key)))
        except (TypeError, ValueError) as e:  # cannot happen for a decoded tree: be safe
            n, why = None, f"{type(e).__name__}: {e}"
        else:
            why = f"{n} bytes would pass the {_SUMMARY_MAX}-byte bound"
        if n is not None and size + n <= _SUMMARY_MAX:
            out[key], size = getattr(info, key), size + n
        else:
            if key == "lineage":
                out["lineage_left_out"] = True
            log.info("summary of a commit: %s left out (%s); read from the manifest on first use",
                     key, why)
    return _codec.pack_values(out)


def info_from_summary(store: Store, data: bytes) -> CheckpointInfo | None:
    """The :class:`CheckpointInfo` of the checkpoint at ``store`` from rank 0's
    :func:`summary_of` it, reading nothing: its tensors, shards (and a section the summary left
    out) are read from the manifest on first use.  None (logged) for a summary that cannot be
    used; the caller reads the manifest then."""
    try:
        s = _codec.unpack(data)
        return _from_summary(store, s)
    except (SchemaError, KeyError, TypeError, ValueError) as e:
        log.warning("%s: rank 0's summary of the commit cannot be used (%s: %s); reading the "
                    "manifest instead", store.url, type(e).__name__, e)
        return None


_KINDS = {"format_version": int, "created": float, "step": int, "epoch": int,
          "framework": (str, type(None)), "framework_versions": dict, "sections": tuple,
          "nbytes": int, "writer": dict, "library": dict, "tensors": int, "shards": int}


def _from_summary(store: Store, s: Any) -> CheckpointInfo:
    if not isinstance(s, dict):
        raise TypeError(f"a {type(s).__name__}, not a map")
    for key, kind in _KINDS.items():
        if not isinstance(s[key], kind) or isinstance(s[key], bool):
            raise TypeError(f"{key} is a {type(s[key]).__name__}")
    source = LazyManifest(store, s["writer"].get("id"))
    sections = {k: s[k] if isinstance(s.get(k), dict) else LazySection(source, k)
                for k in ("data", "metadata")}
    # (a lineage left out of the summary for its size is read on first use, like data)
    lineage = s.get("lineage") if isinstance(s.get("lineage"), dict) else (
        LazySection(source, "lineage") if s.get("lineage_left_out") else None)
    return CheckpointInfo(
        url=store.url, **{k: s[k] for k in _CORE},
        tensors=TensorInfos(source, s["tensors"]),  # type: ignore[arg-type]
        shards=ShardPaths(source, s["shards"]),  # type: ignore[arg-type]
        data=sections["data"], metadata=sections["metadata"],
        stats=s["stats"] if isinstance(s.get("stats"), dict) else {}, lineage=lineage)


def read_manifest(store: Store) -> Manifest:
    """The validated manifest at ``store``; ``CheckpointNotFoundError`` if there is none."""
    return read_manifest_bytes(store)[0]


def read_manifest_bytes(store: Store, select: Any = None) -> tuple[Manifest, bytes]:
    """:func:`read_manifest` and the bytes it was parsed from (a copy writes them back).
    ``select``: of a version-4 manifest, read only the row groups it picks (``_manifest4``;
    ``Manifest.partial`` then tells whether some were left unread)."""
    try:
        data = store.read(MANIFEST_NAME, max_bytes=_knobs.max_manifest_bytes())
    except CheckpointError:
        raise
    except (FileNotFoundError, NotADirectoryError) as e:
        if not store.exists():
            what = "does not exist"
        elif _is_root(store):
            what = ("is a run's root (a CheckpointManager folder of step-* checkpoints), not a "
                    "checkpoint: restore its newest checkpoint with "
                    f"ckptcore.CheckpointManager({store.url!r}).restore(...), or load one step "
                    f"folder ({_step_example(store)}); `ckpt ls {store.url}` lists them")
        else:
            what = ("has no manifest: it is not a committed checkpoint (perhaps the leftovers of "
                    "an interrupted save)")
        raise CheckpointNotFoundError(f"{store.url}: {what}") from e
    return Manifest.from_bytes(data, source=store.join(MANIFEST_NAME),
                               rows=rows_reader(store, select)), data


def manifest_whole(store: Store, data: bytes) -> Manifest:
    """The manifest of ``data`` (bytes :func:`read_manifest_bytes` returned) with all its rows:
    a load whose row groups read do not hold every block it asks for reads them all."""
    return Manifest.from_bytes(data, source=store.join(MANIFEST_NAME), rows=rows_reader(store))


def rows_reader(store: Store, select: Any = None) -> Any:
    """What :meth:`Manifest.from_bytes` takes as ``rows=`` for a manifest at ``store``: its
    rows object read whole, or the row groups ``select`` picks (``_manifest4``)."""
    return reader(rows_fetch(store), select)


def rows_fetch(store: Store) -> Any:
    """``fetch(entry, ranges)`` for a version-4 manifest at ``store``: byte ranges of its rows
    object, a whole read bounded like the manifest's own (``max_manifest_bytes``)."""
    def fetch(entry: Any, ranges: list[tuple[int, int]]) -> list[Any]:
        if ranges == [(0, entry.size)]:
            return [store.read(entry.path, max_bytes=_knobs.max_manifest_bytes())]
        return list(store.read_ranges(entry.path, ranges))
    return fetch


def _is_root(store: Store) -> bool:
    """Whether a folder without a manifest is a manager's root (``_steps.is_root``); False
    when it cannot be listed (the caller's error says enough then).  A step folder's name is
    answered without touching storage: a manager reading its own steps (a step deleted while
    it was read) pays no extra listing."""
    if _steps.STEP.fullmatch(store.name):
        return False
    try:
        return _steps.is_root(store)
    except (OSError, CheckpointError):
        return False


def _step_example(store: Store) -> str:
    """The URL of the root's newest committed step, to show; a made-up one if none."""
    try:
        steps = _steps.committed_steps(store)
    except (OSError, CheckpointError):
        steps = []
    name = steps[-1][1] if steps else _steps.step_name(42)
    return ("e.g. " if not steps else "the newest: ") + store.child(name).url


def inspect(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``url`` from its manifest alone (no tensor data is read)."""
    store = Store(os.fspath(url), dict(storage_options or {}))
    return info_of(store.url, read_manifest(store))
