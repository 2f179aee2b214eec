"""Copying a committed checkpoint to another store: backup replicas and ``ckpt sync``.

A copy is committed with the same protocol as a save (``_commit.commit``: the manifest last;
rename locally, create-only PUT on object stores), from bytes that were verified on the way:
each source shard is read whole and checked against its CRC-32C before a byte of it is written
(a damaged source is never replicated; the copy fails naming the shard).

Two layouts:

* **plain**: the shards are copied as they are (a deduplicated source's ``cas:`` objects become
  ``shard-<hash>.bin`` files of the step folder); the manifest is the source's with those names.
* **deduplicated** (a backup root): every tensor's bytes become a content-addressed object
  ``<root>/chunks/<hh>/<hash>`` (BLAKE2b-256 of the bytes, docs/FORMAT.md, "Deduplicated
  replicas"), shared by every step that holds the same bytes, so a frozen layer is uploaded
  once.  Tensors under ``pack_below`` bytes travel together in packs of about 1 MiB, in table
  order (a small tensor each would cost a request apiece); a second object of the same bytes in
  one step is named with a salted hash (two rows of a manifest never share bytes).  Objects already in the root (``known``,
  listed once by the caller) are not uploaded again.  The manifest's rows keep their checksums
  and point at the objects; only shard paths and offsets change.

Chunks are never deleted here, not even after a failed commit: another step may reference them
(``_commit`` skips ``cas:`` shards when it cleans up).  Unreferenced ones are swept by
``_backup.sweep`` under the root's writer lock, after a grace period.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import crc32c as _crc
import numpy as np

from ._commit import commit
from ._manifest import Manifest, ShardEntry, encoded_tree
from ._storage import CAS_DIR, CAS_PREFIX, Store, fsync_dir
from .errors import CorruptCheckpointError

log = logging.getLogger("ckptcore")

HASH = "blake2b-256"
PACK_BELOW = 256 << 10  # tensors below this many bytes travel in packs
PACK_SIZE = 1 << 20  # a pack is closed once it holds this many bytes
_ALIGN = 64


def content_name(data: Any, copy: int = 0) -> str:
    """The ``cas:`` shard name of ``data``'s bytes; ``copy`` > 0 names the copy-th further
    object of the same bytes in one step (BLAKE2b's salt), so that it too is deduplicated
    across steps and no two rows of one manifest share an object."""
    salt = b"copy%d" % copy if copy else b""
    return CAS_PREFIX + hashlib.blake2b(data, digest_size=32, salt=salt).hexdigest()


def chunk_rel(name: str) -> str:
    """A ``cas:`` name's path under the root: ``chunks/<hh>/<hash>``."""
    digest = name[len(CAS_PREFIX):]
    return f"{CAS_DIR}/{digest[:2]}/{digest}"


@dataclass
class CopyStats:
    """What a copy moved: bytes read from the source, bytes and objects written to the
    destination, objects found there already (deduplicated), and seconds."""

    read: int = 0
    written: int = 0
    objects: int = 0
    reused: int = 0
    seconds: float = 0.0


def list_chunks(root: Store) -> dict[str, tuple[int, float | None]]:
    """``{cas name: (size, mtime)}`` of every chunk object under ``root`` (one listing)."""
    out: dict[str, tuple[int, float | None]] = {}
    for e in root.find(CAS_DIR):
        prefix, _, digest = e.name.partition("/")
        if not e.is_link and len(digest) == 64 and digest.startswith(prefix) and len(prefix) == 2:
            out[CAS_PREFIX + digest] = (int(e.size or 0), e.mtime)
    return out


def _read_shard(src: Store, shard: ShardEntry) -> bytes:
    data = src.read(shard.path)
    if len(data) != shard.size:
        raise CorruptCheckpointError(f"{src.join(shard.path)}: {len(data)} bytes, the manifest "
                                     f"says {shard.size}; not copied", file=src.join(shard.path))
    actual = _crc.crc32c(data)
    if actual != shard.checksum:
        raise CorruptCheckpointError(
            f"{src.join(shard.path)}: shard checksum mismatch (expected {shard.checksum:#010x}, "
            f"got {actual:#010x}); not copied", file=src.join(shard.path),
            expected=shard.checksum, actual=actual)
    return data


def _write_objects(root: Store, objects: dict[str, bytes | memoryview]) -> None:
    """Write content-addressed objects (``{cas name: bytes}``) under ``root``, each appearing
    whole or not at all: one PUT each on object stores (several at once), a temporary file
    renamed into place locally."""
    if not objects:
        return
    if root.local:
        for name, data in objects.items():
            rel = chunk_rel(name)
            root.makedirs(os.path.dirname(rel))
            tmp = f"{rel}.tmp-{uuid.uuid4().hex[:8]}"
            root.write_bytes(tmp, bytes(data))
            os.replace(root.join(tmp), root.join(rel))
            fsync_dir(os.path.dirname(root.join(rel)))  # the rename, durable before the manifest
        return
    for name in objects:  # (object stores have no folders to make; the call is cheap)
        root.makedirs(os.path.dirname(chunk_rel(name)))
    with root._remote("write", CAS_DIR, write=True):
        root.fs.pipe({root.join(chunk_rel(n)): bytes(d) for n, d in objects.items()})


def copy_checkpoint(src: Store, dst: Store, *, dedup: bool, known: dict[str, Any] | None = None,
                    overwrite: bool = False, progress: Callable[[int], None] | None = None,
                    pack_below: int = PACK_BELOW,
                    gate: Callable[[], None] | None = None) -> tuple[Manifest, CopyStats]:
    """Copy the committed checkpoint at ``src`` to ``dst`` (a step folder; with ``dedup`` its
    parent is a deduplicating root whose chunks ``known`` lists, updated with what is written).
    Returns the destination's manifest and what was moved."""
    from .api import read_manifest_bytes

    started = time.perf_counter()
    manifest, raw = read_manifest_bytes(src)
    manifest = dataclasses.replace(manifest, tree=encoded_tree(raw))  # written back as stored
    stats = CopyStats()
    token = uuid.uuid4().hex[:16]
    known = {} if known is None else known
    root = dst.parent()

    def write(target: Store) -> Manifest:
        if dedup:
            return _write_dedup(src, target, root, manifest, known, stats, progress, pack_below,
                                gate)
        return _write_plain(src, target, manifest, stats, progress)

    out = commit(dst, write, token=token, overwrite=overwrite)
    stats.seconds = time.perf_counter() - started
    log.info("copy: %s -> %s (%s): %d bytes read, %d bytes in %d objects written, %d reused, "
             "%.2f s", src.url, dst.url, "deduplicated" if dedup else "plain", stats.read,
             stats.written, stats.objects, stats.reused, stats.seconds)
    return out, stats


def _write_plain(src: Store, target: Store, manifest: Manifest, stats: CopyStats,
                 progress: Callable[[int], None] | None) -> Manifest:
    shards = []
    for shard in manifest.shards:
        data = _read_shard(src, shard)
        name = (f"shard-{shard.path[len(CAS_PREFIX):]}.bin" if shard.path.startswith(CAS_PREFIX)
                else shard.path)
        target.write_bytes(name, data)
        shards.append(ShardEntry(path=name, size=shard.size, checksum=shard.checksum))
        stats.read += len(data)
        stats.written += len(data)
        stats.objects += 1
        if progress:
            progress(len(data))
    return dataclasses.replace(manifest, shards=tuple(shards))


def _write_dedup(src: Store, target: Store, root: Store, manifest: Manifest, known: dict,
                 stats: CopyStats, progress: Callable[[int], None] | None,
                 pack_below: int, gate: Callable[[], None] | None = None) -> Manifest:
    """The deduplicated layout (module docstring).  Pipelined: two threads hash (hashlib
    releases the GIL), and each new object is handed to the upload threads as soon as it is
    named, so hashing, reading the next shard and uploading overlap.  Small tensors are packed
    in table order, a pack closed at ``PACK_SIZE``: the small tensors of frozen layers (next to
    each other in the table) then fill packs that do not change from step to step.  ``gate()``
    is called between objects: the backup tier pauses there while its manager saves."""
    table = manifest.tensors
    n = len(table)
    shard_col, offset_col = table.shard.astype(np.int64), table.offset.astype(np.int64)
    length_col = table.length.astype(np.int64)
    by_shard: dict[int, list[int]] = {}
    for row in range(n):
        by_shard.setdefault(int(shard_col[row]), []).append(row)
    new_shards: list[ShardEntry] = []
    index: dict[str, int] = {}
    row_shard = np.zeros(n, np.uint32)
    row_offset = np.zeros(n, np.uint64)
    hasher = ThreadPoolExecutor(2, thread_name_prefix="ckptcore-hash")
    uploader = ThreadPoolExecutor(max(1, root.writers), thread_name_prefix="ckptcore-upload")
    pending: list[Any] = []
    added: list[str] = []
    pack = bytearray()
    pack_rows: list[tuple[int, int]] = []

    def upload(name: str, data: Any) -> None:
        if gate is not None:
            gate()
        _write_objects(root, {name: data})

    def place(name: str, data: Any, checksum: int, rows: list[tuple[int, int]]) -> None:
        """Name ``data`` (its hash ``name``; a further copy in this step gets a salted one),
        list it as a shard, point ``rows`` (row, offset) at it, upload it unless known."""
        copy = 0
        while name in index:  # the same bytes again in this step: the next copy's name
            copy += 1
            name = content_name(data, copy)
        index[name] = len(new_shards)
        new_shards.append(ShardEntry(path=name, size=len(data), checksum=checksum))
        for r, off in rows:
            row_shard[r], row_offset[r] = index[name], off
        if name in known and known[name][0] == len(data):
            stats.reused += 1
            return
        pending.append(uploader.submit(upload, name, data))
        added.append(name)
        known[name] = (len(data), time.time())
        stats.written += len(data)
        stats.objects += 1

    def close_pack() -> None:
        nonlocal pack, pack_rows
        if pack_rows:
            end = max(off + int(length_col[r]) for r, off in pack_rows)
            body = bytes(pack[:end])
            place(content_name(body), body, _crc.crc32c(body), pack_rows)
        pack, pack_rows = bytearray(), []

    try:
        for s, rows in sorted(by_shard.items()):
            if gate is not None:
                gate()
            data = memoryview(_read_shard(src, manifest.shards[s]))  # slices: views, no copy
            stats.read += len(data)
            views = [data[int(offset_col[r]):int(offset_col[r] + length_col[r])] for r in rows]
            big = [(r, v) for r, v in zip(rows, views) if len(v) >= pack_below]
            hashing = iter([hasher.submit(content_name, v) for _, v in big])
            for r, v in zip(rows, views):  # in table order: a duplicate's copy number is fixed
                if len(v) >= pack_below:
                    place(next(hashing).result(), v, int(table.checksum[r]), [(r, 0)])
                    continue
                pack_rows.append((r, len(pack)))
                pack += v
                pack += bytes((-len(pack)) % _ALIGN)
                if len(pack) >= PACK_SIZE:
                    close_pack()
            if progress:
                progress(len(data))
        close_pack()
        for fut in pending:  # every object in place before the manifest can name it
            fut.result()
    except BaseException:
        for fut in pending:
            fut.cancel()
        for name in added:  # not known to be in the root: the next copy uploads them again
            known.pop(name, None)
        raise
    finally:
        uploader.shutdown(wait=True)
        hasher.shutdown()
    new_table = table.with_locations(row_shard, row_offset)
    return dataclasses.replace(manifest, shards=tuple(new_shards), tensors=new_table)


def references(manifest: Manifest) -> set[str]:
    """The chunk objects a manifest refers to."""
    return {s.path for s in manifest.shards if s.path.startswith(CAS_PREFIX)}

