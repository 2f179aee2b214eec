"""A save by every rank of a process group, committed once by rank 0.

Every rank calls ``save_state(url, state, group=g)`` with the same tree: the same replicated
arrays and, for sharded tensors, ``Shard``/``Chunks`` leaves holding that rank's own blocks.
The replicated bytes are spread: each such tensor is written by exactly one rank, chosen by
:func:`assign` (largest tensors first, each onto the least-loaded rank), which every rank
computes alike from the names and sizes, so N ranks write about 1/N of the bytes each and no
message carries the plan.  Each rank writes its own blocks (:func:`plan`).  A state with blocks
is saved in format 3: each rank sends its own chunk rows without names (``_replies``: rank 0
knows the logical tensors), rank 0 checks and joins every rank's at once, runs the chunk rules
on the result (``check_chunks``, which refuses overlapping blocks) and refuses a tensor its
ranks' blocks do not cover whole.  A plain state keeps format 2 and sends raw row columns instead,
checked as strictly: whatever the format, rank 0 refuses (``GroupError`` naming the rank,
nothing committed) a reply whose shard names are not plain names carrying that rank's own
``r<rank>-<token>`` marker (in that rank's own shard folder, when the save spreads them), that
lists a shard twice (or one another rank lists), or whose rows
point at shards it does not list, at bytes beyond a shard's declared size, or at bytes another
row of the shard uses.  (A shard file smaller than its entry says is caught by ``commit``'s
listing before the manifest is published, and that refusal too reaches every rank.)

The order of collectives is the same on every rank, whatever happens:

1. ``broadcast`` (rank 0 -> all): ``go`` with the token and the folder to write into, or
   ``abort`` with the reason (e.g. a checkpoint already exists and ``overwrite`` is False);
2. every rank writes its tensors into its own shard files (``shard-<n>-r<rank>-<token>.bin``;
   in a group of at least ``prefix_ranks`` ranks, a knob rank 0 reads and sends with ``go``, in
   the rank's shard folder ``<hh>/``, two hex digits of a hash of the rank, :func:`rank_folder`:
   object stores scale request rates per key prefix, and 1,000 ranks' PUTs under one would
   queue);
3. ``gather`` (all -> rank 0): each rank's shard entries and per-tensor rows, or its error,
   plus a digest of what it saved (tree, names, dtypes, shapes) so rank 0 can refuse ranks
   whose "replicated" states differ (only then does a second gather bring their names, to say
   which tensor differs: the happy path carries no per-tensor list from every rank);
4. rank 0 merges the rows into one tensor table and commits with the single-process protocol
   (``_commit.commit``: rename locally, create-only manifest PUT on object stores), which also
   removes every rank's shards if anything failed;
5. ``broadcast`` (rank 0 -> all): the outcome, so every rank returns or raises alike; once
   committed, with what the caller's ``describe(manifest)`` makes of it (``api``: a summary of a
   few hundred bytes, what ``CheckpointInfo`` shows but its tensor and shard lists), so that the
   other ranks need not read the manifest back: at 1,000 ranks it may be 149 MiB each.

A dead or hung peer makes the next collective raise ``GroupTimeoutError`` after the
``group_timeout`` knob, or ``GroupError`` when the engine notices first (gloo: a killed peer
within milliseconds, a hung one after its own 30 s); rank 0 then commits nothing (step 4 raises before the manifest is
written) and the other ranks time out waiting for the outcome.  The knob must be longer than
the slowest rank's write: a rank still writing looks like a dead one.

One outcome: a save is committed (every rank returns) or not (every rank raises, a
``GroupError`` meaning nothing was committed).  Once rank 0 has committed, a peer lost after
its reply (step 5 fails) is logged, not raised: rank 0 returns, and a rank that misses the
outcome looks at the store, returning if the manifest there is this save's (its writer id is
the save's token) and raising otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from . import _codec, _io, _knobs, _replies
from ._chunkrules import check_chunks
from ._commit import commit
from ._manifest import MANIFEST_NAME, Manifest, ShardEntry, TensorTable, safe_shard_name
from ._read import rows_reader
from ._storage import Store
from .errors import CheckpointError, GroupError, SchemaError

log = logging.getLogger("ckptcore")


_GREEDY_MAX = 50_000  # tensors up to which the exact greedy plan is used (about 0.1 s)


def assign(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that writes each tensor: largest first, onto the rank with the fewest bytes so
    far (ties: the lower rank).  Deterministic, so every rank computes the same plan."""
    # Every rank computes this for every save, so it must stay cheap at scale: scanning every
    # rank per tensor cost 160 s at 1,000 ranks x 2 million tensors (bench_scale_sim.py), a
    # heap 4.6 s.  Many tensors: "snake" order over the sizes sorted largest first (ranks 0..R-1,
    # then R-1..0, ...), vectorised; any two ranks then differ by at most the largest tensor.
    if len(sizes) > _GREEDY_MAX:
        order = np.lexsort((np.arange(len(sizes)), -np.asarray(sizes, np.int64)))
        pos = np.arange(len(sizes)) % (2 * ranks)
        snake = np.where(pos < ranks, pos, 2 * ranks - 1 - pos)
        owner_arr = np.empty(len(sizes), np.int64)
        owner_arr[order] = snake
        return owner_arr.tolist()
    heap = [(0, r) for r in range(ranks)]
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + int(sizes[i]), r))
    return owner


# The per-tensor columns of a rank's reply, as raw little-endian arrays: decoding a thousand
# ranks' rows as msgpack lists cost 3.5 s at 2 million tensors (bench_scale_sim.py).
_ROW_DTYPES = {"index": "<i8", "shard": "<u4", "offset": "<u8", "crc": "<u4"}


@dataclass
class _Part:
    """What one rank wrote: its shards and, per tensor it wrote, its index in the state, its
    shard (in this rank's list), offset and CRC-32C (arrays of equal length); or, for a chunked
    save, its chunk table (rank 0's own) or the chunk reply it sent (``_replies``)."""

    shards: list[ShardEntry]
    rows: dict[str, np.ndarray]
    table: TensorTable | None = None  # a chunked save: the rank's own version-3 table
    chunks: dict | None = None  # ... as a peer sent it (_replies.pack), read by _merge_chunks

    def packed_rows(self) -> dict[str, bytes]:
        return {k: np.ascontiguousarray(self.rows[k], _ROW_DTYPES[k]).tobytes()
                for k in _ROW_DTYPES}

    def to_reply(self) -> dict[str, Any]:
        reply: dict[str, Any] = {"shards": [[s.path, s.size, s.checksum] for s in self.shards]}
        if self.table is not None:
            reply["chunks"] = _replies.pack(self.table)
        else:
            reply["rows"] = self.packed_rows()
        return reply

    def chunk_reply(self) -> dict | None:
        return _replies.pack(self.table) if self.table is not None else self.chunks

    @classmethod
    def from_reply(cls, reply: dict, rank: int, source: str, token: str,
                   folder: str = "") -> _Part:
        try:
            shards = _shards(reply["shards"], rank, token, source, folder)
            if "table" in reply:  # the names-per-row table of ckptcore before reply version 1
                raise GroupError(f"{source}: rank {rank} sends its chunks as a table, not in "
                                 f"reply version {_replies.VERSION} (every rank must run the "
                                 "same ckptcore); nothing committed")
            if "chunks" in reply:  # checked with every rank's by _merge_chunks
                return cls(shards, {}, chunks=reply["chunks"])
            rows = {k: np.frombuffer(reply["rows"][k], _ROW_DTYPES[k]) for k in _ROW_DTYPES}
        except (KeyError, TypeError, ValueError) as e:
            raise GroupError(f"rank {rank}'s reply is malformed ({type(e).__name__}: {e})") from e
        if len({len(a) for a in rows.values()}) != 1:
            raise GroupError(f"rank {rank}'s reply has columns of different lengths")
        return cls(shards, rows)


def rank_folder(rank: int) -> str:
    """The shard folder of ``rank`` when its group spreads its shards (the ``prefix_ranks``
    knob): two hex digits of a multiplicative hash of the rank.  An odd multiplier maps the
    ranks mod 256 one to one onto the 256 folders, so N ranks fill them evenly (at most
    ceil(N / 256) each, where a random hash leaves some empty and others three times full), and
    neighbouring ranks (often one host's) land far apart."""
    return f"{(int(rank) * 157 + 90) % 256:02x}"


def _folder(rank: int, spread: bool) -> str:
    return rank_folder(rank) if spread else ""


@functools.lru_cache(maxsize=1024)
def _name_pattern(token: str, folder: str) -> re.Pattern[str]:
    """Shard names of the save ``token`` in ``folder`` (none: top level), the rank's digits
    captured (compiled once per folder, not once per rank: about 50 ms of CPU in a 1,000-rank
    merge)."""
    where = re.escape(f"{folder}/") if folder else ""
    return re.compile(rf"{where}shard-[0-9]{{5,}}-r([0-9]{{5,}})-{re.escape(token)}\.bin")


def _own_name(rank: int, token: str, folder: str = "") -> Callable[[str], bool]:
    """Whether a name is one rank ``rank`` writes in the save ``token`` (see
    :func:`_write_part`), in its ``folder`` when the save spreads its shards (only there: never
    another rank's)."""
    pattern, digits = _name_pattern(token, folder), f"{rank:05d}"

    def own(path: str) -> bool:
        m = pattern.fullmatch(path)
        return m is not None and m.group(1) == digits
    return own


def _shards(entries: Any, rank: int, token: str, source: str,
            folder: str = "") -> list[ShardEntry]:
    """A rank's shard entries, each a plain file name (in its ``folder``, if any) of this save
    written by that rank (never ``../x``, another rank's or another save's shard, nor one in
    another folder), listed once, with a valid size and checksum; ``GroupError`` naming the rank
    otherwise."""
    if not isinstance(entries, list):
        raise GroupError(f"{source}: rank {rank}'s reply is malformed: its shards are a "
                         f"{type(entries).__name__}, not a list; nothing committed")
    own = _own_name(rank, token, folder)
    shards, seen = [], set()
    for i, entry in enumerate(entries):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
            raise GroupError(f"{source}: rank {rank}'s reply is malformed: shard {i} is not a "
                             "(path, size, checksum) triple; nothing committed")
        path, size, crc = entry
        if not (safe_shard_name(path) and own(path)):
            raise GroupError(f"{source}: rank {rank} reports shard {_codec.short_repr(path)}, not a "
                             f"shard it wrote in this save (r{rank:05d}-{token}"
                             f"{f' in folder {folder}/' if folder else ''}); nothing committed")
        if path in seen:
            raise GroupError(f"{source}: rank {rank} lists shard {path!r} twice; nothing "
                             "committed")
        if not (type(size) is int and size >= 0 and type(crc) is int and 0 <= crc <= 0xFFFFFFFF):
            raise GroupError(f"{source}: rank {rank}'s reply is malformed: shard {path!r} has "
                             f"size {_codec.short_repr(size)} and checksum {_codec.short_repr(crc)}; "
                             "nothing committed")
        seen.add(path)
        shards.append(ShardEntry(path=path, size=size, checksum=crc))
    return shards


def _check_bytes(store: Store, rank: int, shards: Sequence[ShardEntry], names: Any,
                 shard: np.ndarray, offset: np.ndarray, length: np.ndarray) -> None:
    """A rank's rows against its own shards, as a reader checks a manifest (docs/FORMAT.md,
    section 7): each row in a listed shard and within its declared size, no two rows sharing a
    byte, each shard ending where its last row ends; ``GroupError`` naming the rank otherwise."""
    where = f"{store.url}: rank {rank}"
    shard = np.asarray(shard, np.int64)
    offset, length = np.asarray(offset, np.uint64), np.asarray(length, np.uint64)
    if not len(shard):
        if any(s.size for s in shards):
            raise GroupError(f"{where} lists shards of {sum(s.size for s in shards)} bytes but no "
                             "tensor in them; nothing committed")
        return
    if shard.min() < 0 or shard.max() >= len(shards):
        i = int(np.flatnonzero((shard < 0) | (shard >= len(shards)))[0])
        raise GroupError(f"{where} puts tensor {names[i]!r} in its shard {int(shard[i])}, but "
                         f"lists {len(shards)} shards; nothing committed")
    sizes = np.array([s.size for s in shards], np.uint64)[shard]
    beyond = (offset > sizes) | (length > sizes - np.minimum(offset, sizes))
    if beyond.any():
        i = int(np.flatnonzero(beyond)[0])
        raise GroupError(f"{where} puts tensor {names[i]!r} at bytes {int(offset[i])}.."
                         f"{int(offset[i]) + int(length[i])}, beyond the end of its shard "
                         f"{shards[int(shard[i])].path!r} ({shards[int(shard[i])].size} bytes); "
                         "nothing committed")
    end = offset + length  # cannot overflow: within the sizes, checked above
    ends = np.zeros(len(shards), np.uint64)
    np.maximum.at(ends, shard, end)
    for s, e in zip(shards, ends.tolist()):
        if s.size != e:
            raise GroupError(f"{where} declares shard {s.path!r} {s.size} bytes, but its tensors "
                             f"end at byte {e}; nothing committed")
    live = np.flatnonzero(length)
    order = live[np.lexsort((offset[live], shard[live]))]
    clash = (shard[order[1:]] == shard[order[:-1]]) & (offset[order[1:]] < end[order[:-1]])
    if clash.any():
        k = int(np.flatnonzero(clash)[0])
        i0, i1 = int(order[k]), int(order[k + 1])
        raise GroupError(f"{where} puts tensors {names[i0]!r} and {names[i1]!r} on the same bytes "
                         f"of shard {shards[int(shard[i0])].path!r}; nothing committed")


def _logical(enc: _codec.Encoded, arrays: Sequence[np.ndarray]
             ) -> tuple[list[str], list[str], list[list[int]], list[bool]]:
    """Name, dtype, global shape and whether it is sharded, per logical tensor: what every rank
    must agree on (a sharded tensor's blocks differ from rank to rank, its global shape not)."""
    if enc.chunks is None:
        return list(enc.names), list(enc.dtypes), [list(a.shape) for a in arrays], [False] * len(arrays)
    names, dtypes, shapes, sharded = [], [], [], []
    seen = -1
    for i, k in enumerate(enc.chunks.tensor):
        if k == seen:  # the further chunks of a Chunks leaf
            continue
        seen = k
        names.append(enc.names[i])
        dtypes.append(enc.dtypes[i])
        shapes.append(list(enc.chunks.global_shapes[i]))
        sharded.append(enc.names[i] in enc.leaves)
    return names, dtypes, shapes, sharded


def _digest(enc: _codec.Encoded, arrays: Sequence[np.ndarray]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(_codec.pack(enc.tree))
    for name, dtype, shape, sharded in zip(*_logical(enc, arrays)):
        h.update(f"{name}\0{dtype}\0{shape}\0{int(sharded)}\0".encode())
    return h.digest()


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # a peer speaking another version, or a damaged message
        raise GroupError(f"{what}: a peer's message could not be decoded ({type(e).__name__})") from e


_OWN = -1  # in a plan: a block of a sharded tensor, written by the rank that holds it


def plan(enc: _codec.Encoded, arrays: Sequence[np.ndarray], ranks: int) -> list[int]:
    """Which rank writes each array: replicated arrays spread by :func:`assign`, each written
    once; the blocks of ``Shard``/``Chunks`` leaves (``_OWN``) by the rank that holds them."""
    if enc.chunks is None:
        return assign([a.nbytes for a in arrays], ranks)
    owner = [_OWN if name in enc.leaves else 0 for name in enc.names]
    replicated = [i for i, r in enumerate(owner) if r == 0]
    for i, r in zip(replicated, assign([arrays[i].nbytes for i in replicated], ranks)):
        owner[i] = r
    return owner


def _write_part(target: Store, rank: int, owner: list[int], arrays: Sequence[np.ndarray],
                enc: _codec.Encoded, token: str, folder: str = "") -> _Part:
    mine = [i for i, r in enumerate(owner) if r == rank or r == _OWN]
    chunks = None
    if enc.chunks is not None:
        c = enc.chunks
        # An empty block of a non-empty tensor (a rank that holds none of it, e.g. another
        # rank's optimizer slot under ZeRO) adds nothing but a row: not written.
        mine = [i for i in mine if owner[i] != _OWN or arrays[i].size
                or not all(c.global_shapes[i])]
        chunks = _codec.Chunking([c.tensor[i] for i in mine], [c.global_shapes[i] for i in mine],
                                 [c.starts[i] for i in mine])
    shards, table = _io.write_payload(target, [arrays[i] for i in mine],
                                      [enc.names[i] for i in mine], f"r{rank:05d}-{token}",
                                      [enc.dtypes[i] for i in mine], chunks=chunks,
                                      folder=folder)
    if chunks is not None:  # format 3: the rank's own chunk table goes to rank 0 whole
        return _Part(list(shards), {}, table)
    return _Part(list(shards), {"index": np.asarray(mine, np.int64), "shard": table.shard,
                                "offset": table.offset, "crc": table.checksum})


def fail(store: Store, group: Any, error: BaseException) -> None:
    """This rank could not even prepare its part (its state failed to capture or encode): take
    part in the save's collectives all the same, so that the others fail at once instead of
    timing out, then raise ``error``."""
    timeout = _knobs.group_timeout()
    message = {"type": type(error).__name__, "message": f"rank {group.rank}: {error}"}
    if group.rank == 0:
        group.broadcast(_pack({"kind": "abort", "error": message}), timeout=timeout)
        raise error
    go = _unpack(group.broadcast(None, timeout=timeout), "save")
    if go["kind"] != "abort":
        group.gather(_pack({"error": message}), timeout=timeout)
        group.broadcast(None, timeout=timeout)
    raise error


def save(store: Store, group: Any, enc: _codec.Encoded, arrays: Sequence[np.ndarray],
         make_manifest: Callable[[Sequence[ShardEntry], TensorTable], Manifest], *,
         token: str, overwrite: bool, fence: Any = None,
         describe: Callable[[Manifest], bytes | None] = lambda m: None
         ) -> Manifest | bytes | None:
    """Run one distributed save on this rank (see the module docstring); raises on every rank
    if nothing was committed.  Returns the committed manifest on rank 0.  On the others: what
    ``describe(manifest)`` returned on rank 0 once committed (bytes: a summary the caller builds
    this rank's answer from, without reading the manifest), or None when there is none
    (``describe`` gave none, or this rank missed the outcome and found the commit in the store)."""
    timeout = _knobs.group_timeout()
    rank, size = int(group.rank), int(group.size)
    owner = plan(enc, arrays, size)
    digest = _digest(enc, arrays)
    if rank == 0:
        return _coordinate(store, group, enc, arrays, owner, digest, make_manifest,
                           token=token, overwrite=overwrite, timeout=timeout, fence=fence,
                           describe=describe)
    go = _unpack(group.broadcast(None, timeout=timeout), "save")
    if go["kind"] == "abort":
        raise _error(go["error"], store)
    token = go["token"]
    target = store.sibling(go["folder"]) if go["folder"] else store
    folder = _folder(rank, go.get("spread") is True)  # rank 0's decision, whatever our knob says
    reply: dict[str, Any] = {"digest": digest}
    failure: BaseException | None = None
    try:
        reply.update(_write_part(target, rank, owner, arrays, enc, token, folder).to_reply())
    except Exception as e:  # reported to rank 0, which commits nothing; raised here below
        failure = e
        reply["error"] = {"type": type(e).__name__, "message": f"rank {rank}: {e}"}
    group.gather(_pack(reply), timeout=timeout)
    try:
        outcome = _unpack(group.broadcast(None, timeout=timeout), "save")
    except GroupError as e:
        if failure is None and _await_commit(store, token, timeout):
            log.warning("%s: committed by rank 0, but this rank (%d) missed the outcome (%s: %s); "
                        "a rank lost after its reply is only logged", store.url, rank,
                        type(e).__name__, e)
            return None
        raise
    if outcome["kind"] == "mismatch":  # rank 0 asks what we saved, to name the difference
        group.gather(_pack(_structure(enc, arrays)), timeout=timeout)
        outcome = _unpack(group.broadcast(None, timeout=timeout), "save")
    if failure is not None:
        raise failure
    if outcome["kind"] != "ok":
        raise _error(outcome["error"], store)
    summary = outcome.get("summary")
    return summary if isinstance(summary, bytes) else None


def _committed(store: Store, token: str) -> bool:
    """Whether the manifest at ``store`` is the one of the save ``token`` (rank 0's writer id):
    what a rank that missed the outcome asks the store."""
    try:
        manifest = Manifest.from_bytes(
            store.read(MANIFEST_NAME, max_bytes=_knobs.max_manifest_bytes()),
            source=store.join(MANIFEST_NAME), rows=rows_reader(store))
    except Exception:  # noqa: BLE001 - no manifest, another one, or the store failing: not ours
        return False
    return isinstance(manifest.writer, dict) and manifest.writer.get("id") == token


def _await_commit(store: Store, token: str, timeout: float) -> bool:
    """Whether rank 0 commits the save ``token``, for a rank whose outcome broadcast broke.

    The engine may report a peer's death (gloo does, at once) while rank 0 is still merging or
    publishing: asked once, the store would say "not committed" while rank 0 commits, and the
    ranks would disagree.  So the manifest is looked for until the group's timeout (rank 0 may
    be gone too); only then is the save taken as not committed."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not _committed(store, token):
        left = deadline - time.monotonic()
        if left <= 0:
            log.info("%s: no committed manifest of this save found within %gs", store.url,
                     timeout)
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.25)
    return True


def _structure(enc: _codec.Encoded, arrays: Sequence[np.ndarray]) -> dict:
    """What a rank saves, tensor by tensor: sent only when the digests disagree (a million
    names from each of a thousand ranks would not fit the happy path)."""
    names, dtypes, shapes, sharded = _logical(enc, arrays)
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "sharded": sharded}


class _Mismatch(SchemaError):
    """Ranks whose states differ: rank 0 gathers their structures to name the difference."""

    def __init__(self, store: Store, ranks: list[int]) -> None:
        super().__init__(f"{store.url}: ranks {ranks} save another state than rank 0")
        self.ranks = ranks


def _coordinate(store: Store, group: Any, enc: _codec.Encoded, arrays: Sequence[np.ndarray],
                owner: list[int], digest: bytes, make_manifest: Callable, *, token: str,
                overwrite: bool, timeout: float, fence: Any = None,
                describe: Callable[[Manifest], bytes | None]) -> Manifest:
    started = broken = False
    spread = int(group.size) >= _knobs.prefix_ranks()  # decided here, for every rank
    if spread:
        log.debug("%s: %d ranks (prefix_ranks %d): shards in folders hashed from the rank",
                  store.url, int(group.size), _knobs.prefix_ranks())

    def write(target: Store) -> Manifest:
        nonlocal started, broken
        tmp = "" if target.path == store.path else target.name
        try:
            group.broadcast(_pack({"kind": "go", "token": token, "folder": tmp,
                                   "spread": spread}), timeout=timeout)
        except GroupError:
            broken = True
            raise
        started = True
        own: BaseException | None = None
        try:
            part = _write_part(target, 0, owner, arrays, enc, token, _folder(0, spread))
        except Exception as e:  # the others still reply: gather first, then fail
            own, part = e, None
        try:
            gathered = group.gather(b"", timeout=timeout)
        except GroupError:
            broken = True  # a peer is gone: nobody is left to tell
            raise
        replies = [_unpack(r, "save") for r in gathered[1:]]
        if own is not None:
            raise own
        return _merge(store, enc, arrays, digest, part, replies, make_manifest, token, spread)

    try:
        manifest = commit(store, write, token=token, overwrite=overwrite, fence=fence)
    except _Mismatch as e:
        raise _refuse_mismatch(store, group, enc, arrays, e.ranks[0], timeout) from None
    except BaseException as e:
        message = {"type": type(e).__name__, "message": str(e)}
        try:
            if not broken:  # the others wait for "go" or for the outcome: tell them
                kind = "error" if started else "abort"
                group.broadcast(_pack({"kind": kind, "error": message}), timeout=timeout)
        except GroupError as g:  # a broken group: the others time out on their own
            log.warning("ckptcore: %s: could not tell the other ranks the save failed (%s)",
                        store.url, g)
        raise
    _announce(store, group, manifest, describe, timeout)
    return manifest


def _announce(store: Store, group: Any, manifest: Manifest,
              describe: Callable[[Manifest], bytes | None], timeout: float) -> None:
    """Committed: tell every rank, with ``describe(manifest)`` (a few hundred bytes: what their
    ``CheckpointInfo`` shows), so that none reads the manifest back (1,000 ranks reading a
    149 MiB manifest would be 149 GB of GETs per save).  Whatever happens now, the save stands
    (a GroupError would say it did not): failures are logged, not raised."""
    try:
        summary = describe(manifest)
    except Exception as e:  # noqa: BLE001 - the others read the manifest instead
        log.warning("%s: committed, but its summary for the other ranks could not be made "
                    "(%s: %s); they read the manifest instead", store.url, type(e).__name__, e)
        summary = None
    try:
        group.broadcast(_pack({"kind": "ok", "summary": summary}), timeout=timeout)
    except Exception as e:
        log.warning("%s: committed, but the outcome could not be told to every rank (%s: %s); "
                    "a rank lost after its reply is only logged", store.url, type(e).__name__, e)


def _refuse_mismatch(store: Store, group: Any, enc: _codec.Encoded, arrays: Sequence[np.ndarray],
                     first: int, timeout: float) -> SchemaError:
    """Rank ``first`` saves another state than rank 0: ask every rank for its structure (the
    happy path sends only digests), tell them all the save is refused, and return the error
    naming the first difference."""
    group.broadcast(_pack({"kind": "mismatch"}), timeout=timeout)
    theirs = [_unpack(r, "save") for r in group.gather(b"", timeout=timeout)[1:]]
    try:
        how = _first_difference(enc, arrays, theirs[first - 1])
    except Exception as x:  # noqa: BLE001 - a peer's malformed answer: say so, still refuse
        how = f"its description of it cannot be read: {type(x).__name__}"
    err = SchemaError(f"{store.url}: rank {first} saves another state than rank 0 "
                      f"({how}); a save with a "
                      "group needs the same replicated state on every rank; nothing committed")
    group.broadcast(_pack({"kind": "error", "error": {"type": "SchemaError",
                                                      "message": str(err)}}), timeout=timeout)
    return err


def settle(store: Store, group: Any) -> None:
    """After a committed save: wait until every rank has built its answer.  Most ranks read
    nothing (rank 0's summary suffices); one that missed the outcome reads the manifest, and
    must be done before rank 0 may delete the step (a rewind, retention).  What a rank reads
    later (its ``CheckpointInfo``'s tensor list, on first use) is not covered: the step may be
    gone by then.  The save is committed whatever happens here, so a peer lost now is logged,
    not raised."""
    try:
        group.barrier(timeout=_knobs.group_timeout())
    except GroupError as e:
        log.warning("%s: committed, but a rank did not confirm it has its answer (%s)",
                    store.url, e)


def _merge(store: Store, enc: _codec.Encoded, arrays: Sequence[np.ndarray], digest: bytes,
           part: _Part, replies: list[dict], make_manifest: Callable, token: str,
           spread: bool = False) -> Manifest:
    """One manifest from every rank's part; refuses failed ranks, differing states and replies
    that do not fit (module docstring; ``spread``: not in the rank's own :func:`rank_folder`)."""
    for r, reply in enumerate(replies, start=1):
        if not isinstance(reply, dict):  # a peer's bytes decode to anything: trust no shape
            raise GroupError(f"{store.url}: rank {r}'s reply is not a map but a "
                             f"{type(reply).__name__}; nothing committed")
        if "error" in reply:
            err = reply["error"]
            if not isinstance(err, dict):
                err = {"message": f"rank {r}: {err!r:.200}", "type": "an error"}
            raise GroupError(f"{store.url}: {err.get('message')} ({err.get('type')}); nothing "
                             "committed")
    differ = [r for r, reply in enumerate(replies, start=1) if reply.get("digest") != digest]
    if differ:
        raise _Mismatch(store, differ)
    parts = [part] + [_Part.from_reply(reply, r, store.url, token, _folder(r, spread))
                      for r, reply in enumerate(replies, start=1)]
    owner: dict[str, int] = {}
    for r, p in enumerate(parts):
        for s in p.shards:
            if owner.setdefault(s.path, r) != r:
                raise GroupError(f"{store.url}: rank {r} lists shard {s.path!r}, which rank "
                                 f"{owner[s.path]} lists too; nothing committed")
    if part.table is not None:
        return make_manifest(*_merge_chunks(store, enc, arrays, parts))
    if any(p.chunks is not None for p in parts):
        raise GroupError(f"{store.url}: the ranks disagree on whether the state is chunked; "
                         "nothing committed")
    n = len(arrays)
    nbytes = np.array([a.nbytes for a in arrays] or [0], np.uint64)
    shards: list[ShardEntry] = []
    shard = np.zeros(n, np.uint32)
    offset = np.zeros(n, np.uint64)
    crc = np.zeros(n, np.uint32)
    written = np.zeros(n, np.int64)
    for r, p in enumerate(parts):
        idx, local = p.rows["index"], p.rows["shard"]
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise GroupError(f"{store.url}: rank {r} reports tensors the state does not have; "
                             "nothing committed")
        _check_bytes(store, r, p.shards, _Names(enc.names, idx), local, p.rows["offset"],
                     nbytes[idx] if len(idx) else np.zeros(0, np.uint64))
        shard[idx] = local + len(shards)
        offset[idx], crc[idx] = p.rows["offset"], p.rows["crc"]
        np.add.at(written, idx, 1)
        shards.extend(p.shards)
    if not (written == 1).all():
        bad = int(np.flatnonzero(written != 1)[0])
        raise GroupError(f"{store.url}: tensor {enc.names[bad]!r} was written {int(written[bad])} "
                         "times by the ranks, not once; nothing committed")
    table = TensorTable.from_columns(list(enc.names), enc.dtypes, [a.shape for a in arrays],
                                     shard, offset, [a.nbytes for a in arrays], crc)
    return make_manifest(shards, table)


class _Names:
    """The names of the rows ``idx`` of ``names``, looked up only for an error message."""

    def __init__(self, names: Sequence[str], idx: np.ndarray) -> None:
        self._names, self._idx = names, idx

    def __getitem__(self, i: int) -> str:
        return self._names[int(self._idx[i])]


def _merge_chunks(store: Store, enc: _codec.Encoded, arrays: Sequence[np.ndarray],
                  parts: list[_Part]) -> tuple[list[ShardEntry], TensorTable]:
    """A chunked save: every rank's chunk reply split, checked and joined at once
    (``_replies.join``: shards, byte ranges, block checksums), the chunk rules run on the
    joined table (``check_chunks`` refuses blocks that overlap, e.g. a replicated tensor written
    twice or two ranks' Shards of one region), then every tensor must be covered whole by its
    blocks: a save by a whole group that leaves a hole (a rank that forgot its Shard, offsets
    off by one) is refused, not committed."""
    replies = [p.chunk_reply() for p in parts]
    if any(c is None for c in replies):
        raise GroupError(f"{store.url}: the ranks disagree on whether the state is chunked; "
                         "nothing committed")
    names, dtypes, shapes, _ = _logical(enc, arrays)
    logical = _replies.Logical.of(names, dtypes, shapes)
    rows = [_replies.split(c, r, logical, store.url) for r, c in enumerate(replies)]
    table = _replies.join(rows, [p.shards for p in parts], logical, store.url)
    try:
        check_chunks(table, f"{store.url}: the ranks' blocks", interned=logical.names)
    except ValueError as e:
        # (SchemaError is a ValueError): the ranks' Shard blocks overlap or reach outside their
        # tensor; nothing committed.
        raise SchemaError(f"{e}; a save with a group needs disjoint Shard blocks, and every "
                          "rank's table must fit the state; nothing committed") from None
    have = np.bincount(table.tensor, weights=table.length.astype(np.float64),
                       minlength=len(names))
    want = [int(np.prod(shape, dtype=np.int64)) * int(size)
            for shape, size in zip(shapes, logical.itemsize.tolist())]
    for k in np.flatnonzero(have != np.array(want, np.float64)).tolist()[:1]:
        raise SchemaError(f"{store.url}: tensor {names[k]!r} {shapes[k]}: the ranks' blocks hold "
                          f"{int(have[k])} of its {want[k]} bytes; a save with a group must "
                          "cover every sharded tensor whole (nothing committed)")
    return [s for p in parts for s in p.shards], table


def _first_difference(enc: _codec.Encoded, arrays: Sequence[np.ndarray], reply: dict) -> str:
    names, dtypes, shapes, sharded = _logical(enc, arrays)
    mine = list(zip(names, dtypes, shapes, sharded))
    theirs = list(zip(reply["names"], reply["dtypes"], reply["shapes"],
                      reply.get("sharded") or [False] * len(reply["names"])))
    kind = {True: " (a Shard)", False: ""}
    for a, b in zip(mine, theirs):
        if tuple(a) != tuple(b):
            return (f"tensor {a[0]!r} {a[1]}{a[2]}{kind[a[3]]} against "
                    f"{b[0]!r} {b[1]}{b[2]}{kind[b[3]]}")
    if len(mine) != len(theirs):
        return f"{len(mine)} tensors against {len(theirs)}"
    return "the same tensors, other values in the rest of the state"


def _error(err: dict, store: Store, rank: int = 0) -> Exception:
    """Rank ``rank``'s failure, raised on another rank: the same class where it is ckptcore's own
    (or ``ValueError``/``TypeError``, a caller's mistake), else ``GroupError``."""
    from . import errors

    kind = getattr(errors, err.get("type", ""), None)
    if kind is None:
        kind = {"ValueError": ValueError, "TypeError": TypeError}.get(err.get("type", ""))
    text = f"{err.get('message')} (raised on rank {rank})"
    if isinstance(kind, type) and issubclass(kind, (CheckpointError, ValueError, TypeError)):
        try:
            return kind(text)
        except TypeError:  # a class with a richer constructor
            pass
    return GroupError(f"{store.url}: failed on rank {rank}: {err.get('type')}: {text}")


def agree(store: Store, group: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (this rank's part of a load) on every rank, then make every rank return or
    raise alike: if any rank failed, the others raise its error (its class where it is
    ckptcore's own, naming the rank), so no rank trains on while another could not restore
    (and then hangs in the next collective)."""
    timeout = _knobs.group_timeout()
    failure: BaseException | None = None
    value = None
    try:
        value = fn()
    except Exception as e:  # told to the others, raised here below
        failure = e
    mine = {} if failure is None else {"error": {"type": type(failure).__name__,
                                                 "message": f"rank {group.rank}: {failure}"}}
    gathered = group.gather(_pack(mine), timeout=timeout)
    if group.rank == 0:
        failed = [(r, m["error"]) for r, m in enumerate(_unpack(x, "load") for x in gathered)
                  if isinstance(m, dict) and "error" in m]
        outcome = ({"kind": "ok"} if not failed else
                   {"kind": "error", "rank": failed[0][0], "error": failed[0][1]})
        group.broadcast(_pack(outcome), timeout=timeout)
    else:
        outcome = _unpack(group.broadcast(None, timeout=timeout), "load")
    if failure is not None:
        raise failure
    if outcome["kind"] != "ok":
        raise _error(outcome["error"], store, int(outcome.get("rank", 0)))
    return value


def decide(store: Store, group: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (a check only rank 0 can make: its writer lock, the manager's step order) on
    rank 0 and hand its result, or its error, to every rank, so that a refusal reaches the
    others at once instead of leaving them to time out in the save that never starts."""
    timeout = _knobs.group_timeout()
    if group.rank != 0:
        msg = _unpack(group.broadcast(None, timeout=timeout), "save")
        if msg["kind"] != "ok":
            raise _error(msg["error"], store)
        return msg["value"]
    try:
        value = fn()
    except Exception as e:
        group.broadcast(_pack({"kind": "error", "error": {"type": type(e).__name__,
                                                           "message": str(e)}}), timeout=timeout)
        raise
    group.broadcast(_pack({"kind": "ok", "value": value}), timeout=timeout)
    return value
