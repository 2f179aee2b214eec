"""Fencing: generations of a root's writer, and which committed steps readers accept.

Every acquisition of a root's writer lock claims a *generation*: the object
``<root>/.ckptcore.gen/<g, 20 digits>``, created with a create-only write, so two writers can
never hold the same generation, and ``g`` is one more than the newest generation listed, so
generations only grow.  Its JSON record names the holder and, as ``accepted``, the steps readers
accepted at the moment of the claim; the holder adds the steps it commits (``committed``).  Every
manifest a locked writer commits records its generation (``writer["generation"]``).

A writer of generation ``g`` is *superseded* once any generation above ``g`` exists.  Its commits
made before that are in the newer generation's ``accepted`` list; a commit it makes afterwards
(a process paused between its last check and its PUT) is not, and readers ignore it:

    a step is accepted  iff  its manifest has no generation (an unlocked writer, an older
    ckptcore), or its generation is the newest one G or above, or the step is in G's record
    (``accepted`` or ``committed``).

The record makes the common case cheap: one listing of ``.ckptcore.gen`` and one read of the
newest record; a manifest is read only for a step the record does not name (a commit after the
record was last written, or a fenced one).  Why this is safe on every store: the claim is a
create-only write (atomic on local disk, S3 ``If-None-Match``, GCS ``ifGenerationMatch=0``, Azure
``If-None-Match``), the only compare-and-swap these stores offer; no reader needs a clock.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from . import _codec, _knobs
from ._manifest import MANIFEST_NAME
from ._storage import Store
from .errors import CheckpointError, LockedError, StorageError

log = logging.getLogger("ckptcore")

GEN_DIR = ".ckptcore.gen"
STEP = re.compile(r"step-(\d{12,})")  # a step folder (fullmatch only: "$" admits a newline)
_GEN = re.compile(r"\d{20}")
_KEEP_RECORDS = 8  # older generation records are pruned by a new claim (the newest always stays)
_reported: set[tuple[str, int, Any]] = set()  # fenced steps already logged by this process


def gen_name(g: int) -> str:
    return f"{GEN_DIR}/{g:020d}"


def generations(root: Store) -> list[int]:
    """Every generation claimed under ``root``, ascending (one listing)."""
    return sorted(int(e.name) for e in root.listdir(GEN_DIR) if _GEN.fullmatch(e.name))


@dataclass(frozen=True)
class _Malformed:
    """A record that is there but is no record (junk, hostile, too large): why."""

    why: str


def _load_record(root: Store, g: int) -> Any:
    """Generation ``g``'s record: a dict; None when absent; :class:`_Malformed` when it is there
    but is not a record.  An I/O failure (the store's retries spent) raises
    :class:`StorageError`: the record decides which commits are fenced, so a read that did not
    happen is never taken for a record with nothing to say (see :func:`view`)."""
    try:
        record = json.loads(root.read(gen_name(g), max_bytes=64 << 20))
    except FileNotFoundError:
        return None
    except (IsADirectoryError, NotADirectoryError, ValueError) as e:
        # Not a record (junk, a torn or hostile write, over the limit, a folder, a link):
        # retrying cannot help, so this is judged as no record at all (see View.accepts).
        return _Malformed(f"{type(e).__name__}: {e}")
    except OSError as e:  # StorageError, permissions, a disk error: the store failed
        raise StorageError(f"{root.url}: the record of writer generation {g} cannot be read "
                           f"({type(e).__name__}: {e}); it decides which commits readers accept, "
                           "so nothing was judged: try again") from e
    return record if isinstance(record, dict) else _Malformed("not a JSON object")


def read_record(root: Store, g: int) -> dict[str, Any] | None:
    """Generation ``g``'s record, for messages (its holder's name); None when absent, malformed
    or unreadable (logged): never the basis of a verdict (:func:`view` is)."""
    try:
        record = _load_record(root, g)
    except StorageError as e:
        log.warning("%s", e)
        return None
    return record if isinstance(record, dict) else None


def _steps(value: Any) -> set[int]:
    return {int(s) for s in value if isinstance(s, int) and not isinstance(s, bool)} \
        if isinstance(value, list) else set()


@dataclass(frozen=True)
class View:
    """What a reader knows of a root's generations: the newest, and the steps its record names."""

    newest: int
    named: frozenset[int] = field(default_factory=frozenset)
    holder: str = "unknown"
    readable: bool = True
    # the record's "backups" as read: its data, checked by backups_of() on use
    backups: Any = field(default=None, compare=False, hash=False)

    def accepts(self, step: int, generation: Callable[[], int | None]) -> bool:
        """Whether readers accept ``step`` (``generation()`` reads its manifest's generation,
        asked only when the record does not name the step)."""
        if step in self.named:
            return True
        g = generation()
        if g is None or g >= self.newest:
            return True
        return not self.readable  # no record to judge by: never hide a step


def view(root: Store) -> View | None:
    """The reader's view of ``root`` (None: no writer ever claimed a generation there).

    :class:`StorageError` when the newest record cannot be read (an I/O failure): accepting
    every step then would show readers a fenced writer's commit, and a claim would write it into
    its own record for good.  A record that is absent or malformed, which no retry changes, is
    judged as no record: every step is accepted (never hide a step), logged."""
    gens = generations(root)
    if not gens:
        return None
    record = _load_record(root, gens[-1])
    if not isinstance(record, dict):
        log.warning("%s: the record of writer generation %d is %s: every committed step is "
                    "accepted, none is hidden", root.url, gens[-1],
                    "absent" if record is None else f"malformed ({record.why})")
        return View(gens[-1], readable=False)
    named = frozenset(_steps(record.get("accepted")) | _steps(record.get("committed")))
    return View(gens[-1], named, str(record.get("holder", "unknown")),
                backups=record.get("backups"))


# -- the retention index ------------------------------------------------------------------------
# Beside its record, a holder keeps ``<g>.index``: what retention knows of each step (creation
# time and metrics), so that a new manager applies its policy without reading a manifest per
# step.  A cache of the manifests, not a source of truth: written at most every INDEX_SECONDS
# and at release (its size grows with the steps kept; the record, rewritten at every commit,
# holds only step numbers), trusted only when written by the newest generation before a claim,
# and checked as data; a step it lacks is read from its manifest.
INDEX_SECONDS = 30.0


def index_name(g: int) -> str:
    return gen_name(g) + ".index"


def read_index(root: Store, g: int, named: Iterable[int]) -> dict[int, tuple[float, Any]]:
    """Generation ``g``'s retention index, for the steps in ``named``; {} when absent, unreadable
    or written by another generation."""
    try:
        body = json.loads(root.read(index_name(g), max_bytes=256 << 20))
    except FileNotFoundError:
        return {}
    except (ValueError, CheckpointError, OSError) as e:
        log.warning("%s: the retention index of writer generation %d cannot be read (%s); the "
                    "steps' manifests are read instead", root.url, g, e)
        return {}
    if not isinstance(body, dict) or body.get("generation") != g:
        return {}
    return _entries(body.get("entries"), frozenset(named))


def write_index(root: Store, g: int, entries: Mapping[int, tuple[float, Any]]) -> None:
    body = {"generation": g, "entries": {str(s): [c, m] for s, (c, m) in sorted(entries.items())}}
    root.write_bytes(index_name(g), json.dumps(body).encode())


def _entries(value: Any, named: frozenset[int]) -> dict[int, tuple[float, Any]]:
    """An index's ``entries``, as far as they are well formed (the rest: read from the
    manifests).  ``{"<step>": [created, metrics or null]}``; metrics are checked by retention."""
    if not isinstance(value, dict):
        return {}
    out = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 20) or int(k) not in named:
            continue
        if (isinstance(v, list) and len(v) == 2 and isinstance(v[0], (int, float))
                and not isinstance(v[0], bool) and math.isfinite(v[0])
                and (v[1] is None or isinstance(v[1], dict))):
            out[int(k)] = (float(v[0]), v[1])
    return out


def manifest_generation(ckpt: Store) -> int | None:
    """The generation a committed manifest records; None for none (or a damaged manifest: such
    a step is judged as damage by whoever loads it, not hidden here).  An I/O failure raises
    :class:`StorageError`, as for the record (:func:`view`): a step whose writer could not be
    told is neither hidden nor taken for accepted."""
    try:
        data = ckpt.read(MANIFEST_NAME, max_bytes=_knobs.max_manifest_bytes())
    except FileNotFoundError:  # deleted since it was listed: whoever loads it says so
        return None
    except (IsADirectoryError, NotADirectoryError, ValueError):
        return None  # not a manifest (damage, or hostile): not ours to judge here
    except OSError as e:  # StorageError too: the store failed, not the manifest
        raise StorageError(f"{ckpt.url}: its manifest cannot be read to tell which writer "
                           f"generation committed it ({type(e).__name__}: {e}); nothing was "
                           "judged: try again") from e
    try:
        outer = _codec.unpack_plain(data, MANIFEST_NAME)  # the reader's own bounded decoders
        g = _codec.unpack_raw(outer["body"])["writer"].get("generation")
    except Exception:  # noqa: BLE001 - damaged or foreign: not ours to judge here
        return None
    return g if isinstance(g, int) and not isinstance(g, bool) else None


def step_folders(root: Store, named: Iterable[int] = ()) -> list[tuple[int, str]]:
    """``(step, folder name)`` of every step folder under ``root`` with a manifest, ascending.

    One listing of the root; a folder's manifest is asked for only when ``named`` (the steps
    the newest writer record names) does not hold its step.  That record is rewritten before
    its holder deletes a manifest, so a listed folder of a named step has one; this is what
    keeps a save's cost from growing with the steps a run keeps (docs/SCALE.md)."""
    root.fs.invalidate_cache()  # object stores' cached listings miss other processes' commits
    named = frozenset(named)
    found = []
    for e in root.listdir(details=False):
        m = STEP.fullmatch(e.name)
        if m and e.is_link:
            # A link could lead out of the root; retention would then delete through it.
            log.warning("%s: skipping %s, a symbolic link, not a checkpoint folder", root.url, e.name)
        elif m and (int(m.group(1)) in named or root.child(e.name).exists(MANIFEST_NAME)):
            found.append((int(m.group(1)), e.name))
    return sorted(found)


def listed(root: Store, known: View | None = None) -> tuple[list[tuple[int, str]], View | None]:
    """The step folders with a manifest under ``root`` (:func:`step_folders`, trusting the
    steps the newest record names) and the view they were judged by (``known``, else read)."""
    v = known if known is not None else view(root)
    return step_folders(root, v.named if v is not None and v.readable else ()), v


def split(root: Store, found: Iterable[tuple[int, str]], known: View | None = None
          ) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``found`` step folders as (accepted, fenced): fenced ones were committed by a superseded
    writer after it was superseded (logged once per process).  ``known``: the holder's own view
    (``WriterLock.view()``), instead of reading it: a newer holder's steps are accepted by it as
    by the real one (their generation is above), and a stale one is caught at its next commit."""
    found = list(found)
    v = (known or view(root)) if found else None
    if v is None:
        return found, []
    named = v.named
    accepted, fenced = [], []
    for step, name in found:
        # (a named step, the common case thousands of times over, needs no call)
        if step in named or v.accepts(step, lambda: manifest_generation(root.child(name))):
            accepted.append((step, name))
            continue
        fenced.append((step, name))
        key = (root.url, step, v.newest)
        if key not in _reported:
            _reported.add(key)
            log.warning("%s: ignoring step %d: it was committed by a writer whose lease had been "
                        "taken over (generation %d holds the root now); gc() removes it",
                        root.url, step, v.newest)
    return accepted, fenced


def accepted_steps(root: Store) -> tuple[list[int], View | None]:
    """The steps readers accept under ``root`` and the view that judged them."""
    if not root.exists():
        return [], None
    found, v = listed(root)
    return [s for s, _ in split(root, found, v)[0]], v


def claim(root: Store, holder: str, *, extra: Iterable[int] = (),
          backups: Iterable[str] | None = None
          ) -> tuple[int, list[int], dict[int, tuple[float, Any]], list[str]]:
    """Claim the next generation of ``root`` for ``holder`` (who holds its lock or lease) and
    return it with the steps its record accepts; ``LockedError`` if another writer claimed it
    first.  The record lists the steps readers accept now (and ``extra``: a step this holder
    just committed).  The caller keeps the list returned here: reading the record back could
    fail (a timeout, a stale listing), and a holder that took its accepted steps as none would
    hide every earlier step from its own restore, then write that empty list into the record
    with its first commit, hiding them from every reader.  ``backups``: the holder's backup
    roots (None: those the newest record names, carried forward); returned as recorded."""
    gens = generations(root)
    g = (gens[-1] if gens else 0) + 1
    # (an I/O failure reading the newest record raises here: a claim that took every step for
    # accepted would write a fenced writer's commits into its record, accepted for good)
    steps, before = accepted_steps(root)
    if before is not None and not before.readable:
        log.warning("%s: claiming writer generation %d over a newest record that is absent or "
                    "malformed: its accepted list is every committed step (%d), as readers "
                    "accept them", root.url, g, len(steps))
    accepted = sorted(set(steps) | set(extra))
    entries = read_index(root, before.newest, accepted) if before is not None else {}
    if backups is None:  # (the view just read the newest record: no second read)
        backups = backups_of(root, before)
    named = _backups_field(backups)
    record = {"generation": g, "holder": holder, "claimed": time.time(), "accepted": accepted,
              "committed": [], **named}
    root.makedirs(GEN_DIR)
    try:
        root.write_bytes(gen_name(g), json.dumps(record).encode(), create_only=True)
    except FileExistsError:
        other = read_record(root, g) or {}
        raise LockedError(f"{root.url}: another writer ({other.get('holder', 'unknown')}) claimed "
                          f"writer generation {g} at the same time; it holds the root") from None
    try:
        late = _late_commits(root, gens[-1] if gens else None, accepted)
    except (CheckpointError, OSError) as e:
        # This generation stands now; a step the superseded writer committed in the instant
        # before it, if any, cannot be added: said, and the claim fails (nothing is committed).
        log.error("%s: writer generation %d is claimed, but reading the record it supersedes "
                  "again failed (%s: %s): a step its predecessor committed while this claim was "
                  "being made would not be accepted", root.url, g, type(e).__name__, e)
        raise
    if late:
        log.info("%s: writer generation %d also accepts step(s) %s, committed by the writer it "
                 "supersedes while this claim was being made", root.url, g, late)
        accepted = sorted(set(accepted) | set(late))
        record["accepted"] = accepted
        root.write_bytes(gen_name(g), json.dumps(record).encode())
    for old in gens[:max(0, len(gens) + 1 - _KEEP_RECORDS)]:
        log.debug("%s: pruning the record of writer generation %d", root.url, old)
        root.delete(gen_name(old))
        root.delete(index_name(old))  # (nothing if absent)
    return g, accepted, entries, named.get("backups", [])


def _late_commits(root: Store, previous: int | None, accepted: Iterable[int]) -> list[int]:
    """Steps the superseded generation's record names that a claim's listing missed: read again
    once the claim's generation exists (one GET, whatever the number of steps).  A holder on an
    object store rewrites its record with each step it commits and then lists the generations
    (``WriterLock.after_commit``); one whose listing ran before this claim's create was told its
    save succeeded, and its record, rewritten before that listing, names the step.  ``[]``
    when there is no such record, or it is malformed (readers then accept every step anyway)."""
    if previous is None:
        return []
    record = _load_record(root, previous)  # (an I/O failure raises: see claim)
    if not isinstance(record, dict):
        return []
    named = _steps(record.get("accepted")) | _steps(record.get("committed"))
    return sorted(named - set(accepted))


def record(root: Store, g: int, holder: str, accepted: Iterable[int],
           committed: Iterable[int], backups: Iterable[str] = ()) -> None:
    """Rewrite generation ``g``'s record (only its holder does, while it holds the root)."""
    body = {"generation": g, "holder": holder, "claimed": time.time(),
            "accepted": sorted(set(accepted)), "committed": sorted(set(committed)),
            **_backups_field(backups)}
    root.write_bytes(gen_name(g), json.dumps(body).encode())


# -- the backups a writer replicates to ----------------------------------------------------------
# A manager with ``backup=`` names its backup roots in its record, so that a reader of the local
# root (``ckpt ls``/``log``/``report``) can say where the other tiers are.  Only plain URLs of the
# stores a backup can be on, without credentials; never storage options.  A reader treats them
# as hostile data (a root may come from anywhere): each URL is checked (the same check the
# writer applies, so a writer never records what its readers refuse), and none is read unless
# the user asks (``--backup recorded``).  A claim without its own list (``gc``, ``ckpt sync``)
# carries the newest record's forward, so routine maintenance does not erase it.
MAX_BACKUPS, MAX_URL = 16, 2048
_BACKUP_SCHEMES = frozenset({"file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl",
                             "memory"})


def backup_url_problem(url: Any) -> str | None:
    """Why ``url`` may not be named as a backup root in a writer record (None: it may)."""
    if not isinstance(url, str) or not 0 < len(url) <= MAX_URL:
        return f"not a string of 1 to {MAX_URL} characters"
    if not url.isprintable():
        return "control or invisible characters"
    if "::" in url:
        return "a chained fsspec URL"
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None if url.startswith("/") else "neither an absolute path nor a URL"
    if scheme.lower() not in _BACKUP_SCHEMES:
        return f"the scheme {scheme!r} is not one a backup can be on"
    if "@" in rest.split("/", 1)[0]:
        return "credentials in the URL"
    return None


def _backups_field(backups: Iterable[str]) -> dict[str, list[str]]:
    urls = []
    for u in backups:
        problem = backup_url_problem(u) or (
            f"more than {MAX_BACKUPS} backups" if len(urls) == MAX_BACKUPS else None)
        if problem is None:
            urls.append(u)
        else:
            log.info("not naming the backup root %r in the writer record: %s", str(u)[:200],
                     problem)
    return {"backups": urls} if urls else {}


def recorded_backups(root: Store) -> list[str]:
    """The backup roots the newest writer of ``root`` recorded (``[]``: none, or no record).
    A malformed list is logged and ignored, never raised: it only ever adds a hint."""
    return backups_of(root, view(root) if root.exists() else None)


def backups_of(root: Store, known: View | None) -> list[str]:
    """A view's ``backups``, checked (see above); ``[]`` when absent or malformed (logged)."""
    value = known.backups if known is not None and known.backups is not None else []
    problem = ("not a list of at most %d URLs" % MAX_BACKUPS
               if not isinstance(value, list) or len(value) > MAX_BACKUPS else
               next((p for p in map(backup_url_problem, value) if p), None))
    if problem:
        log.warning("%s: the writer record's list of backups is malformed (%s); ignoring it",
                    root.url, problem)
        return []
    return list(value)
