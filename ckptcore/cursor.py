"""DataCursor: the exact, framework-neutral position of a run in its data.

A cursor walks a dataset of ``num_samples`` samples in global batches of
``batch_size`` sample indices.  Its whole state is three integers (``seed``,
``epoch``, ``position``) plus the configuration, so saving it is free and
resuming is O(1): nothing is replayed.

The order of an epoch
---------------------
The order of epoch ``e`` is the permutation ``i -> P(seed, e, i)`` of
``range(n)`` defined below.  It depends on nothing else (not the numpy version,
the machine or the framework), and any position of it costs O(1) to compute,
so it is never materialised.  With ``shuffle=False`` the order is the identity.
All arithmetic is on unsigned 64-bit integers modulo 2**64; ``>>``/``<<`` are
logical shifts, ``^`` xor, ``&`` and, ``|`` or.

1. ``mix64(z)`` is the splitmix64 output function (Steele, Lea & Flood 2014)::

       z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
       z = (z ^ (z >> 27)) * 0x94D049BB133111EB
       return z ^ (z >> 31)

2. Round keys, with ``G = 0x9E3779B97F4A7C15``::

       h = mix64(seed + G)
       h = mix64(h + epoch + G)
       key[r] = mix64(h + (r + 1) * G)        for r = 0 .. 5

   (``key`` are the first six outputs of splitmix64 started at state ``h``.)

3. The domain is ``w`` bits, ``w = bit_length(n - 1)``: the smallest power of
   two ``2**w >= n``.  One Feistel round ``r`` splits a ``w``-bit value ``x``
   into a high part ``L`` and a low part ``R`` of ``b`` bits, where
   ``b = w // 2`` for even ``r`` and ``b = w - w // 2`` for odd ``r``
   (``a = w - b``)::

       L = x >> b;  R = x & (2**b - 1)
       x = (R << a) | (L ^ (mix64(R ^ key[r]) & (2**a - 1)))

   Each round is a bijection of ``range(2**w)`` (an unbalanced Feistel round
   whose halves swap widths), so six rounds ``F = round5 o ... o round0`` are too.

4. Cycle walking maps ``F`` back into ``range(n)``::

       y = F(i);  while y >= n: y = F(y);  P(seed, e, i) = y

   The walk ends because ``i < n`` lies on ``F``'s cycle through ``y``; since
   ``2**w < 2 n`` it takes under two applications of ``F`` on average.

``tests/test_cursor.py`` pins the first orders of a few ``(seed, n)`` pairs and
``mix64`` against the reference splitmix64 output, so the order cannot change
silently.  ``docs/CURSOR.md`` restates this for other implementations.

Batches, epochs and saving
--------------------------
``position`` counts the samples of epoch ``epoch`` already handed out.  At rest
it is always a multiple of ``batch_size`` and before the end of the epoch:
:meth:`DataCursor.next_batch` rolls over to ``(epoch + 1, 0)`` as soon as it
hands out the epoch's last batch (with ``drop_last=True``, the last full one).
A cursor advances when it hands a batch out; save after the step that
consumed it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

import numpy as np

from .errors import SchemaError

__all__ = ["DataCursor", "CursorShard"]

KIND = "ckptcore.DataCursor"
VERSION = 1
ROUNDS = 6

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_U = np.uint64
_S30, _S27, _S31, _UC1, _UC2 = _U(30), _U(27), _U(31), _U(_C1), _U(_C2)
# Below this many unfinished cycle walks, pure-Python ints beat numpy's per-call overhead.
_SCALAR_TAIL = 16


def _mix64(z: int) -> int:
    """splitmix64's output function on a Python int in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


@lru_cache(maxsize=64)
def _plan(seed: int, epoch: int, width: int) -> tuple[tuple[int, ...], ...]:
    """Per round: (b, R mask, key, output mask, a) as Python ints, then as numpy uint64."""
    h = _mix64((seed + _GOLDEN) & _M64)
    h = _mix64((h + epoch + _GOLDEN) & _M64)
    rounds = []
    for r in range(ROUNDS):
        key = _mix64((h + (r + 1) * _GOLDEN) & _M64)
        b = width // 2 if r % 2 == 0 else width - width // 2
        a = width - b
        ints = (b, (1 << b) - 1, key, (1 << a) - 1, a)
        rounds.append(ints + tuple(_U(v) for v in ints))
    return tuple(rounds)


def _feistel_int(x: int, plan: tuple[tuple[int, ...], ...]) -> int:
    for b, mask_b, key, mask_a, a, *_ in plan:
        right = x & mask_b
        f = _mix64(right ^ key) & mask_a
        x = (right << a) | ((x >> b) ^ f)
    return x


def _feistel_array(x: np.ndarray, plan: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """The same rounds as ``_feistel_int`` on a uint64 array, in place."""
    for *_, b, mask_b, key, mask_a, a in plan:
        left = x >> b
        x &= mask_b
        z = x ^ key
        z ^= z >> _S30
        z *= _UC1
        z ^= z >> _S27
        z *= _UC2
        z ^= z >> _S31
        z &= mask_a
        z ^= left
        x <<= a
        x |= z
    return x


def _permute(x: np.ndarray, n: int, plan: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Cycle-walk every element of ``x`` (uint64, all < n) into range(n)."""
    out = _feistel_array(x, plan)
    todo = np.flatnonzero(out >= n)
    while todo.size > _SCALAR_TAIL:
        y = _feistel_array(out[todo], plan)
        out[todo] = y
        todo = todo[y >= n]
    for i in todo.tolist():
        y = int(out[i])
        while y >= n:
            y = _feistel_int(y, plan)
        out[i] = y
    return out


def _as_int(value: Any, name: str, *, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


class DataCursor:
    """A deterministic, resumable sampler over ``num_samples`` samples.

    Args:
        num_samples: Dataset size (>= 1).
        batch_size: Global batch size: samples per step over all ranks.
        seed: Shuffle seed, an int in [0, 2**64).
        shuffle: If False every epoch is ``0, 1, ..., num_samples - 1``.
        drop_last: Skip each epoch's final partial batch.

    Iterating a cursor (``for batch in cursor`` or :meth:`iter_epoch`) yields
    the rest of the current epoch as int64 index arrays, then stops with the
    cursor already at the next epoch; ``len(cursor)`` is the full epoch's
    batch count, as framework samplers report it.

    Example:
        >>> cursor = DataCursor(10, 4, seed=1)
        >>> [len(b) for b in cursor], cursor.epoch, cursor.position
        ([4, 4, 2], 1, 0)
        >>> saved = cursor.state_dict()
        >>> first = cursor.next_batch()
        >>> resumed = DataCursor.from_state(saved)
        >>> bool((resumed.next_batch() == first).all())
        True
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        self.num_samples = _as_int(num_samples, "num_samples", low=1, high=2**63 - 1)
        self.batch_size = _as_int(batch_size, "batch_size", low=1)
        self.seed = _as_int(seed, "seed", high=_M64)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.batch_size > self.num_samples:
            raise ValueError(f"drop_last=True with batch_size {self.batch_size} > num_samples "
                             f"{self.num_samples} leaves no batch at all; lower the batch size "
                             "or pass drop_last=False")
        self.epoch = 0
        self.position = 0

    # -- the order -------------------------------------------------------------------

    def index_at(self, epoch: int, i: int) -> int:
        """The sample at place ``i`` of epoch ``epoch``'s order, in O(1).

        Example:
            >>> DataCursor(10, 4, shuffle=False).index_at(3, 7)
            7
        """
        epoch = _as_int(epoch, "epoch")
        i = _as_int(i, "i", high=self.num_samples - 1)
        if not self.shuffle:
            return i
        plan = _plan(self.seed, epoch, (self.num_samples - 1).bit_length())
        y = _feistel_int(i, plan)
        while y >= self.num_samples:
            y = _feistel_int(y, plan)
        return y

    def indices(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Places ``start:stop`` of epoch ``epoch``'s order as an int64 array (vectorized).

        Example:
            >>> c = DataCursor(10, 4, seed=3)
            >>> bool((c.indices(0, 2, 5) == [c.index_at(0, i) for i in range(2, 5)]).all())
            True
        """
        epoch = _as_int(epoch, "epoch")
        start = _as_int(start, "start", high=self.num_samples)
        stop = _as_int(stop, "stop", low=start, high=self.num_samples)
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        plan = _plan(self.seed, epoch, (self.num_samples - 1).bit_length())
        places = np.arange(start, stop, dtype=np.uint64)
        return _permute(places, self.num_samples, plan).astype(np.int64)

    # -- iteration ----------------------------------------------------------------------

    @property
    def samples_per_epoch(self) -> int:
        """Samples handed out per epoch (fewer than ``num_samples`` with ``drop_last``)."""
        if self.drop_last:
            return self.num_samples - self.num_samples % self.batch_size
        return self.num_samples

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one full epoch."""
        return -(-self.samples_per_epoch // self.batch_size)

    @property
    def steps_remaining_in_epoch(self) -> int:
        """Global batches left before the cursor rolls over to the next epoch."""
        return self.batches_per_epoch - self.position // self.batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _take(self, lo: int, hi: int) -> np.ndarray:
        """Places ``lo:hi`` of the next global batch (relative to it), then advance past the batch."""
        start = self.position
        stop = min(start + self.batch_size, self.samples_per_epoch)
        batch = self.indices(self.epoch, start + min(lo, stop - start), start + min(hi, stop - start))
        self.position = stop
        if stop >= self.samples_per_epoch:
            self.epoch += 1
            self.position = 0
        return batch

    def next_batch(self) -> np.ndarray:
        """The next global batch of sample indices (int64); advances, rolling over at epoch end.

        Example:
            >>> DataCursor(5, 2, shuffle=False).next_batch()
            array([0, 1])
        """
        return self._take(0, self.batch_size)

    def iter_epoch(self) -> Iterator[np.ndarray]:
        """Yield the remaining batches of the current epoch; afterwards the cursor is at the next one.

        Example:
            >>> c = DataCursor(5, 2, shuffle=False)
            >>> [b.tolist() for b in c.iter_epoch()], c.epoch
            ([[0, 1], [2, 3], [4]], 1)
        """
        return _epoch_iter(self.next_batch, self, self.epoch)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_epoch()

    def shard(self, rank: int, world_size: int) -> CursorShard:
        """A view yielding rank ``rank``'s part of every global batch (see :class:`CursorShard`).

        Example:
            >>> c = DataCursor(8, 4, shuffle=False)
            >>> c.shard(1, 2).next_batch()
            array([2, 3])
        """
        return CursorShard(self, rank, world_size)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor as plain Python ints and bools; see ``docs/CURSOR.md`` for the format.

        Example:
            >>> DataCursor(10, 4, seed=7).state_dict()["seed"]
            7
        """
        return {"kind": KIND, "version": VERSION, "seed": self.seed, "epoch": self.epoch,
                "position": self.position, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state`` in O(1): take its seed, epoch and position.

        Raises:
            SchemaError: ``state`` is malformed (the message names the field).
            ValueError: ``state`` describes another dataset or batching
                (``num_samples``, ``batch_size``, ``shuffle`` or ``drop_last`` differ).

        Example:
            >>> a = DataCursor(10, 2, seed=5); _ = a.next_batch()
            >>> b = DataCursor(10, 2); b.load_state_dict(a.state_dict()); (b.seed, b.position)
            (5, 2)
        """
        parsed = _parse_state(state)
        for name in ("num_samples", "batch_size", "shuffle", "drop_last"):
            if parsed[name] != getattr(self, name):
                raise ValueError(
                    f"saved cursor has {name}={parsed[name]!r} but this cursor has "
                    f"{getattr(self, name)!r}: resuming would walk a different dataset or "
                    "batching; build the cursor with the saved settings or use DataCursor.from_state")
        self.seed, self.epoch, self.position = parsed["seed"], parsed["epoch"], parsed["position"]
        if self.position >= self.samples_per_epoch:  # saved at the very end of an epoch
            self.epoch, self.position = self.epoch + 1, 0

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataCursor:
        """A cursor built from a :meth:`state_dict`.

        Example:
            >>> DataCursor.from_state(DataCursor(10, 4, seed=2).state_dict())
            DataCursor(epoch=0, position=0/10, seed=2, batch_size=4, shuffle=True, drop_last=False)
        """
        parsed = _parse_state(state)
        try:
            cursor = cls(parsed["num_samples"], parsed["batch_size"], seed=parsed["seed"],
                         shuffle=parsed["shuffle"], drop_last=parsed["drop_last"])
        except ValueError as e:
            raise SchemaError(f"inconsistent DataCursor state: {e}") from e
        cursor.load_state_dict(parsed)
        return cursor

    def __repr__(self) -> str:
        return (f"DataCursor(epoch={self.epoch}, position={self.position}/{self.num_samples}, "
                f"seed={self.seed}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last})")


def _epoch_iter(take: Any, cursor: DataCursor, epoch: int) -> Iterator[np.ndarray]:
    # ``epoch`` is bound when iteration is requested, not at the first ``next()``.
    while cursor.epoch == epoch:
        yield take()


_INT_FIELDS = {"seed": (0, _M64), "epoch": (0, 2**63 - 1), "position": (0, 2**63 - 1),
               "num_samples": (1, 2**63 - 1), "batch_size": (1, 2**63 - 1)}
_BOOL_FIELDS = ("shuffle", "drop_last")


def _parse_state(state: Any) -> dict[str, Any]:
    """Validate a saved cursor state; SchemaError names the first bad field."""
    if not isinstance(state, Mapping):
        raise SchemaError(f"DataCursor state must be a mapping, got {type(state).__name__}")
    expected = {"kind", "version", *_INT_FIELDS, *_BOOL_FIELDS}
    missing, unknown = expected - state.keys(), state.keys() - expected
    if missing or unknown:
        what = "missing" if missing else "unknown"
        fields = ", ".join(repr(f) for f in sorted(missing or unknown, key=str))
        raise SchemaError(f"DataCursor state: {what} field(s) {fields}")
    if state["kind"] != KIND:
        raise SchemaError(f"DataCursor state: field 'kind' is {state['kind']!r}, expected {KIND!r}")
    if state["version"] != VERSION or isinstance(state["version"], bool):
        raise SchemaError(f"DataCursor state: field 'version' is {state['version']!r}; this "
                          f"ckptcore reads version {VERSION} (a newer ckptcore may read it)")
    parsed: dict[str, Any] = {"kind": KIND, "version": VERSION}
    for name, (low, high) in _INT_FIELDS.items():
        try:
            parsed[name] = _as_int(state[name], name, low=low, high=high)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"DataCursor state: field {name!r}: {e}") from e
    for name in _BOOL_FIELDS:
        if not isinstance(state[name], (bool, np.bool_)):
            raise SchemaError(f"DataCursor state: field {name!r} must be a bool, "
                              f"got {type(state[name]).__name__}")
        parsed[name] = bool(state[name])
    position, n, bs = parsed["position"], parsed["num_samples"], parsed["batch_size"]
    if position > n or (position % bs and position != n):
        raise SchemaError(f"DataCursor state: field 'position' ({position}) must be a multiple of "
                          f"batch_size ({bs}) no larger than num_samples ({n})")
    return parsed


class CursorShard:
    """Rank ``rank``'s view of a :class:`DataCursor` for data-parallel training.

    Every global batch is split as ``np.array_split(batch, world_size)[rank]``
    (the first ``len(batch) % world_size`` ranks get one sample more; a rank
    may get none when the batch is smaller than the world).  Taking a batch
    advances the underlying cursor's *global* position, so each process holds
    its own cursor and one view of it, and all ranks advance in step.
    ``state_dict()`` is the cursor's: saved positions are always at global-batch
    boundaries, so a state saved with any world size resumes under any other
    (elastic resume) at exactly the same global sample, with nothing to fix.

    Example:
        >>> views = [DataCursor(6, 4, shuffle=False).shard(r, 3) for r in range(3)]
        >>> [v.next_batch().tolist() for v in views]
        [[0, 1], [2], [3]]
    """

    def __init__(self, cursor: DataCursor, rank: int, world_size: int):
        self.world_size = _as_int(world_size, "world_size", low=1)
        self.rank = _as_int(rank, "rank", high=self.world_size - 1)
        self.cursor = cursor

    def next_batch(self) -> np.ndarray:
        """This rank's part of the next global batch; advances the global position."""
        c = self.cursor
        size = min(c.batch_size, c.samples_per_epoch - c.position)
        q, extra = divmod(size, self.world_size)
        lo = self.rank * q + min(self.rank, extra)  # np.array_split's boundaries
        return c._take(lo, lo + q + (self.rank < extra))

    def iter_epoch(self) -> Iterator[np.ndarray]:
        """Yield this rank's parts of the remaining batches of the current epoch."""
        return _epoch_iter(self.next_batch, self.cursor, self.cursor.epoch)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_epoch()

    def __len__(self) -> int:
        return self.cursor.batches_per_epoch

    @property
    def steps_remaining_in_epoch(self) -> int:
        return self.cursor.steps_remaining_in_epoch

    def state_dict(self) -> dict[str, Any]:
        """The global cursor state (identical on every rank)."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a global cursor state saved under any world size."""
        self.cursor.load_state_dict(state)

    def __repr__(self) -> str:
        return f"CursorShard(rank={self.rank}, world_size={self.world_size}, cursor={self.cursor!r})"
