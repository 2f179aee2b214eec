"""Every tunable in one place: defaults, environment overrides, a typed accessor per knob
(``threads()``, ``gc_grace()``, ...; ``get(name)`` is the untyped lookup they share) and a context
manager for tests (``override``)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

# Shard files are bounded so they can be written and read in parallel; a single tensor larger
# than the bound gets a shard of its own.
_DEFAULTS = {
    "shard_size": 128 * 1024 * 1024,
    # 64 bytes covers the strictest alignment of any numpy dtype and a cache line; it keeps
    # zero-copy views of memory-mapped shards aligned.
    "alignment": 64,
    # Shard writers and checksum threads mostly wait on the disk (crc32c and file I/O release the
    # GIL), so the disk's queue depth, not the core count, sets how many pay off: at least 4 even
    # on small machines (2 cores here: saves and cold loads 5-20% faster with 4 threads than 2).
    "threads": max(4, min(8, os.cpu_count() or 1)),
    # Tensors are checksummed and written in pieces of this size, so each piece is still in the CPU
    # cache when the write copies it (one trip through memory instead of two).
    "write_chunk": 4 * 1024 * 1024,
    # Local writes ask the kernel to start writing back every this many bytes (0: never), so the
    # disk works while we copy instead of all at once in the final fsync.  4 MiB (one write
    # chunk): a 40 MB state (mobilenet_v2 + Adam) then saves in 29 ms instead of 37 ms with
    # 32 MiB kicks (its first kick came too late to overlap), and a 768 MiB one no slower.
    "writeback_bytes": 4 * 1024 * 1024,
    # Manifests larger than this are refused before being read (a hostile or damaged file must not
    # exhaust memory).  About 100 bytes per tensor, so the default admits ~5 million tensors.
    "max_manifest_bytes": 512 * 1024 * 1024,
    # How long a manifest-less leftover must sit before gc() may remove it (seconds).
    "gc_grace": 15 * 60.0,
    # Object-store writer leases: a lease not renewed for this long is expired and may be taken
    # over (its holder is presumed gone).  Short, so a preempted run's successor on another host
    # resumes within it; the heartbeat renews it well before then.
    "lease_seconds": 30.0,
    # How often a live writer's heartbeat thread renews its lease (seconds).
    "heartbeat_seconds": 10.0,
    # The manifest format version writers produce: 2 (columnar tensor table) by default; 1 for
    # checkpoints that older ckptcore releases must read.  Readers read both.
    "format_version": 2,
    # A verified load checksums tensors in pool tasks of about this many bytes, in shard order; a
    # restore into live objects assigns each tensor as soon as its batch is verified.
    "verify_batch": 4 * 1024 * 1024,
    # Object stores: their bandwidth comes from many requests in flight.  Shards are uploaded to
    # S3 in parts of this size while the next parts are checksummed (an object that fits in one
    # part is a single PUT: one request, no multipart to complete), and ranged reads of every async
    # filesystem (S3, GCS, Azure) are split into pieces of this size fetched concurrently.  32 MiB:
    # well above S3's 5 MiB minimum part (smaller values fail on S3 itself), large enough that
    # per-request latency (tens of ms) costs little against the transfer, in the range S3's own
    # tools use (8-64 MiB; s3fs 50 MiB).  Store.shard_size bounds remote shards to one part.
    "remote_part_size": 32 * 1024 * 1024,
    # How many parts (uploads) or pieces (reads) of one save or load are in flight at once: 8, like
    # boto3's and s3fs's defaults (10), within botocore's pool of 10 connections.  A save's uploads
    # hold at most remote_concurrency x remote_part_size (256 MiB) above its state (_remote.py).
    "remote_concurrency": 8,
    # An async save's staging budget in bytes (0: unlimited).  save() copies the state's arrays
    # into staging buffers so the caller may go on training while a thread writes them; with a
    # budget smaller than the state, the arrays that do not fit are written from the caller's own
    # arrays before save() returns (the caller blocks for that part only), so a state larger
    # than free memory can still be saved asynchronously.
    "staging_bytes": 0,
    # A distributed save (save_state(..., group=)) waits this long (seconds) for each collective:
    # a rank that does not arrive in time is taken for dead, and the save fails on every rank
    # with nothing committed.  It must exceed the slowest rank's write of its part.
    "group_timeout": 120.0,
    # A distributed save by a group of at least this many ranks puts each rank's shards in one
    # of 256 folders named by a hash of the rank (<checkpoint>/3f/shard-...): S3 scales request
    # rates per key prefix (about 3,500 PUT/s each), and 1,000 ranks' shards under one prefix
    # would queue there.  Smaller groups keep the flat layout every reader since format 1 knows
    # (0 or 1: every group spreads).
    "prefix_ranks": 256,
    # A chunked tensor table of at least this many rows is written as format 4: the manifest
    # keeps one name per logical tensor and an index, the rows go to a separate rows object read
    # whole or, by a load of some blocks, by range (docs/FORMAT.md, section 12).  Below it the
    # manifest stays format 3, which every earlier reader of sharded checkpoints knows.
    "manifest_split_rows": 100_000,
    # A backup replication that fails on the store (network, throttling, an outage) is tried
    # again this many times, waiting backup_retry_seconds, then twice that, ... (at most 60 s)
    # in between; a step that still fails is left to the next successful replication or the
    # next start (its local copy is kept meanwhile).  4 tries from 2 s: about 30 s of outage.
    "backup_retries": 4,
    "backup_retry_seconds": 2.0,
}
_ENV = {k: "CKPTCORE_" + k.upper() for k in _DEFAULTS}
_overrides: dict[str, float] = {}


def get(name: str) -> int | float:
    """The value of the knob ``name`` (an override, else its environment variable, else the
    default), untyped; prefer the typed accessors below (``threads()``, ``gc_grace()``, ...)."""
    if name in _overrides:
        return _overrides[name]
    env = os.environ.get(_ENV[name])
    if env is not None:
        return _parse(name, env)
    return _DEFAULTS[name]


def _int(name: str) -> int:
    return int(get(name))


def _float(name: str) -> float:
    return float(get(name))


# -- typed accessors: one per knob, in the order of _DEFAULTS --------------------------------------
def shard_size() -> int:
    """Bytes a shard file holds at most (a larger tensor gets a shard of its own)."""
    return _int("shard_size")


def alignment() -> int:
    """Byte alignment of each tensor within its shard: a power of two up to 4096 (a page; the
    writers pad from a page of zeros), else a ValueError naming the knob before anything is
    written."""
    value = _int("alignment")
    if not 1 <= value <= 4096 or value & (value - 1):
        raise ValueError(f"the alignment knob ({_ENV['alignment']}) must be a power of two from "
                         f"1 to 4096, not {value}; nothing was saved")
    return value


def threads() -> int:
    """Shard writers and checksum threads at once."""
    return _int("threads")


def write_chunk() -> int:
    """Bytes a tensor is checksummed and written in at a time."""
    return _int("write_chunk")


def writeback_bytes() -> int:
    """Local writes start the kernel's writeback every this many bytes (0: never)."""
    return _int("writeback_bytes")


def max_manifest_bytes() -> int:
    """A manifest larger than this is refused before being read."""
    return _int("max_manifest_bytes")


def gc_grace() -> float:
    """Seconds a manifest-less leftover must sit before gc may remove it."""
    return _float("gc_grace")


def lease_seconds() -> float:
    """Seconds after which an object-store writer lease not renewed is expired."""
    return _float("lease_seconds")


def heartbeat_seconds() -> float:
    """Seconds between a live writer's lease renewals."""
    return _float("heartbeat_seconds")


def format_version() -> int:
    """The manifest format version writers produce."""
    return _int("format_version")


def verify_batch() -> int:
    """Bytes of tensors a verified load checksums per pool task."""
    return _int("verify_batch")


def remote_part_size() -> int:
    """Bytes of an object-store upload part or ranged-read piece."""
    return _int("remote_part_size")


def remote_concurrency() -> int:
    """Object-store parts or pieces of one save or load in flight at once."""
    return _int("remote_concurrency")


def staging_bytes() -> int:
    """Bytes an async save may copy into staging buffers (0: the whole state)."""
    return _int("staging_bytes")


def group_timeout() -> float:
    """Seconds a distributed save or load waits for each collective."""
    return _float("group_timeout")


def prefix_ranks() -> int:
    """Group size from which a distributed save spreads its shards over shard folders."""
    return _int("prefix_ranks")


def manifest_split_rows() -> int:
    """Chunk rows from which a manifest is written as format 4 (rows in a separate object)."""
    return _int("manifest_split_rows")


def backup_retries() -> int | float:
    """Extra tries of a failed backup replication.  Not cast: the backup tier refuses a value
    that is not a whole number >= 0 with an error naming it."""
    return get("backup_retries")


def backup_retry_seconds() -> float:
    """Seconds before the first retry of a failed backup replication (doubling after)."""
    return _float("backup_retry_seconds")


def _parse(name: str, text: str) -> int | float:
    """An environment override, as the default's type ("3.0" is fine for a whole number); one
    that is not a number is a ValueError naming the variable, not a crash deep in a save."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{_ENV[name]}={text!r} is not a number (default {_DEFAULTS[name]!r})")
    if isinstance(_DEFAULTS[name], int):
        if value != int(value):
            raise ValueError(f"{_ENV[name]}={text!r} is not a whole number "
                             f"(default {_DEFAULTS[name]!r})")
        return int(value)
    return value


@contextlib.contextmanager
def override(**values: float) -> Iterator[None]:
    """Temporarily change knobs, e.g. ``with override(shard_size=1024): ...``.

    An unknown name is a ``KeyError``; a value that is not a real number (a bool, a string,
    NaN or infinity) a ``TypeError``/``ValueError`` naming the knob.  Range checks are left to
    the code that uses the knob (it names the knob in its error).
    """
    unknown = set(values) - set(_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown knob(s): {sorted(unknown)}")
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"knob {name} must be a number, got {type(value).__name__}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"knob {name}={value!r} is not a finite number")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
