"""A tier: one root of committed steps, and every act on it written once.

A :class:`~ckptcore.CheckpointManager` has a local tier (its root) and one tier per backup; a
``ckpt sync`` destination is a tier too.  Each is a :class:`Tier`: a :class:`Store`, its storage
options and, for a writer, the root's :class:`~ckptcore._lock.WriterLock` (the fence every
deletion checks first).  Listing committed steps, reading what retention needs of a step,
retention itself, the manifest-first deletion, verification and gc live here and nowhere else,
so the local root, a bucket and a sync target obey the same rules:

* a deletion removes the manifest first (a half-deleted step is never "committed"), refuses to
  go through a symbolic link, and asks the lock first (a superseded writer deletes nothing);
* retention always keeps the newest committed step (and any step a policy cannot judge: its
  manifest does not read), and deletes nothing while that newest step fails the reader's
  structural checks, since it is what supersedes the others.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

from . import _fence, layout
from .api import save_state, verify
from ._manifest import MANIFEST_NAME
from ._read import inspect
from ._commit import remove_uncommitted
from ._replica import copy_checkpoint
from ._steps import STEP, committed_steps, fenced_steps, is_committed, step_name
from ._storage import Store
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError,
                     LockedError, StorageError,
                     UnsafeCheckpointError, UnsupportedCheckpointError)
from .policies import CheckpointEntry, RetentionPolicy, check_metrics, saved_metrics

log = logging.getLogger("ckptcore")


def is_damage(e: BaseException) -> bool:
    """Whether a step that failed to load is damaged (bad, missing or malformed bytes), as opposed
    to intact but unreadable here (a newer format), gone, or out of reach (network, lock)."""
    return isinstance(e, CheckpointError) and not isinstance(
        e, (UnsupportedCheckpointError, CheckpointNotFoundError, StorageError, LockedError))


class Tier:
    """One root of committed steps (see the module docstring).

    ``lock``: the root's writer lock when this process writes there (None for readers);
    ``view``: list through the lock's own view of the root (saves reading manifests; only for a
    lock used by the listing thread); ``what``: how logs name its steps; ``tracked``: every
    commit to this tier goes through :meth:`commit` and :meth:`remember` in this process, so
    while its lock keeps other writers out its own listing stays true and retention need not
    list the root again (a manager's local tier).
    """

    def __init__(self, root: Store, options: Mapping[str, Any] | None = None, *,
                 lock: Any = None, view: bool = True, what: str = "checkpoint",
                 tracked: bool = False) -> None:
        self.root = root
        self.options = dict(options or {})
        self.lock = lock
        self._view = lock if view else None
        self.what = what
        self._tracked = tracked and lock is not None
        self._entries: dict[int, CheckpointEntry] = {}
        self._listed: list[int] | None = None  # committed steps, as of this tier's last write

    def __repr__(self) -> str:
        return f"Tier({self.root.url!r})"

    @property
    def url(self) -> str:
        return self.root.url

    def step_store(self, step: int) -> Store:
        return self.root.child(step_name(step))

    def step_url(self, step: int) -> str:
        return self.step_store(step).url

    # -- listing --------------------------------------------------------------------------------
    def steps(self, *, missing_ok: bool = False) -> list[int]:
        """Committed steps that readers accept, ascending (listed now).  ``missing_ok``: a root
        that does not exist yet has none (one more request to ask)."""
        if missing_ok and not self.root.exists():
            steps: list[int] = []
        else:
            steps = [s for s, _ in committed_steps(self.root, self._view)]
        self._listed = steps
        return list(steps)

    def committed(self) -> list[int]:
        """Committed steps, from this tier's last listing while its lock keeps other writers out
        (a save's order check need not list the root every time)."""
        if self._listed is None and self._tracked:
            self._listed = self.lock.claimed_steps()  # the claim's own listing, if just made
        if self._listed is None or self.lock is None:
            return self.steps()
        return list(self._listed)

    def relist(self) -> None:
        """Forget the last listing: the next :meth:`committed` lists again."""
        self._listed = None

    def has(self, step: int) -> bool:
        """Whether ``step`` is committed here and readers accept it (asked now)."""
        return is_committed(self.root, step)

    # -- committing ----------------------------------------------------------------------------
    def commit(self, step: int, state: Any, *, overwrite: bool = False, group: Any = None,
               decide: Callable[[Callable[[], Any]], Any] = lambda work: work(),
               lineage: Any = None) -> Any:
        """Save ``state`` as ``step`` (:func:`ckptcore.save_state` under this tier's lock) and
        return its ``CheckpointInfo``.  A step in the way that no reader accepts (committed by a
        writer after its lease was taken over) is removed first; ``decide(work)`` runs that
        decision (with a group: on rank 0, every rank following, a group's save being one act).
        A step in the way otherwise is a ``CheckpointExistsError`` saying what to do."""
        def save() -> Any:
            return save_state(self.step_url(step), state, storage_options=self.options,
                              overwrite=overwrite, group=group, fence=self.lock,
                              lineage=lineage)
        try:
            try:
                return save()
            except CheckpointExistsError:
                if not decide(lambda: self.clear_fenced(step)):
                    raise
                return save()
        except CheckpointExistsError as e:
            # A writer that lost the root sees the new holder's steps: say that, not this.
            self.check_current(f"step {step} was not committed")
            if step not in self.steps():
                raise CheckpointExistsError(
                    f"{e}. The folder of step {step} under {self.url} holds the leftovers of an "
                    f"interrupted save or deletion: mgr.gc() removes them once they are older "
                    f"than its grace period, mgr.rewind({step}) at once") from e
            raise CheckpointExistsError(
                f"{e}. Step {step} was committed by another run or manager under {self.url}, and "
                f"a manager replaces only the steps it saved itself: to resume from it, call "
                f"mgr.restore() and save the steps after it; to discard it, call mgr.rewind({step}) "
                "(deletes it and every newer checkpoint) and save again") from e
        except IncompleteCheckpointError:
            self.check_current(f"step {step} was not committed")  # as above
            raise

    def check_current(self, what: str) -> None:
        """Raise ``FencedError`` if this tier's writer was superseded (nothing for readers)."""
        if self.lock is not None:
            self.lock.check_current(what)

    # -- what retention knows of a step ---------------------------------------------------------
    def remember(self, step: int, created: float, metadata: Any) -> None:
        """What a step this process just committed carries (its manifest need not be read)."""
        entry = self._entries[step] = CheckpointEntry(step, created, saved_metrics(step, metadata))
        if self._listed is not None and step not in self._listed:
            self._listed = sorted(self._listed + [step])
        if self.lock is not None:
            self.lock.remember(step, entry.created, entry.metrics)

    def entry(self, step: int) -> CheckpointEntry | None:
        """The step's retention entry (creation time, metrics); None when its manifest cannot be
        read (a policy cannot judge it)."""
        if step in self._entries:
            return self._entries[step]
        entry = self._recorded(step)
        if entry is None:
            entry = self._read_entry(step)
            if entry is None:
                return None
            self._learn(entry)
        self._entries[step] = entry
        return entry

    def _recorded(self, step: int) -> CheckpointEntry | None:
        """The retention index's entry for ``step`` (no request); None if none or malformed."""
        recorded = self.lock.entry(step) if self.lock is not None else None
        if recorded is None:
            return None
        created, metrics = recorded
        try:
            return CheckpointEntry(step, created, check_metrics(metrics) if metrics else None)
        except (TypeError, ValueError):
            return None  # malformed: read the manifest instead

    def _read_entry(self, step: int) -> CheckpointEntry | None:
        try:
            info = inspect(self.step_url(step), storage_options=self.options)
        except CheckpointError:
            return None
        return CheckpointEntry(step, info.created, saved_metrics(step, info.metadata))

    def _learn(self, entry: CheckpointEntry) -> None:
        if self.lock is not None:  # into the retention index: read once per root
            self.lock.remember(entry.step, entry.created, entry.metrics)

    def _entries_of(self, steps: list[int]) -> dict[int, CheckpointEntry | None]:
        """:meth:`entry` of each step; the manifests to read (a root written before the index,
        or by writers without a lock) are read on the store's writer threads at once."""
        unknown = [s for s in steps if s not in self._entries and self._recorded(s) is None]
        if len(unknown) > 1:
            with ThreadPoolExecutor(min(len(unknown), max(1, self.root.writers))) as pool:
                for entry in pool.map(self._read_entry, unknown):
                    if entry is not None:  # (cached here, on this thread)
                        self._entries[entry.step] = entry
                        self._learn(entry)
        return {s: self.entry(s) for s in steps}

    # -- deleting -------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Remove ``step``: manifest first, then its data (the one deletion of every tier)."""
        name = step_name(step)
        if self.root.local and os.path.islink(self.root.join(name)):
            # Deleting "its manifest" would delete a file wherever the link points.
            raise UnsafeCheckpointError(f"{self.root.join(name)} is a symbolic link, not a "
                                        "checkpoint folder of this root; refusing to delete "
                                        "through it")
        ckpt = self.root.child(name)
        # Listed before the lock is asked: a writer that takes the root over while this one is
        # paused claims first and writes after, so only objects of this step as it was go (on
        # an object store it may commit the step again in this very folder: a rewind's).
        listed = None if ckpt.local else ckpt.find()
        if self.lock is not None:
            self.lock.before_delete()  # a superseded writer deletes nothing
            self.lock.forget(step)
        ckpt.delete(MANIFEST_NAME)  # uncommit first: a half-deleted step is never "committed"
        remove_uncommitted(ckpt, fence=self.lock, why=f"deleting step {step}", listed=listed)
        self._entries.pop(step, None)
        if self._listed is not None and step in self._listed:
            self._listed.remove(step)

    def retain(self, policy: RetentionPolicy, *, skip: Iterable[int] = (),
               hold: Callable[[list[int]], set[int]] | None = None,
               dry_run: bool = False, missing_ok: bool = False) -> list[int]:
        """Apply ``policy`` to the committed steps; delete (oldest first) and return the others.

        ``skip``: steps neither judged nor counted as the newest (damaged ones a restore fell
        back over: else one would hold the newest slot and the resumed run's saves below it
        would go).  ``hold(doomed)``: steps among those the policy would delete that must stay
        for now (a step not replicated yet), logged by the caller.  ``dry_run``: only say which.
        ``missing_ok``: the root may not exist (a sync target); after this tier's own commit it
        does, and asking would cost a request per save on object stores.
        """
        # A writer's own view (its listing, its commits and deletions since) while its lock keeps
        # others out: no listing per save (a run keeps thousands of steps on a bucket).
        steps = self.committed() if self._tracked and self._listed is not None \
            else self.steps(missing_ok=missing_ok)
        skipped = set(skip)
        good = [s for s in steps if s not in skipped]
        if len(good) < 2:
            return []
        read = self._entries_of(good)
        keep = set(policy.keep([e for e in read.values() if e is not None]))
        keep.add(good[-1])  # the newest committed good one, always
        keep.update(s for s, e in read.items() if e is None)  # unreadable: a policy cannot judge it
        doomed = [s for s in good[:-1] if s not in keep]
        if doomed and hold is not None:
            held = hold(doomed)
            doomed = [s for s in doomed if s not in held]
        if not doomed or dry_run:
            return doomed
        problem = layout.structure_problem(self.step_store(good[-1]))
        if problem:
            log.warning("retention: not deleting steps %s under %s: the newest step %d, which "
                        "supersedes them, does not pass the reader's checks (%s)", doomed,
                        self.root.url, good[-1], problem)
            return []
        for s in doomed:  # every one has a committed successor
            log.info("retention: deleting %s step %d under %s", self.what, s, self.root.url)
            self.delete(s)
        return doomed

    def rewind(self, step: int) -> list[int]:
        """Delete every committed step from ``step`` on, newest first (a crash midway leaves a
        prefix of the run), and the manifest-less step folders from there on (an interrupted
        deletion's leftovers, which would block saving those steps again); returns the steps."""
        gone = [s for s in reversed(self.steps()) if s >= step]
        for s in gone:
            log.info("rewind(%d): deleting %s step %d (%s)", step, self.what, s, self.step_url(s))
            self.delete(s)
        self.root.fs.invalidate_cache()
        for e in self.root.listdir():
            m = STEP.fullmatch(e.name)
            if m and not e.is_link and int(m.group(1)) >= step:
                self._remove_leftover(step, int(m.group(1)), self.root.child(e.name))
        self.relist()
        return gone

    def _remove_leftover(self, rewound: int, step: int, ckpt: Store) -> None:
        """A step folder ``rewind(rewound)`` found after deleting the committed steps: removed
        if it has no manifest, or one no reader accepts; a step readers accept (committed
        meanwhile, by a writer that took the root over from this paused one) is left alone."""
        listed = None if ckpt.local else ckpt.find()  # before the lock is asked (see delete)
        if ckpt.exists(MANIFEST_NAME):
            if self.lock is not None:
                self.lock.before_delete()
            if not _fence.split(self.root, [(step, ckpt.name)])[1]:
                log.warning("rewind(%d): not removing %s: a committed step readers accept "
                            "(saved after the rewind's listing)", rewound, ckpt.url)
                return
            log.info("rewind(%d): removing %s, committed by a writer after its lease was taken "
                     "over", rewound, ckpt.url)
            ckpt.delete(MANIFEST_NAME)
        else:
            log.info("rewind(%d): removing leftover %s (no manifest)", rewound, ckpt.url)
        try:
            remove_uncommitted(ckpt, fence=self.lock, why=f"rewind({rewound})", listed=listed)
        except FileNotFoundError:
            pass  # an object store's folder vanishes with its last object

    def clear_fenced(self, step: int, *, by: str = "save") -> bool:
        """Remove a checkpoint of ``step`` that no reader accepts (committed by a writer after
        its lease was taken over), so a save (``by``: what logs call it) can go there; whether
        there was one."""
        if self.lock is None or step not in {s for s, _ in fenced_steps(self.root)}:
            return False
        log.warning("%s(%d): removing %s, committed by a writer after its lease was taken "
                    "over (no reader accepts it), to %s the step there", by, step,
                    self.step_url(step), "copy" if by == "sync" else "save")
        self.delete(step)
        return True

    def damage(self, step: int) -> list[BaseException] | None:
        """Why ``step`` is damaged (its data fails a checksum or is missing, verified now), or
        None when it is not: intact, gone, or merely unreadable here (a newer format)."""
        try:
            problems: list[BaseException] = list(self.verify(step))
        except Exception as e:  # noqa: BLE001 - classified just below
            problems = [e]
        return problems if problems and all(is_damage(p) for p in problems) else None

    def seed(self, source: Tier, step: int, *, replace: bool = False) -> None:
        """Copy ``source``'s committed ``step`` here (``restore(seed=True)``), under this tier's
        lock; ``replace``: the copy here was found damaged, and is replaced if it still fails
        its checks (a read that failed once does not delete a copy that verifies now)."""
        dst = self.step_store(step)
        if dst.exists(MANIFEST_NAME):
            if not replace:
                log.info("restore: step %d is already under %s; not seeding it", step, self.url)
                return
            self._acquire()
            try:
                problems: list[Exception] = list(self.verify(step))
            except CheckpointError as e:  # its manifest is unreadable: damaged too
                problems = [e]
            if not problems:
                log.info("restore: the local copy of step %d under %s verifies now; keeping it",
                         step, self.url)
                return
            log.warning("restore: replacing the damaged copy of step %d under %s (%s) with its "
                        "replica from %s", step, self.url, problems[0], source.url)
            self.delete(step)
        self._acquire()
        log.info("restore: seeding %s with step %d from %s", self.url, step, source.url)
        copy_checkpoint(source.step_store(step), dst, dedup=False, fence=self.lock)
        self.relist()

    def _acquire(self) -> None:
        if self.lock is not None:
            self.lock.acquire()

    # -- checking and cleaning ------------------------------------------------------------------
    def verify(self, step: int) -> list[CheckpointError]:
        """Every checksum of ``step`` (see :func:`ckptcore.verify`)."""
        return verify(self.step_url(step), storage_options=self.options)

    def gc(self, grace: float) -> list[str]:
        """Remove leftovers older than ``grace`` seconds (:func:`ckptcore.gc` on this root, under
        this tier's lock, which the caller holds)."""
        return layout.remove_leftovers(self.root, grace, self.lock)
