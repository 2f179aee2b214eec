"""Reading a checkpoint's manifest, and what it says (:class:`CheckpointInfo`), without its data.

The one manifest reader every layer above uses (loads, listings, replication, retention, gc,
scrub, diff): bounded by ``max_manifest_bytes``, validated by :class:`~ckptcore._manifest.Manifest`,
and, when there is no manifest, an error that says what the folder is instead (a run's root, the
leftovers of a save).  It stands below the load path (``api``) and the tiers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from . import _codec, _knobs, _steps
from ._manifest import MANIFEST_NAME, Manifest
from ._storage import Store
from .errors import CheckpointError, CheckpointNotFoundError
from .state import TrainingState

__all__ = ["CheckpointInfo", "TensorInfo", "inspect", "read_manifest", "read_manifest_bytes",
           "info_of"]


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


class TensorInfos(Sequence[TensorInfo]):
    """``CheckpointInfo.tensors``: a read-only tuple-like of :class:`TensorInfo`, built on first
    use from the manifest's columns (a save of 10,000 tensors need not build 10,000 of them for
    an info nobody reads).  Equal to the tuple of the same entries."""

    __slots__ = ("_manifest", "_items")

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._items: tuple[TensorInfo, ...] | None = None

    def _all(self) -> tuple[TensorInfo, ...]:
        if self._items is None:
            m = self._manifest
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
        return len(self._manifest.tensors)

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
        return repr(self._all())


def info_of(url: str, m: Manifest) -> CheckpointInfo:
    tree = m.tree
    # Only the small sections are shown as values; tensors in them are named, not loaded.
    named = {k: _codec.substitute(tree.get(k), lambda r: f"<tensor {m.tensors.logical_name(r.index)}>")
             for k in ("data", "metadata")}
    sections = tuple(k for k in TrainingState.SECTIONS
                     if tree.get(k) not in (None, {}, [], "") and k not in ("step", "epoch"))
    return CheckpointInfo(
        url=url, format_version=m.version, created=m.created,
        step=_codec.count_field(tree, "step"), epoch=_codec.count_field(tree, "epoch"),
        framework=m.framework.get("name"), framework_versions=m.framework.get("versions") or {},
        sections=sections, tensors=TensorInfos(m),  # type: ignore[arg-type]
        nbytes=m.tensors.nbytes(), shards=tuple(s.path for s in m.shards),
        writer=m.writer, library=m.library,
        data=named["data"] if isinstance(named["data"], dict) else {},
        metadata=named["metadata"] if isinstance(named["metadata"], dict) else {})


def read_manifest(store: Store) -> Manifest:
    """The validated manifest at ``store``; ``CheckpointNotFoundError`` if there is none."""
    return read_manifest_bytes(store)[0]


def read_manifest_bytes(store: Store) -> tuple[Manifest, bytes]:
    """:func:`read_manifest` and the bytes it was parsed from (a copy writes them back)."""
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
    return Manifest.from_bytes(data, source=store.join(MANIFEST_NAME)), data


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
