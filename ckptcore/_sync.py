"""``ckpt sync SRC DST``: copy the committed checkpoints of one root to another.

Every step committed under SRC and missing under DST is copied in step order with
``_replica.copy_checkpoint`` (the source verified as it is read, the copy committed with the
save protocol), deduplicated by default, so a step whose tensors DST already holds uploads only
what changed.  A run interrupted anywhere leaves no half step under DST, and the next run
copies what is still missing (blobs already uploaded are found and not sent again).  A step
folder of DST that no reader accepts (committed by a writer after its lease was taken over) is
removed before its step is copied there, logged, as a manager's save does.  DST's
writer lock is held throughout, so a manager replicating there, or another sync, waits its
turn; retention (``keep``) then applies to DST, and blobs no step refers to any more are swept.

Integrity.  A blob DST already holds is reused only once verified against the source's bytes
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

from . import _knobs
from ._cas import sweep
from ._lock import WriterLock
from ._replica import check_structure, copy_checkpoint, list_blob_objects
from ._read import inspect
from ._steps import committed_steps
from ._storage import Store, check_url
from .policies import as_policy
from ._tier import Tier
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                     CorruptCheckpointError, IncompleteCheckpointError)

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
    so = dict(storage_options or {})
    dso = dict(so if dst_storage_options is None else dst_storage_options)
    job = _Sync(Store(check_url(src, "src"), so), Store(check_url(dst, "dst"), dso), so, dso,
                dedup=dedup, dry_run=dry_run, progress=progress)
    if not job.src.exists():
        raise CheckpointNotFoundError(f"{src} does not exist (no such folder or bucket)")
    lock = None if dry_run else WriterLock(job.dst)
    if lock is not None:
        lock.acquire()
    job.lock = lock
    try:
        return job.run(keep)
    finally:
        if lock is not None:
            lock.release()


class _Sync:
    """One ``sync`` (see the module docstring), under DST's writer lock (``lock``)."""

    def __init__(self, src: Store, dst: Store, so: Mapping[str, Any], dso: Mapping[str, Any], *,
                 dedup: bool, dry_run: bool,
                 progress: Callable[[str, int, int], None] | None) -> None:
        self.src, self.dst, self.so, self.dso = src, dst, so, dso
        self.dedup, self.dry_run, self.progress = dedup, dry_run, progress
        self.lock: Any = None
        self.report = SyncReport()
        self.known: dict[str, Any] = {}  # objects of DST this sync uploaded or verified
        self.listing: Any = None  # DST's objects, listed for the structure checks

    def run(self, keep: Any) -> SyncReport:
        report, src, dst = self.report, self.src, self.dst
        have = {s: n for s, n in committed_steps(dst)} if dst.exists() else {}
        src_steps = committed_steps(src)
        kept = None if keep is None else _kept(keep, src_steps, src, self.so, have, dst,
                                               self.dso)
        for step, name in src_steps:
            if kept is not None and step not in have and step not in kept:
                # retention would delete it right after: not worth copying
                log.info("sync: step %d not copied: the retention would not keep it", step)
                report.skipped.append(step)
            elif step in have:
                self._check_present(step, name)
            else:
                self._copy(step, name)
        if keep is not None:
            target = Tier(dst, self.dso, lock=self.lock, what="replica")
            report.deleted = target.retain(as_policy(keep), dry_run=self.dry_run,
                                           missing_ok=True)
        if report.deleted and self.dedup and not self.dry_run:
            report.swept = sweep(dst, _knobs.gc_grace(), fence=self.lock)
        return report

    def _check_present(self, step: int, name: str) -> None:
        """A step DST holds: the same checkpoint (else a conflict, left alone), and whole (else
        copied again over itself)."""
        report, src, dst = self.report, self.src, self.dst
        try:
            # (the checkpoint's identity; its generation is each root's own)
            same = (inspect(src.child(name).url, storage_options=self.so).writer.get("id")
                    == inspect(dst.child(name).url, storage_options=self.dso).writer.get("id"))
        except CheckpointError:
            same = False
        (report.present if same else report.conflicts).append(step)
        if not same:
            log.warning("sync: step %d under %s is another checkpoint than under %s; left as it "
                        "is", step, dst.url, src.url)
            return
        if self.listing is None:
            self.listing = list_blob_objects(dst)
        try:
            _, problems = check_structure(dst.child(name), listing=self.listing)
        except CheckpointError as e:
            problems = [e]
        if not problems:
            return
        log.warning("sync: step %d under %s is broken (%s); %s", step, dst.url, problems[0],
                    "it would be copied again" if self.dry_run else "copying it again")
        if self.dry_run:
            return
        try:
            copy_checkpoint(src.child(name), dst.child(name), dedup=self.dedup, known=self.known,
                            overwrite=True, fence=self.lock)
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:
            log.error("sync: step %d under %s is still broken: %s", step, dst.url, e)
            report.broken.append(step)
            report.problems[step] = f"{type(e).__name__}: {e}"
        else:
            log.warning("sync: step %d under %s healed from %s", step, dst.url, src.url)
            report.healed.append(step)
        self.listing = None  # objects were uploaded: list again for the next check

    def _copy(self, step: int, name: str) -> None:
        """A step DST lacks: copied (or, in a dry run, only reported)."""
        report = self.report
        report.copied.append(step)
        if self.dry_run:
            return
        total = inspect(self.src.child(name).url, storage_options=self.so).nbytes
        done = [0]
        progress = self.progress

        def tick(n: int) -> None:
            done[0] += n
            if progress:
                progress(name, done[0], total)

        def copy() -> Any:
            return copy_checkpoint(self.src.child(name), self.dst.child(name), dedup=self.dedup,
                                   known=self.known, progress=tick, fence=self.lock)

        try:
            try:
                _, stats = copy()
            except CheckpointExistsError:
                # A step DST's readers ignore (committed there by a writer after its lease was
                # taken over) is in the way: removed first, as a manager's save does.
                if not Tier(self.dst, self.dso, lock=self.lock).clear_fenced(step, by="sync"):
                    raise
                done[0] = 0
                _, stats = copy()
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:
            # (a damaged source, or a copy that did not verify: uncommitted, not a step)
            log.error("sync: step %d could not be copied to %s: %s", step, self.dst.url, e)
            report.copied.remove(step)
            report.broken.append(step)
            report.problems[step] = f"{type(e).__name__}: {e}"
            return
        if progress and done[0] < total:  # (objects DST had were not sent: the step is done)
            progress(name, total, total)
        self.listing = None
        report.read += stats.read
        report.written += stats.written


def _kept(keep: Any, src_steps: list, s_root: Store, so: Mapping[str, Any], have: Mapping[int, str],
          d_root: Store, dso: Mapping[str, Any]) -> set[int]:
    """The steps the retention ``keep`` would leave under DST once every step of SRC is there:
    the policy over SRC's steps and those DST already holds, plus the newest and any whose
    manifest cannot be read (as ``Tier.retain`` keeps them)."""
    src, dst = Tier(s_root, so), Tier(d_root, dso)
    where = {step: dst for step in have}
    where.update({step: src for step, _ in src_steps})
    entries, unreadable = [], set()
    for step in sorted(where):
        entry = where[step].entry(step)
        if entry is None:
            unreadable.add(step)
        else:
            entries.append(entry)
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
