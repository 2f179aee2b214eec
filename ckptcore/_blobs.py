"""A deduplicated root's blobs: as a listing shows them, and which committed manifests name.

:func:`list_blob_objects` lists every blob once (one paginated listing), with the store's own
checksum of each where it gives one (``_replica``, "Verified reuse").

A sweep (``_cas.sweep``) dooms the blobs no committed manifest names; one paused while another
writer takes the root over may still delete them.  So a writer reuses as it is only a blob that
a manifest it read since its claim (or committed since) names; any other blob it reuses it
writes again first (``_replica``, "Refreshed reuse").  :class:`Named` is that knowledge, read
once per generation, on the first reuse that needs it.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ._manifest import Manifest
from ._read import read_manifest
from ._steps import committed_steps
from ._storage import CAS_DIR, CAS_PREFIX, Store, as_time, mtime_of
from .errors import CheckpointError, StorageError

_ETAG = re.compile(r"[0-9a-f]{32}(-[0-9]+)?")


@dataclass(frozen=True)
class Listed:
    """One blob object as a listing shows it: its size, time, and the store's checksum of it
    (``md5``: an MD5 hex digest, or S3's multipart ETag ``<hex>-<parts>``; None when the store
    gives none, as local disk and ``memory://``)."""

    size: int
    mtime: float | None
    md5: str | None = None
    exact: bool = False  # md5 is surely the MD5 of the bytes (GCS, Azure; not an S3 ETag)

    @property
    def tag(self) -> Any:
        """What changes when the object is replaced: its checksum, else its time."""
        return self.md5 if self.md5 is not None else self.mtime


def _store_md5(info: dict) -> tuple[str | None, bool]:
    """The MD5 a store's listing gives of an object: S3's ETag (quoted hex; ``-N`` after
    multipart; not an MD5 under SSE-KMS, which then simply fails to match and is read back),
    GCS's ``md5Hash`` (base64), Azure's ``content_settings.content_md5`` (bytes); and whether it
    is surely an MD5 (a mismatch then proves damage without reading the object)."""
    etag = info.get("ETag")
    if isinstance(etag, str) and _ETAG.fullmatch(etag.strip('"').lower()):
        return etag.strip('"').lower(), False
    b64 = info.get("md5Hash")
    if isinstance(b64, str):
        try:
            digest = base64.b64decode(b64)
        except (binascii.Error, ValueError):
            return None, False
        return (digest.hex(), True) if len(digest) == 16 else (None, False)
    settings = info.get("content_settings")
    md5 = getattr(settings, "get", lambda _: None)("content_md5")  # (Azure's DictMixin)
    if isinstance(md5, (bytes, bytearray)) and len(md5) == 16:
        return bytes(md5).hex(), True
    return None, False


def list_blob_objects(root: Store) -> dict[str, Listed]:
    """``{cas name: Listed}`` of every blob object under ``root``: one paginated listing,
    with each object's checksum where the store gives one."""
    out: dict[str, Listed] = {}

    def add(rel: str, size: Any, mtime: Any, md5: tuple[str | None, bool] = (None, False)) -> None:
        prefix, _, digest = rel.partition("/")
        if len(digest) == 64 and digest.startswith(prefix) and len(prefix) == 2:
            out[CAS_PREFIX + digest] = Listed(int(size or 0), mtime, *md5)

    if root.local:
        for e in root.find(CAS_DIR):
            if not e.is_link:
                add(e.name, e.size, e.mtime)
        return out
    path = root.join(CAS_DIR)
    root.fs.invalidate_cache(path)  # another writer's uploads and deletions since
    try:
        with root.translate_errors("list", CAS_DIR):
            infos = root.fs.find(path, detail=True, withdirs=False)
    except FileNotFoundError:
        return out
    for full, info in infos.items():
        if info.get("type") == "directory":
            continue
        size = info.get("size")
        add(full[len(path):].lstrip("/"), size if isinstance(size, (int, float)) else 0,
            as_time(mtime_of(info)), _store_md5(info))
    return out


def blob_ages(root: Store, names: list[str]) -> dict[str, tuple[int, float | None]]:
    """``{cas name: (size, mtime)}`` of those of ``names`` that exist now, one stat or HEAD
    each (a sweep's check before a batch of deletes: its cost is the batch's, not the store's;
    :func:`list_blobs` would list every blob again for each batch)."""
    out: dict[str, tuple[int, float | None]] = {}
    for name in names:
        digest = name[len(CAS_PREFIX):]
        rel = f"{CAS_DIR}/{digest[:2]}/{digest}"
        if root.local:
            try:
                st = os.stat(root.join(rel))
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StorageError(f"{root.url_of(rel)}: stat failed: {e}") from e
            out[name] = (st.st_size, st.st_mtime)
            continue
        full = root.join(rel)
        root.fs.invalidate_cache(full)
        try:
            with root.translate_errors("info", rel):
                info = root.fs.info(full)
        except FileNotFoundError:
            continue
        size = info.get("size")
        out[name] = (int(size) if isinstance(size, (int, float)) else 0, as_time(mtime_of(info)))
    return out


def list_blobs(root: Store) -> dict[str, tuple[int, float | None]]:
    """``{cas name: (size, mtime)}`` of every blob object under ``root`` (one listing)."""
    return {n: (e.size, e.mtime) for n, e in list_blob_objects(root).items()}


KEY = "named"  # the key of a writer's Named in its ``known`` record (not a "cas:" name)


class Named:
    """The blobs named by the manifests committed under a deduplicated root, as one writer read
    them once in its generation (on the first reuse that needs them), plus those of every
    replica it committed since: ``_cas.sweep``'s invariant."""

    def __init__(self, generation: Any) -> None:
        self.generation = generation
        self.names: set[str] | None = None
        self.mu = threading.Lock()

    @classmethod
    def of(cls, known: dict, root: Store, fence: Any) -> Named:
        """The writer's record, kept in ``known``; a new one with each new generation (a
        takeover, a reclaim): what it read before its claim proves nothing after it."""
        generation = None if fence is None else fence.generation
        named = known.get(KEY)
        if not isinstance(named, Named) or named.generation != generation:
            named = known[KEY] = cls(generation)
        return named

    def has(self, root: Store, name: str) -> bool:
        with self.mu:
            if self.names is None:
                self.names = committed_references(root)
            return name in self.names

    def add(self, names: set[str]) -> None:
        with self.mu:
            if self.names is not None:  # (else read later, with the manifest just committed)
                self.names |= names


def committed_references(root: Store) -> set[str]:
    """The blobs every committed manifest under ``root`` names, read concurrently; one that
    cannot be decoded names nothing here (its blobs are then refreshed when reused)."""
    def read(name: str) -> set[str]:
        try:
            return references(read_manifest(root.child(name)))
        except StorageError:
            raise  # the store, not the manifest: the copy fails and is tried again
        except (CheckpointError, FileNotFoundError):
            return set()  # damaged, or deleted since the listing

    names = [n for _, n in committed_steps(root)]
    if not names:
        return set()
    with ThreadPoolExecutor(min(len(names), max(1, root.writers)),
                            thread_name_prefix="ckptcore-refs") as pool:
        return set().union(*pool.map(read, names))


def references(manifest: Manifest) -> set[str]:
    """The blob objects a manifest refers to."""
    return {s.path for s in manifest.shards if s.path.startswith(CAS_PREFIX)}

