"""The sharded state the multi-process jobs save and load (tests/paddle_adapter/test_sharded.py,
tests/keras_adapter/test_group.py): global arrays cut into uneven blocks (NumPy and ckptcore only)."""

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


def rank_state(rank: int, world: int, *, template: bool):
    """Rank ``rank`` of ``world``: its blocks of the sharded tensors (zeros when ``template``),
    a replicated array, and its own RNG row."""
    import ckptcore

    def block(g):
        a, b = split(g.shape[0], world)[rank:rank + 2]
        data = np.zeros_like(g[a:b]) if template else np.ascontiguousarray(g[a:b])
        return ckptcore.Shard(data, g.shape, (a,) + (0,) * (g.ndim - 1))

    g = global_arrays()
    rng = np.random.default_rng(WORLD_RNG + rank).integers(0, 2**32, (1, 4), dtype=np.uint32)
    return ckptcore.TrainingState(
        model={"emb": block(g["emb"]), "head": g["head"]},  # head: replicated
        optimizer=ckptcore.OptimizerState("adamw", step=9, slots={
            "emb": {"moment1": block(g["m1"]), "moment2": block(g["m2"])}}),
        rng={"numpy_rank": ckptcore.Shard(np.zeros_like(rng) if template else rng,
                                          (world, 4), (rank, 0))},
        data={"epoch": 1, "position": 40}, step=9)


def check_rank_state(got, rank: int, world: int, saved_world: int) -> dict[str, bool]:
    """Which parts of a state loaded by rank ``rank`` of ``world`` (with the template of
    :func:`rank_state`) are bit for bit what ``saved_world`` ranks saved."""
    want = rank_state(rank, world, template=False)
    row = np.random.default_rng(WORLD_RNG + min(rank, saved_world - 1)).integers(
        0, 2**32, (1, 4), dtype=np.uint32)
    return {
        "emb": got.model["emb"].data.tobytes() == want.model["emb"].data.tobytes(),
        "emb_offsets": got.model["emb"].offsets == want.model["emb"].offsets,
        "head": got.model["head"].tobytes() == want.model["head"].tobytes(),
        "m1": got.optimizer.slots["emb"]["moment1"].data.tobytes()
        == want.optimizer.slots["emb"]["moment1"].data.tobytes(),
        "m2": got.optimizer.slots["emb"]["moment2"].data.tobytes()
        == want.optimizer.slots["emb"]["moment2"].data.tobytes(),
        "rest": (got.step, got.data) == (9, {"epoch": 1, "position": 40}),
        "rng": got.rng["numpy_rank"].data.tobytes() == row.tobytes(),
    }


def load_template(rank: int, world: int, saved_world: int):
    """What rank ``rank`` of ``world`` passes as ``like``: its blocks, and the RNG row of the
    saving rank of its number (the last one's where the saving job was smaller)."""
    import ckptcore

    like = rank_state(rank, world, template=True)
    like.rng = {"numpy_rank": ckptcore.Shard(np.zeros((1, 4), np.uint32), (saved_world, 4),
                                             (min(rank, saved_world - 1), 0))}
    return like
