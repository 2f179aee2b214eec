"""Optimizer states partitioned across ranks (ZeRO stage 1), mapped onto ``ckptcore.Shard``s.

``fleet.distributed_optimizer`` with ``sharding_degree > 1`` wraps the optimizer twice:
``HybridParallelOptimizer`` -> ``DygraphShardingOptimizer`` -> the user's optimizer (AdamW...).
The sharding layer assigns each parameter to one rank of the sharding group (``_param2rank``);
the inner optimizer of a rank holds accumulators for its own parameters only (its
``_parameter_list`` is that subset) and the updated parameters are broadcast, so the model's
weights stay replicated.  (Measured with Paddle 3.3 on CPU over gloo, 2 processes: rank 0's
inner AdamW held ``linear_0.w_0``'s four accumulators, rank 1's the other three parameters'.)

Every rank of a group save must encode the same tree, so each rank lists every parameter's
slots: its own as a ``Shard`` covering the whole slot, the others' as an empty ``Shard`` (a
block of zero rows) of the same global shape and dtype, learnt from the other ranks through
the group (ckptcore's own gather/broadcast of msgpack bytes: no pickle).  A group save then
writes each slot once, by its owner, and the checkpoint holds whole tensors, which any other
layout (another sharding degree, or no sharding) restores: a rank takes the slots of the
parameters it owns in the current run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ckptcore.adapter import knobs
from ckptcore.errors import CaptureError, RestoreError
from ckptcore.sharding import Shard
from ckptcore.state import OptimizerState

log = logging.getLogger("ckptcore")

_WRAPPERS = ("HybridParallelOptimizer",)  # wrappers that hold the real optimizer as _inner_opt
_SHARDING = ("DygraphShardingOptimizer",)
# Sharding optimizers that split a parameter's slots across ranks: their blocks are not whole
# tensors and need an offset map this adapter does not read yet; refused rather than guessed.
_SPLIT = ("DygraphShardingOptimizerV2",)


@dataclass(frozen=True)
class Sharding:
    """The sharding layer of a wrapped optimizer: this rank, the group's size and ranks, and the
    owning rank of every parameter (by its runtime name)."""

    rank: int
    size: int
    owner: dict[str, int]
    group: Any  # the paddle group of the sharding ranks


def unwrap_optimizer(opt: Any) -> tuple[Any, Sharding | None]:
    """The optimizer that holds the accumulators, and the sharding layer around it if any."""
    sharding = None
    seen = 0
    while opt is not None and seen < 8:  # wrappers nest a few deep at most
        seen += 1
        kind = type(opt).__name__
        if kind in _SPLIT:
            raise CaptureError(f"{kind} splits each parameter's optimizer states across ranks "
                               "(sharding stage 1 v2, split_param); ckptcore_paddle handles "
                               "DygraphShardingOptimizer (whole parameters per rank)")
        if kind in _SHARDING:
            hcg = opt._hcg
            sharding = Sharding(rank=int(opt._sharding_rank), size=int(opt._sharding_world_size),
                                owner={str(k): int(v) for k, v in opt._param2rank.items()},
                                group=hcg.get_sharding_parallel_group())
            opt = opt._inner_opt
            continue
        if kind in _WRAPPERS and getattr(opt, "_inner_opt", None) is not None:
            opt = opt._inner_opt
            continue
        break
    return opt, sharding


def _exchange(sharding: Sharding, mine: dict) -> list[dict]:
    """Every rank's ``mine`` (msgpack-able), on every rank, through ckptcore's group protocol."""
    from ._group import process_group

    group = process_group(sharding.group)
    timeout = knobs.group_timeout()
    packed = msgpack.packb(mine, use_bin_type=True)
    gathered = group.gather(packed, timeout=timeout)
    merged = msgpack.packb(gathered, use_bin_type=True) if group.rank == 0 else None
    return [msgpack.unpackb(x, raw=False) for x in
            msgpack.unpackb(group.broadcast(merged, timeout=timeout), raw=False)]


def shard_slots(state: OptimizerState, sharding: Sharding, runtime_to_struct: dict[str, str],
                order: list[str]) -> OptimizerState:
    """``state`` (this rank's own parameters' slots) as the same tree on every rank: each slot a
    ``Shard``, whole where this rank owns the parameter, empty elsewhere.  ``order``: the
    model's structured names, so that every rank lists them alike."""
    mine = {s: {slot: [list(a.shape), a.dtype.str] for slot, a in per.items()}
            for s, per in state.slots.items()}
    everyone = _exchange(sharding, mine)
    layout: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    for r, theirs in enumerate(everyone):
        for s, per in theirs.items():
            for slot, (shape, dtype) in per.items():
                prev = layout.setdefault(s, {}).setdefault(slot, (tuple(shape), dtype))
                if prev != (tuple(shape), dtype):
                    raise CaptureError(f"optimizer slot {s}/{slot}: rank {r} holds it as "
                                       f"{dtype}{list(shape)}, another rank as {prev[1]}{list(prev[0])}")
    slots: dict[str, dict[str, Any]] = {}
    for s in [s for s in order if s in layout] + sorted(set(layout) - set(order)):
        slots[s] = {}
        for slot in sorted(layout[s]):
            shape, dtype = layout[s][slot]
            if not shape:
                raise CaptureError(f"optimizer slot {s}/{slot} is a 0-d tensor; a sharded "
                                   "optimizer's slots need at least one dimension")
            own = state.slots.get(s, {}).get(slot)
            data = own if own is not None else np.empty((0, *shape[1:]), np.dtype(dtype))
            slots[s][slot] = Shard(np.ascontiguousarray(data), shape, (0,) * len(shape))
    struct_owner = {runtime_to_struct.get(p, p): r for p, r in sharding.owner.items()}
    extra = {**state.extra, "sharding": {"degree": sharding.size,
                                         "owner": {s: struct_owner[s] for s in order
                                                   if s in struct_owner}}}
    return OptimizerState(kind=state.kind, step=state.step, hyperparams=state.hyperparams,
                          slots=slots, extra=extra)


def whole_slots(state: OptimizerState, owned: set[str] | None) -> OptimizerState:
    """The slots a restore assigns: whole arrays (a ``Shard`` loaded with a template comes back as
    a block; only a whole one can be assigned), of the parameters this rank owns (``owned``;
    None: every parameter, an optimizer that is not sharded)."""
    slots: dict[str, dict[str, Any]] = {}
    for s, per in state.slots.items():
        if owned is not None and s not in owned:
            continue
        slots[s] = {}
        for slot, value in per.items():
            if isinstance(value, Shard):
                if value.shape != value.global_shape:
                    raise RestoreError(f"optimizer/{s}/{slot}: this rank loaded the block "
                                       f"{value!r}, but its optimizer holds the whole tensor; "
                                       "load without like= (or ask for the whole tensor)")
                value = value.data
            slots[s][slot] = value
    if owned is not None:
        log.debug("restore: a sharded optimizer takes the slots of its %d parameters of %d",
                  len(slots), len(state.slots))
    return OptimizerState(kind=state.kind, step=state.step, hyperparams=state.hyperparams,
                          slots=slots, extra=state.extra)


# ------------------------------------------------------------------ distributed tensors
#
# ``paddle.distributed.shard_tensor(t, mesh, placements)`` makes a tensor whose rank-local part
# (``_local_value()``) is a block of the global tensor: ``Shard(d)`` cuts tensor dimension d
# across a mesh dimension (Paddle's balanced split: the first ``n % k`` blocks one row longer),
# ``Replicate()`` copies it, ``Partial()`` holds a summand.  The block's place is what Paddle's
# own distributed save records (``compute_local_shape_and_global_offset``), so the same function
# places it here.  Verified on CPU with 2 gloo processes (Paddle 3.3): a (10, 3) tensor with
# ``[Shard(0)]`` on a mesh of 2 has local blocks of 5 rows at offsets 0 and 5.


def is_dist(t: Any) -> bool:
    is_dist_fn = getattr(t, "is_dist", None)
    return bool(is_dist_fn()) if callable(is_dist_fn) else False


def _local_box(t: Any, name: str) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """This rank's block of dist tensor ``t``: its shape, its offsets, and whether this rank is a
    replica (a non-zero coordinate along a mesh dimension that replicates it) rather than the
    one copy that is saved."""
    try:
        from paddle.distributed.flex_checkpoint.dcp.utils import compute_local_shape_and_global_offset
    except ImportError:  # Paddle before 3.1 kept it here
        from paddle.distributed.checkpoint.utils import compute_local_shape_and_global_offset
    import paddle.distributed as dist

    placements = list(t.placements)
    if any(p.is_partial() for p in placements):
        raise CaptureError(f"model/{name}: a Partial dist tensor holds a summand, not a block; "
                           "reshard it (dist.reshard to Replicate or Shard) before saving")
    if not t.shape:
        return (), (), dist.get_rank() != int(t.process_mesh.process_ids[0])
    mesh = t.process_mesh
    shape, offset = compute_local_shape_and_global_offset(list(t.shape), mesh, placements)
    if shape is None:
        raise CaptureError(f"model/{name}: this rank is outside the mesh of the dist tensor")
    grid = np.array(mesh.process_ids).reshape(mesh.shape)
    coord = np.argwhere(grid == dist.get_rank())[0]
    replica = any(coord[d] != 0 for d, p in enumerate(placements) if p.is_replicated())
    return tuple(int(x) for x in shape), tuple(int(x) for x in offset), replica


def dist_leaf(t: Any, name: str, copy: bool) -> Any:
    """Dist tensor ``t`` as a leaf: a plain array when every rank holds all of it, else this
    rank's block as a ``Shard`` (empty on replicas, so that each block is written once)."""
    from ._tensors import to_numpy

    local = to_numpy(t._local_value(), copy)
    if all(p.is_replicated() for p in t.placements):
        return local
    shape, offset, replica = _local_box(t, name)
    if replica:
        local = np.empty((0, *local.shape[1:]), local.dtype)
    return Shard(np.ascontiguousarray(local), tuple(int(d) for d in t.shape), offset)


def dist_block(t: Any, name: str, value: Any) -> np.ndarray:
    """The part of a saved ``value`` that dist tensor ``t`` holds on this rank: the block of a
    whole array, or a loaded ``Shard`` that is exactly this rank's block."""
    gshape = tuple(int(d) for d in t.shape)
    if all(p.is_replicated() for p in t.placements):
        shape, offset = gshape, (0,) * len(gshape)
    else:
        shape, offset, _ = _local_box(t, name)
    if isinstance(value, Shard):
        if value.global_shape != gshape or value.offsets != offset or value.shape != shape:
            raise RestoreError(f"model/{name}: loaded {value!r}, but this rank holds the block of "
                               f"shape {list(shape)} at {list(offset)} of {list(gshape)}")
        return value.data
    value = np.asarray(value)
    if value.shape != gshape:
        raise RestoreError(f"model/{name}: the checkpoint holds {value.dtype}{list(value.shape)}, "
                           f"the dist tensor is {list(gshape)}")
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
