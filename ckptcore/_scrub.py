"""``ckptcore.scrub`` (``ckpt verify --deep``): check a whole backup root, repair what it can.

A deduplicated root (docs/FORMAT.md, "Deduplicated replicas") is checked in full:

* every blob object is read and hashed against its name (BLAKE2b-256 of its bytes; a salted
  copy's name is found by trying the copy numbers its manifest admits) and, where a committed
  manifest names it, against that manifest's size and CRC-32C;
* every committed replica's manifest is read (it decodes, by the reader's own checks) and every
  blob it names is listed present with its size.

A damaged or missing blob that a replica names is repaired from the first tier in
``repair_from`` that holds a good copy: another deduplicated root holding the same blob, or any
root holding the same step (the same ``writer.id`` in its manifest: the same checkpoint), whose
tensors are read, checked against their CRC-32C and laid out as the blob (packs hold several
small tensors at their offsets, zero padding between); the result must hash to the blob's name.
A repair writes only content-addressed objects (the same name, the same bytes), so it needs no
writer lock: a writer or sweep meanwhile cannot be harmed by it.

A plain root (no ``cas:`` objects) is verified step by step (``ckptcore.verify``); it is not
repaired.  Every finding, repair and failure is logged on the ``ckptcore`` logger.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import crc32c as _crc
import numpy as np

from . import layout
from ._manifest import MANIFEST_NAME, Manifest
from ._replica import (Listed, write_objects, check_structure, blob_matches, blob_rel,
                       list_blob_objects)
from ._storage import CAS_PREFIX, Store, check_url
from .errors import CheckpointError, CheckpointNotFoundError

__all__ = ["ScrubReport", "scrub"]

log = logging.getLogger("ckptcore")
_UNREFERENCED_COPIES = 8  # salted copy numbers tried for a blob no manifest names


@dataclass(frozen=True)
class ScrubReport:
    """What :func:`scrub` checked and found.

    Attributes:
        url: The root scrubbed.
        deduplicated: Whether it is a deduplicated (backup) root; a plain root's steps are
            verified whole.
        steps: The committed steps checked.
        blobs: How many blob objects were read and hashed.
        bytes_read: Bytes read from the root.
        damaged: What was found damaged or missing: ``cas:<hex>`` blobs, ``step N`` steps.
        repaired: What was repaired (blobs written again from a good copy).
        broken: What is still broken (not repaired): a blob a replica names, or a step.
        problems: One line per finding, in the words of the error found.
    """

    url: str
    deduplicated: bool
    steps: tuple[int, ...]
    blobs: int
    bytes_read: int
    damaged: tuple[str, ...]
    repaired: tuple[str, ...]
    broken: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Nothing is still broken."""
        return not self.broken

    @property
    def chunks(self) -> int:
        """The earlier name of :attr:`blobs` (kept for one release)."""
        return self.blobs


def scrub(url: str | os.PathLike, *, repair_from: Iterable[str | os.PathLike] = (),
          storage_options: Mapping[str, Any] | None = None,
          repair_storage_options: Mapping[str, Any] | None = None) -> ScrubReport:
    """Check every blob and committed replica of the root at ``url`` and repair damaged or
    missing blobs from the roots in ``repair_from`` (module docstring).  ``storage_options``
    apply to ``url``, ``repair_storage_options`` (default: the same) to the repair roots."""
    so = dict(storage_options or {})
    rso = dict(so if repair_storage_options is None else repair_storage_options)
    root = Store(check_url(os.fspath(url), "url"), so)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root.url} does not exist (no such folder or bucket)")
    if root.exists(MANIFEST_NAME):
        raise ValueError(f"{root.url} is one checkpoint, not a root: `ckpt verify` checks it; "
                         "scrub the root it is in")
    sources = [Store(check_url(os.fspath(u), "repair_from"), rso) for u in repair_from]
    return _Scrub(root, sources, so).run()


class _Scrub:
    def __init__(self, root: Store, sources: list[Store], options: dict) -> None:
        self.root, self.sources, self.options = root, sources, options
        self.damaged: list[str] = []
        self.repaired: list[str] = []
        self.broken: list[str] = []
        self.problems: list[str] = []
        self.bytes_read = 0

    def finding(self, what: str, message: str, *, broken: bool, damaged: bool = True) -> None:
        log.warning("scrub: %s", message)
        self.problems.append(message)
        if damaged and what not in self.damaged:
            self.damaged.append(what)
        if broken and what not in self.broken:
            self.broken.append(what)

    def report(self, dedup: bool, steps: list[int], blobs: int) -> ScrubReport:
        out = ScrubReport(self.root.url, dedup, tuple(steps), blobs, self.bytes_read,
                          tuple(self.damaged), tuple(self.repaired), tuple(self.broken),
                          tuple(self.problems))
        log.info("scrub: %s: %d step(s), %d blob(s) checked, %d bytes read: %d damaged, "
                 "%d repaired, %d still broken", out.url, len(steps), blobs, out.bytes_read,
                 len(out.damaged), len(out.repaired), len(out.broken))
        return out

    def run(self) -> ScrubReport:
        root = self.root
        steps = layout.committed_steps(root)
        manifests = self._read_manifests(steps)
        listing = list_blob_objects(root)
        dedup = bool(listing) or any(s.path.startswith(CAS_PREFIX)
                                     for m in manifests.values() for s in m.shards)
        if not dedup:  # a plain root: every committed step verified whole
            self._verify_plain(steps, manifests)
            return self.report(False, [s for s, _ in steps], 0)

        # who names each blob: (step, manifest, shard index)
        refs: dict[str, list[tuple[int, Manifest, int]]] = {}
        for step, m in manifests.items():
            for i, s in enumerate(m.shards):
                if s.path.startswith(CAS_PREFIX):
                    refs.setdefault(s.path, []).append((step, m, i))
        bad = self._check_listed(listing, refs)
        for step, name in steps:  # the structure of each replica, as the reader sees it
            if step in manifests:
                _, problems = check_structure(root.child(name), manifests[step], listing)
                for p in problems:
                    log.info("scrub: step %d: %s", step, p)
        self._repair_named(bad, refs)
        return self.report(True, [s for s, _ in steps], len(listing))

    def _read_manifests(self, steps: list[tuple[int, str]]) -> dict[int, Manifest]:
        """The manifest of each committed step that can be read; the others are findings."""
        from .api import read_manifest

        manifests: dict[int, Manifest] = {}
        for step, name in steps:
            try:
                manifests[step] = read_manifest(self.root.child(name))
            except CheckpointError as e:
                self.finding(f"step {step}", f"step {step}: its manifest cannot be read "
                             f"({type(e).__name__}: {e}); not repaired", broken=True)
        return manifests

    def _verify_plain(self, steps: list[tuple[int, str]], manifests: dict[int, Manifest]) -> None:
        from .api import verify

        for step, name in steps:
            if step not in manifests:
                continue
            for e in verify(self.root.child(name).url, storage_options=self.options):
                self.finding(f"step {step}", f"step {step}: {type(e).__name__}: {e}",
                             broken=True)
            self.bytes_read += sum(sh.size for sh in manifests[step].shards)

    def _check_listed(self, listing: dict[str, Listed],
                      refs: dict[str, list[tuple[int, Manifest, int]]]) -> dict[str, str]:
        """Every listed blob read and judged (unreferenced bad ones are findings at once), and
        every referenced one checked present with its size.  Returns blob: why it is bad."""
        root = self.root
        bad: dict[str, str] = {}  # blob: why

        def check(item: tuple[str, Listed]) -> tuple[str, int, str | None]:
            name, entry = item
            try:
                data = root.read(blob_rel(name))
            except FileNotFoundError:
                return name, 0, "missing (deleted since it was listed)"
            return name, len(data), self._judge(name, data, refs.get(name, []))

        with ThreadPoolExecutor(max(1, min(8, root.writers))) as pool:
            for name, n, why in pool.map(check, sorted(listing.items())):
                self.bytes_read += n
                if why is not None:
                    bad[name] = why
        for name, why in sorted(bad.items()):
            if name not in refs:
                self.finding(name, f"blob {name} under {root.url} is {why}; no committed "
                             "replica names it (the sweep removes it)", broken=False)
        for name, users in sorted(refs.items()):
            shard = users[0][1].shards[users[0][2]]
            if name not in listing:
                bad[name] = "missing"
            elif listing[name].size != shard.size and name not in bad:
                bad[name] = f"{listing[name].size} bytes, the manifest says {shard.size}"
        return bad

    def _repair_named(self, bad: dict[str, str],
                      refs: dict[str, list[tuple[int, Manifest, int]]]) -> None:
        """Each bad blob a replica names: a finding, then repaired from ``repair_from`` or
        counted as broken."""
        for name in sorted(n for n in bad if n in refs):
            steps_naming = sorted({u[0] for u in refs[name]})
            self.finding(name, f"blob {name} under {self.root.url} is {bad[name]}; named by "
                         f"step(s) {steps_naming}", broken=False)
            if self._repair(name, refs[name]):
                self.repaired.append(name)
            else:
                self.broken.append(name)
                log.error("scrub: blob %s under %s is still broken: no tier in repair_from "
                          "holds a good copy; step(s) %s cannot be restored from this root",
                          name, self.root.url, steps_naming)

    def _judge(self, name: str, data: bytes, users: list[tuple[int, Manifest, int]]
               ) -> str | None:
        """Why ``data`` is not the blob ``name`` (None: it is)."""
        if users:
            step, m, i = users[0]
            shard = m.shards[i]
            if len(data) != shard.size:
                return f"damaged ({len(data)} bytes, the manifest of step {step} says {shard.size})"
            if _crc.crc32c(data) != shard.checksum:
                return "damaged (its CRC-32C differs from the manifest's)"
            copies = max(len(u[1].shards) for u in users)
        else:
            copies = _UNREFERENCED_COPIES
        if blob_matches(data, name, copies) is None:
            return "damaged (its bytes do not hash to its name)"
        return None

    def _repair(self, name: str, users: list[tuple[int, Manifest, int]]) -> bool:
        step, m, i = users[0]
        copies = max(len(u[1].shards) for u in users)
        for src in self.sources:
            try:
                data = self._from_blob(src, name, m.shards[i], copies)
                how = "its copy of the blob"
                if data is None:
                    data, how = self._rebuild(src, name, users, copies), "the tensors of the step"
                if data is None:
                    continue
                write_objects(self.root, {name: data})
                back = self.root.read(blob_rel(name))
                self.bytes_read += len(back)
                if back != data:
                    log.error("scrub: blob %s written again under %s does not read back the "
                              "same", name, self.root.url)
                    return False
                log.warning("scrub: repaired blob %s under %s from %s (%s)", name,
                            self.root.url, src.url, how)
                return True
            except (CheckpointError, OSError) as e:
                log.warning("scrub: repairing blob %s from %s failed (%s: %s); trying the next "
                            "tier", name, src.url, type(e).__name__, e)
        return False

    def _from_blob(self, src: Store, name: str, shard: Any, copies: int) -> bytes | None:
        """Another deduplicated root's copy of the blob, if it is good."""
        try:
            data = src.read(blob_rel(name))
        except FileNotFoundError:
            return None
        if (len(data) == shard.size and _crc.crc32c(data) == shard.checksum
                and blob_matches(data, name, copies) is not None):
            return data
        log.info("scrub: %s's copy of blob %s is damaged too; not used", src.url, name)
        return None

    def _rebuild(self, src: Store, name: str, users: list[tuple[int, Manifest, int]],
                 copies: int) -> bytes | None:
        """The blob rebuilt from the tensors of a step ``src`` holds as the same checkpoint
        (the same writer id) as a step naming it."""
        from .api import read_manifest

        for step, m, i in users:
            there = src.child(layout.step_name(step))
            if not there.exists(MANIFEST_NAME):
                continue
            try:
                other = read_manifest(there)
            except CheckpointError as e:
                log.info("scrub: %s cannot be read (%s); not used", there.url, e)
                continue
            if other.writer.get("id") != m.writer.get("id"):
                log.info("scrub: %s is another checkpoint of step %d (writer %s, not %s); not "
                         "used", there.url, step, other.writer.get("id"), m.writer.get("id"))
                continue
            data = _assemble(there, other, m, i)
            shard = m.shards[i]
            if (data is not None and len(data) == shard.size
                    and _crc.crc32c(data) == shard.checksum
                    and blob_matches(data, name, copies) is not None):
                return data
            log.info("scrub: the tensors of %s do not rebuild blob %s", there.url, name)
        return None


def _assemble(src: Store, source: Manifest, target: Manifest, index: int) -> bytes | None:
    """The bytes of shard ``index`` of ``target``, from the rows of ``source`` (the same
    checkpoint laid out otherwise) that hold the same tensors: each read, checked against its
    CRC-32C, and put at its offset; zero padding between."""
    t, s = target.tensors, source.tensors
    shard = target.shards[index]
    by_content: dict[tuple[int, int], list[int]] = {}
    for r in range(len(s)):
        by_content.setdefault((int(s.checksum[r]), int(s.length[r])), []).append(r)
    buf = bytearray(shard.size)
    for r in np.nonzero(t.shard.astype(np.int64) == index)[0]:
        off, n, crc = int(t.offset[r]), int(t.length[r]), int(t.checksum[r])
        for cand in by_content.get((crc, n), []):
            start = int(s.offset[cand])
            piece = src.read_ranges(source.shards[int(s.shard[cand])].path, [(start, start + n)])[0]
            if len(piece) == n and _crc.crc32c(piece) == crc:
                buf[off:off + n] = piece
                break
        else:
            return None
    return bytes(buf)
