"""Comparing two checkpoints tensor by tensor, checksums first.

Both manifests carry every tensor's dtype, shape, length and CRC-32C, so most of a comparison
needs no tensor data at all: only tensors whose checksums differ are read, to say by how much
they differ.  (Equal checksums are taken as equal contents: the chance that two different
tensors of one name, dtype and shape collide is about 2**-32 per tensor.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from . import _io, api
from ._storage import Store

__all__ = ["diff", "CheckpointDiff", "TensorDiff"]


@dataclass(frozen=True)
class TensorDiff:
    """One tensor that differs between checkpoints A and B.

    Attributes:
        name: The tensor's name (``model/dense/kernel``).
        change: ``"only_in_a"``, ``"only_in_b"``, ``"type"`` (dtype or shape differ) or
            ``"values"`` (same dtype and shape, different contents).
        a, b: ``dtype[shape]`` on each side, None on the side that lacks the tensor.
        max_abs_diff: For ``"values"``: the largest absolute difference (float64), None when the
            dtype is not numeric.
    """

    name: str
    change: str
    a: str | None = None
    b: str | None = None
    max_abs_diff: float | None = None

    def describe(self) -> str:
        """One line, as ``ckpt diff`` prints it."""
        if self.change == "only_in_a":
            return f"- {self.name}  (only in A)"
        if self.change == "only_in_b":
            return f"+ {self.name}  (only in B)"
        if self.change == "type":
            return f"~ {self.name}  {self.a} vs {self.b}"
        shown = "n/a (non-numeric)" if self.max_abs_diff is None else f"{self.max_abs_diff:.6g}"
        return f"~ {self.name}  max abs diff {shown}"


@dataclass(frozen=True)
class CheckpointDiff:
    """The result of :func:`diff`.

    Attributes:
        a, b: The two checkpoints' URLs.
        differences: The tensors that differ, by name.
        same: Names of the tensors equal in both (by dtype, shape and checksum).
        read: Names of the tensors whose data was read (those whose checksums differ).
    """

    a: str
    b: str
    differences: tuple[TensorDiff, ...]
    same: tuple[str, ...]
    read: tuple[str, ...]

    @property
    def total(self) -> int:
        """How many tensor names the two checkpoints have between them."""
        return len(self.differences) + len(self.same)

    @property
    def equal(self) -> bool:
        return not self.differences


def _keys(m: Any) -> dict[str, int]:
    """Row index by key: the tensor's name, or for a chunk of a tensor stored in several chunks
    (format 3) ``name@[start]``, so every chunk is compared, not only the last of a name."""
    table = m.tensors
    names = [t.name for t in m.tensors]
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    out: dict[str, int] = {}
    for i, n in enumerate(names):
        start = table.chunk_start(i) if hasattr(table, "chunk_start") else ()
        out[f"{n}@{list(start)}" if seen[n] > 1 or any(start) else n] = i
    return out


def _spec(t: Any) -> str:
    return f"{t.dtype}{list(t.shape)}"


def diff(a: str | os.PathLike, b: str | os.PathLike, *,
         storage_options: Mapping[str, Any] | None = None) -> CheckpointDiff:
    """Compare the tensors of checkpoints ``a`` and ``b``, reading only those whose checksums differ.

    Example:
        >>> d = ckptcore.diff("run/step-000000000100", "run/step-000000000200")  # doctest: +SKIP
        >>> [t.name for t in d.differences]                                       # doctest: +SKIP

    Raises:
        CheckpointNotFoundError: nothing committed at ``a`` or ``b``.
        CorruptCheckpointError: a tensor that had to be read fails its checksum.
    """
    options = dict(storage_options or {})
    stores = [Store(os.fspath(u), options) for u in (a, b)]
    manifests = [api.read_manifest(s) for s in stores]
    index = [_keys(m) for m in manifests]
    differences: list[TensorDiff] = []
    same: list[str] = []
    changed: list[str] = []
    for name in sorted(set(index[0]) | set(index[1])):
        if name not in index[1]:
            differences.append(TensorDiff(name, "only_in_a", a=_spec(manifests[0].tensors[index[0][name]])))
            continue
        if name not in index[0]:
            differences.append(TensorDiff(name, "only_in_b", b=_spec(manifests[1].tensors[index[1][name]])))
            continue
        ta, tb = manifests[0].tensors[index[0][name]], manifests[1].tensors[index[1][name]]
        if ta.dtype != tb.dtype or tuple(ta.shape) != tuple(tb.shape):
            differences.append(TensorDiff(name, "type", a=_spec(ta), b=_spec(tb)))
        elif ta.length != tb.length or ta.checksum != tb.checksum:
            changed.append(name)
        else:
            same.append(name)
    if changed:
        # Each side's changed tensors in one read (verified: a damaged tensor is an error, not a diff).
        arrays = [_io.read_tensors(s, m, [ix[n] for n in changed], verify=True)
                  for s, m, ix in zip(stores, manifests, index)]
        for name in changed:
            x, y = arrays[0][index[0][name]], arrays[1][index[1][name]]
            t = manifests[0].tensors[index[0][name]]
            differences.append(TensorDiff(name, "values", a=_spec(t), b=_spec(t),
                                          max_abs_diff=_max_abs_diff(x, y)))
        differences.sort(key=lambda d: d.name)
    return CheckpointDiff(a=stores[0].url, b=stores[1].url, differences=tuple(differences),
                          same=tuple(same), read=tuple(changed))


def _max_abs_diff(x: np.ndarray, y: np.ndarray) -> float | None:
    try:
        return float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
    except (TypeError, ValueError):
        return None
