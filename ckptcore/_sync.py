"""``ckpt sync SRC DST``: copy the committed checkpoints of one root to another.

Every step committed under SRC and missing under DST is copied in step order with
``_replica.copy_checkpoint`` (the source verified as it is read, the copy committed with the
save protocol), deduplicated by default, so a step whose tensors DST already holds uploads only
what changed.  A run interrupted anywhere leaves no half step under DST, and the next run
copies what is still missing (chunks already uploaded are found and not sent again).  DST's
writer lock is held throughout, so a manager replicating there, or another sync, waits its
turn; retention (``keep``) then applies to DST, and chunks no step refers to any more are swept.

Integrity.  A chunk DST already holds is reused only once verified against the source's bytes
(``_replica``, "Verified reuse"); a damaged or missing one is uploaded again, which heals every
step naming it.  Each copied step is verified after its commit.  Steps DST already holds are
checked structurally (manifest readable, every object it names present with its size); a broken
one is copied again from SRC over itself.  A step that stays broken is reported (``broken``,
with the reason in ``problems``) and ``ckpt sync`` exits 1.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import _knobs, layout
from ._backup import retain, sweep
from ._lock import WriterLock
from ._manifest import MANIFEST_NAME
from ._replica import check_structure, copy_checkpoint, list_chunk_objects
from ._storage import Store, check_url
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError)

log = logging.getLogger("ckptcore")


@dataclass
class SyncReport:
    """What a sync did (or, with ``dry_run``, would do)."""

    copied: list[int] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    conflicts: list[int] = field(default_factory=list)  # the same step, another checkpoint
    deleted: list[int] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)
    healed: list[int] = field(default_factory=list)  # present but broken, copied again
    broken: list[int] = field(default_factory=list)  # still broken under DST (see problems)
    problems: dict[int, str] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)  # missing under DST, but ``keep`` drops them
    read: int = 0
    written: int = 0


def sync(src: str, dst: str, *, dedup: bool = True, keep: Any = None, dry_run: bool = False,
         storage_options: Mapping[str, Any] | None = None,
         dst_storage_options: Mapping[str, Any] | None = None,
         progress: Callable[[str, int, int], None] | None = None) -> SyncReport:
    """Copy the committed steps of root ``src`` that root ``dst`` lacks (see the module
    docstring).  ``progress(step name, bytes done, bytes total)`` is called as bytes go."""
    from . import api

    so = dict(storage_options or {})
    dso = dict(so if dst_storage_options is None else dst_storage_options)
    s_root, d_root = Store(check_url(src, "src"), so), Store(check_url(dst, "dst"), dso)
    if not s_root.exists():
        raise CheckpointNotFoundError(f"{src} does not exist (no such folder or bucket)")
    report = SyncReport()
    lock = None if dry_run else WriterLock(d_root)
    if lock is not None:
        lock.acquire()
    try:
        have = {s: n for s, n in layout.committed_steps(d_root)} if d_root.exists() else {}
        known: dict[str, Any] = {}  # chunks of DST this sync uploaded or verified
        listing = None
        src_steps = layout.committed_steps(s_root)
        kept = None if keep is None else _kept(keep, src_steps, s_root, so, have, d_root, dso)
        for step, name in src_steps:
            if kept is not None and step not in have and step not in kept:
                # retention would delete it right after: not worth copying
                log.info("sync: step %d not copied: the retention would not keep it", step)
                report.skipped.append(step)
                continue
            if step in have:
                try:
                    # (the checkpoint's identity; its generation is each root's own)
                    same = (api.inspect(s_root.child(name).url, storage_options=so).writer.get("id")
                            == api.inspect(d_root.child(name).url,
                                           storage_options=dso).writer.get("id"))
                except CheckpointError:
                    same = False
                (report.present if same else report.conflicts).append(step)
                if not same:
                    log.warning("sync: step %d under %s is another checkpoint than under %s; "
                                "left as it is", step, dst, src)
                    continue
                if listing is None:
                    listing = list_chunk_objects(d_root)
                try:
                    _, problems = check_structure(d_root.child(name), listing=listing)
                except CheckpointError as e:
                    problems = [e]
                if not problems:
                    continue
                log.warning("sync: step %d under %s is broken (%s); %s", step, dst, problems[0],
                            "it would be copied again" if dry_run else "copying it again")
                if dry_run:
                    continue
                try:
                    copy_checkpoint(s_root.child(name), d_root.child(name), dedup=dedup,
                                    known=known, overwrite=True, fence=lock)
                except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                    log.error("sync: step %d under %s is still broken: %s", step, dst, e)
                    report.broken.append(step)
                    report.problems[step] = f"{type(e).__name__}: {e}"
                else:
                    log.warning("sync: step %d under %s healed from %s", step, dst, src)
                    report.healed.append(step)
                listing = None  # chunks were uploaded: list again for the next check
                continue
            report.copied.append(step)
            if dry_run:
                continue
            total = api.inspect(s_root.child(name).url, storage_options=so).nbytes
            done = [0]

            def tick(n: int, name: str = name, total: int = total) -> None:
                done[0] += n
                if progress:
                    progress(name, done[0], total)

            try:
                _, stats = copy_checkpoint(s_root.child(name), d_root.child(name), dedup=dedup,
                                           known=known, progress=tick, fence=lock)
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                # (a damaged source, or a copy that did not verify: uncommitted, not a step)
                log.error("sync: step %d could not be copied to %s: %s", step, dst, e)
                report.copied.remove(step)
                report.broken.append(step)
                report.problems[step] = f"{type(e).__name__}: {e}"
                continue
            if progress and done[0] < total:  # (chunks DST had were not sent: the step is done)
                progress(name, total, total)
            listing = None
            report.read += stats.read
            report.written += stats.written
        if keep is not None:
            report.deleted = retain(d_root, keep, dso, dry_run=dry_run, fence=lock)
        if report.deleted and dedup and not dry_run:
            report.swept = sweep(d_root, float(_knobs.get("gc_grace")), fence=lock)
    finally:
        if lock is not None:
            lock.release()
    return report


def _kept(keep: Any, src_steps: list, s_root: Store, so: Mapping[str, Any], have: Mapping[int, str],
          d_root: Store, dso: Mapping[str, Any]) -> set[int]:
    """The steps the retention ``keep`` would leave under DST once every step of SRC is there:
    the policy over SRC's steps and those DST already holds, plus the newest and any whose
    manifest cannot be read (as ``_backup.retain`` keeps them)."""
    from . import api
    from .manager import saved_metrics
    from .policies import CheckpointEntry, as_policy

    where = {step: (d_root, name, dso) for step, name in have.items()}
    where.update({step: (s_root, name, so) for step, name in src_steps})
    entries, unreadable = [], set()
    for step in sorted(where):
        root, name, options = where[step]
        try:
            info = api.inspect(root.child(name).url, storage_options=options)
        except CheckpointError:
            unreadable.add(step)
            continue
        entries.append(CheckpointEntry(step, info.created, saved_metrics(step, info.metadata)))
    kept = set(as_policy(keep).keep(entries)) | unreadable
    return kept | ({max(where)} if where else set())


def progress_bar(stream: Any = None) -> Callable[[str, int, int], None]:
    """A one-line progress display on ``stream`` (stderr)."""
    stream = stream or sys.stderr

    def show(name: str, done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        stream.write(f"\r{name} [{'#' * filled}{'.' * (width - filled)}] "
                     f"{done / 2**20:8.1f} / {total / 2**20:.1f} MiB")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show


def progress_lines(stream: Any = None) -> Callable[[str, int, int], None]:
    """Progress for a log file (``stream`` not a terminal): one line per step, once copied."""
    stream = stream or sys.stderr

    def show(name: str, done: int, total: int) -> None:
        if done >= total:
            stream.write(f"{name}: copied ({total / 2**20:.1f} MiB)\n")
            stream.flush()

    return show
