"""Committing a checkpoint: payload first, manifest last; the manifest is the commit.

A reader trusts only ``manifest.msgpack``: a checkpoint exists when, and only
when, its manifest does, and the manifest names every shard with its size and
checksum.  Two strategies, chosen by the store's capabilities:

**Local disk (atomic rename).**  Everything is written into a temporary sibling
directory ``.<name>.tmp-<token>``: shards, fsync each; the manifest, fsync; the
directory, fsync.  Then the directory is renamed into place and the parent is
fsynced.  (A save may leave its shards' fsyncs running while it builds and writes the
manifest: ``commit(..., durable=)`` waits for them before the rename.)  ``rename`` onto an existing non-empty directory fails, so a second
writer gets :class:`CheckpointExistsError` and its temporary directory is
removed.  An overwrite swaps the two directories atomically with
``renameat2(RENAME_EXCHANGE)`` (Linux), so some complete checkpoint is always
readable at the path; where the kernel or filesystem lacks it, the old
directory is renamed aside first, leaving a window of two renames without one.

**Object stores (S3, GCS, Azure, memory).**  There is no atomic rename:
``fs.mv`` and ``fsspec.transaction`` are copy + delete, or in-process only, so
neither is used.  Shards are written in place under names unique to this save
attempt (``shard-00000-<token>.bin``), then the manifest is published with a
create-only PUT (S3 ``If-None-Match: *``).  Two writers racing for one
checkpoint each write their own shards and exactly one publish succeeds; the
loser removes its shards (or ``gc()`` does, if it died).  An overwrite replaces
the manifest with a single PUT, which object stores apply atomically, and only
then deletes the old shards: at every moment the manifest in place names shards
that exist.  On stores without an atomic create, create-only is a check and a
write; docs/RELIABILITY.md spells out what that means.

**Only what every reader accepts is published.**  Before the rename or the PUT, the manifest's
bytes go through the reader's own validation (:meth:`Manifest.from_bytes`, the size bound of
``max_manifest_bytes``) and every shard it names in the folder is checked present with its
size (one listing); a refusal is raised and nothing is committed.

**Fencing.**  A writer holding a root's lease passes its ``fence`` (``_lock.WriterLock``):
``fence.before_commit()`` raises if the lease was lost (superseded, or its renewal overdue and
taken over), and ``fence.after_commit(step)`` checks, once the manifest is in place, that the
commit landed while the lease was still this writer's (a writer paused between the check and
the PUT).  A commit made after a takeover is ignored by every reader (``_fence``), and the
writer gets :class:`FencedError`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from typing import Any, Callable

from . import _knobs
from ._fence import STEP
from ._manifest import MANIFEST_NAME, SHARD_FOLDER, Manifest, safe_shard_name, shard_folder
from ._manifest4 import encode_manifest, memory_fetch, reader
from ._storage import CAS_PREFIX, Entry, Store, tick, fsync_dir
from .errors import (CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError,
                     SchemaError, StorageError)

TMP_MARK = ".tmp-"
log = logging.getLogger("ckptcore")


def commit(store: Store, write: Callable[[Store], Manifest], *, token: str, overwrite: bool,
           fence: Any = None, durable: Callable[[], None] | None = None) -> Manifest:
    """Write a checkpoint at ``store`` with ``write(target) -> Manifest`` (which writes the shards).

    Any failure to write, flush, fsync or close a file, or to fsync a folder, is raised and
    nothing is committed (except a failed fsync of the parent folder after the rename, which the
    error describes).  So is a manifest that a reader would refuse (:func:`publishable`), and a
    lost lease (``fence``, see the module docstring).  ``durable()``, when given, returns once
    the shards ``write`` wrote are durable (raising if they cannot be): ``write`` may leave
    their fsync running (``_io.Syncs``) while the manifest is built and checked, and it is
    called before anything is renamed or published.
    """
    try:
        present = store.exists(MANIFEST_NAME)
    except CheckpointNotFoundError as e:  # a missing bucket: for a save, a storage failure
        raise StorageError(str(e)) from e
    if present and not overwrite:
        raise CheckpointExistsError(f"{store.url}: a checkpoint already exists there; "
                                    "pass overwrite=True to replace it")
    stale: list[str] = []
    if store.atomic_rename:
        manifest = _commit_rename(store, write, token=token, overwrite=overwrite, fence=fence,
                                  durable=durable)
    else:
        manifest, stale = _commit_publish(store, write, token=token, overwrite=overwrite,
                                          fence=fence, durable=durable)
    if fence is not None:
        fence.after_commit(store)
    # An overwrite's previous shards go only once this commit stands: a writer found fenced
    # here deletes nothing (they are gc's, which sees what readers accept).
    for name in stale:
        log.debug("%s: removing %s of the overwritten checkpoint", store.url, name)
        store.delete(name)
    return manifest


def publishable(target: Store, manifest: Manifest, token: str = "0" * 16
                ) -> tuple[Manifest, bytes, list[tuple[str, bytes]]]:
    """The manifest as committed, its bytes and the objects to write before it (a version-4
    manifest's rows object, :func:`_manifest4.encode_manifest`), once a reader would accept
    them: within ``max_manifest_bytes``, valid by :meth:`Manifest.from_bytes` (structure, names,
    byte ranges), and every shard it names in ``target`` present with its size.  A refusal
    raises; nothing is published then.

    (``cas:`` blobs of a deduplicated replica live outside the folder; ``_replica`` checks them.)
    """
    manifest, data, extra = encode_manifest(manifest, token)
    limit = _knobs.max_manifest_bytes()
    for what, size in [("manifest", len(data))] + [(p, len(b)) for p, b in extra]:
        if size > limit:
            raise SchemaError(f"{target.url}: the {what} would be {size} bytes, over the "
                              f"{limit}-byte limit every reader applies (max_manifest_bytes): "
                              "nothing committed; keep large values in tensors, not in metadata")
    Manifest.from_bytes(data, source=f"{target.join(MANIFEST_NAME)} (before publishing)",
                        rows=reader(memory_fetch(dict(extra))))
    sizes = {e.name: e.size for e in shard_files(target) if not e.is_link}
    for s in manifest.shards:
        if s.path.startswith(CAS_PREFIX):
            continue
        if sizes.get(s.path) != s.size:
            what = "missing" if s.path not in sizes else f"{sizes[s.path]} bytes"
            raise IncompleteCheckpointError(
                f"{target.join(s.path)}: the manifest to publish names it with {s.size} bytes, "
                f"but it is {what}; nothing committed")
    return manifest, data, extra


def shard_files(store: Store) -> list[Entry]:
    """The files of a checkpoint folder that may be shards: those directly in it and, when it
    has shard folders (a large group's save, ``_manifest.SHARD_FOLDER``), those in them, named
    relative to the folder (``3f/shard-...``).  Links are listed as links, never followed."""
    top = store.listdir()
    files = [e for e in top if not e.is_dir]
    if any(e.is_dir and SHARD_FOLDER.fullmatch(e.name) for e in top):
        # One recursive listing (one paginated LIST on an object store), not one per folder.
        files += [e for e in store.find() if "/" in e.name and safe_shard_name(e.name)]
    return files


def is_shard_file(name: str) -> bool:
    """Whether a listed name (:func:`shard_files`) is named like a shard of some save."""
    return name.rpartition("/")[2].startswith("shard-")


def _commit_rename(store: Store, write, *, token: str, overwrite: bool, fence: Any,
                   durable: Callable[[], None] | None = None) -> Manifest:
    parent = os.path.dirname(store.path)
    os.makedirs(parent, exist_ok=True)
    tmp = store.sibling(f".{store.name}{TMP_MARK}{token}")
    os.makedirs(tmp.path)
    swapped = False
    try:
        manifest = write(tmp)  # raises any failed write/fsync/close of a shard
        manifest, data, extra = publishable(tmp, manifest, token)
        for path, blob in extra:  # (a rows object, named by this attempt's token)
            tmp.write_bytes(path, blob)
        for folder in sorted({shard_folder(s.path) for s in manifest.shards} - {""}):
            fsync_dir(tmp.join(folder))  # the shards' names in their folders, before the commit
        tmp.write_bytes(MANIFEST_NAME, data)  # raises a failed write/fsync/close, as above
        fsync_dir(tmp.path)
        if durable is not None:
            durable()  # the shards too, before the folder is renamed into place
        if fence is not None:
            fence.before_commit()
        tick("rename", store.path)
        if overwrite and os.path.lexists(store.path):
            _swap_into_place(tmp.path, store.path)
            swapped = True
        else:
            try:
                os.rename(tmp.path, store.path)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise CheckpointExistsError(
                        f"{store.url}: already exists (another writer committed first, or the path "
                        "holds other files); pass overwrite=True to replace it") from e
                raise
    except BaseException as e:
        # Nothing was committed: the previous checkpoint (if any) is untouched at the path.
        log.info("%s: save failed (%s: %s); removing its temporary folder %s", store.url,
                 type(e).__name__, e, tmp.path)
        _discard(tmp)
        raise
    if swapped:
        # tmp now holds the old checkpoint: uncommit it (manifest first) before removing its
        # shards, so a crash mid-removal never leaves a manifest naming missing shards.
        _remove_old_copy(tmp)
    try:
        fsync_dir(parent)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror}: fsync of {parent} failed after the checkpoint was "
                      f"renamed into place at {store.path}; readers may see it but it may not "
                      "survive a power loss: save it again", parent) from e
    return manifest


def _discard(tmp: Store) -> None:
    """Remove a failed save's temporary folder; never masks the error being raised."""
    try:
        tmp.delete_tree()
    except Exception as e:
        log.warning("%s: could not remove the temporary folder (%s); gc() will", tmp.path, e)


def _remove_old_copy(tmp: Store) -> None:
    """After an overwrite's swap: remove the previous checkpoint, now at ``tmp``.

    The new checkpoint is committed, so a failure here is logged (``gc()`` removes the leftover),
    not raised.  If the path was a symbolic link, ``tmp`` is now that link: it is removed itself
    and nothing is deleted through it.
    """
    try:
        if os.path.islink(tmp.path):
            log.warning("%s: the overwritten path was a symbolic link; removing the link only "
                        "(its target is untouched)", tmp.path)
            tmp.delete_tree()
            return
        log.debug("%s: removing the overwritten checkpoint", tmp.path)
        tmp.delete(MANIFEST_NAME)
        tmp.delete_tree()
    except Exception as e:
        log.warning("%s: could not remove the overwritten checkpoint (%s: %s); gc() will",
                    tmp.path, type(e).__name__, e)


def _swap_into_place(new: str, old: str) -> None:
    if _rename_exchange(new, old):
        return
    aside = old + TMP_MARK + "old"
    log.info("%s: renameat2(RENAME_EXCHANGE) is unavailable here; falling back to three renames "
             "(no checkpoint at the path between the first two)", old)
    os.rename(old, aside)
    os.rename(new, old)
    os.rename(aside, new)


def _rename_exchange(a: str, b: str) -> bool:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _commit_publish(store: Store, write, *, token: str, overwrite: bool, fence: Any,
                    durable: Callable[[], None] | None = None) -> tuple[Manifest, list[str]]:
    """The manifest published, and the shards of the overwritten checkpoint it does not name
    (removed by the caller once the commit is known to stand)."""
    old_shards: set[str] = set()
    if overwrite:
        old_shards = {e.name for e in shard_files(store) if is_shard_file(e.name)}
    manifest = None
    try:
        manifest = write(store)
        manifest, data, extra = publishable(store, manifest, token)
        for path, blob in extra:  # before the manifest that names it
            store.write_bytes(path, blob)
        if durable is not None:
            durable()
        if fence is not None:
            fence.before_commit()
        tick("publish", store.join(MANIFEST_NAME))
        store.write_bytes(MANIFEST_NAME, data, create_only=not overwrite)
    except FileExistsError as e:
        log.info("%s: another writer committed first; removing this attempt's shards", store.url)
        _remove_shards(store, manifest, token=token)
        raise CheckpointExistsError(f"{store.url}: another writer committed a checkpoint there "
                                    "first") from e
    except BaseException as e:
        log.info("%s: save failed before its manifest was published (%s: %s); removing this "
                 "attempt's shards", store.url, type(e).__name__, e)
        _remove_shards(store, manifest, token=token)
        raise
    return manifest, sorted(old_shards - set(manifest.files()))


def _remove_shards(store: Store, manifest: Manifest | None, token: str | None = None) -> None:
    """Best-effort removal of this attempt's shards; ``gc()`` catches what this misses.

    Only names carrying this attempt's ``token`` are removed (every shard a save or a copy
    writes does, docs/FORMAT.md): a name without it is another attempt's, such as the committed
    shards of a writer that took the root over while this one was paused.  A manifest that
    failed validation may name anything (a peer's ``../evil.bin``), and a deduplicated
    replica's blobs are shared with other steps (never removed here; unreferenced ones are
    swept under the root's lock, ``_cas.sweep``)."""
    if not token:
        return
    try:
        names = {e.name for e in shard_files(store) if carries_token(e.name, token)}
        if manifest is not None:  # (named, but missed by a listing that lags its writes)
            names |= {p for p in manifest.files() if safe_shard_name(p)
                      and not p.startswith(CAS_PREFIX) and carries_token(p, token)}
        for name in sorted(names):
            store.delete(name)
    except Exception as e:  # cleanup must never mask the original error
        log.warning("%s: could not remove this attempt's shards (%s: %s); gc() will", store.url,
                    type(e).__name__, e)


def carries_token(name: str, token: str) -> bool:
    """Whether the listed file ``name`` (``3f/shard-...`` too) is named with the attempt ``token``."""
    return name.rpartition("/")[2].endswith(f"-{token}.bin")


def remove_uncommitted(folder: Store, *, fence: Any = None, why: str,
                       listed: list[Entry] | None = None) -> bool:
    """Remove ``folder``, which holds no manifest (a leftover of a save, or a step whose
    manifest was just deleted); whether it is gone.

    On an object store, where a writer paused past its lease may wake after another took the
    root over and committed this very step here, only the objects ``listed`` go (listed now
    when not given, and in any case before the fence is asked: a taker claims its generation
    before it writes, so nothing listed is its).  Each is deleted right after asking ``fence``
    (``before_delete``: a superseded writer deletes nothing more, ``FencedError``) and checking
    that no manifest appeared: if one did, a writer committed there meanwhile and the rest is
    left alone (logged, False; also when one appeared after the last deletion).  Every
    deletion is logged under ``why``.  On local disk the
    folder goes whole: the writer's flock cannot lapse while this process lives, so nobody
    else writes there.
    """
    if folder.local:
        if fence is not None:
            fence.before_delete()
        log.info("%s: removing %s", why, folder.url)
        folder.delete_tree()
        return True
    names = sorted(e.name for e in (folder.find() if listed is None else listed)
                   if e.name != MANIFEST_NAME)
    for name in names:
        if fence is not None:
            fence.before_delete()
        if folder.exists(MANIFEST_NAME):
            log.warning("%s: %s has a manifest again (a writer committed there meanwhile); "
                        "leaving it, and %d listed object(s) not yet deleted, alone", why,
                        folder.url, len(names) - names.index(name))
            return False
        log.info("%s: deleting %s", why, folder.join(name))
        folder.delete(name)
    if names and folder.exists(MANIFEST_NAME):  # (the folder is not gone: a step is there)
        log.warning("%s: %s has a manifest again (a writer committed there meanwhile); its "
                    "listed leftovers were deleted, the step is left alone", why, folder.url)
        return False
    _remove_empty_folders(folder, names)
    return True


def _remove_empty_folders(folder: Store, names: list[str]) -> None:
    """The folders a filesystem keeps of its own (``memory://``'s pseudo folders, made by
    ``makedirs``; object stores have none, and a folder there goes with its last object),
    deepest first, each only if empty: ``rmdir`` never removes what a writer put there since."""
    if getattr(folder.fs, "pseudo_dirs", None) is None:
        return
    subs = sorted({n.rpartition("/")[0] for n in names if "/" in n}, key=len, reverse=True)
    for rel in subs + [""]:
        try:
            folder.fs.rmdir(folder.join(rel))
        except (OSError, ValueError):  # not empty (a writer put something there since), or gone
            pass


def uncommit(ckpt: Store, token: str, fence: Any = None) -> None:
    """Take back the commit ``token`` just made at ``ckpt`` (a copy that did not verify once
    committed, ``_replica``): the writer record stops naming the step, its manifest goes, then
    the files that commit wrote (their names carry ``token``, listed before the fence is
    asked), all only while ``fence`` says this writer still holds the root: a superseded one
    deletes nothing (``FencedError``)."""
    ours = [] if ckpt.local else [e for e in ckpt.find() if carries_token(e.name, token)]
    if fence is not None:
        fence.before_delete()
        m = STEP.fullmatch(ckpt.name)
        if m:  # (readers trust a step the record names to have its manifest)
            fence.forget(int(m.group(1)))
    ckpt.delete(MANIFEST_NAME)
    remove_uncommitted(ckpt, fence=fence, why="uncommitting", listed=ours)
