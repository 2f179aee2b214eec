"""Copying a committed checkpoint to another store: backup replicas and ``ckpt sync``.

A copy is committed with the same protocol as a save (``_commit.commit``: the manifest last;
rename locally, create-only PUT on object stores), from bytes that were verified on the way:
each source shard is read whole and checked against its CRC-32C before a byte of it is written
(a damaged source is never replicated; the copy fails naming the shard).

Two layouts:

* **plain**: the shards are copied as they are, named ``shard-<n>-<token>.bin`` by the copy's
  own token like a save's (in the same shard folders, ``3f/...``; a source's ``cas:`` objects
  become files of the step folder); the manifest is the source's with those names.
* **deduplicated** (a backup root): every tensor's bytes become a content-addressed object, a
  *blob*, ``<root>/chunks/<hh>/<hash>`` (BLAKE2b-256 of the bytes, docs/FORMAT.md,
  "Deduplicated replicas"; the folder's name predates the word, which keeps "chunk" for format
  3's blocks of a sharded tensor), shared by every step that holds the same bytes, so a frozen layer is uploaded
  once.  Tensors under ``pack_below`` bytes travel together in packs of about 1 MiB, in table
  order (a small tensor each would cost a request apiece); a second object of the same bytes in
  one step is named with a salted hash (two rows of a manifest never share bytes).  The manifest's
  rows keep their checksums and point at the objects; only shard paths and offsets change.

Verified reuse.  Each copy lists the root's blobs once at its start (one paginated LIST, with
the store's own checksum of each object where it gives one: S3's single-part ETag and Azure's
Content-MD5 are the MD5 of the bytes, GCS's ``md5Hash`` too).  A blob already there is reused
only when known good: ``known`` records, per writer (a ``BackupTier``, a sync), the blobs it
uploaded or verified in this process with the size and store checksum (or, where the store gives
none, the time) they had then.  A blob not recorded, or listed with another size or checksum
since, is verified against the local bytes about to (not) be uploaded: their MD5 against the
store's checksum, else the object read back and compared.  A damaged or missing blob is
uploaded again from the local copy, logged at WARNING (which heals every replica naming it: the
name is the content hash).

A replica is returned only once it verifies: after the commit, its manifest is read back and
every object it names is listed present with its size, and its content checked (reused blobs as
above; blobs just uploaded by the store's checksum of them, else read back and hashed).  If it
does not verify, the manifest is deleted again (uncommitted, logged) and the copy raises
:class:`CorruptCheckpointError` or :class:`IncompleteCheckpointError` naming the blob, so the
caller never counts it as replicated.

Refreshed reuse.  A blob that no committed manifest names may be doomed by a sweep that was
paused while this writer took the root over (``_cas.sweep``): the first reuse, in a writer's
generation, of a blob that no manifest it read since its claim (or committed since) names writes
the blob again, so that its age is that of the reuse and a sweep checking ages after its fence
check keeps it (``refreshed`` in the stats).  A blob such a manifest names is never doomed by a
sweep of an older generation, and is reused as it is.

Blobs are never deleted here, not even after a failed commit: another step may reference them
(``_commit`` skips ``cas:`` shards when it cleans up).  Unreferenced ones are swept by
``_backup.sweep`` under the root's writer lock, after a grace period.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import crc32c as _crc
import numpy as np

from ._commit import commit, shard_files, uncommit
from ._manifest import MANIFEST_NAME, Manifest, ShardEntry, encoded_tree, shard_folder
from ._read import read_manifest, read_manifest_bytes
from ._blobs import Listed, Named, list_blob_objects, list_blobs, references
from ._storage import CAS_DIR, CAS_PREFIX, Store, fsync_dir
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

log = logging.getLogger("ckptcore")

HASH = "blake2b-256"
PACK_BELOW = 256 << 10  # tensors below this many bytes travel in packs
PACK_SIZE = 1 << 20  # a pack is closed once it holds this many bytes
_ALIGN = 64
_S3_PART = 50 << 20  # s3fs pipe_file's part size: an object of >= 2 parts gets a multipart ETag
# Stores whose listings carry an MD5 of each object (S3 ETag, GCS md5Hash, Azure Content-MD5):
# an upload there records the MD5 of what it sent, compared with the listing after the commit.
_MD5_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def content_name(data: Any, copy: int = 0) -> str:
    """The ``cas:`` shard name of ``data``'s bytes; ``copy`` > 0 names the copy-th further
    object of the same bytes in one step (BLAKE2b's salt), so that it too is deduplicated
    across steps and no two rows of one manifest share an object."""
    salt = b"copy%d" % copy if copy else b""
    return CAS_PREFIX + hashlib.blake2b(data, digest_size=32, salt=salt).hexdigest()


def blob_rel(name: str) -> str:
    """A ``cas:`` name's path under the root: ``chunks/<hh>/<hash>``."""
    digest = name[len(CAS_PREFIX):]
    return f"{CAS_DIR}/{digest[:2]}/{digest}"


@dataclass
class CopyStats:
    """What a copy moved: bytes read from the source, bytes and objects written to the
    destination, objects found there already (deduplicated), and seconds.  Verification:
    ``checked`` objects verified by the store's checksum (no byte read), ``read_back`` bytes
    read back to verify objects the store gives no usable checksum of, ``lists`` blob
    listings, ``healed`` the blobs found damaged or missing and uploaded again;
    ``reused_bytes`` the bytes of the ``reused`` objects (deduplicated: not sent)."""

    read: int = 0
    written: int = 0
    objects: int = 0
    reused: int = 0
    seconds: float = 0.0
    checked: int = 0
    read_back: int = 0
    lists: int = 0
    healed: list = dataclasses.field(default_factory=list)
    reused_bytes: int = 0
    refreshed: int = 0  # reused blobs no manifest named, written again (module docstring)


def _md5_like(data: Any, md5: str) -> str | None:
    """The MD5 ``data`` would have in the form of ``md5`` (plain, or S3's multipart ETag at
    s3fs's part size); None when that form cannot be computed (another part size)."""
    if "-" not in md5:
        return hashlib.md5(data).hexdigest()
    parts = int(md5.rsplit("-", 1)[1])
    view = memoryview(data)
    if parts < 1 or -(-len(view) // _S3_PART) != parts:
        return None
    digests = b"".join(hashlib.md5(view[i:i + _S3_PART]).digest()
                       for i in range(0, len(view), _S3_PART))
    return f"{hashlib.md5(digests).hexdigest()}-{parts}"


def verify_object(root: Store, name: str, data: Any, listed: Listed,
                  stats: CopyStats | None = None) -> bool:
    """Whether the blob ``name`` under ``root`` holds exactly ``data`` (the local bytes): by
    the store's checksum where it gives one that can be computed here, else read back."""
    if listed.size != len(data):
        return False
    if listed.md5 is not None:
        mine = _md5_like(data, listed.md5)
        if mine == listed.md5:
            if stats is not None:
                stats.checked += 1
            return True
        if listed.exact and mine is not None:
            return False
        # (a mismatch may be an S3 ETag that is no MD5, SSE-KMS: the bytes decide)
    try:
        there = root.read(blob_rel(name))
    except FileNotFoundError:
        return False
    if stats is not None:
        stats.read_back += len(there)
    return there == bytes(data)


def blob_matches(data: Any, name: str, copies: int = 0) -> int | None:
    """The copy number whose salted BLAKE2b-256 of ``data`` is ``name`` (0: unsalted), trying
    up to ``copies``; None if none is."""
    for copy in range(copies + 1):
        if content_name(data, copy) == name:
            return copy
    return None


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


def write_objects(root: Store, objects: dict[str, bytes | memoryview]) -> None:
    """Write content-addressed objects (``{cas name: bytes}``) under ``root``, each appearing
    whole or not at all: one PUT each on object stores (several at once), a temporary file
    renamed into place locally."""
    if not objects:
        return
    if root.local:
        for name, data in objects.items():
            rel = blob_rel(name)
            root.makedirs(os.path.dirname(rel))
            tmp = f"{rel}.tmp-{uuid.uuid4().hex[:8]}"
            root.write_bytes(tmp, bytes(data))
            os.replace(root.join(tmp), root.join(rel))
            fsync_dir(os.path.dirname(root.join(rel)))  # the rename, durable before the manifest
        return
    for name in objects:  # (object stores have no folders to make; the call is cheap)
        root.makedirs(os.path.dirname(blob_rel(name)))
    with root.translate_errors("write", CAS_DIR, write=True):
        root.fs.pipe({root.join(blob_rel(n)): bytes(d) for n, d in objects.items()})


def copy_checkpoint(src: Store, dst: Store, *, dedup: bool, known: dict[str, Any] | None = None,
                    overwrite: bool = False, progress: Callable[[int], None] | None = None,
                    pack_below: int = PACK_BELOW,
                    gate: Callable[[], None] | None = None,
                    fence: Any = None) -> tuple[Manifest, CopyStats]:
    """Copy the committed checkpoint at ``src`` to ``dst`` (a step folder; with ``dedup`` its
    parent is a deduplicating root, listed at the start of the copy).  ``known`` is the
    writer's record of the blobs it uploaded or verified in this process (``{cas name: (size,
    store checksum or time)}``, module docstring), updated here; keep one per writer and pass it
    to every copy.  Returns the destination's manifest and what was moved, once the committed
    replica verifies; if it does not, it is uncommitted and the error raised."""
    started = time.perf_counter()
    manifest, raw = read_manifest_bytes(src)
    # The writer's generation belongs to the root it was committed in: the copy records the
    # destination writer's (``fence``, its lock there), or none.
    writer = {k: v for k, v in manifest.writer.items() if k != "generation"}
    if fence is not None and fence.generation is not None:
        writer["generation"] = int(fence.generation)
    manifest = dataclasses.replace(manifest, tree=encoded_tree(raw),  # written back as stored
                                   writer=writer)
    stats = CopyStats()
    token = uuid.uuid4().hex[:16]
    known = {} if known is None else known
    root = dst.parent()
    placed: dict[str, tuple[int, tuple[str, ...]]] = {}  # cas name: (copy number, MD5s sent)
    listing: dict[str, Listed] = {}
    named = None
    if dedup:
        listing = list_blob_objects(root)  # fresh per copy: others may have changed the root
        stats.lists += 1
        named = Named.of(known, root, fence)

    def write(target: Store) -> Manifest:
        if dedup:
            return _write_dedup(src, target, root, manifest, known, stats, progress, pack_below,
                                gate, listing=listing, placed=placed, named=named)
        return _write_plain(src, target, manifest, stats, progress, token)

    out = commit(dst, write, token=token, overwrite=overwrite, fence=fence)
    try:
        _check_committed(dst, out, dedup=dedup, known=known, placed=placed, stats=stats)
    except BaseException as e:
        log.warning("copy: the replica %s just committed does not verify (%s: %s); "
                    "uncommitting it (deleting its manifest): it is not a replica", dst.url,
                    type(e).__name__, e)
        try:
            uncommit(dst, token, fence)
        except (CheckpointError, OSError) as e2:  # (FencedError too: then it deleted nothing)
            log.error("copy: uncommitting %s failed too (%s: %s)", dst.url, type(e2).__name__, e2)
        raise
    if named is not None:
        named.add(references(out))  # reused as they are from now on, in this generation
    stats.seconds = time.perf_counter() - started
    log.info("copy: %s -> %s (%s): %d bytes read, %d bytes in %d objects written, %d reused, "
             "%d verified by checksum, %d bytes read back, %d healed, %.2f s", src.url, dst.url,
             "deduplicated" if dedup else "plain", stats.read, stats.written, stats.objects,
             stats.reused, stats.checked, stats.read_back, len(stats.healed), stats.seconds)
    return out, stats


def check_structure(dst: Store, manifest: Manifest | None = None,
                    listing: dict[str, Listed] | None = None) -> tuple[Manifest, list[CheckpointError]]:
    """A committed checkpoint's structure: its manifest decodes (read now unless given; an
    unreadable one is raised), and every object it names is present with its size (blobs by
    ``listing`` of its root, listed now unless given; plain shards by a listing of its folder).
    Returns the manifest and the problems (:class:`IncompleteCheckpointError`, naming each)."""
    if manifest is None:
        manifest = read_manifest(dst)
    problems: list[CheckpointError] = []
    cas = [s for s in manifest.shards if s.path.startswith(CAS_PREFIX)]
    if cas and listing is None:
        listing = list_blob_objects(dst.parent())
    plain = ({e.name: e.size for e in shard_files(dst) if not e.is_link}
             if len(cas) < len(manifest.shards) else {})
    for s in manifest.shards:
        if s.path.startswith(CAS_PREFIX):
            entry = (listing or {}).get(s.path)
            size = None if entry is None else entry.size
        else:
            size = plain.get(s.path)
        if size != s.size:
            url = dst.join(s.path)
            what = "missing" if size is None else f"{size} bytes, the manifest says {s.size}"
            problems.append(IncompleteCheckpointError(
                f"{url}: {'blob ' + s.path if s.path.startswith(CAS_PREFIX) else 'shard'} "
                f"named by {dst.url} is {what}"))
    return manifest, problems


def _check_committed(dst: Store, manifest: Manifest, *, dedup: bool, known: dict,
                     placed: dict[str, tuple[int, tuple[str, ...]]], stats: CopyStats) -> None:
    """The replica just committed at ``dst`` verifies (module docstring), else raise."""
    there = read_manifest(dst)  # it decodes, by the reader's own checks
    if there.shards != manifest.shards:
        raise CorruptCheckpointError(f"{dst.join(MANIFEST_NAME)}: the manifest read back names "
                                     "other objects than the one written",
                                     file=dst.join(MANIFEST_NAME))
    listing = None
    if dedup:
        listing = list_blob_objects(dst.parent())
        stats.lists += 1
    _, problems = check_structure(dst, there, listing)
    if problems:
        raise problems[0]
    if not dedup:
        return
    root = dst.parent()
    for s in there.shards:
        entry = listing[s.path]
        if known.get(s.path) == (entry.size, entry.tag):
            continue  # verified in this copy (or before), unchanged since
        copy, md5s = placed.get(s.path, (0, ()))
        if entry.md5 is not None and entry.md5 in md5s:
            stats.checked += 1
        else:
            url = root.join(blob_rel(s.path))
            try:
                data = root.read(blob_rel(s.path))
            except FileNotFoundError as e:
                raise IncompleteCheckpointError(f"{url}: blob {s.path} is missing") from e
            stats.read_back += len(data)
            if (len(data) != s.size or _crc.crc32c(data) != s.checksum
                    or blob_matches(data, s.path, copy) is None):
                raise CorruptCheckpointError(
                    f"{url}: blob {s.path} does not hold the bytes its name and the manifest "
                    f"of {dst.url} say", file=url, expected=s.checksum, actual=_crc.crc32c(data))
        known[s.path] = (entry.size, entry.tag)


def _write_plain(src: Store, target: Store, manifest: Manifest, stats: CopyStats,
                 progress: Callable[[int], None] | None, token: str) -> Manifest:
    shards = []
    for j, shard in enumerate(manifest.shards):
        data = _read_shard(src, shard)
        # This copy's token, as a save's: two copies of one step (one paused past its lease,
        # one by the writer that took over) share no file, and a loser removes only its own.
        folder = "" if shard.path.startswith(CAS_PREFIX) else shard_folder(shard.path)
        name = f"{folder + '/' if folder else ''}shard-{j:05d}-{token}.bin"
        if shard_folder(name):  # a large group's save: its shards are in shard folders
            target.makedirs(shard_folder(name))
        target.write_bytes(name, data)
        shards.append(ShardEntry(path=name, size=shard.size, checksum=shard.checksum))
        stats.read += len(data)
        stats.written += len(data)
        stats.objects += 1
        if progress:
            progress(len(data))
    return dataclasses.replace(manifest, shards=tuple(shards))


def _upload_md5s(root: Store, data: Any) -> tuple[str, ...]:
    """The checksums the store's listing may give of ``data`` once uploaded (module docstring):
    none on stores that give none."""
    protocols = root.fs.protocol if isinstance(root.fs.protocol, (tuple, list)) else (root.fs.protocol,)
    if root.local or not _MD5_PROTOCOLS & set(protocols):
        return ()
    out = [hashlib.md5(data).hexdigest()]
    parts = -(-len(data) // _S3_PART)
    if parts >= 2 and {"s3", "s3a"} & set(protocols):
        out.append(_md5_like(data, f"x-{parts}") or "")
    return tuple(out)


def _write_dedup(src: Store, target: Store, root: Store, manifest: Manifest, known: dict,
                 stats: CopyStats, progress: Callable[[int], None] | None,
                 pack_below: int, gate: Callable[[], None] | None = None, *,
                 listing: dict[str, Listed] | None = None,
                 placed: dict[str, tuple[int, tuple[str, ...]]] | None = None,
                 named: Named | None = None) -> Manifest:
    """The deduplicated layout (module docstring).  Pipelined: two threads hash (hashlib
    releases the GIL), and each new object is handed to the upload threads as soon as it is
    named, so hashing, reading the next shard and uploading overlap.  Small tensors are packed
    in table order, a pack closed at ``PACK_SIZE``: the small tensors of frozen layers (next to
    each other in the table) then fill packs that do not change from step to step.  ``gate()``
    is called between objects: the backup tier pauses there while its manager saves."""
    job = _DedupCopy(src, root, manifest, known, stats, gate,
                     {} if listing is None else listing, {} if placed is None else placed,
                     named)
    job.run(progress, pack_below)
    new_table = manifest.tensors.with_locations(job.row_shard, job.row_offset)
    return dataclasses.replace(manifest, shards=tuple(job.new_shards), tensors=new_table)


class _DedupCopy:
    """One deduplicated copy (``_write_dedup``): the objects named so far, where each row of the
    table now lives, the open pack and the uploads in flight.  A class rather than closures so
    that each step of the pipeline reads on its own; ``_upload`` and ``_reuse_or_heal`` run on
    the upload threads (hence ``counting``), the rest on the caller's thread."""

    def __init__(self, src: Store, root: Store, manifest: Manifest, known: dict,
                 stats: CopyStats, gate: Callable[[], None] | None,
                 listing: dict[str, Listed],
                 placed: dict[str, tuple[int, tuple[str, ...]]],
                 named: Named | None = None) -> None:
        self.src, self.root, self.manifest, self.known = src, root, manifest, known
        self.stats, self.gate, self.listing, self.placed = stats, gate, listing, placed
        self.named = named
        table = manifest.tensors
        n = len(table)
        self.shard_col = table.shard.astype(np.int64)
        self.offset_col = table.offset.astype(np.int64)
        self.length_col = table.length.astype(np.int64)
        self.new_shards: list[ShardEntry] = []
        self.index: dict[str, int] = {}
        self.row_shard = np.zeros(n, np.uint32)
        self.row_offset = np.zeros(n, np.uint64)
        self.pending: list[Any] = []
        self.pack = bytearray()
        self.pack_rows: list[tuple[int, int]] = []
        self.counting = threading.Lock()  # stats are counted on the upload threads too

    def run(self, progress: Callable[[int], None] | None, pack_below: int) -> None:
        """Every source shard in turn, then the last pack; returns once every object is in
        place (before the manifest can name it), or cancels the uploads not started and raises."""
        by_shard: dict[int, list[int]] = {}
        for row in range(len(self.manifest.tensors)):
            by_shard.setdefault(int(self.shard_col[row]), []).append(row)
        hasher = ThreadPoolExecutor(2, thread_name_prefix="ckptcore-hash")
        self.uploader = ThreadPoolExecutor(max(1, self.root.writers),
                                           thread_name_prefix="ckptcore-upload")
        try:
            for s, rows in sorted(by_shard.items()):
                if self.gate is not None:
                    self.gate()
                size = self._copy_shard(s, rows, hasher, pack_below)
                if progress:
                    progress(size)
            self._close_pack()
            for fut in self.pending:  # every object in place before the manifest can name it
                fut.result()
        except BaseException:
            for fut in self.pending:
                fut.cancel()
            raise
        finally:
            self.uploader.shutdown(wait=True)
            hasher.shutdown()

    def _copy_shard(self, s: int, rows: list[int], hasher: ThreadPoolExecutor,
                    pack_below: int) -> int:
        """Source shard ``s``, read whole: its large tensors hashed on ``hasher`` and placed,
        its small ones packed, in table order.  Returns the shard's size."""
        data = memoryview(_read_shard(self.src, self.manifest.shards[s]))  # slices: views, no copy
        self.stats.read += len(data)
        offset_col, length_col = self.offset_col, self.length_col
        views = [data[int(offset_col[r]):int(offset_col[r] + length_col[r])] for r in rows]
        big = [(r, v) for r, v in zip(rows, views) if len(v) >= pack_below]
        hashing = iter([hasher.submit(content_name, v) for _, v in big])
        checksums = self.manifest.tensors.checksum
        for r, v in zip(rows, views):  # in table order: a duplicate's copy number is fixed
            if len(v) >= pack_below:
                self._place(next(hashing).result(), v, int(checksums[r]), [(r, 0)])
                continue
            self.pack_rows.append((r, len(self.pack)))
            self.pack += v
            self.pack += bytes((-len(self.pack)) % _ALIGN)
            if len(self.pack) >= PACK_SIZE:
                self._close_pack()
        return len(data)

    def _close_pack(self) -> None:
        if self.pack_rows:
            end = max(off + int(self.length_col[r]) for r, off in self.pack_rows)
            body = bytes(self.pack[:end])
            self._place(content_name(body), body, _crc.crc32c(body), self.pack_rows)
        self.pack, self.pack_rows = bytearray(), []

    def _place(self, name: str, data: Any, checksum: int, rows: list[tuple[int, int]]) -> None:
        """Name ``data`` (its hash ``name``; a further copy in this step gets a salted one),
        list it as a shard, point ``rows`` (row, offset) at it, upload it unless known."""
        copy = 0
        while name in self.index:  # the same bytes again in this step: the next copy's name
            copy += 1
            name = content_name(data, copy)
        self.index[name] = len(self.new_shards)
        self.new_shards.append(ShardEntry(path=name, size=len(data), checksum=checksum))
        for r, off in rows:
            self.row_shard[r], self.row_offset[r] = self.index[name], off
        self.placed[name] = (copy, ())
        entry, record = self.listing.get(name), self.known.get(name)
        if entry is not None and entry.size == len(data) and record == (entry.size, entry.tag):
            if self._named(name):
                with self.counting:
                    self.stats.reused += 1  # verified by this writer, unchanged since
                    self.stats.reused_bytes += len(data)
                return
            self.pending.append(self.uploader.submit(contextvars.copy_context().run,
                                                     self._refresh, name, data, copy))
            return
        if entry is None and record is None:  # new here
            self.pending.append(self.uploader.submit(contextvars.copy_context().run,
                                                     self._upload, name, data, copy))
            return
        self.pending.append(self.uploader.submit(contextvars.copy_context().run,
                                                 self._reuse_or_heal, name, data, copy, entry))

    def _upload(self, name: str, data: Any, copy: int) -> None:
        if self.gate is not None:
            self.gate()
        md5s = _upload_md5s(self.root, data)
        write_objects(self.root, {name: data})
        self.placed[name] = (copy, md5s)
        with self.counting:
            self.stats.written += len(data)
            self.stats.objects += 1

    def _reuse_or_heal(self, name: str, data: Any, copy: int, entry: Listed | None) -> None:
        """A blob this writer has not verified (or that changed since): reuse it if it holds
        ``data``, else upload ``data`` again."""
        if self.gate is not None:
            self.gate()
        mine = CopyStats()
        good = entry is not None and verify_object(self.root, name, data, entry, mine)
        with self.counting:
            self.stats.checked += mine.checked
            self.stats.read_back += mine.read_back
        if good and not self._named(name):
            self._refresh(name, data, copy)
            return
        if good:
            self.known[name] = (entry.size, entry.tag)
            with self.counting:
                self.stats.reused += 1
                self.stats.reused_bytes += len(data)
            return
        why = ("missing (this writer uploaded or verified it before)" if entry is None else
               f"damaged ({entry.size} bytes where {len(data)} belong)"
               if entry.size != len(data) else "damaged (its bytes differ from the local copy)")
        log.warning("copy: blob %s under %s is %s; uploading it again from %s (this heals every "
                    "replica naming it)", name, self.root.url, why, self.src.url)
        with self.counting:
            self.stats.healed.append(name)
        self.known.pop(name, None)
        self._upload(name, data, copy)


    def _named(self, name: str) -> bool:
        """Whether a manifest this writer read or committed in its generation names ``name``
        (or no sweep can doom it: a store that gives no times)."""
        entry = self.listing.get(name)
        return self.named is None or (entry is not None and entry.mtime is None) \
            or self.named.has(self.root, name)

    def _refresh(self, name: str, data: Any, copy: int) -> None:
        """Reuse a blob no manifest names by writing it again (module docstring, "Refreshed
        reuse"): its age is then this copy's, which a sweep of an older generation keeps."""
        log.info("copy: blob %s under %s is named by no committed manifest; writing it again "
                 "rather than reusing it as it is (a sweep may be deciding to remove it)",
                 name, self.root.url)
        with self.counting:
            self.stats.refreshed += 1
        self.known.pop(name, None)
        self._upload(name, data, copy)
