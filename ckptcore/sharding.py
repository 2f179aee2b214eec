"""``Shard``: this process's block of a larger array, the leaf of a sharded training state.

A ``TrainingState`` may mix plain arrays (replicated: the same on every rank) and ``Shard``s
(each rank holds a different block of one global array).  A block is the box
``offsets[d] <= i[d] < offsets[d] + data.shape[d]`` of an array of ``global_shape``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Shard", "Chunks"]


def _dims(value: Any, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(value)
    except TypeError:
        raise TypeError(f"Shard: {what} must be a sequence of ints, got {value!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"Shard: {what} must hold non-negative ints, got {value!r}")
    return tuple(int(d) for d in dims)


@dataclass(frozen=True, eq=False)
class Shard:
    """``data``: this block (a NumPy array); ``global_shape``: the whole array's shape;
    ``offsets``: where the block starts in every dimension.  Frozen: a shard's place in the
    global array never changes; its ``data`` is an ordinary (mutable) array."""

    data: np.ndarray
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.data, np.ndarray):
            raise TypeError(f"Shard: data must be a numpy.ndarray, got {type(self.data).__name__}")
        shape = _dims(self.global_shape, "global_shape")
        offsets = _dims(self.offsets, "offsets")
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offsets", offsets)
        if not (len(shape) == len(offsets) == self.data.ndim):
            raise ValueError(f"Shard: data has {self.data.ndim} dimensions, global_shape "
                             f"{shape} and offsets {offsets} must have as many")
        for d, (o, n, g) in enumerate(zip(offsets, self.data.shape, shape)):
            if o + n > g:
                raise ValueError(f"Shard: dimension {d}: block [{o}, {o + n}) lies outside the "
                                 f"global shape {shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's own shape (``data.shape``)."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def index(self) -> tuple[slice, ...]:
        """The block's place in the global array, as an index: ``whole[shard.index()]``."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.data.shape))

    def __repr__(self) -> str:
        return (f"Shard({self.data.dtype}{list(self.data.shape)} at {list(self.offsets)} of "
                f"{list(self.global_shape)})")


@dataclass(frozen=True, eq=False)
class Chunks:
    """Several blocks of one global array held by this process (``parts``: ``Shard``s of the
    same global shape and dtype, not overlapping): a leaf saved as one logical tensor with a
    chunk per part, and a template leaf asking a load for several blocks at once."""

    parts: tuple[Shard, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        object.__setattr__(self, "parts", parts)
        if not parts or not all(isinstance(p, Shard) for p in parts):
            raise TypeError("Chunks: parts must be one or more ckptcore.Shard")
        first = parts[0]
        for p in parts[1:]:
            if p.global_shape != first.global_shape or p.dtype != first.dtype:
                raise ValueError(f"Chunks: parts of one array must share its global shape and "
                                 f"dtype; {first!r} and {p!r} do not")

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.parts[0].global_shape

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    def __repr__(self) -> str:
        return f"Chunks({', '.join(map(repr, self.parts))})"
