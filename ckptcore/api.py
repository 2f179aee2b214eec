"""The public functions: save_state, load_state, inspect, verify, convert."""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import socket
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import _codec, _dist, _io, _knobs, _meter, events
from . import lineage as lineage_module
from .adapter import restore_gate, warn_unapplied
from ._version import __version__
from ._commit import commit
from ._convert import convert_for, convert_state_for, restore_converted  # noqa: F401 (convert_for: api's name)
from ._manifest import (CHUNKED_VERSION, WRITE_VERSIONS, Manifest, ShardEntry, TensorTable,
                        check_chunks)
from ._read import (CheckpointInfo, TensorInfo, info_from_summary, info_of, inspect,
                    manifest_whole, read_manifest, read_manifest_bytes, summary_of)
from ._storage import Store
from .errors import CheckpointError, IncompleteCheckpointError, SchemaError, caller_level
from .group import ProcessGroup
from .lineage import Run
from .registry import adapter_for
from .state import TrainingState

__all__ = ["save_state", "load_state", "inspect", "verify", "convert", "CheckpointInfo", "TensorInfo"]

log = logging.getLogger("ckptcore")


def save_state(url: str | os.PathLike, state: TrainingState | None = None, *,
               model: Any = None, optimizer: Any = None, cursor: Any = None,
               storage_options: Mapping[str, Any] | None = None, overwrite: bool = False,
               group: ProcessGroup | None = None, fence: Any = None,
               tags: Mapping[str, str] | None = None,
               resumed_from: str | os.PathLike | CheckpointInfo | None = None,
               lineage: Run | None = None, **objects: Any) -> CheckpointInfo:
    """Save a training state as a checkpoint directory at ``url`` (any fsspec URL).

    Pass either a :class:`TrainingState` or framework objects (``model``, ``optimizer``,
    ``cursor``, and whatever else the model's adapter captures, e.g. ``scheduler=``), which the
    matching adapter captures.  The save is atomic: readers see the whole checkpoint or none
    of it.

    Example:
        >>> import numpy as np, ckptcore
        >>> s = ckptcore.TrainingState(model={"w": np.arange(3.0)}, step=1)
        >>> info = ckptcore.save_state("memory://doc/ckpt-1", s)
        >>> ckptcore.load_state("memory://doc/ckpt-1").model["w"]
        array([0., 1., 2.])

    With ``group``, every rank calls ``save_state`` with the same replicated state and its own
    blocks of sharded tensors as ``ckptcore.Shard`` leaves: each writes its blocks and about
    1/N of the replicated bytes, rank 0 commits once, and every rank returns or raises alike
    (``ckptcore/_dist.py``).  ``fence``: the writer lease of the root ``url`` is in (what a
    ``CheckpointManager`` passes; docs/RELIABILITY.md, "Fencing").

    The manifest records the checkpoint's lineage (``CheckpointInfo.lineage``, ``ckpt log``):
    the run (one run id for every ``save_state`` of a process), the host, versions, the git
    commit of the working directory, ``tags`` (``{str: str}``, yours) and a fingerprint of the
    data position, RNG states and optimizer step.  ``resumed_from``: the URL (or
    ``CheckpointInfo``) of the checkpoint this run resumed from, when it did: the save then
    keeps that checkpoint's run id and counts one resume more (a ``CheckpointManager`` does
    this itself).  ``lineage``: the :class:`ckptcore.lineage.Run` to record instead (what a
    manager passes).

    Returns:
        The :class:`CheckpointInfo` of what was committed.  With ``group``, on the ranks other
        than 0 it is built from a summary rank 0 sends them, without reading the store: its
        ``tensors`` and ``shards`` lists (and ``data``/``metadata`` when they are larger than a
        few KiB) are read from the manifest on first use, once.  By then the step may be gone
        (a rewind, retention) or replaced: that first use raises ``CheckpointNotFoundError``.

    Raises:
        CheckpointExistsError: a checkpoint is already at ``url`` and ``overwrite`` is False.
        TypeError: the state holds a value that cannot be stored (the message names it).
        SchemaError: a reader would refuse the manifest (e.g. too large); nothing committed.
        GroupError: with ``group``, a peer failed, died or timed out; nothing was committed.
        FencedError: with ``fence``, another writer took the root over; a commit made after
            that is ignored by every reader.
    """
    objects = _given(model=model, optimizer=optimizer, cursor=cursor, **objects)
    outer = _meter.current()  # a manager's save: its event, not this one's
    meter = outer or _meter.Meter()
    with _meter.measuring(meter):
        try:
            info = _save(os.fspath(url), state, objects, storage_options, overwrite, group,
                         fence, meter, lineage, tags, resumed_from)
        except Exception as e:
            if outer is None:
                events.emit(events.SaveEvent(url=os.fspath(url), step=getattr(state, "step", None),
                                             error=type(e).__name__, **_meter.figures(meter)))
            raise
    if outer is None:
        events.emit(events.SaveEvent(url=info.url, step=info.step, bytes=info.nbytes,
                                     **_meter.figures(meter)))
    return info


def _save(url: str, state: TrainingState | None, objects: dict[str, Any],
          storage_options: Mapping[str, Any] | None, overwrite: bool,
          group: ProcessGroup | None, fence: Any, meter: _meter.Meter, lineage: Run | None,
          tags: Mapping[str, str] | None, resumed_from: Any) -> CheckpointInfo:
    """``save_state``'s work, measured by ``meter``."""
    store = Store(url, dict(storage_options or {}))
    run = lineage if lineage is not None else _run_of(tags, resumed_from, storage_options)
    state, enc, arrays, version = _encode(store, state, objects, group)
    token = uuid.uuid4().hex[:16]
    record = _lineage_record(state, run, group)
    make_manifest = _manifest_maker(state, enc, version, token, fence, len(arrays), meter,
                                    record)
    if group is not None:
        return _save_with_group(store, group, enc, arrays, make_manifest, token=token,
                                overwrite=overwrite, fence=fence)
    return info_of(store.url, _commit_arrays(store, enc, arrays, make_manifest, token=token,
                                             overwrite=overwrite, fence=fence))


def _commit_arrays(store: Store, enc: Any, arrays: list[np.ndarray], make_manifest: Any, *,
                   token: str, overwrite: bool, fence: Any) -> Manifest:
    """Write ``arrays`` and commit their manifest at ``store`` (one process).  The shards'
    fsyncs run while the manifest is built and validated (``_io.Syncs``); the commit waits for
    them before the rename or publish, and a failed save still waits for them before raising."""
    syncs = _io.Syncs()

    def write(target: Store) -> Manifest:
        shards, table = _io.write_payload(target, arrays, enc.names, token, enc.dtypes,
                                          chunks=enc.chunks, syncs=syncs)
        if table.chunked:  # overlapping blocks of one array: a reader would refuse the file
            try:
                check_chunks(table, store.url)
            except SchemaError as e:
                raise ValueError(f"{e}; nothing was saved") from None
        return make_manifest(shards, table)

    try:
        return commit(store, write, token=token, overwrite=overwrite, fence=fence,
                      durable=syncs.wait)
    finally:
        syncs.join()  # after a failure: no fsync left running behind the error


def _save_with_group(store: Store, group: ProcessGroup, enc: Any, arrays: list[np.ndarray],
                     make_manifest: Any, *, token: str, overwrite: bool,
                     fence: Any) -> CheckpointInfo:
    """``save_state``'s part with a group: the save (``_dist``), then this rank's answer."""
    committed = _dist.save(store, group, enc, arrays, make_manifest, token=token,
                           overwrite=overwrite, fence=fence, describe=summary_of)
    try:
        return _group_info(store, committed)
    finally:
        # Rank 0 goes on only once every rank has its answer: its next act may delete this very
        # step (a rewind), and a rank still reading the manifest (one that missed rank 0's
        # summary) would find it gone.  Lists read later, on first use, are not covered: they
        # raise CheckpointNotFoundError if the step is gone by then (save_state's docstring).
        _dist.settle(store, group)


def _group_info(store: Store, committed: Manifest | bytes | None) -> CheckpointInfo:
    """This rank's answer to a group save (``_dist.save``'s result): rank 0 has the manifest;
    the others build it from rank 0's summary, reading nothing; a rank without a usable one (it
    missed the outcome and found the commit in the store) reads the manifest."""
    if isinstance(committed, Manifest):
        return info_of(store.url, committed)
    info = info_from_summary(store, committed) if committed is not None else None
    if info is None:
        log.info("%s: no summary of the commit from rank 0; reading the manifest", store.url)
        info = info_of(store.url, read_manifest(store))
    return info


def _encode(store: Store, state: TrainingState | None, objects: dict[str, Any],
            group: ProcessGroup | None) -> tuple[TrainingState, Any, list[np.ndarray], int]:
    """The state (captured from ``objects`` if need be), its encoding, its arrays (little
    endian) and the manifest version; with a group, a failure here fails every rank at once."""
    _writer_version(None)  # a bad knob is the caller's error, before anything is captured
    try:
        state, _ = capture_state(state, objects)  # borrowed arrays: written before we return
        enc = _codec.encode_state(state)
        arrays = [_codec.to_little_endian(a) for a in enc.arrays]
        return state, enc, arrays, _writer_version(enc, arrays)
    except Exception as e:
        if group is not None:
            _dist.fail(store, group, e)  # the other ranks learn it at once, then this raises
        raise


def _given(**objects: Any) -> dict[str, Any]:
    """The framework objects a call was given (``None``: not given)."""
    return {k: v for k, v in objects.items() if v is not None}


def _writer_version(enc: Any, arrays: Sequence[np.ndarray] = ()) -> int:
    """The manifest version to write: the ``format_version`` knob's, or 3 (chunked tensors) for
    a state with ``Shard`` leaves; ``ValueError`` for a knob this ckptcore cannot write."""
    version = _knobs.format_version()
    if version not in WRITE_VERSIONS:  # (4 is chosen by the table's size, _manifest4)
        raise ValueError(f"the format_version knob is {version}; this ckptcore writes "
                         f"{', '.join(map(str, WRITE_VERSIONS))}")
    if enc is not None and (enc.chunks is not None or version >= CHUNKED_VERSION):
        if version < 2:
            raise ValueError("the format_version knob is 1, but the state holds ckptcore.Shard "
                             "leaves, which need format version 3")
        version = CHUNKED_VERSION
        if enc.chunks is None:
            enc.chunks = _codec.Chunking.whole(arrays)
    return version


def _run_of(tags: Mapping[str, str] | None, resumed_from: Any,
            storage_options: Mapping[str, Any] | None) -> Run:
    """The run of a plain ``save_state``: this process's, or one resumed from ``resumed_from``
    (its manifest read for its run id and fingerprint)."""
    run = lineage_module.process_run(lineage_module.check_tags(tags))
    if resumed_from is None:
        return run
    info = (resumed_from if isinstance(resumed_from, CheckpointInfo)
            else inspect(resumed_from, storage_options=storage_options))
    saved = dict(info.lineage) if info.lineage is not None else None
    parts = (saved or {}).get("parts") or {p: None for p in lineage_module.PARTS}
    return run.resumed(saved, lineage_module.resume(
        saved, step=info.step, url=info.url, tier="local",
        generation=info.writer.get("generation"), framework=info.framework, saved_parts=parts))


def _lineage_record(state: TrainingState, run: Run, group: ProcessGroup | None
                    ) -> dict[str, Any] | None:
    """The manifest's lineage map; None (logged) if it cannot be made: a save never fails
    for want of its lineage."""
    try:
        return lineage_module.record(
            state, run, world_size=int(group.size) if group is not None else 1,
            framework=state.framework,
            framework_versions=dict(state.metadata.get("versions") or {}))
    except Exception as e:  # noqa: BLE001 - bookkeeping: never the reason a save fails
        log.warning("save: no lineage recorded (%s: %s)", type(e).__name__, e)
        return None


def _manifest_maker(state: TrainingState, enc: Any, version: int, token: str, fence: Any,
                    narrays: int, meter: _meter.Meter,
                    lineage: dict[str, Any] | None = None) -> Any:
    """``make(shards, table)``: the manifest of this save once its shards are written, with
    what the save knows of its cost by then (``stats``: docs/FORMAT.md) and its lineage."""
    count = enc.chunks.tensor[-1] + 1 if enc.chunks is not None and narrays else narrays
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
            alignment=_knobs.alignment(), shards=tuple(shards), tensors=tensors,
            tree=enc.tree, version=version, referenced=tuple(range(count)),
            stats=_stats(shards, tensors, meter), lineage=lineage)

    return make_manifest


def _stats(shards: Sequence[ShardEntry], tensors: TensorTable, meter: _meter.Meter
           ) -> dict[str, Any]:
    """The manifest's ``stats``: the checkpoint's bytes and shards, the seconds since the save
    began, and (an async save) whether and how long its caller waited, when known."""
    stats = {"bytes": tensors.nbytes(), "bytes_written": sum(s.size for s in shards),
             "shards": len(shards), "seconds": round(meter.elapsed(), 6),
             "asynchronous": meter.background}
    if meter.blocked is not None:
        stats["seconds_blocked"] = round(meter.blocked, 6)
    return stats


def check_keys(keys: Iterable[str] | str | None) -> list[str] | None:
    """``keys=`` of a load or restore as a list of sections (None: all); ``ValueError`` naming
    an unknown one (a usage error, raised before anything is read)."""
    if keys is None:
        return None
    wanted = [keys] if isinstance(keys, str) else list(keys)
    unknown = [k for k in wanted if k not in TrainingState.SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {TrainingState.SECTIONS}")
    return wanted


def _select(tree: dict, keys: Iterable[str] | None) -> dict:
    keys = check_keys(keys)
    if keys is None:
        return tree
    # Small bookkeeping sections always come along: they hold no tensors worth skipping.
    wanted = set(keys) | {"step", "epoch", "framework", "metadata", "params"}
    skipped = sorted(k for k, v in tree.items() if k not in wanted and v not in (None, {}, [], ""))
    if skipped:
        log.debug("load_state: keys=%s; not reading the saved section(s) %s", sorted(keys), skipped)
    return {k: v for k, v in tree.items() if k in wanted}


def load_state(url: str | os.PathLike, *, model: Any = None, optimizer: Any = None,
               cursor: Any = None, verify: bool = True, keys: Iterable[str] | None = None,
               storage_options: Mapping[str, Any] | None = None,
               like: TrainingState | None = None, group: ProcessGroup | None = None,
               strict: bool | None = None, rng: bool | None = None,
               name_map: Mapping[str, str | None] | None = None, approximate: bool = False,
               **objects: Any) -> TrainingState:
    """Load the checkpoint at ``url``; with framework objects, restore into them too.

    ``model``, ``optimizer``, ``cursor`` and whatever else the model's adapter restores (e.g.
    ``scheduler=``) are the objects.  ``strict`` (raise on a missing or unexpected name; the
    adapter's default, True, when None) and ``rng`` (restore the saved RNG states; default
    True) go to the adapter's ``restore``; ``name_map`` and ``approximate`` to the conversion
    of a state saved by another framework (:func:`convert`).

    Sharded tensors (saved from ``ckptcore.Shard`` leaves) come back whole when their chunks
    cover them.  ``like`` (a :class:`TrainingState` whose leaves are ``Shard``s, ``Chunks`` or
    arrays; their values are ignored) asks for blocks instead: each ``Shard`` leaf comes back as
    that block of the saved global array, however the checkpoint was cut, reading only the
    byte ranges that intersect it.  Other values come back as saved.

    Sizes are always checked before reading; with ``verify`` every tensor read is checked
    against its checksum before it is returned.  ``keys`` loads (and reads) some sections only.

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
    objects = _given(model=model, optimizer=optimizer, cursor=cursor, strict=strict, rng=rng,
                     name_map=name_map, **objects)
    if approximate:
        objects["approximate"] = True
    outer = _meter.current()  # a manager's restore, or a group's load: theirs is the event
    meter = outer or _meter.Meter()
    with _meter.measuring(meter):
        try:
            state = _load(os.fspath(url), verify, keys, storage_options, like, group, objects)
        except Exception as e:
            if outer is None:
                events.emit(events.RestoreEvent(url=os.fspath(url), error=type(e).__name__,
                                                **_restore_figures(meter)))
            raise
    if outer is None:
        events.emit(events.RestoreEvent(url=os.fspath(url), step=state.step,
                                        **_restore_figures(meter)))
    return state


def _restore_figures(meter: _meter.Meter) -> dict[str, Any]:
    """The fields of a restore's event: the meter's, and the bytes and shards it loaded."""
    figures = _meter.figures(meter)
    figures["bytes"], figures["shards"] = meter.loaded
    return figures


def _load(url: str, verify: bool, keys: Iterable[str] | None,
          storage_options: Mapping[str, Any] | None, like: TrainingState | None,
          group: ProcessGroup | None, objects: dict[str, Any]) -> TrainingState:
    """``load_state``'s work (measured by the caller)."""
    store = Store(url, dict(storage_options or {}))
    if group is not None:
        return _dist.agree(store, group, lambda: load_state(
            url, verify=verify, keys=keys, storage_options=storage_options, like=like, **objects))
    manifest, tree, state, reading = _open(store, keys, like, verify,
                                           lazy=verify and store.local and _checks_values(objects))
    if reading is None:  # chunked tensors: read and verified already
        restore_objects(state, objects)
        return state
    try:
        return _assign(manifest, tree, reading, objects, verify)
    finally:
        reading.close()


def _checks_values(objects: Mapping[str, Any]) -> bool:
    """Whether the adapter of ``objects`` verifies each value as it copies it (its restore calls
    ``ckptcore.adapter.value_check``): then the load verifies nothing ahead (``_io.Reading``,
    ``lazy``)."""
    if "model" not in objects:
        return False
    try:
        adapter = adapter_for(objects["model"])
    except Exception:  # noqa: BLE001 - no adapter: the restore raises it, after the reading
        return False
    return bool(getattr(adapter, "checks_values", False))


def _open(store: Store, keys: Iterable[str] | None, like: TrainingState | None, verify: bool,
          lazy: bool = False) -> tuple[Manifest, dict, TrainingState | None, _io.Reading | None]:
    """The manifest and the selected tree, and either the decoded state (chunked tensors: read
    and verified already) or the :class:`_io.Reading` of its tensors, started.  A checkpoint
    overwritten between its manifest and its shards is read again."""
    for attempt in range(_READ_ATTEMPTS):
        manifest, tree = _manifest_for(store, keys, like)
        wanted = (manifest.referenced_indices() if keys is None
                  else sorted({r.index for r in _codec.refs(tree)}))
        _meter.loading(_wanted_bytes(manifest, None if keys is None else wanted),
                       len(manifest.shards))
        try:
            if like is not None or manifest.tensors.chunked:
                from . import _chunks

                return manifest, tree, _codec.decode_state(
                    _chunks.load_tree(store, manifest, tree, like, verify=verify)), None
            return manifest, tree, None, _io.Reading(store, manifest, wanted, verify=verify,
                                                     lazy=lazy)
        except (IncompleteCheckpointError, FileNotFoundError):
            # An overwrite may have replaced the checkpoint between our reading its manifest and
            # its shards: then read the new one; otherwise the shards really are missing.
            if attempt + 1 == _READ_ATTEMPTS or not _replaced(store, manifest):
                raise
            log.info("load_state: %s was overwritten while it was read; reading the new one "
                     "(attempt %d of %d)", store.url, attempt + 2, _READ_ATTEMPTS)
    raise AssertionError("unreachable")  # the last attempt returned or raised


def _wanted_bytes(manifest: Manifest, wanted: Sequence[int] | None) -> int:
    """The bytes of the tensors a load reads: all (``wanted`` None) or those of some sections."""
    if wanted is None:
        return manifest.tensors.nbytes()
    lengths = manifest.tensors.length
    index = np.asarray(wanted, dtype=np.int64)
    return int(lengths[index[index < len(lengths)]].sum(dtype=np.uint64))


def _manifest_for(store: Store, keys: Iterable[str] | None, like: TrainingState | None
                  ) -> tuple[Manifest, dict]:
    """The manifest and the selected tree for a load; with ``like``, of a version-4 manifest
    only the row groups that can hold its blocks, unless the rows read do not cover them all
    (then all of them: docs/FORMAT.md, section 12)."""
    if like is None:
        manifest = read_manifest(store)
        return manifest, _select(manifest.tree, keys)
    from . import _chunks

    manifest, data = read_manifest_bytes(store, _chunks.selector(like))
    tree = _select(manifest.tree, keys)
    if manifest.partial and not _chunks.covers(store, manifest, tree, like):
        log.debug("load_state: %s: the row groups that can hold the blocks asked for do not "
                  "hold them all; reading every row group", store.url)
        manifest = manifest_whole(store, data)
        tree = _select(manifest.tree, keys)
    return manifest, tree


def _assign(manifest: Manifest, tree: dict, reading: _io.Reading, objects: dict,
            verify: bool) -> TrainingState:
    """The state of ``reading``'s tensors, restored into ``objects``; streaming (each tensor
    assigned once its own batch verified) when the objects are of the saving framework."""
    stream = verify and _streams(manifest, objects)
    arrays = reading.arrays if stream else reading.result()
    tree = _codec.substitute(tree, lambda r: arrays[r.index][()] if r.scalar else arrays[r.index])
    state = _codec.decode_state(tree)
    if not stream:
        restore_objects(state, objects)
        return state
    # Tensors are assigned as soon as their own batch is verified, while later batches are still
    # being read (RestorePlan.apply waits on this gate before each put).
    with restore_gate(_Gate(reading, arrays)):
        try:
            restore_objects(state, objects)
        except Exception:
            reading.result()  # damage, if any, is the error to report, not its symptom
            raise
    reading.result()  # what no put took (RNG states, extra...) is verified before we return
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

    def check(self, value: Any) -> None:
        """Verify ``value`` now, in the calling thread (``_io.Reading.check``)."""
        i = self._index.get(id(value))
        if i is None:
            self.wait_all()
        elif not self._done:
            self._reading.check(i)

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
                                "to continue at the saved sample"}, stacklevel=caller_level() + 1)


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
