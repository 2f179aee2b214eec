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
from typing import Any, Callable, Iterable, Mapping

from . import layout
from .api import verify
from ._manifest import MANIFEST_NAME
from ._read import inspect
from ._steps import committed_steps, is_committed, step_name
from ._storage import Store
from .errors import CheckpointError, UnsafeCheckpointError
from .policies import CheckpointEntry, RetentionPolicy, saved_metrics

log = logging.getLogger("ckptcore")


class Tier:
    """One root of committed steps (see the module docstring).

    ``lock``: the root's writer lock when this process writes there (None for readers);
    ``view``: list through the lock's own view of the root (saves reading manifests; only for a
    lock used by the listing thread); ``what``: how logs name its steps.
    """

    def __init__(self, root: Store, options: Mapping[str, Any] | None = None, *,
                 lock: Any = None, view: bool = True, what: str = "checkpoint") -> None:
        self.root = root
        self.options = dict(options or {})
        self.lock = lock
        self._view = lock if view else None
        self.what = what
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
        if self._listed is None or self.lock is None:
            return self.steps()
        return list(self._listed)

    def relist(self) -> None:
        """Forget the last listing: the next :meth:`committed` lists again."""
        self._listed = None

    def has(self, step: int) -> bool:
        """Whether ``step`` is committed here and readers accept it (asked now)."""
        return is_committed(self.root, step)

    # -- what retention knows of a step ---------------------------------------------------------
    def remember(self, step: int, created: float, metadata: Any) -> None:
        """What a step this process just committed carries (its manifest need not be read)."""
        self._entries[step] = CheckpointEntry(step, created, saved_metrics(step, metadata))
        if self._listed is not None and step not in self._listed:
            self._listed = sorted(self._listed + [step])

    def entry(self, step: int) -> CheckpointEntry | None:
        """The step's retention entry (creation time, metrics); None when its manifest cannot be
        read (a policy cannot judge it)."""
        if step not in self._entries:
            try:
                info = inspect(self.step_url(step), storage_options=self.options)
            except CheckpointError:
                return None
            self._entries[step] = CheckpointEntry(step, info.created,
                                                  saved_metrics(step, info.metadata))
        return self._entries[step]

    # -- deleting -------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Remove ``step``: manifest first, then its data (the one deletion of every tier)."""
        name = step_name(step)
        if self.root.local and os.path.islink(self.root.join(name)):
            # Deleting "its manifest" would delete a file wherever the link points.
            raise UnsafeCheckpointError(f"{self.root.join(name)} is a symbolic link, not a "
                                        "checkpoint folder of this root; refusing to delete "
                                        "through it")
        if self.lock is not None:
            self.lock.before_delete()  # a superseded writer deletes nothing
            self.lock.forget(step)
        ckpt = self.root.child(name)
        ckpt.delete(MANIFEST_NAME)  # uncommit first: a half-deleted step is never "committed"
        ckpt.delete_tree()
        self._entries.pop(step, None)
        if self._listed is not None and step in self._listed:
            self._listed.remove(step)

    def retain(self, policy: RetentionPolicy, *, skip: Iterable[int] = (),
               hold: Callable[[list[int]], set[int]] | None = None,
               dry_run: bool = False) -> list[int]:
        """Apply ``policy`` to the committed steps; delete (oldest first) and return the others.

        ``skip``: steps neither judged nor counted as the newest (damaged ones a restore fell
        back over: else one would hold the newest slot and the resumed run's saves below it
        would go).  ``hold(doomed)``: steps among those the policy would delete that must stay
        for now (a step not replicated yet), logged by the caller.  ``dry_run``: only say which.
        """
        steps = self.steps(missing_ok=True)
        skipped = set(skip)
        good = [s for s in steps if s not in skipped]
        if len(good) < 2:
            return []
        read = {s: self.entry(s) for s in good}
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

    # -- checking and cleaning ------------------------------------------------------------------
    def verify(self, step: int) -> list[CheckpointError]:
        """Every checksum of ``step`` (see :func:`ckptcore.verify`)."""
        return verify(self.step_url(step), storage_options=self.options)

    def gc(self, grace: float) -> list[str]:
        """Remove leftovers older than ``grace`` seconds (:func:`ckptcore.gc` on this root, under
        this tier's lock, which the caller holds)."""
        return layout.remove_leftovers(self.root, grace, self.lock)
