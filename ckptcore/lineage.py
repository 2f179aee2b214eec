"""A checkpoint's lineage: which run wrote it, where that run came from, on what machine and code.

Every save records, in the manifest body's optional ``lineage`` map (docs/FORMAT.md, section 5):

* ``run_id``: the run, kept across resumes (a :class:`~ckptcore.CheckpointManager` that restores
  a step takes its run id; one that starts afresh draws a new one); ``session``: the process
  (manager) that saved it, and ``started``, when that session began;
* ``resume_count`` and ``resumed_from``: how many resumes lie behind this checkpoint, and the
  last one: the step restored, from which tier and writer generation, its fingerprint as saved
  and as restored (below), its framework and world size;
* ``conversion``: the source of an import or a conversion (framework, format, root), else nil;
* ``world_size``, ``host``, ``versions`` (Python, NumPy, ckptcore and the framework's), ``git``
  (the commit of the working directory's checkout and whether it was dirty, else nil), ``tags``
  (the user's own ``{str: str}``);
* ``fingerprint`` and ``parts``: a short digest of what the next step depends on besides the
  weights (the data cursor's position and seed, the RNG states, the optimizer's step), and one
  digest per part, so that a resume can be checked against what was saved (``ckpt log``).

This module is framework-free and below the manifest reader, which validates a lineage map with
:func:`parse` as untrusted data (bounded, plain values only, known keys typed).  ``ckpt log``
(``ckptcore._runlog``) reads it back over a whole root.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import socket
import struct
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ._version import __version__
from .errors import SchemaError

__all__ = ["Run", "new_id", "environment", "git_state", "fingerprint_parts", "fingerprint",
           "position", "process_run", "resume", "resuming", "converted",
           "restored_parts", "record", "parse", "PARTS", "check_tags"]

log = logging.getLogger("ckptcore")

PARTS = ("data", "rng", "optimizer")  # what a fingerprint covers, in this order
# What a restore did with a saved part, instead of its digest (``restored_parts``).
IGNORED = "ignored"        # saved, a target was restored, but none for this part (no cursor=)
NOT_LOADED = "not loaded"  # keys=[...] left it out on purpose
RETURNED = "returned"      # no objects given: the state went to the caller, who applies it

# Bounds a reader holds a lineage map to (it is untrusted): depth, items, string length.
_MAX_DEPTH = 8
_MAX_ITEMS = 4096
_MAX_STR = 4096
_GIT_TIMEOUT = 2.0


def new_id() -> str:
    """A fresh run or session id: 16 hex digits."""
    return uuid.uuid4().hex[:16]


def check_tags(tags: Mapping[str, str] | None) -> dict[str, str]:
    """``tags=`` as a plain dict; ``TypeError`` unless every key and value is a str."""
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise TypeError(f"tags must be a mapping of str to str, got {type(tags).__name__}")
    bad = [k for k, v in tags.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"tags must map str to str; {bad[0]!r} does not "
                        f"({type(tags[bad[0]]).__name__} value)")
    too_long = [k for k, v in tags.items() if len(k) > _MAX_STR or len(v) > _MAX_STR]
    if too_long or len(tags) > 256:
        raise ValueError(f"tags: at most 256 of them, each key and value under {_MAX_STR} "
                         "characters")
    return dict(tags)


@dataclass(frozen=True, kw_only=True)
class Run:
    """The run a save belongs to: what a :class:`~ckptcore.CheckpointManager` keeps between
    its restore and its saves, or what ``save_state(resumed_from=...)`` builds.

    ``resumed_from``: the record of the last resume (``None`` for a fresh run);
    ``conversion``: the source of an import or a conversion.
    """

    run_id: str = field(default_factory=new_id)
    session: str = field(default_factory=new_id)
    started: float = field(default_factory=time.time)
    resume_count: int = 0
    resumed_from: Mapping[str, Any] | None = None
    conversion: Mapping[str, Any] | None = None
    tags: Mapping[str, str] = field(default_factory=dict)

    def resumed(self, saved: Mapping[str, Any] | None, resume: Mapping[str, Any]) -> Run:
        """This session, resuming from a checkpoint whose lineage is ``saved`` (None: an old
        checkpoint without one): its run id, one resume more, ``resume`` as the record."""
        saved = saved or {}
        run_id = saved.get("run_id") if isinstance(saved.get("run_id"), str) else self.run_id
        count = saved.get("resume_count") if isinstance(saved.get("resume_count"), int) else 0
        tags = {**dict(saved.get("tags") or {}), **dict(self.tags)}  # the user's own win
        return Run(run_id=run_id, session=self.session, started=self.started,
                   resume_count=count + 1, resumed_from=dict(resume), conversion=None, tags=tags)


# -- environment ---------------------------------------------------------------------------------
_git_cache: dict[str, dict | None] = {}
_git_lock = threading.Lock()


def environment(framework: str | None, framework_versions: Mapping[str, Any]) -> dict[str, Any]:
    """Host, versions and the git checkout of the working directory (cached per process)."""
    versions: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                                "ckptcore": __version__}
    for k, v in (framework_versions or {}).items():
        if isinstance(k, str) and isinstance(v, (str, int, float)) and not isinstance(v, bool):
            versions[k] = v
    return {"host": socket.gethostname(), "versions": versions, "git": git_state()}


def git_state(where: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """``{"commit": hex, "dirty": bool or None}`` of the git checkout holding ``where`` (the
    working directory by default), or None outside one.  The commit is read from ``.git``'s
    files (HEAD, refs, packed-refs; worktrees too); dirtiness asks ``git status`` with a
    timeout (None when git is missing or slow).  Never raises; cached per folder and process."""
    start = os.path.abspath(os.fspath(where) if where is not None else os.getcwd())
    with _git_lock:
        if start not in _git_cache:
            try:
                _git_cache[start] = _read_git(Path(start))
            except Exception as e:  # noqa: BLE001 - a save never fails because of git
                log.debug("lineage: no git commit recorded (%s: %s)", type(e).__name__, e)
                _git_cache[start] = None
        found = _git_cache[start]
    return dict(found) if found is not None else None


def _read_git(start: Path) -> dict[str, Any] | None:
    top = next((d for d in (start, *start.parents) if (d / ".git").exists()), None)
    if top is None:
        return None
    gitdir = top / ".git"
    if gitdir.is_file():  # a worktree or submodule: "gitdir: <path>"
        text = gitdir.read_text(errors="replace").strip()
        if not text.startswith("gitdir:"):
            return None
        gitdir = (top / text[len("gitdir:"):].strip()).resolve()
    common = gitdir
    if (gitdir / "commondir").is_file():  # a worktree's refs live in the main repository
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    commit = _resolve_head(gitdir, common)
    if commit is None:
        return None
    return {"commit": commit, "dirty": _dirty(top)}


def _resolve_head(gitdir: Path, common: Path) -> str | None:
    head = (gitdir / "HEAD").read_text(errors="replace").strip()
    for _ in range(5):  # symbolic refs may chain
        if not head.startswith("ref:"):
            return head if _is_sha(head) else None
        ref = head[len("ref:"):].strip()
        if ".." in ref:
            return None
        for base in (gitdir, common):
            if (base / ref).is_file():
                head = (base / ref).read_text(errors="replace").strip()
                break
        else:
            return _packed(common, ref)
    return None


def _packed(common: Path, ref: str) -> str | None:
    packed = common / "packed-refs"
    if not packed.is_file():
        return None
    for line in packed.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == ref and _is_sha(parts[0]):
            return parts[0]
    return None


def _is_sha(text: str) -> bool:
    return len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text)


def _dirty(top: Path) -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=top,
                             capture_output=True, timeout=_GIT_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("lineage: git status in %s failed (%s); dirty unknown", top, e)
        return None
    if out.returncode != 0:
        return None
    return bool(out.stdout.strip())


# -- fingerprints --------------------------------------------------------------------------------
def _feed(h: Any, value: Any, depth: int = 0) -> None:
    """A canonical byte stream of a plain tree with arrays: equal for a value and its msgpack
    round trip (tuples as lists, numpy scalars as 0-d arrays, arrays as little-endian bytes)."""
    if depth > 64:
        raise ValueError("too deeply nested to fingerprint")
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, Mapping):
        h.update(b"M%d:" % len(value))
        for k in sorted(value, key=repr):
            _feed(h, k, depth + 1)
            _feed(h, value[k], depth + 1)
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d:" % len(value))
        for v in value:
            _feed(h, v, depth + 1)
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        h.update(b"A" + a.dtype.str.encode() + repr(a.shape).encode())
        h.update(a.tobytes())
    elif value is None or isinstance(value, bool):
        h.update(b"N" if value is None else b"T" if value else b"F")
    elif isinstance(value, int):
        h.update(b"I%d;" % value)
    elif isinstance(value, float):
        h.update(b"D" + struct.pack("<d", value))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        h.update(b"B%d:" % len(value) + bytes(value))
    elif isinstance(value, str):
        b = value.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(b) + b)
    else:  # a leaf the codec stores otherwise (a Shard): its type only, never its address
        h.update(b"O" + type(value).__qualname__.encode())


def _digest(value: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    _feed(h, value)
    return h.hexdigest()


def _cursor_key(data: Mapping[str, Any]) -> Any:
    """What of a data position the next step depends on: a DataCursor's seed, epoch and
    position (an end-of-epoch position rolled over, as ``load_state_dict`` does) and its
    batching; any other data section whole."""
    d = dict(data)
    try:
        n, b = int(d["num_samples"]), int(d["batch_size"])
        epoch, pos = int(d["epoch"]), int(d["position"])
        per_epoch = n - n % b if d.get("drop_last") else n
        if per_epoch > 0 and pos >= per_epoch:
            epoch, pos = epoch + 1, 0
        return {"seed": d.get("seed"), "epoch": epoch, "position": pos, "num_samples": n,
                "batch_size": b, "shuffle": d.get("shuffle"), "drop_last": d.get("drop_last")}
    except (KeyError, TypeError, ValueError):
        return d


def fingerprint_parts(state: Any) -> dict[str, str | None]:
    """One short digest per part of ``state`` (a TrainingState) the next step depends on
    besides the weights; None for a part the state does not hold."""
    opt = getattr(state, "optimizer", None)
    return {"data": _digest(_cursor_key(state.data)) if state.data else None,
            "rng": _digest(state.rng) if state.rng else None,
            "optimizer": _digest(_as_int(opt.step)) if opt is not None else None}


def _as_int(v: Any) -> Any:
    """An optimizer step as a Python int (a NumPy integer at capture is a plain int once
    loaded); anything else as it is."""
    try:
        return int(v) if not isinstance(v, (bool, float)) else v
    except (TypeError, ValueError):
        return v


def fingerprint(parts: Mapping[str, Any]) -> str:
    """The digest over every part (16 hex digits)."""
    return _digest([parts.get(p) for p in PARTS])


def restored_parts(state: Any, objects: Mapping[str, Any], keys: Any,
                   saved: Mapping[str, Any], unapplied: set[str] | frozenset = frozenset()
                   ) -> dict[str, str | None]:
    """What a restore put back, per part: the digest of what was restored (the cursor's own
    position read back from it), or why not (:data:`IGNORED`, :data:`NOT_LOADED`,
    :data:`RETURNED`); None for a part the checkpoint does not hold.  ``saved``: the parts as
    saved (also those ``keys`` left out); ``unapplied``: the parts the restore warned it left
    unapplied (``UnappliedStateWarning``: the adapter's word, e.g. an optimizer without
    ``optimizer=``)."""
    keys = None if keys is None else set(keys)
    model = objects.get("model") is not None
    left = {p.split()[0] for p in unapplied}  # "optimizer slots" is the optimizer's
    out: dict[str, str | None] = {}
    for part in PARTS:
        if saved.get(part) is None:
            out[part] = None
        elif keys is not None and part not in keys:
            out[part] = NOT_LOADED
        elif part in left or (part == "rng" and model and objects.get("rng") is False):
            out[part] = IGNORED
        elif part == "data" and objects.get("cursor") is not None:
            got = getattr(objects["cursor"], "state_dict", None)
            out[part] = _digest(_cursor_key(got() if callable(got) else state.data))
        elif not model:
            out[part] = RETURNED
        elif part == "data":  # a model without a cursor: the core warned (or keys left it)
            out[part] = IGNORED
        else:
            out[part] = fingerprint_parts(state)[part]
    return out


def position(data: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A data cursor's ``{seed, epoch, position, per_epoch}`` (rolled over at an epoch's end;
    ``per_epoch``: the samples an epoch hands out), else None."""
    if not data:
        return None
    key = _cursor_key(data)
    if not isinstance(key, dict) or "num_samples" not in key or "position" not in key:
        return None
    n, b = key["num_samples"], key["batch_size"]
    per_epoch = n - n % b if key.get("drop_last") else n
    return {"seed": key["seed"], "epoch": key["epoch"], "position": key["position"],
            "per_epoch": per_epoch}


def record(state: Any, run: Run, *, world_size: int) -> dict[str, Any] | None:
    """The ``lineage`` map of a save of ``state`` in ``run``; None (logged) if it cannot be
    made: a save never fails for want of its lineage."""
    try:
        parts = fingerprint_parts(state)
        versions = state.metadata.get("versions") if isinstance(state.metadata, Mapping) else None
        return {"run_id": run.run_id, "session": run.session, "started": float(run.started),
                "resume_count": int(run.resume_count),
                "resumed_from": dict(run.resumed_from) if run.resumed_from is not None else None,
                "conversion": dict(run.conversion) if run.conversion is not None else None,
                "world_size": int(world_size), "framework": state.framework,
                **environment(state.framework, versions if isinstance(versions, Mapping) else {}),
                "tags": dict(run.tags), "fingerprint": fingerprint(parts), "parts": parts,
                "position": position(state.data)}
    except Exception as e:  # noqa: BLE001 - bookkeeping: never the reason a save fails
        log.warning("save: no lineage recorded (%s: %s)", type(e).__name__, e)
        return None


# -- reading: untrusted ------------------------------------------------------------------------
_TYPED: dict[str, tuple] = {
    "run_id": (str,), "session": (str,), "started": (int, float), "resume_count": (int,),
    "resumed_from": (dict, type(None)), "conversion": (dict, type(None)),
    "world_size": (int, type(None)), "framework": (str, type(None)), "host": (str, type(None)),
    "versions": (dict,), "git": (dict, type(None)), "tags": (dict,),
    "fingerprint": (str, type(None)), "parts": (dict,), "position": (dict, type(None)),
}


# The numbers of a ``resumed_from`` record, each nil or non-negative (checked by :func:`parse`).
_RESUME_TYPED: dict[str, tuple] = {"step": (int,), "newest_step": (int,), "at": (int, float),
                                   "seconds": (int, float), "bytes": (int,)}


def parse(value: Any, source: str) -> dict[str, Any]:
    """A manifest's ``lineage`` as untrusted data: a map of plain values (str, int, float, bool,
    nil, lists, maps with str keys), at most 8 deep, 4096 items and 4096-character strings,
    its known keys of their types (``resume_count`` and ``world_size`` non-negative, ``tags``
    str to str); ``SchemaError`` naming ``source`` otherwise."""
    where = f"{source}: field 'lineage'"
    if not isinstance(value, dict):
        raise SchemaError(f"{where} is not a map ({type(value).__name__})")
    _plain(value, where, [0], 0)
    for key, kinds in _TYPED.items():
        if key not in value:
            continue
        v = value[key]
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise SchemaError(f"{where}: {key!r} has the wrong type ({type(v).__name__})")
        if key in ("resume_count", "world_size") and v is not None and v < 0:
            raise SchemaError(f"{where}: {key!r} is negative")
    if any(not isinstance(v, str) for v in value.get("tags", {}).values()):
        raise SchemaError(f"{where}: 'tags' must map str to str")
    rf = value.get("resumed_from")
    for key, kinds in _RESUME_TYPED.items():
        # (what a report plots: a number of the wrong kind would be drawn as one)
        v = rf.get(key) if isinstance(rf, dict) else None
        if v is not None and (not isinstance(v, kinds) or isinstance(v, bool) or v < 0):
            raise SchemaError(f"{where}: 'resumed_from.{key}' is {v!r}, not a non-negative "
                              f"{'int' if kinds == (int,) else 'number'} or nil")
    return value


def _plain(v: Any, where: str, count: list[int], depth: int) -> None:
    count[0] += 1
    if count[0] > _MAX_ITEMS:
        raise SchemaError(f"{where}: more than {_MAX_ITEMS} values")
    if depth > _MAX_DEPTH:
        raise SchemaError(f"{where}: nested deeper than {_MAX_DEPTH}")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise SchemaError(f"{where}: a map key is a {type(k).__name__}, not a str")
            _plain(k, where, count, depth + 1)
            _plain(x, where, count, depth + 1)
    elif isinstance(v, list):
        for x in v:
            _plain(x, where, count, depth + 1)
    elif isinstance(v, str):
        if len(v) > _MAX_STR:
            raise SchemaError(f"{where}: a string of {len(v)} characters (at most {_MAX_STR})")
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise SchemaError(f"{where}: a number that is not finite")
    elif v is not None and not isinstance(v, (bool, int)):
        raise SchemaError(f"{where}: a value of type {type(v).__name__} (only plain values)")


_process_run: Run | None = None


def process_run(tags: Mapping[str, str] | None = None) -> Run:
    """The run of this process's plain ``save_state`` calls (one run id per process), with
    ``tags`` of this call."""
    global _process_run
    with _git_lock:
        if _process_run is None:
            _process_run = Run()
        run = _process_run
    return Run(run_id=run.run_id, session=run.session, started=run.started,
               tags=check_tags(tags)) if tags else run


def resume(saved: Mapping[str, Any] | None, *, step: int, url: str, tier: str,
           generation: int | None, framework: str | None, saved_parts: Mapping[str, Any],
           restored: Mapping[str, Any] | None = None, newest_step: int | None = None,
           restored_position: Mapping[str, Any] | None = None, seconds: float | None = None,
           nbytes: int | None = None) -> dict[str, Any]:
    """The ``resumed_from`` record of a resume from checkpoint ``step`` at ``url`` (in tier
    ``tier``, ``"local"`` or a backup's URL) whose lineage is ``saved`` (None: an old one).

    ``saved_parts``: the checkpoint's part digests; ``restored``: what the restore put back
    (:func:`restored_parts`; None when unknown, a plain ``save_state(resumed_from=...)``);
    ``newest_step``: the newest step committed when it was restored (a rewind when larger);
    ``seconds`` and ``nbytes``: how long the restore took and the tensor bytes it loaded (the
    figures of its RestoreEvent; None when not measured)."""
    saved = saved or {}
    parts = saved.get("parts") if isinstance(saved.get("parts"), Mapping) else saved_parts
    return {"step": int(step), "url": url, "tier": tier, "generation": generation,
            "run_id": saved.get("run_id"), "session": saved.get("session"),
            "fingerprint": saved.get("fingerprint") or fingerprint(parts),
            "parts": dict(parts), "framework": framework,
            "world_size": saved.get("world_size"),
            "restored": dict(restored) if restored is not None else None,
            "restored_fingerprint": (fingerprint(restored) if restored is not None else None),
            "position": dict(restored_position) if restored_position is not None else None,
            "newest_step": newest_step, "at": time.time(),
            "seconds": None if seconds is None else round(float(seconds), 6),
            "bytes": None if nbytes is None else int(nbytes)}


def converted(*, framework: str | None, format: str, root: str,
              source: Mapping[str, Any] | None = None) -> Run:
    """The run of a checkpoint made by an import (``format``: the native format read) or a
    conversion (``format="ckptcore"``) of ``root``: the source's run id when it has one (a
    converted ckptcore checkpoint continues its run), else a new run."""
    source = source or {}
    run_id = source.get("run_id") if isinstance(source.get("run_id"), str) else new_id()
    count = source.get("resume_count") if isinstance(source.get("resume_count"), int) else 0
    tags = source.get("tags") if isinstance(source.get("tags"), Mapping) else {}
    return Run(run_id=run_id, resume_count=count, tags=dict(tags),
               conversion={"framework": framework, "format": format, "root": root,
                           "fingerprint": source.get("fingerprint")})


def resuming(run: Run, saved: Mapping[str, Any] | None, *, step: int, url: str,
             generation: int | None, framework: str | None) -> Run:
    """``run`` resumed from checkpoint ``step`` at ``url`` whose lineage is ``saved``, what was
    restored not known (``save_state(resumed_from=...)``)."""
    saved = dict(saved) if saved is not None else None
    parts = (saved or {}).get("parts") or {p: None for p in PARTS}
    return run.resumed(saved, resume(saved, step=step, url=url, tier="local",
                                     generation=generation, framework=framework,
                                     saved_parts=parts))
