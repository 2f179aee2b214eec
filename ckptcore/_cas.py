"""Garbage collection of a deduplicated backup root's content-addressed objects.

A deduplicated replica (``_replica``) stores each tensor's bytes once, as an object named by
its content under ``.ckptcore.cas/``, shared by every step that holds those bytes.  An object
may go only when no committed manifest names it and no upload in progress may still name it:

* an uploader records an *intent* (:func:`intent`) while it writes objects, and a sweep keeps
  every object written since the oldest live intent (with a minute of slack for clock skew);
  an intent left by a killed uploader is fenced by the next lock holder's generation (or,
  unlocked, expires after a day) and removed by the next sweep;
* :func:`sweep` lists the objects *first*, then reads every committed manifest, so an object
  committed in between is referenced by the time it is judged; an unreadable manifest stops the
  sweep (what it names is unknown); a store that gives no modification time keeps everything.

The caller holds the root's writer lock and passes it as ``fence``: a writer superseded
meanwhile deletes nothing more (see :func:`sweep` for what this promises, and where it stops).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from typing import Any, Iterator

from . import _fence
from ._read import read_manifest
from ._blobs import blob_ages
from ._replica import blob_rel, list_blobs, references
from ._steps import committed_steps
from ._storage import Store
from .errors import CheckpointError

log = logging.getLogger("ckptcore")

INTENT_DIR = ".ckptcore.intents"
_INTENT_MAX_AGE = 24 * 3600.0  # an unlocked uploader's intent is honoured this long
_INTENT_SLACK = 60.0  # seconds of clock skew between an uploader and the store
_BATCH = 64  # blobs deleted between two fence checks (each check: a listing of generations)


@contextlib.contextmanager
def intent(root: Store, generation: int | None, holder: str) -> Iterator[str]:
    """Record, while the block runs, that blobs are being uploaded under ``root`` (a sweep keeps
    every blob written since, unless ``generation`` was fenced meanwhile: its replica can then
    never be accepted).  Removed after; one left by a killed uploader is fenced by the next
    holder's generation (or, unlocked, expires after a day) and removed by the next sweep."""
    name = f"{INTENT_DIR}/{uuid.uuid4().hex}.json"
    root.makedirs(INTENT_DIR)
    root.write_bytes(name, json.dumps({"generation": generation, "holder": holder,
                                       "started": time.time()}).encode())
    try:
        yield name
    finally:
        try:
            root.delete(name)
        except Exception as e:  # noqa: BLE001 - a leftover intent only delays the sweep
            log.warning("backup: could not remove the upload intent %s (%s: %s)",
                        root.join(name), type(e).__name__, e)


def live_intents(root: Store, own: tuple[str, ...] = ()) -> tuple[float | None, list[str]]:
    """The start of the oldest upload in progress under ``root`` that a sweep must honour (None:
    none; the sweeper's ``own`` intents aside), and the stale intents (fenced generations,
    expired) a sweep may remove."""
    newest = max(_fence.generations(root), default=0)
    oldest, stale = None, []
    for e in root.listdir(INTENT_DIR):
        rel = f"{INTENT_DIR}/{e.name}"
        if rel in own:
            continue
        try:
            body = json.loads(root.read(rel, max_bytes=1 << 16))
            started, g = float(body["started"]), body.get("generation")
        except (ValueError, KeyError, TypeError, OSError, CheckpointError):
            started, g = (e.mtime or time.time()), None  # unreadable: honoured by its age
        fenced = isinstance(g, int) and g < newest
        if fenced or time.time() - started > _INTENT_MAX_AGE:
            stale.append(rel)
        else:
            oldest = started if oldest is None else min(oldest, started)
    return oldest, stale


def sweep(root: Store, grace: float, fence: Any = None, own: tuple[str, ...] = ()) -> list[str]:
    """Remove blobs under ``root`` that no committed manifest refers to, that are older than
    ``grace`` seconds and that no upload in progress may name (``intent``); returns their URLs.
    The caller holds ``root``'s writer lock (``fence``: checked before each batch of deletes).

    A sweeper paused (SIGSTOP, swap) while its lease lapses must not delete a blob that the new
    holder reuses.  The interleaving, and what closes each part of it:

    1. the sweep lists the blobs, then reads every manifest (a blob a manifest committed in
       between names is kept), then decides which blobs are doomed;
    2. before each batch of ``_BATCH`` deletes it checks the fence (no newer generation, its own
       lease not overdue; an overdue one claims a new generation first), then asks the store
       again for the batch's blobs (a stat or HEAD each) and deletes only those still as old
       as the cutoff;
    3. a new holder claims a generation only once the sweeper's lease has lapsed in its eyes,
       that is at least the lease margin after the sweeper's last passed check; its first reuse
       of a blob that no manifest it read since its claim names re-uploads the blob
       (``_replica``: refreshed), so the blob's age is then that of the reuse.

    Invariant: a blob is deleted only if, after the last fence check this sweeper passed, the
    store showed it older than the cutoff; so a holder that took over before that check
    fences the sweep, and one that took over after it and refreshed the blob before that
    look keeps it.  A blob a manifest names at step 1 is never deleted (any manifest
    committed later by another writer is by a newer generation, which fences step 2, or which
    refreshed every reused blob step 1 could have doomed).  What is left: a sweeper stopped
    for longer than the lease margin exactly between step 2's look and its delete request,
    whose new holder refreshed the blob in that gap; object stores have no delete conditional
    on an object's age, so only a bounded pause there keeps it.  A replica naming a blob lost
    that way fails its own post-commit check if the delete lands first; if it lands after
    that check, the replica stays broken (``ckpt verify`` of the backup names it) until the
    next copy holding the same bytes heals it, and once the local tier's retention removed
    the local copy, that step is lost from both tiers.
    """
    blobs = list_blobs(root)  # first: a blob listed here and referenced later is kept below
    referenced: set[str] = set()
    for _, name in committed_steps(root):
        try:
            referenced |= references(read_manifest(root.child(name)))
        except CheckpointError as e:
            log.warning("backup: not sweeping blobs under %s: the manifest of %s cannot be read "
                        "(%s), so what it refers to is unknown", root.url, name, e)
            return []
    uploading, stale = live_intents(root, own)
    cutoff = time.time() - grace
    if uploading is not None:
        log.info("backup: an upload to %s is in progress since %s: keeping every blob written "
                 "since", root.url, time.strftime("%H:%M:%S", time.localtime(uploading)))
        cutoff = min(cutoff, uploading - _INTENT_SLACK)

    def old(listed: dict[str, tuple[int, float | None]], name: str) -> bool:
        mtime = listed[name][1] if name in listed else None
        return mtime is not None and mtime <= cutoff  # (no time: its age is unknown, so kept)

    doomed = [n for n in sorted(blobs) if n not in referenced and old(blobs, n)]
    removed = []
    for i in range(0, len(doomed), _BATCH):
        if fence is not None:
            fence.before_delete()
        # After the check, the batch's blobs alone (a stat or HEAD each, not a listing of the
        # whole store per batch): a blob a new holder refreshed is young again.
        now = blob_ages(root, doomed[i:i + _BATCH])
        for name in doomed[i:i + _BATCH]:
            if not old(now, name):
                if name in now:
                    log.info("backup: keeping blob %s: it was written again since the sweep "
                             "listed it (reused)", root.url_of(blob_rel(name)))
                continue
            url = root.url_of(blob_rel(name))
            log.info("backup: removing blob %s, which no committed replica refers to", url)
            root.delete(blob_rel(name))
            removed.append(url)
    if stale and fence is not None:
        fence.before_delete()
    for rel in stale:
        log.info("backup: removing the stale upload intent %s (its uploader was superseded or "
                 "is long gone)", root.url_of(rel))
        root.delete(rel)
    return removed
