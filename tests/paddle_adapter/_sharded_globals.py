"""The global arrays the sharded jobs of test_sharded.py cut into blocks (NumPy only)."""

from __future__ import annotations

import numpy as np

WORLD_RNG = 500  # seed of rank r's RNG row: WORLD_RNG + r


def global_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {"emb": rng.standard_normal((103, 7)).astype(np.float32),
            "head": rng.standard_normal((7, 5)).astype(np.float32),
            "m1": rng.standard_normal((103, 7)).astype(np.float32),
            "m2": rng.random((103, 7)).astype(np.float64)}


def split(n: int, parts: int) -> list[int]:
    """Uneven bounds of ``n`` rows among ``parts`` ranks (numpy's array_split sizes)."""
    sizes = [len(a) for a in np.array_split(np.arange(n), parts)]
    return [0, *np.cumsum(sizes).tolist()]
