"""The public functions: save_state, load_state, inspect, verify, convert."""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from . import _codec, _dist, _io, _knobs
from .adapter import restore_gate, warn_unapplied
from ._version import __version__
from ._commit import commit
from ._convert import convert_for, convert_state_for, restore_converted  # noqa: F401 (convert_for: api's name)
from ._manifest import (CHUNKED_VERSION, FORMAT_VERSION, MANIFEST_NAME, READ_VERSIONS, Manifest,
                        ShardEntry, TensorTable, check_chunks)
from ._storage import Store
from .errors import (CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError,
                     SchemaError)
from .registry import adapter_for
from .state import TrainingState

__all__ = ["save_state", "load_state", "inspect", "verify", "convert", "CheckpointInfo", "TensorInfo"]

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


class _TensorInfos(Sequence[TensorInfo]):
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
        if isinstance(other, _TensorInfos):
            return self._all() == other._all()
        if isinstance(other, (tuple, list)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


def _info(url: str, m: Manifest) -> CheckpointInfo:
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
        sections=sections, tensors=_TensorInfos(m),  # type: ignore[arg-type]
        nbytes=m.tensors.nbytes(), shards=tuple(s.path for s in m.shards),
        writer=m.writer, library=m.library,
        data=named["data"] if isinstance(named["data"], dict) else {},
        metadata=named["metadata"] if isinstance(named["metadata"], dict) else {})


def save_state(url: str | os.PathLike, state: TrainingState | None = None, *,
               storage_options: Mapping[str, Any] | None = None, overwrite: bool = False,
               group: Any = None, fence: Any = None, **objects: Any) -> CheckpointInfo:
    """Save a training state as a checkpoint directory at ``url`` (any fsspec URL).

    Pass either a :class:`TrainingState` or framework objects (``model=...,
    optimizer=..., cursor=...``), which the matching adapter captures.  The
    save is atomic: readers see the whole checkpoint or none of it.

    Example:
        >>> import numpy as np, ckptcore
        >>> s = ckptcore.TrainingState(model={"w": np.arange(3.0)}, step=1)
        >>> info = ckptcore.save_state("memory://doc/ckpt-1", s)
        >>> ckptcore.load_state("memory://doc/ckpt-1").model["w"]
        array([0., 1., 2.])

    With ``group`` (a :class:`ckptcore.ProcessGroup`, e.g. ``ckptcore_paddle.process_group()``),
    every rank calls ``save_state`` with the same replicated state, and its own blocks of
    sharded tensors as ``ckptcore.Shard`` leaves (which the ranks' blocks must cover whole):
    each writes its blocks and about 1/N of the replicated bytes, rank 0 commits once, and
    every rank returns or raises alike (see
    ``ckptcore/_dist.py``; the ``group_timeout`` knob bounds every wait on a peer).

    ``fence`` is the writer lease of the root ``url`` is in (what a ``CheckpointManager`` passes):
    the manifest records its generation, and a lease lost before the commit raises
    :class:`FencedError` (docs/RELIABILITY.md, "Fencing").

    Raises:
        CheckpointExistsError: a checkpoint is already at ``url`` and ``overwrite`` is False.
        TypeError: the state holds a value that cannot be stored (the message names it).
        SchemaError: the manifest would be one a reader refuses (e.g. over
            ``max_manifest_bytes``); nothing was committed.
        GroupError: with ``group``, a peer failed, died or timed out; nothing was committed.
        FencedError: with ``fence``, another writer took the root over; a commit made after
            that is ignored by every reader.
    """
    version = int(_knobs.get("format_version"))
    if version not in READ_VERSIONS:
        raise ValueError(f"the format_version knob is {version}; this ckptcore writes "
                         f"{', '.join(map(str, READ_VERSIONS))}")
    store = Store(os.fspath(url), dict(storage_options or {}))
    try:
        state, _ = capture_state(state, objects)  # borrowed arrays: written before we return
        enc = _codec.encode_state(state)
        arrays = [_codec.to_little_endian(a) for a in enc.arrays]
    except Exception as e:
        if group is None:
            raise
        _dist.fail(store, group, e)  # the other ranks learn it at once, then this raises
        raise
    token = uuid.uuid4().hex[:16]
    # Shard leaves need chunked tensors (format 3); a plain state keeps the knob's version.
    if enc.chunks is not None or version >= CHUNKED_VERSION:
        if version < 2:
            raise ValueError("the format_version knob is 1, but the state holds ckptcore.Shard "
                             "leaves, which need format version 3")
        version = CHUNKED_VERSION
        if enc.chunks is None:
            enc.chunks = _codec.Chunking.whole(arrays)
    count = enc.chunks.tensor[-1] + 1 if enc.chunks is not None and arrays else len(arrays)
    writer = {"id": token, "host": socket.gethostname(), "pid": os.getpid()}
    if fence is not None and fence.generation is not None:
        writer["generation"] = int(fence.generation)  # readers ignore commits of a fenced one

    def make_manifest(shards: Sequence[ShardEntry], tensors: TensorTable) -> Manifest:
        return Manifest(
            created=time.time(),
            writer=writer,
            library={"ckptcore": __version__, "numpy": np.__version__,
                     "python": platform.python_version()},
            framework={"name": state.framework,
                       "versions": dict(state.metadata.get("versions") or {})},
            alignment=int(_knobs.get("alignment")), shards=tuple(shards), tensors=tensors,
            tree=enc.tree, version=version, referenced=tuple(range(count)))

    def write(target: Store) -> Manifest:
        shards, table = _io.write_payload(target, arrays, enc.names, token, enc.dtypes,
                                          chunks=enc.chunks)
        if table.chunked:  # overlapping blocks of one array: a reader would refuse the file
            try:
                check_chunks(table, store.url)
            except SchemaError as e:
                raise ValueError(f"{e}; nothing was saved") from None
        return make_manifest(shards, table)

    if group is not None:
        manifest = _dist.save(store, group, enc, arrays, make_manifest, token=token,
                              overwrite=overwrite, fence=fence)
        try:
            if manifest is None:  # another rank: rank 0 committed; describe what it committed
                manifest = read_manifest(store)
        finally:
            # Rank 0 goes on only once every rank has read the manifest: its next act may
            # delete this very step (a rewind), and a rank still reading would find it gone.
            _dist.settle(store, group)
        return _info(store.url, manifest)
    manifest = commit(store, write, token=token, overwrite=overwrite, fence=fence)
    return _info(store.url, manifest)


def read_manifest(store: Store) -> Manifest:
    """The validated manifest at ``store``; ``CheckpointNotFoundError`` if there is none."""
    return read_manifest_bytes(store)[0]


def read_manifest_bytes(store: Store) -> tuple[Manifest, bytes]:
    """:func:`read_manifest` and the bytes it was parsed from (a copy writes them back)."""
    try:
        data = store.read(MANIFEST_NAME, max_bytes=int(_knobs.get("max_manifest_bytes")))
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
    """Whether a folder without a manifest is a manager's root (``layout.is_root``); False
    when it cannot be listed (the caller's error says enough then).  A step folder's name is
    answered without touching storage: a manager reading its own steps (a step deleted while
    it was read) pays no extra listing."""
    from . import layout

    if layout.STEP.fullmatch(store.name):
        return False
    try:
        return layout.is_root(store)
    except (OSError, CheckpointError):
        return False


def _step_example(store: Store) -> str:
    """The URL of the root's newest committed step, to show; a made-up one if none."""
    from . import layout

    try:
        steps = layout.committed_steps(store)
    except (OSError, CheckpointError):
        steps = []
    name = steps[-1][1] if steps else layout.step_name(42)
    return ("e.g. " if not steps else "the newest: ") + store.child(name).url


def _select(tree: dict, keys: Iterable[str] | None) -> dict:
    if keys is None:
        return tree
    keys = [keys] if isinstance(keys, str) else list(keys)
    unknown = [k for k in keys if k not in TrainingState.SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {TrainingState.SECTIONS}")
    # Small bookkeeping sections always come along: they hold no tensors worth skipping.
    wanted = set(keys) | {"step", "epoch", "framework", "metadata", "params"}
    skipped = sorted(k for k, v in tree.items() if k not in wanted and v not in (None, {}, [], ""))
    if skipped:
        log.debug("load_state: keys=%s; not reading the saved section(s) %s", sorted(keys), skipped)
    return {k: v for k, v in tree.items() if k in wanted}


def load_state(url: str | os.PathLike, *, verify: bool = True, keys: Iterable[str] | None = None,
               storage_options: Mapping[str, Any] | None = None,
               like: TrainingState | None = None, group: Any = None,
               **objects: Any) -> TrainingState:
    """Load the checkpoint at ``url``; with framework objects, restore into them too.

    Sharded tensors (saved from ``ckptcore.Shard`` leaves) come back whole when their chunks
    cover them.  ``like`` (a :class:`TrainingState` whose leaves are ``Shard``s, ``Chunks`` or
    arrays; their values are ignored) asks for blocks instead: each ``Shard`` leaf comes back as
    a ``Shard`` holding that block of the saved global array, however the checkpoint was cut,
    and only the byte ranges of the chunks that intersect it are read (ranged reads on object
    stores), each verified.  Other values come back as saved.

    Sizes are always checked before reading; with ``verify`` every tensor read
    is checked against its checksum before anything is returned.  ``keys``
    loads only some sections (e.g. ``["model"]``) and reads only their bytes.

    Restoring into framework objects streams: each tensor is assigned as soon as its own
    verification batch has passed, while later ones are still being read.  A damaged tensor
    raises ``CorruptCheckpointError`` before it is assigned, but tensors before it may already
    be in the objects: restore them again after that error (``CheckpointManager.restore()``
    verifies a whole step before assigning anything).  See docs/RELIABILITY.md.

    With ``group`` (the group the state was saved with, or another size), every rank calls
    ``load_state`` with its own ``like``, reads only its blocks, and every rank returns or raises
    alike: a rank whose read fails makes the others raise its error too (naming the rank),
    so no rank trains on alone.

    Example:
        >>> state = ckptcore.load_state("memory://doc/ckpt-1", keys=["model"])  # doctest: +SKIP

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``.
        CorruptCheckpointError: a checksum does not match (names the file and tensor).
        IncompleteCheckpointError: a shard is missing or truncated.
        SchemaError: the manifest is malformed or of an unsupported version.
    """
    if group is not None:
        store = Store(os.fspath(url), dict(storage_options or {}))
        return _dist.agree(store, group, lambda: load_state(
            url, verify=verify, keys=keys, storage_options=storage_options, like=like, **objects))
    store = Store(os.fspath(url), dict(storage_options or {}))
    for attempt in range(_READ_ATTEMPTS):
        manifest = read_manifest(store)
        tree = _select(manifest.tree, keys)
        wanted = (manifest.referenced_indices() if keys is None
                  else sorted({r.index for r in _codec.refs(tree)}))
        try:
            if like is not None or manifest.tensors.chunked:
                from . import _chunks

                state = _codec.decode_state(_chunks.load_tree(store, manifest, tree, like,
                                                              verify=verify))
                reading = None
            else:
                reading = _io.Reading(store, manifest, wanted, verify=verify)
            break
        except (IncompleteCheckpointError, FileNotFoundError):
            # An overwrite may have replaced the checkpoint between our reading its manifest and
            # its shards: then read the new one; otherwise the shards really are missing.
            if attempt + 1 == _READ_ATTEMPTS or not _replaced(store, manifest):
                raise
            log.info("load_state: %s was overwritten while it was read; reading the new one "
                     "(attempt %d of %d)", store.url, attempt + 2, _READ_ATTEMPTS)
    if reading is None:  # chunked tensors: read and verified already
        restore_objects(state, objects)
        return state
    try:
        stream = verify and _streams(manifest, objects)
        arrays = reading.arrays if stream else reading.result()
        tree = _codec.substitute(tree, lambda r: arrays[r.index][()] if r.scalar else arrays[r.index])
        state = _codec.decode_state(tree)
        if stream:
            # Tensors are assigned as soon as their own batch is verified, while later batches
            # are still being read (RestorePlan.apply waits on this gate before each put).
            with restore_gate(_Gate(reading, arrays)):
                try:
                    restore_objects(state, objects)
                except Exception:
                    reading.result()  # damage, if any, is the error to report, not its symptom
                    raise
            reading.result()  # what no put took (RNG states, extra...) is verified before we return
        else:
            restore_objects(state, objects)
    finally:
        reading.close()
    return state


def _streams(manifest: Manifest, objects: Mapping[str, Any]) -> bool:
    """Whether a restore into ``objects`` may overlap verification with assignment: framework
    objects of the framework that saved the state (a conversion between frameworks computes on
    every tensor first, so it gets verified ones)."""
    if "model" not in objects:
        return False
    saved = manifest.framework.get("name")
    return saved is None or saved == adapter_for(objects["model"]).name


class _Gate:
    """What ``RestorePlan.apply`` waits on before each put: the verification of that value's own
    tensor, when it is one of the loaded arrays; of every tensor, for any other value."""

    def __init__(self, reading: _io.Reading, arrays: Mapping[int, np.ndarray]) -> None:
        self._reading = reading
        self._index = {id(a): i for i, a in arrays.items()}
        self._done = False

    def wait_for(self, value: Any) -> None:
        i = self._index.get(id(value))
        if i is None:
            self.wait_all()
        elif not self._done:
            self._reading.wait_for(i)

    def wait_all(self) -> None:
        if not self._done:
            self._reading.result()
            self._done = True


_READ_ATTEMPTS = 5


def _replaced(store: Store, manifest: Manifest) -> bool:
    """Whether the checkpoint at ``store`` is no longer the one ``manifest`` describes."""
    try:
        return read_manifest(store).writer != manifest.writer
    except CheckpointError:
        return False


def capture_state(state: TrainingState | None, objects: dict[str, Any]) -> tuple[TrainingState, bool]:
    """The state to save, and whether its arrays are borrowed from the caller.

    Internal to the package (``save_state`` and ``CheckpointManager.save`` share it), not
    re-exported by ``ckptcore``.

    That is ``state`` itself (plus a ``cursor``'s position), or an adapter's capture.  An adapter
    that can (``capture_views = True``) returns views of the live framework buffers rather than
    copies: fine for a save written before the caller resumes training; an async save copies
    borrowed arrays into its staging buffers first.
    """
    check_state_argument(state, "save_state(url, state)")
    if state is None:
        if "model" not in objects:
            raise TypeError("save_state needs a TrainingState or framework objects (model=...)")
        adapter = adapter_for(objects["model"])
        if getattr(adapter, "capture_views", False):
            return adapter.capture(copy=False, **objects), True
        return adapter.capture(**objects), False
    cursor = objects.pop("cursor", None)
    if objects:
        raise TypeError(f"got both a state and framework objects {sorted(objects)}; pass one")
    if cursor is not None:
        state = dataclasses.replace(state, data=cursor.state_dict())
    return state, True


def check_state_argument(state: Any, call: str) -> None:
    """``TypeError`` unless ``state`` (the positional state of a save) is a
    :class:`TrainingState` or None, naming what to pass instead."""
    if state is None or isinstance(state, TrainingState):
        return
    hint = ""
    if isinstance(state, Mapping):
        hint = (f" (a {type(state).__name__} of arrays is one section of a state: wrap it, e.g. "
                "ckptcore.TrainingState(model={'w': array}))")
    raise TypeError(
        f"{call}: state must be a ckptcore.TrainingState, got {type(state).__name__}{hint}; "
        "to save framework objects, pass them as keywords instead: "
        "model=..., optimizer=..., cursor=...")


_MIGRATION_OPTIONS = ("name_map", "approximate")


def restore_objects(state: TrainingState, objects: Mapping[str, Any]) -> None:
    """Restore framework objects from ``state`` through their adapter (a lone cursor needs none).

    A state from another framework is converted first (:func:`convert`); ``name_map`` and
    ``approximate`` among ``objects`` are passed to it.
    """
    objects = dict(objects)
    options = {k: objects.pop(k) for k in _MIGRATION_OPTIONS if k in objects}
    if not objects:
        return
    if "model" in objects:
        state = restore_converted(adapter_for(objects["model"]), state, objects, **options)
        _warn_cursor_unapplied(state, objects)
    elif set(objects) == {"cursor"}:
        objects["cursor"].load_state_dict(state.data)
    else:
        raise TypeError(f"restoring into {sorted(objects)} needs model=... as well")


def _warn_cursor_unapplied(state: TrainingState, objects: Mapping[str, Any]) -> None:
    """The data position is the core's to warn about, once per restore, whatever the framework:
    a run restored without its cursor restarts the epoch and sees samples again.  Adapters warn
    (through the same :func:`warn_unapplied`) only for the parts they own: optimizer, slots,
    accumulation, schedule.  ``keys=[...]`` without ``"data"`` loads no position: no warning."""
    if state.data and objects.get("cursor") is None:
        warn_unapplied({"data": "pass cursor=... (a DataCursor, or anything with load_state_dict) "
                                "to continue at the saved sample"}, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` (for a warning raised by this module's caller's :func:`warn_unapplied`)
    of the first frame outside ckptcore and its adapters: the user's ``load_state``/``restore``
    line or their framework's ``fit``, whichever path the restore took."""
    frame, level = sys._getframe(1), 2  # level 2 from warn_unapplied is our caller's frame
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ckptcore"):
        frame, level = frame.f_back, level + 1
    return level


def convert(state: TrainingState | str | os.PathLike, to: str, model: Any, optimizer: Any = None, *,
            name_map: Mapping[str, str | None] | None = None, approximate: bool = False,
            storage_options: Mapping[str, Any] | None = None, **objects: Any) -> TrainingState:
    """Convert a state captured in one framework into another's layout, without restoring it.

    The target's structure comes from live target objects: ``model``, ``optimizer`` and any
    framework-specific ones the target adapter's ``capture`` takes (``scheduler=``...), which are
    only read (an optimizer that never stepped may be built).
    Parameters are paired by layer order, kind and shape; ``name_map`` pins pairs
    (``{source name or layer: target name or layer}``, ``None`` drops a source layer).  Weights
    and optimizer slots get the same layout transforms; step counters, the schedule position, the
    data cursor and gradient accumulation are carried; framework RNGs are reseeded
    deterministically.  See docs/MIGRATION.md.

    Example:
        >>> state = ckptcore.load_state("s3://runs/a/step-100")                     # doctest: +SKIP
        >>> converted = ckptcore.convert(state, "other", net, opt)                  # doctest: +SKIP
        >>> ckptcore.save_state("s3://runs/b/step-100", converted)                  # doctest: +SKIP

    Args:
        state: A :class:`TrainingState`, or the URL of a checkpoint to load.
        to: The target adapter's name (see ``ckptcore.registry.available_adapters()``).
        approximate: Convert schedules (and a few optimizer settings) that cannot continue exactly,
            with a :class:`~ckptcore.MigrationWarning` saying how far off, instead of raising.
        objects: Further target objects for the adapter's ``capture``; ``None`` values are left out.

    Raises:
        MigrationError: something cannot be placed or continued; the message lists every problem.
        AdapterNotFoundError: no adapter for ``to`` is installed.
        TypeError: ``model`` is not the target adapter's, or an object the adapter does not take.
    """
    if not isinstance(state, TrainingState):
        state = load_state(state, storage_options=storage_options)
    return convert_state_for(state, to, model, optimizer, name_map=name_map,
                             approximate=approximate, **objects)


def inspect(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``url`` from its manifest alone (no tensor data is read)."""
    store = Store(os.fspath(url), dict(storage_options or {}))
    return _info(store.url, read_manifest(store))


def verify(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None
           ) -> list[CheckpointError]:
    """Check every shard and tensor checksum; return the problems found (empty when intact).

    A missing or unreadable manifest is raised, not returned: there is nothing to verify.
    """
    store = Store(os.fspath(url), dict(storage_options or {}))
    manifest = read_manifest(store)
    errors: list[CheckpointError] = []
    _io.read_tensors(store, manifest, range(len(manifest.tensors)), verify=True, errors=errors)
    tensor_files = {e.file for e in errors if getattr(e, "file", None)}
    shard_errors: list[CheckpointError] = []
    _io.verify_shards(store, manifest, shard_errors)
    if manifest.tensors.chunked:
        from . import _chunks

        _chunks.verify_blocks(store, manifest, errors)
    # A damaged tensor already names its shard; report shard-level damage only where it adds news.
    errors += [e for e in shard_errors if getattr(e, "file", None) not in tensor_files
               and str(e) not in {str(x) for x in errors}]
    return errors
