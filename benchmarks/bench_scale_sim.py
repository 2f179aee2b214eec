"""What a distributed save's commit costs at 1,000 ranks, simulated in one process with ckptcore's code.

No 1,000-host cluster is at hand, so the parts that depend on the rank count are run in one
process with the real functions: each rank's reply is built and packed as
``ckptcore/_dist.py`` packs it (msgpack: shard entries, per-tensor rows, a digest), the
coordinator decodes and merges them (``_dist._merge``) into the manifest's columnar tensor table,
the manifest is encoded (``Manifest.to_bytes``) and parsed and validated again as a reader does
(``Manifest.from_bytes``).  A tree-shaped gather (leaders of ``--fan`` ranks merge first) is
simulated with the same functions.  After the commit, rank 0 sends the other ranks a summary of
the manifest with the outcome (``_read.summary_of``), from which they build their
``CheckpointInfo`` without reading the store (``_read.info_from_summary``): both are run on the
simulated manifests, and the bytes the other ranks read (before: the whole manifest each) are
reported.  Shard folders (``_dist.rank_folder``) are counted per key prefix.  Object-store request latencies are measured against moto's
S3 server on 127.0.0.1 (unless ``--no-s3``) and composed into the commit's critical path.

Default: ``--ranks 1000 --tensors 2000`` (2 million tensors: each rank writes 2,000, about a
thousandth of a replicated state; small tensors, since only their count matters here).

    python benchmarks/bench_scale_sim.py [--ranks 1000] [--tensors 2000] [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


TOKEN = "0123456789abcdef"  # the save's token every simulated reply carries in its shard names


def _timed(fn, rounds: int):
    out, times = None, []
    for _ in range(rounds):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times), min(times), max(times)


def build(ranks: int, per_rank: int):
    """The encoded state every rank holds (names, dtypes, shapes) and each rank's packed reply."""
    import msgpack
    import numpy as np

    from ckptcore import _codec
    from ckptcore._dist import _Part, assign

    n = ranks * per_rank
    names = [f"block{i // 64}/layer{i % 64}/w{i}" for i in range(n)]
    shapes = [(16 + i % 48,) for i in range(n)]
    sizes = [4 * s[0] for s in shapes]
    owner = assign(sizes, ranks)
    enc = _codec.Encoded(tree={"model": {}}, arrays=[], names=names, dtypes=["float32"] * n)
    arrays = [np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), s, (0,)) for s in shapes]
    mine: list[list[int]] = [[] for _ in range(ranks)]
    for i, r in enumerate(owner):
        mine[r].append(i)
    digest = hashlib.blake2b(b"state", digest_size=16).digest()
    replies = []
    for r in range(ranks):
        offset, end, offsets = 0, 0, []
        for i in mine[r]:
            offset += (-offset) % 64  # aligned, as _io.plan_shards lays tensors out
            offsets.append(offset)
            offset += sizes[i]
            end = offset
        idx = np.asarray(mine[r], np.int64)
        part = _Part([], {"index": idx, "shard": np.zeros(len(idx), np.uint32),
                          "offset": np.asarray(offsets, np.uint64),
                          "crc": ((idx * 2654435761) & 0xFFFFFFFF).astype(np.uint32)})
        replies.append(msgpack.packb({"digest": digest, "shards": [
            [f"shard-00000-r{r:05d}-{TOKEN}.bin", end, r]], "rows": part.packed_rows()},
            use_bin_type=True))
    return enc, arrays, digest, replies, mine


def merge(enc, arrays, digest, packed: list[bytes]):
    """What rank 0 does with the gathered replies: decode, check, merge into one table."""
    import msgpack

    from ckptcore._dist import _Part, _merge
    from ckptcore._manifest import Manifest

    replies = [msgpack.unpackb(b, raw=False) for b in packed]
    part = _Part.from_reply(replies[0], 0, "sim://", TOKEN)

    def make(shards, table):
        return Manifest(created=time.time(), writer=_writer(), library=_library(),
                        framework={"name": None, "versions": {}},
                        alignment=64, shards=tuple(shards), tensors=table,
                        tree={"model": {}, "step": 1000, "epoch": 3,
                              "data": {"epoch": 3, "position": 123456}},
                        version=2, referenced=())

    class _S:  # only .url is read on the happy path
        url = "sim://"

    return _merge(_S(), enc, arrays, digest, part, replies[1:], make, TOKEN)


def _writer() -> dict:
    """What ``api`` records as a manifest's writer (the summary carries it)."""
    return {"id": TOKEN, "host": socket.gethostname(), "pid": os.getpid()}


def _library() -> dict:
    import numpy as np

    from ckptcore import __version__
    return {"ckptcore": __version__, "numpy": np.__version__,
            "python": platform.python_version()}


def build_sharded(ranks: int, tensors: int):
    """A sharded state: every rank holds one block (rows ``8r..8r+7``) of each of ``tensors``
    tensors of shape ``(8 * ranks,)``; each rank's reply as ``_dist`` packs it (its chunk
    table's columns without names, ``_replies.pack``)."""
    import msgpack
    import numpy as np

    from ckptcore import _codec, _replies
    from ckptcore._manifest import CRC_BLOCK, TensorTable

    names = [f"block{k // 64}/layer{k % 64}/w{k}" for k in range(tensors)]
    gshape = (8 * ranks,)
    digest = hashlib.blake2b(b"sharded", digest_size=16).digest()
    replies = []
    for r in range(ranks):
        table = TensorTable.from_columns(
            names, ["float32"] * tensors, [(8,)] * tensors, [0] * tensors,
            [64 * k for k in range(tensors)], [32] * tensors,
            [(k * 2654435761 + r) & 0xFFFFFFFF for k in range(tensors)], tensor=range(tensors),
            global_shapes=[gshape] * tensors, starts=[(8 * r,)] * tensors, block_crc=[],
            crc_block=CRC_BLOCK)
        replies.append(msgpack.packb({"digest": digest, "shards": [
            [f"shard-00000-r{r:05d}-{TOKEN}.bin", 64 * (tensors - 1) + 32, r]],
            "chunks": _replies.pack(table)}, use_bin_type=True))
    block = np.zeros(8, np.float32)
    enc = _codec.Encoded(tree={"model": {}}, arrays=[block] * tensors, names=names,
                         dtypes=["float32"] * tensors,
                         chunks=_codec.Chunking(list(range(tensors)), [gshape] * tensors,
                                                [(0,)] * tensors),
                         leaves={n: None for n in names})
    return enc, replies


def _sharded_shards(packed: list[bytes]):
    import msgpack

    from ckptcore._manifest import ShardEntry

    for b in packed:
        for path, size, crc in msgpack.unpackb(b, raw=False)["shards"]:
            yield ShardEntry(path=path, size=size, checksum=crc)


def merge_sharded(enc, packed: list[bytes]):
    """Rank 0's work for a sharded save: decode every reply, check each rank's shards and
    columns, join and check every rank's rows at once (byte ranges, overlaps), check every
    tensor is covered whole."""
    import msgpack

    from ckptcore._dist import _merge_chunks, _Part

    class _S:
        url = "sim://"

    parts = [_Part.from_reply(msgpack.unpackb(b, raw=False), r, "sim://", TOKEN)
             for r, b in enumerate(packed)]
    return _merge_chunks(_S(), enc, enc.arrays, parts)


def after_commit(manifest, data: bytes, rounds: int) -> dict:
    """What a rank other than 0 costs once rank 0 committed ``manifest`` (``data``: its bytes,
    what each of them read before): the summary rank 0 broadcasts with the outcome, the time to
    make it, and the time to build a rank's ``CheckpointInfo`` from it, against an empty store
    (a read there would raise: it reads nothing)."""
    from ckptcore._read import info_from_summary, summary_of
    from ckptcore._storage import Store

    summary, make, _, _ = _timed(lambda: summary_of(manifest), rounds)
    store = Store("memory://bench-scale-sim/nothing-here")
    info, build, _, _ = _timed(lambda: info_from_summary(store, summary), rounds)
    assert info is not None and len(info.tensors) == len(manifest.tensors)
    assert info.created == manifest.created and info.writer == manifest.writer
    return {"summary": len(summary), "make": make, "build": build, "before": len(data)}


def format4(manifest, rounds: int, ranks: int) -> dict:
    """The sharded manifest as format 4 (``_manifest4``): sizes, encode and full-parse times,
    and what a rank loading its own blocks (``load_state(like=...)``: ``_chunks.selector``
    picks the row groups) reads: the manifest and the groups fetched, counted on the encoded
    objects, for ranks 0, the middle one and the last (the largest is reported)."""
    from ckptcore._manifest import Manifest
    from ckptcore._manifest4 import encode_manifest, memory_fetch, reader

    from ckptcore import _knobs

    # (--quick: a table below the knob's default is split all the same)
    with _knobs.override(manifest_split_rows=min(_knobs.manifest_split_rows(),
                                                  len(manifest.tensors))):
        (m4, root, extra), enc, _, _ = _timed(lambda: encode_manifest(manifest, "0" * 16),
                                              rounds)
    assert m4.version == 4, "the table is below manifest_split_rows"
    _, parse, _, _ = _timed(lambda: Manifest.from_bytes(
        root, rows=reader(memory_fetch(dict(extra)))), rounds)
    import numpy as np
    import msgpack
    length = np.frombuffer(msgpack.unpackb(msgpack.unpackb(root)["body"], raw=False,
                                           strict_map_key=False)["tensors"]["index"]["length"],
                           "<u8")
    own = [_own_blocks(root, dict(extra), manifest, ranks, r, rounds)
           for r in sorted({0, ranks // 2, ranks - 1})]
    worst = max(own, key=lambda o: o["bytes"])
    return {"encode": enc, "parse": parse, "root": len(root), "rows": len(extra[0][1]),
            "groups": len(length), "largest": int(length.max()), "own": worst["bytes"],
            "own_groups": worst["groups"], "own_parse": worst["parse"],
            "own_rows": worst["rows"]}


def _own_blocks(root: bytes, objects: dict, manifest, ranks: int, r: int, rounds: int) -> dict:
    """Rank ``r``'s ``like=`` load of its blocks (rows ``8r..8r+7`` of every tensor) from the
    format-4 ``root``: bytes read (manifest + groups fetched), groups, rows, parse time; its
    rows checked to cover every block (``_chunks.covers``: else the load would read all)."""
    import numpy as np

    from ckptcore import Shard, TrainingState, _chunks
    from ckptcore._manifest import Manifest
    from ckptcore._manifest4 import memory_fetch, reader
    from ckptcore._storage import Store

    table = manifest.tensors
    gshape = table.global_shape(0)
    names = [table.logical_name(k) for k in range(table.logical_count())]
    like = TrainingState(model={f"w{k}": Shard(np.zeros(8, np.float32), gshape, (8 * r,))
                                for k in range(len(names))})
    select = _chunks.selector(like)
    assert select is not None
    inner = memory_fetch(objects)
    fetched: list[int] = []

    def fetch(entry, ranges):
        fetched.append(sum(b - a for a, b in ranges))
        return inner(entry, ranges)

    m, parse, _, _ = _timed(lambda: Manifest.from_bytes(root, rows=reader(fetch, select)), rounds)
    assert m.partial
    # The bench's tree names its tensors w<k> (the table's names are longer): map them.
    tree = {"model": {f"w{k}": m.tree["model"][f"w{k}"] for k in range(len(names))}}
    m.tensors.names = [f"model/w{int(k)}" for k in m.tensors.tensor]
    assert _chunks.covers(Store("memory://bench-scale-sim/none"), m, tree, like), r
    groups = int(select(_index(root)).sum())
    return {"bytes": len(root) + fetched[-1], "groups": groups, "parse": parse,
            "rows": len(m.tensors)}


def _index(root: bytes) -> dict:
    import msgpack
    import numpy as np

    from ckptcore._manifest4 import INDEX

    t = msgpack.unpackb(msgpack.unpackb(root)["body"], raw=False, strict_map_key=False)["tensors"]
    return {k: np.frombuffer(t["index"][k], c) for k, c in INDEX.items()}


def prefix_load(ranks: int) -> tuple[int, int]:
    """Shard folders (``_dist.rank_folder``) of ``ranks`` ranks: (most ranks in one, folders)."""
    from collections import Counter

    from ckptcore._dist import rank_folder

    counts = Counter(rank_folder(r) for r in range(ranks))
    return max(counts.values()), len(counts)


def s3_latencies(rounds: int) -> dict[str, float]:
    """Median seconds of the requests a commit makes, against moto's S3 server on 127.0.0.1."""
    import bench_s3
    import s3fs
    from fsspec.asyn import sync

    opts, stop = bench_s3.start_server("process")
    try:
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("sim")
        out: dict[str, list[float]] = {"PUT 1 KiB": [], "create-only PUT 1 KiB": [], "HEAD": [],
                                       "GET 1 KiB": []}
        for i in range(rounds):
            for name, fn in (
                    ("PUT 1 KiB", lambda: fs.pipe_file(f"sim/a{i}", b"x" * 1024)),
                    ("create-only PUT 1 KiB", lambda: sync(fs.loop, fs._call_s3, "put_object",
                                                            Bucket="sim", Key=f"c{i}",
                                                            Body=b"x" * 1024, IfNoneMatch="*")),
                    ("HEAD", lambda: fs.info(f"sim/a{i}", refresh=True)),
                    ("GET 1 KiB", lambda: fs.cat_file(f"sim/a{i}"))):
                t = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - t)
        return {k: statistics.median(v) for k, v in out.items()}
    finally:
        stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--tensors", type=int, default=2000, help="tensors written per rank")
    p.add_argument("--fan", type=int, default=32, help="ranks per leader in the tree gather")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--quick", action="store_true", help="100 ranks x 200 tensors, not recorded")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.tensors, args.rounds, args.no_record = 100, 200, 1, True
    from ckptcore import _codec
    from ckptcore._manifest import Manifest

    t = time.perf_counter()
    enc, arrays, digest, replies, mine = build(args.ranks, args.tensors)
    built = time.perf_counter() - t
    n = args.ranks * args.tensors
    gathered = sum(map(len, replies))
    manifest, m_med, m_min, m_max = _timed(lambda: merge(enc, arrays, digest, replies), args.rounds)
    data, e_med, _, _ = _timed(manifest.to_bytes, args.rounds)
    _, p_med, p_min, p_max = _timed(lambda: Manifest.from_bytes(data), args.rounds)

    # Tree: leaders merge the replies of their `fan` ranks into one reply (rows concatenated,
    # shards listed in rank order), then rank 0 merges the leaders' replies.
    import msgpack

    fan = max(2, args.fan)
    groups = [replies[i:i + fan] for i in range(0, len(replies), fan)]

    import numpy as np

    from ckptcore._dist import _Part

    def leader(j: int, group: list[bytes]) -> bytes:
        shards, cols = [], {k: [] for k in ("index", "shard", "offset", "crc")}
        for i, b in enumerate(group):
            p = _Part.from_reply(msgpack.unpackb(b, raw=False), j * fan + i, "sim://", TOKEN)
            for k in cols:
                cols[k].append(p.rows[k] + (len(shards) if k == "shard" else 0))
            shards.extend([s.path, s.size, s.checksum] for s in p.shards)
        # Rank 0 checks each reply's shard names against the rank it comes from: the leader's
        # reply names its ranks' shards as if it were that rank (same count, same checks).
        shards = [[f"shard-{k:05d}-r{j:05d}-{TOKEN}.bin", size, crc]
                  for k, (_, size, crc) in enumerate(shards)]
        rows = _Part([], {k: np.concatenate(v) for k, v in cols.items()}).packed_rows()
        return msgpack.packb({"digest": digest, "shards": shards, "rows": rows}, use_bin_type=True)

    t = time.perf_counter()
    leaders = [leader(j, g) for j, g in enumerate(groups)]
    level1 = (time.perf_counter() - t) / len(groups)  # one leader's work (leaders run in parallel)
    _, l2_med, _, _ = _timed(lambda: merge(enc, arrays, digest, leaders), args.rounds)
    per_leader_in = statistics.median([sum(map(len, g)) for g in groups])

    t = time.perf_counter()
    s_enc, s_replies = build_sharded(args.ranks, args.tensors)
    s_built = time.perf_counter() - t
    (_, s_table), s_med, s_min, s_max = _timed(lambda: merge_sharded(s_enc, s_replies), args.rounds)
    s_gathered = sum(map(len, s_replies))
    s_manifest = Manifest(created=time.time(), writer=_writer(), library=_library(),
                          framework={"name": None, "versions": {}},
                          alignment=64, shards=tuple(p for p in _sharded_shards(s_replies)),
                          tensors=s_table, tree={"model": {f"w{k}": _codec._ext(_codec.EXT_TENSOR, k)
                                                           for k in range(args.tensors)}},
                          version=3, referenced=tuple(range(args.tensors)))
    s_data = s_manifest.to_bytes()
    _, sp_med, sp_min, sp_max = _timed(lambda: Manifest.from_bytes(s_data), args.rounds)
    v4 = format4(s_manifest, args.rounds, args.ranks)
    flat_after = after_commit(manifest, data, args.rounds)
    s_after = after_commit(s_manifest, s_data, args.rounds)
    most, folders = prefix_load(args.ranks)
    others = args.ranks - 1

    lat = {} if args.no_s3 else s3_latencies(max(5, args.rounds * 3))
    # Shard keys: "<checkpoint>/shard-<n>-r<rank>-<token>.bin" all share the checkpoint's prefix;
    # S3 scales request rates per prefix (about 3,500 PUT and 5,500 GET per second each).
    puts = args.ranks  # one shard per rank here (a rank's share fits one part)
    lines = [
        f"## bench_scale_sim.py, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
        f"{args.ranks} ranks x {args.tensors} tensors = {n:,} tensors; one process, ckptcore's own "
        f"functions; medians of {args.rounds} rounds [min-max]; building the replies took "
        f"{built:.1f} s (not part of a save).", "",
        "| quantity | value |", "|---|---:|",
        f"| bytes gathered at rank 0 (flat) | {gathered / 2**20:.1f} MiB ({gathered / args.ranks / 1024:.1f} KiB per rank) |",
        f"| rank 0: decode + check + merge {args.ranks} replies (flat) | {m_med:.2f} s [{m_min:.2f}-{m_max:.2f}] |",
        f"| manifest encode | {e_med:.2f} s |",
        f"| manifest size | {len(data) / 2**20:.1f} MiB ({len(data) / n:.0f} bytes per tensor) |",
        f"| manifest parse + validate (every reader, every load) | {p_med:.2f} s [{p_min:.2f}-{p_max:.2f}] |",
        f"| tree gather, fan {fan}: bytes into one leader | {per_leader_in / 2**20:.2f} MiB |",
        f"| tree gather: one leader's merge ({fan} replies) | {level1 * 1000:.0f} ms |",
        f"| tree gather: rank 0 merges {len(groups)} leaders' replies | {l2_med:.2f} s |",
        f"| sharded: {args.tensors} tensors cut in {args.ranks} blocks ({len(s_table):,} chunk rows); "
        f"bytes gathered | {s_gathered / 2**20:.1f} MiB ({s_gathered / args.ranks / 1024:.1f} KiB per rank) |",
        f"| sharded: rank 0 decodes, validates each rank's table, merges, checks coverage | "
        f"{s_med:.2f} s [{s_min:.2f}-{s_max:.2f}] (building the tables took {s_built:.1f} s) |",
        f"| sharded: manifest size; parse + validate (chunk rules, overlaps) | "
        f"{len(s_data) / 2**20:.1f} MiB; {sp_med:.2f} s [{sp_min:.2f}-{sp_max:.2f}] |",
        f"| sharded, format 4 (rows object): encode; manifest / rows object size; groups (largest) "
        f"| {v4['encode']:.2f} s; {v4['root'] / 2**20:.2f} MiB / {v4['rows'] / 2**20:.1f} MiB; "
        f"{v4['groups']} ({v4['largest'] / 1024:.0f} KiB) |",
        f"| sharded, format 4: full parse + validate (rows object read whole) | {v4['parse']:.2f} s |",
        f"| sharded, format 4: a rank's like= load of its own blocks reads the manifest + "
        f"{v4['own_groups']} row group(s), {v4['own_rows']:,} rows (largest of ranks 0, middle, "
        f"last; counted on the encoded objects); its parse + checks | "
        f"{v4['own'] / 2**20:.2f} MiB; {v4['own_parse'] * 1000:.0f} ms |",
        f"| bytes each other rank reads from the store after a save | before: the manifest, "
        f"{len(data) / 2**20:.1f} MiB (sharded: {len(s_data) / 2**20:.1f} MiB); now: 0 |",
        f"| bytes the {others} other ranks read per save | before: {others * len(data) / 2**30:.1f} "
        f"GiB (sharded: {others * len(s_data) / 2**30:.1f} GiB); now: 0 |",
        f"| summary broadcast with the outcome (what the other ranks get instead) | "
        f"{flat_after['summary']} bytes (sharded: {s_after['summary']} bytes) |",
        f"| rank 0 makes the summary; a rank builds its CheckpointInfo from it | "
        f"{flat_after['make'] * 1000:.1f} ms (sharded {s_after['make'] * 1000:.1f} ms); "
        f"{flat_after['build'] * 1e6:.0f} us |",
        f"| shard PUTs per key prefix (one shard per rank) | one prefix: {args.ranks}; shard "
        f"folders (groups of >= prefix_ranks ranks): at most {most} in each of {folders} prefixes |",
    ]
    if lat:
        put, create, head = lat["PUT 1 KiB"], lat["create-only PUT 1 KiB"], lat["HEAD"]
        lines += [
            f"| S3 (moto, loopback) PUT 1 KiB / create-only PUT / HEAD / GET | {put * 1000:.1f} / "
            f"{create * 1000:.1f} / {head * 1000:.1f} / {lat['GET 1 KiB'] * 1000:.1f} ms |",
            f"| shard PUTs per save under one prefix | {puts} ({puts / 3500:.2f} s at 3,500 PUT/s per prefix) |",
            f"| commit critical path after the last rank's shards (flat) | exists HEAD {head * 1000:.0f} ms + "
            f"merge {m_med:.2f} s + encode {e_med:.2f} s + manifest PUT {create * 1000:.0f} ms "
            f"= {head + m_med + e_med + create:.2f} s |",
        ]
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        from _report import record

        record(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
