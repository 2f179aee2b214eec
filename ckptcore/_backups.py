"""A manager's backup tiers acted on together (``CheckpointManager(backup=[...])``): each
committed step goes to every one, local retention asks each whether a step is replicated, and
what one of them fails is raised once every one was waited for.  One tier is
``_backup.BackupTier``."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from ._backup import BackupTier
from ._storage import Store
from .errors import CheckpointError
from .options import Backup, Lease

log = logging.getLogger("ckptcore")


class Backups:
    """A manager's backup tiers, acted on together: each committed step goes to every one, and
    what one of them fails is raised once every one was waited for."""

    def __init__(self, local: Store, specs: list[Backup], *, lock: bool, lease: Lease) -> None:
        self.tiers = [BackupTier(local, s, lock=lock, lease=lease) for s in specs]
        for i, b in enumerate(self.tiers):
            for other in self.tiers[:i]:
                if b.root.same_place(other.root):
                    raise ValueError(f"backup: {b.root.url!r} is given twice (as "
                                     f"{other.root.url!r}); each backup must be another location")

    def __iter__(self) -> Iterator[BackupTier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def __getitem__(self, i: int) -> BackupTier:
        return self.tiers[i]

    def reachable_steps(self) -> set[int]:
        """The steps committed in any backup that can be listed now (one out of reach: logged)."""
        steps: set[int] = set()
        for b in self.tiers:
            try:
                steps |= set(b.steps())
            except (CheckpointError, OSError) as e:
                log.warning("latest_step: the backup %s cannot be listed (%s); the other tiers "
                            "only", b.root.url, e)
        return steps

    def check(self, local_steps: list[int]) -> None:
        for b in self.tiers:
            b.check_reachable(local_steps)

    def resume(self, local_steps: list[int]) -> None:
        for b in self.tiers:
            b.resume(local_steps)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Replication waits at its next object while the block (a save) runs."""
        for b in self.tiers:
            b.pause()
        try:
            yield
        finally:
            for b in self.tiers:
                b.proceed()

    def enqueue(self, step: int) -> None:
        for b in self.tiers:
            b.enqueue(step)

    def unreplicated(self, steps: list[int]) -> set[int]:
        """Those of ``steps`` some backup with ``keep_unreplicated`` still lacks (logged)."""
        held = set()
        for b in self.tiers:
            if not b.spec.keep_unreplicated:
                continue
            have = b.confirmed(steps)  # (each listed replica checked once, all together)
            for s in steps:
                if s not in have:
                    log.info("retention: keeping checkpoint step %d under %s until its replica "
                             "in %s is committed", s, b.local.url, b.root.url)
                    held.add(s)
        return held

    def wait(self) -> None:
        """Every tier's :meth:`BackupTier.wait`; the first error raised after all were waited."""
        errors = []
        for b in self.tiers:
            try:
                b.wait()
            except BaseException as e:  # noqa: BLE001 - every backup waited for; first raised
                errors.append(e)
        if errors:
            raise errors[0]

    def closing(self) -> None:
        for b in self.tiers:
            b.closing()

    def close(self) -> None:
        """Stop every tier's thread and release its lock (after :meth:`wait`)."""
        errors = []
        for b in self.tiers:
            try:
                b.close()
            except BaseException as e:  # noqa: BLE001 - every tier closed; first raised
                errors.append(e)
        if errors:
            raise errors[0]

