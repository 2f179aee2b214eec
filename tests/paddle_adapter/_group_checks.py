"""Checks of the ckptcore.ProcessGroup protocol that any group must pass, written once so that
the same calls run on ckptcore.ThreadGroup (the reference), on ckptcore_paddle.process_group()
and on any other engine's group: ``check_protocol(group)`` is called on every rank at once and
returns named booleans (each rank's own view; rank 0 also checks what it gathered)."""

from __future__ import annotations

import hashlib

import ckptcore


def payloads(rank: int) -> list[bytes]:
    """What ``rank`` contributes: empty, unequal small lengths, zeros, and over 1 MB (unequal)."""
    return [b"", bytes([rank % 256]) * (rank * 1000 + 1), b"\x00" * 7,
            bytes(range(256)) * (4096 * (rank + 1)) + b"tail%d" % rank]


def broadcasts() -> list[bytes]:
    return [b"", b"zero", b"\x00\xff" * 3, bytes(range(256)) * 4096 + b"end"]


def check_protocol(group: ckptcore.ProcessGroup, *, timeout: float = 30.0,
                   rounds: int = 20) -> dict[str, bool]:
    rank, size = group.rank, group.size
    out = {"is_protocol": isinstance(group, ckptcore.ProcessGroup),
           "rank_and_size": isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size}
    gather_ok, none_elsewhere = True, True
    for i in range(len(payloads(0))):
        got = group.gather(payloads(rank)[i], timeout=timeout)
        if rank == 0:
            gather_ok &= got == [payloads(r)[i] for r in range(size)]
        else:
            none_elsewhere &= got is None
    out["gather_exact"], out["gather_none_elsewhere"] = gather_ok, none_elsewhere
    out["broadcast_exact"] = all(
        group.broadcast(b if rank == 0 else None, timeout=timeout) == b for b in broadcasts())
    out["barrier"] = group.barrier(timeout=timeout) is None
    # Many rounds, each depending on the one before: rank 0 broadcasts a digest of what it
    # gathered, so a round answered out of order or mixed with another shows on every rank.
    digest, ordered = b"start", True
    for i in range(rounds):
        mine = b"%d:%d:" % (rank, i) + digest
        got = group.gather(mine, timeout=timeout)
        if rank == 0:
            ordered &= got == [b"%d:%d:" % (r, i) + digest for r in range(size)]
            news = hashlib.sha256(b"|".join(got)).digest()
        else:
            news = None
        digest = group.broadcast(news, timeout=timeout)
        if i % 5 == 4:
            group.barrier(timeout=timeout)
    out["rounds_in_order"] = ordered
    # The final digest must be the same on every rank: gather it and compare on rank 0.
    finals = group.gather(digest, timeout=timeout)
    out["same_digest_everywhere"] = finals is None or len(set(finals)) == 1
    return out
