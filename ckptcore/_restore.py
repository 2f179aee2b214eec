"""Restoring from a manager's tiers: which step, from which tier, and falling back.

``CheckpointManager.restore()`` hands its tiers (local first, then each backup) to
:class:`Restorer`.  Without a step it tries every committed step of every tier, newest first,
a step's local copy before its replicas, and takes the first that loads:

* a step that fails to decode or verify is skipped with a :class:`CheckpointFallbackWarning`
  (its replica next, else an older step);
* a :class:`~ckptcore.errors.GroupError` raises (a peer is gone: no other step loads without
  it), and so does a :class:`~ckptcore.errors.StorageError` on the local tier (the store is out
  of reach: an older step would be no better); on a backup tier it only means there is no
  replica to fall back on (logged);
* a listing whose every step was deleted while it was read (another writer's retention) is
  made again, a few times; so is one that comes out empty (a listing paused between the step
  folders and their manifests can miss every step).

With a group, rank 0 lists the tiers and every rank tries the same candidates in the same
order; every rank follows rank 0's verdict after a failure, so none falls back while another
raises.  No storage is touched while ranks agree on a verdict.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import _dist, api, events, lineage
from ._manifest import MANIFEST_NAME
from ._storage import Store
from ._tier import Tier, is_damage
from .errors import (CheckpointError, CheckpointFallbackWarning, CheckpointNotFoundError,
                     CorruptCheckpointError, GroupError, StorageError, caller_level)
from .state import TrainingState

log = logging.getLogger("ckptcore")
_RELISTS = 3  # listings made again when every listed step vanished while read


@dataclass
class Restored:
    """What :meth:`Restorer.newest` restored, and what it fell back over on the local tier."""

    state: TrainingState
    step: int
    tier: int  # index into the tiers: 0 is local
    damaged: set[int] = field(default_factory=set)  # local copies that failed their checks
    passed: set[int] = field(default_factory=set)  # local copies that did not load at all


class Restorer:
    """The candidates of a restore over ``tiers`` (index 0 local); ``anchor``: the store a
    group's collectives are keyed by (the manager's root)."""

    def __init__(self, tiers: list[Tier], group: Any, anchor: Store) -> None:
        self.tiers, self.group, self.anchor = tiers, group, anchor
        self.chosen: tuple[int, int] | None = None  # (step, tier) restored, once known
        self.fallbacks: list[events.Fallback] = []  # every candidate passed over (the event's)
        # After a restore: (tier index, step restored, newest step committed in any tier).
        self.restored: tuple[int, int, int | None] | None = None
        self.newest_step: int | None = None

    def restore(self, step: int | None, *, keys: Any, like: Any, seed: bool,
                objects: dict) -> tuple[TrainingState, Restored | None]:
        """``CheckpointManager.restore``: ``step`` (never falls back) or the newest that loads,
        restored into ``objects``, its replica seeded into the local tier when ``seed``.  With
        no step, also what was fallen back over (the copy seeded from a replica: healed)."""
        keys = api.check_keys(keys)  # a usage error, not a step to fall back over
        if step is not None:
            return self._restore_step(step, keys, like, seed, objects), None

        def load(tier: Tier, s: int) -> TrainingState:
            return api.load_state(tier.step_url(s), storage_options=tier.options, keys=keys,
                                  like=like, group=self.group)

        found = self.newest(load, lambda state: self._restore_into(state, objects))
        self.restored = (found.tier, found.step, self.newest_step)
        if found.tier > 0:
            log.info("restore: step %d restored from its replica %s", found.step,
                     self.tiers[found.tier].step_url(found.step))
            if seed:
                self._seed(found.tier, found.step, replace=found.step in found.damaged)
                found.damaged.discard(found.step)  # healed: the local copy is the replica's now
        return found.state, found

    def _restore_step(self, step: int, keys: Any, like: Any, seed: bool,
                      objects: dict) -> TrainingState:
        where = self.where(step)
        local = self.tiers[0]
        if not where and local.step_store(step).exists(MANIFEST_NAME):
            raise CheckpointNotFoundError(
                f"{local.step_url(step)}: step {step} was committed by a writer after its "
                "lease was taken over, so no reader accepts it (gc() removes it)")
        tier = self.tiers[where[0] if where else 0]  # nowhere: the local error names it
        self.chosen = (step, where[0] if where else 0)
        if self.group is None:  # streams: each tensor assigned once its own batch verified
            state = api.load_state(tier.step_url(step), storage_options=tier.options, keys=keys,
                                   like=like, **objects)
        else:
            state = api.load_state(tier.step_url(step), storage_options=tier.options, keys=keys,
                                   like=like, group=self.group)
            self._restore_into(state, objects)
        if where and where[0] > 0 and seed:
            self._seed(where[0], step)
        if self.group is None or int(self.group.rank) == 0:  # (the newest: for the lineage)
            self._plan_steps()
        self.restored = (where[0] if where else 0, step, self.newest_step)
        return state

    def _plan_steps(self) -> None:
        try:
            self.newest_step = max((int(s) for s, _ in self._plan()), default=None)
        except (CheckpointError, OSError) as e:
            log.debug("restore: the newest step is unknown (%s); not recorded", e)

    def _restore_into(self, state: TrainingState, objects: dict) -> None:
        """Assign a loaded state to the objects; with a group, every rank succeeds or raises."""
        if self.group is None:
            api.restore_objects(state, objects)
        elif objects:
            _dist.agree(self.anchor, self.group, lambda: api.restore_objects(state, objects))

    def _seed(self, tier: int, step: int, replace: bool = False) -> None:
        """``seed=True``: copy the replica into the local tier (rank 0 with a group)."""
        self._everyone(lambda: self.tiers[0].seed(self.tiers[tier], step, replace=replace))

    def _everyone(self, work: Callable[[], Any]) -> Any:
        """``work()`` here, or with a group rank 0's result on every rank."""
        return work() if self.group is None else _dist.decide(self.anchor, self.group, work)

    def where(self, step: int) -> list[int]:
        """The tiers where ``step`` is committed, local first (asked of rank 0 with a group); a
        backup out of reach is left out (logged), as in :meth:`_plan`: it cannot hold back a
        step that is whole on the local tier."""
        return [int(i) for i in self._everyone(
            lambda: [i for i, t in enumerate(self.tiers) if self._has(i, t, step)])]

    @staticmethod
    def _has(i: int, tier: Tier, step: int) -> bool:
        if i == 0:
            return tier.has(step)  # the local tier out of reach: no other step is better
        try:
            return tier.has(step)
        except (CheckpointError, OSError) as e:
            log.warning("restore: the backup %s cannot be asked for step %d (%s: %s); the other "
                        "tiers only", tier.url, step, type(e).__name__, e)
            return False

    def _plan(self) -> list[list[Any]]:
        """``[step, [tier, ...]]`` for every committed step of any tier, from one listing of
        each (a backup out of reach: the others only, logged)."""
        held: dict[int, list[int]] = {}
        for i, tier in enumerate(self.tiers):
            try:
                steps = tier.steps(missing_ok=True)
            except (CheckpointError, OSError) as e:
                if i == 0:
                    raise
                log.warning("restore: the backup %s cannot be listed (%s); the other tiers only",
                            tier.url, e)
                continue
            for s in steps:
                held.setdefault(s, []).append(i)
        return [[s, held[s]] for s in sorted(held)]

    def newest(self, load: Callable[[Tier, int], TrainingState],
               apply: Callable[[TrainingState], None]) -> Restored:
        """Load the newest step that loads (see the module docstring) and ``apply`` it."""
        for attempt in range(_RELISTS):
            plan = {int(s): [int(i) for i in tiers] for s, tiers in self._everyone(self._plan)}
            self.newest_step = max(plan, default=None)
            if not plan:
                # A listing is not atomic (step folders, then each one's manifest): one paused
                # in between can find every listed step deleted by the holder's retention and
                # none of its newer steps.  Empty only if a listing made now is empty too.
                if attempt + 1 < _RELISTS:
                    continue
                where = " or ".join(t.url for t in self.tiers)
                raise CheckpointNotFoundError(f"{where}: no committed checkpoints")
            found, last, gone = self._try(plan, load, apply)
            if found is not None:
                return found
            if not gone or attempt + 1 == _RELISTS:
                break
            log.warning("restore: %d of the checkpoints listed under %s were deleted while they "
                        "were read (another writer's retention); listing again", gone,
                        self.tiers[0].url)
        raise CorruptCheckpointError(f"{self.tiers[0].url}: none of the {len(plan)} checkpoints "
                                     f"verifies; the last error was: {last}") from last

    def _try(self, plan: Mapping[int, list[int]], load: Callable[[Tier, int], TrainingState],
             apply: Callable[[TrainingState], None]
             ) -> tuple[Restored | None, Exception | None, int]:
        """One pass over ``plan``, newest first: what loaded, the last error, how many were gone."""
        last: Exception | None = None
        damaged: set[int] = set()
        passed: set[int] = set()
        gone = 0
        for s in sorted(plan, reverse=True):
            for n, i in enumerate(plan[s]):
                try:
                    state = load(self.tiers[i], s)
                except Exception as e:  # noqa: BLE001 - judged by verdict
                    if self.verdict(s, i, e, replica_next=len(plan[s]) > n + 1) == "raise":
                        raise
                    if i == 0:
                        passed.add(s)
                        if is_damage(e):
                            damaged.add(s)
                    gone += isinstance(e, CheckpointNotFoundError)
                    last = e
                    continue
                self.chosen = (s, i)
                apply(state)
                return Restored(state, s, i, damaged, passed), last, gone
        return None, last, gone

    def verdict(self, step: int, tier: int, e: Exception, replica_next: bool) -> str:
        """After a candidate failed to load: ``"raise"`` or ``"next"`` (warned and logged)."""
        if isinstance(e, GroupError):
            verdict = ["raise", "group"]  # a peer is gone: no other step loads without it
        elif isinstance(e, StorageError):
            verdict = ["next" if tier > 0 else "raise", "unreachable"]
        else:  # any step that fails to decode or verify
            verdict = ["next", "invalid"]
        if self.group is not None:
            mine = verdict
            verdict = list(_dist.decide(self.anchor, self.group, lambda: mine))
        if verdict[0] == "raise":
            return "raise"
        url = self.tiers[tier].step_url(step)
        self.fallbacks.append(events.Fallback(step, url, verdict[1], type(e).__name__, str(e)))
        if verdict[1] == "unreachable":
            log.warning("restore: the replica of step %d (%s) cannot be read (%s); the backup "
                        "is out of reach", step, url, e)
            return "next"
        fallback = "its replica" if replica_next else "an older one"
        warnings.warn(f"checkpoint step {step} ({url}) does not verify: {e}; falling back to "
                      + fallback, CheckpointFallbackWarning, stacklevel=caller_level())
        log.warning("restore: checkpoint step %d (%s) does not load (%s: %s); falling back to %s",
                    step, url, type(e).__name__, e, fallback)
        return "next"


def resumed_run(run: lineage.Run, tiers: list[Tier], tier: int, step: int, newest: int | None,
                state: TrainingState, objects: Mapping[str, Any], keys: Any,
                unapplied: set[str] | frozenset = frozenset(), *,
                seconds: float | None = None, nbytes: int | None = None) -> lineage.Run:
    """The run a manager continues after restoring ``step`` from ``tiers[tier]`` into
    ``objects``: the step's run id, one resume more, and the record of what was restored
    against what was saved (``ckptcore.lineage.resume``), with the restore's ``seconds`` and
    ``nbytes`` (``ckpt report`` shows them).  The step's manifest is read again
    for its lineage; if it is gone already (another writer's retention), what the state
    says is recorded (logged)."""
    where = tiers[tier]
    url = where.step_url(step)
    try:
        info = api.inspect(url, storage_options=where.options)
    except CheckpointError as e:
        log.warning("restore: the lineage of step %d (%s) cannot be read (%s); recording the "
                    "resume from what was restored", step, url, e)
        info = None
    saved = dict(info.lineage) if info is not None and info.lineage is not None else None
    parts = ((saved or {}).get("parts") if isinstance((saved or {}).get("parts"), Mapping)
             else lineage.fingerprint_parts(state))
    restored = lineage.restored_parts(state, objects, keys, parts, unapplied)
    cursor = objects.get("cursor")
    got = getattr(cursor, "state_dict", None)
    record = lineage.resume(
        saved, step=step, url=url, tier="local" if tier == 0 else where.url,
        generation=info.writer.get("generation") if info is not None else None,
        framework=info.framework if info is not None else state.framework,
        saved_parts=parts, restored=restored, newest_step=newest,
        restored_position=lineage.position(got()) if callable(got) else None,
        seconds=seconds, nbytes=nbytes)
    new = run.resumed(saved, record)
    left = [p for p, v in restored.items() if v in (lineage.IGNORED, lineage.NOT_LOADED)]
    log.info("restore: run %s resumes from step %d (%s), resume %d%s", new.run_id, step, url,
             new.resume_count, f"; saved part(s) not restored: {', '.join(left)}" if left else "")
    return new
