"""Random-number state across frameworks: carried where portable, reseeded where not.

Python's ``random`` and NumPy's global state (and NumPy generators) are the same in every process,
so they are carried as they are.  A framework's own generators use their own algorithms and state,
so no state of one can be expressed in another.  They are *reseeded deterministically*: a 31-bit
seed is derived from a SHA-256 of the source's non-portable generator states and the step, and the
target dialect's :meth:`~.dialect.Dialect.rng_from_seed` gives the state that seeding its
generators with it would leave.  Converting the same checkpoint twice therefore gives the same
continued run, but its dropout masks and random augmentations differ from the ones the source
framework would have drawn.

:func:`mt19937_64_text` is a helper for dialects whose framework keeps a C++ ``std::mt19937_64``
engine seeded through ``std::seed_seq``; :func:`mt19937_state` for a 32-bit ``std::mt19937``
seeded with one integer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from .dialect import Dialect

__all__ = ["derive_seed", "convert_rng", "mt19937_64_text", "mt19937_state", "PORTABLE"]

PORTABLE = ("python", "numpy", "numpy_generators")
_M32 = 0xFFFFFFFF


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, bytes):
        return x.hex()
    return x


def derive_seed(rng: dict[str, Any], step: int, salt: str = "") -> int:
    """A 31-bit seed that depends only on the non-portable generator states, ``step`` and ``salt``."""
    own = {k: v for k, v in (rng or {}).items() if k not in PORTABLE}
    blob = json.dumps({"rng": _jsonable(own), "step": int(step), "salt": salt}, sort_keys=True)
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "little") & 0x7FFFFFFF


def _seed_seq(values: list[int], n: int) -> list[int]:
    """C++11 ``std::seed_seq::generate`` ([rand.util.seedseq]) into ``n`` 32-bit words."""
    b = [0x8B8B8B8B] * n
    s = len(values)
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p, m = (n - t) // 2, max(s + 1, n)
    q = p + t

    def mix(x: int) -> int:
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * mix(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n])) & _M32
        r2 = (r1 + (s if k == 0 else (k % n + values[k - 1] if k <= s else k % n))) & _M32
        b[(k + p) % n] = (b[(k + p) % n] + r1) & _M32
        b[(k + q) % n] = (b[(k + q) % n] + r2) & _M32
        b[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * mix((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & _M32)) & _M32
        r4 = (r3 - k % n) & _M32
        b[(k + p) % n] ^= r3
        b[(k + q) % n] ^= r4
        b[k % n] = r4
    return b


def mt19937_64_text(seed: int) -> str:
    """The text form of ``std::mt19937_64`` seeded with ``std::seed_seq{seed}`` (312 words + index)."""
    words = _seed_seq([seed & _M32], 624)
    state = [words[2 * i] | (words[2 * i + 1] << 32) for i in range(312)]
    return " ".join(map(str, state)) + " 312"


def mt19937_state(seed: int) -> list[int]:
    """The 624 words of a 32-bit ``std::mt19937`` constructed with ``seed`` (the reference
    ``init_genrand``: ``x[i] = 1812433253·(x[i-1] ^ (x[i-1] >> 30)) + i``), before any draw."""
    words = [seed & _M32]
    for i in range(1, 624):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & _M32)
    return words


def convert_rng(rng: dict[str, Any], to: Dialect, step: int) -> dict[str, Any]:
    """``rng`` for dialect ``to``: portable entries as they are, the framework's own reseeded."""
    out = {k: v for k, v in (rng or {}).items() if k in PORTABLE}
    out.update(to.rng_from_seed(derive_seed(rng, step)))
    return out
