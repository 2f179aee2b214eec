"""Distributed tensors (``DTensor``: FSDP2's ``fully_shard``, ``distribute_tensor``) as ``ckptcore.Shard``s.

A ``DTensor`` holds, on each rank, the block of a global tensor that its placements give it over
its ``DeviceMesh``: ``Shard(d)`` cuts tensor dimension d across a mesh dimension (torch's split is
``torch.chunk``'s: blocks of ``ceil(n / k)`` rows, the last ones shorter or empty), ``Replicate()``
copies it, ``Partial()`` holds a summand.  FSDP2 shards every parameter, and the optimizer's
states of it (Adam's ``exp_avg``...), as ``Shard(0)`` over its mesh (HSDP: ``(Replicate(),
Shard(0))`` over a 2-D mesh).  Measured with torch 2.13 on CPU over gloo, 2 processes: a (7, 5)
Linear weight under ``fully_shard`` holds 4 rows on rank 0 and 3 on rank 1, and so do its
``exp_avg``/``exp_avg_sq``; Adam's ``step`` stays a plain 0-d tensor.

Capture (:func:`dtensor_leaf`): a DTensor replicated on every mesh dimension is a plain array
(the same on every rank: ckptcore's group save spreads its writing over the ranks); otherwise this
rank's block as a ``Shard`` with its global offsets, which torch computes itself
(``DTensor.__create_chunk_list__``, the protocol of ``torch.distributed.checkpoint``).  A rank
that is a replica of a block (a non-zero coordinate along a mesh dimension that replicates it)
contributes an empty ``Shard``, so that each block is written once.  Every rank of a group save
must encode the same tree, which FSDP2 gives: every rank holds every parameter's DTensor.

Restore (:func:`dtensor_block`): whatever world size and mesh saved the checkpoint, a rank takes
the block of the global tensor its live DTensor holds now: from a whole array (a load without
``like=``, or a single process's checkpoint), or from a ``Shard`` loaded with ``like=``
(:func:`dtensor_template` builds that rank's request, so it reads only its own bytes).

Placements other than ``Shard``/``Replicate`` are refused: ``Partial`` (a summand, not a block)
and ``_StridedShard`` (FSDP2 over tensor parallelism, whose local rows are not one box).

Not imported by ``import ckptcore_torch``; importing it imports nothing from torch either (the
DTensor class is looked up when a tensor is examined).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptcore.errors import CaptureError, RestoreError
from ckptcore.sharding import Shard

__all__ = ["is_dtensor", "dtensor_leaf", "dtensor_template", "dtensor_block", "local_tensor"]


def is_dtensor(t: Any) -> bool:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (checked by class name first, so that a
    plain tensor never imports ``torch.distributed``)."""
    if not any(c.__name__ == "DTensor" for c in type(t).__mro__):
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _kinds(t: Any, name: str) -> list[str]:
    """The kind of each placement (``"shard"`` or ``"replicate"``); others are refused."""
    kinds = []
    for p in t.placements:
        kind = type(p).__name__
        if kind == "Shard":
            kinds.append("shard")
        elif kind == "Replicate":
            kinds.append("replicate")
        elif kind == "Partial":
            raise CaptureError(f"{name}: a Partial DTensor holds a summand, not a block; redistribute "
                               "it (dt.redistribute(placements=[Replicate()]) or Shard) before saving")
        else:
            raise CaptureError(f"{name}: DTensor placement {p!r} is not supported (only Shard and "
                               "Replicate: the local rows of a strided shard are not one block)")
    return kinds


def _box(t: Any, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's block of ``t``: its shape and its offsets in the global tensor."""
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise CaptureError(f"{name}: the DTensor holds {len(chunks)} blocks on this rank; one expected")
    sizes = tuple(int(s) for s in chunks[0].sizes)
    offsets = tuple(int(o) for o in chunks[0].offsets)
    if sizes != tuple(t._local_tensor.shape):
        raise CaptureError(f"{name}: torch places a block of {list(sizes)} but the local tensor is "
                           f"{list(t._local_tensor.shape)}")
    return sizes, offsets


def _replica(t: Any, kinds: list[str]) -> bool:
    """This rank holds a copy of a block that another rank (coordinate 0) writes."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        raise CaptureError("this rank is outside the DeviceMesh of a DTensor it holds")
    return any(c != 0 for c, k in zip(coord, kinds) if k == "replicate")


def local_tensor(t: Any) -> Any:
    """The rank-local ``torch.Tensor`` of DTensor ``t`` (its storage: assigning into it updates
    ``t``)."""
    return t._local_tensor


def dtensor_leaf(t: Any, name: str, to_numpy: Any) -> Any:
    """DTensor ``t`` as a leaf: a plain array when every rank holds all of it, else this rank's
    block as a ``Shard`` (empty on replicas, so that each block is written once).  ``to_numpy``
    turns the local ``torch.Tensor`` into an array (the capture's own conversion)."""
    kinds = _kinds(t, name)
    local = to_numpy(local_tensor(t))
    if all(k == "replicate" for k in kinds):
        return local
    shape, offsets = _box(t, name)
    gshape = tuple(int(d) for d in t.shape)
    if _replica(t, kinds):
        local = np.empty((0, *local.shape[1:]), local.dtype)
        offsets = (0,) * len(gshape)
    return Shard(np.ascontiguousarray(local), gshape, offsets)


def dtensor_template(t: Any, name: str, dtype: Any) -> Any:
    """The ``like=`` leaf that asks a load for this rank's block of ``t`` (``dtype``: the NumPy
    dtype it is stored as): a ``Shard`` of that box, or an array of the global shape when the
    DTensor is replicated everywhere."""
    kinds = _kinds(t, name)
    gshape = tuple(int(d) for d in t.shape)
    if all(k == "replicate" for k in kinds):
        return np.empty(gshape, dtype)
    shape, offsets = _box(t, name)
    return Shard(np.empty(shape, dtype), gshape, offsets)


def dtensor_block(t: Any, name: str, value: Any) -> np.ndarray:
    """The part of a saved ``value`` that DTensor ``t`` holds on this rank: the block of a whole
    array, or a loaded ``Shard`` that is exactly this rank's block.

    Raises:
        RestoreError: the saved global shape differs from the live one, or a loaded ``Shard`` is
            not this rank's block (it was loaded with another rank's or mesh's template).
    """
    try:
        kinds = _kinds(t, name)
    except CaptureError as e:
        raise RestoreError(str(e)) from None
    gshape = tuple(int(d) for d in t.shape)
    if all(k == "replicate" for k in kinds):
        shape, offsets = gshape, (0,) * len(gshape)
    else:
        shape, offsets = _box(t, name)
    if isinstance(value, Shard):
        if value.global_shape != gshape or value.offsets != offsets or value.shape != shape:
            raise RestoreError(f"{name}: loaded {value!r}, but this rank holds the block of shape "
                               f"{list(shape)} at {list(offsets)} of {list(gshape)}; load with like= built "
                               "from this run's model (ckptcore_torch._sharding.template(model)), or without like=")
        return value.data
    value = np.asarray(value)
    if value.shape != gshape:
        raise RestoreError(f"{name}: the checkpoint holds {value.dtype}{list(value.shape)}, the "
                           f"DTensor is {list(gshape)}")
    return value[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]


# ------------------------------------------------------------------ hooks of the capture/restore
#
# ``_tensors.to_numpy`` hands a DTensor to :func:`capture_leaf` (so the model's tensors and the
# optimizer's slots of an FSDP2 model become Shards wherever the capture converts them);
# ``_capture`` routes each restored DTensor through :func:`restore_target` (model entries and
# gradients: the plan checks and assigns this rank's block into the local tensor),
# :func:`set_grad` and, after the optimizer's load, :func:`reshard_optimizer`.


def capture_leaf(t: Any, copy: bool) -> Any:
    """A DTensor's leaf for the capture (see :func:`dtensor_leaf`)."""
    from ._tensors import to_numpy

    name = f"a DTensor of shape {list(t.shape)} on {t.placements}"  # the capture names none here
    return dtensor_leaf(t, name, lambda local: to_numpy(local, copy))


def restore_target(t: Any, name: str, value: Any) -> tuple[Any, Any]:
    """What the restore plan checks and assigns for target ``t``: ``(t, value)`` for a plain
    tensor, ``(its local tensor, this rank's block of value)`` for a DTensor."""
    if not is_dtensor(t):
        return t, value
    return local_tensor(t), dtensor_block(t, name, value)


def _like(p: Any, local: Any) -> Any:
    """``local`` (this rank's block) as a DTensor placed like parameter ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def set_grad(t: Any, block: np.ndarray) -> None:
    """Give DTensor parameter ``t`` the gradient whose local block is ``block``."""
    from ._tensors import assign, new_tensor

    g = t.grad
    if is_dtensor(g) and tuple(local_tensor(g).shape) == block.shape and g.placements == t.placements:
        assign(local_tensor(g), block)
    else:
        t.grad = _like(t, new_tensor(block, local_tensor(t)))


def reshard_optimizer(opt: Any) -> None:
    """After an optimizer's ``load_state_dict``: each slot loaded as a whole (global) tensor for
    a DTensor parameter becomes a DTensor holding this rank's block, placed like the parameter
    (FSDP2's optimizer states are DTensors; torch's step refuses a plain tensor beside one)."""
    import torch

    for p, st in opt.state.items():
        if not is_dtensor(p):
            continue
        for slot, v in list(st.items()):
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and tuple(v.shape) == tuple(p.shape) \
                    and v.dim() > 0:
                block = dtensor_block(p, f"optimizer/{slot}", v.detach().cpu().numpy())
                local = torch.from_numpy(np.ascontiguousarray(block)).to(local_tensor(p).device)
                st[slot] = _like(p, local.to(v.dtype))


def has_dtensors(tensors: Any) -> bool:
    return any(is_dtensor(t) for t in tensors)


def template(model: Any) -> Any:
    """A ``like=`` for ``ckptcore.load_state``/``CheckpointManager.restore``: the model's DTensors
    as ``Shard``s of this rank's blocks (so a rank reads only its own bytes of them); every other
    entry (and the optimizer: its slots are restored whole, then cut by :func:`reshard_optimizer`)
    as saved.  The names are the capture's."""
    from ckptcore.state import TrainingState

    from ._tensors import named_tensors, numpy_dtype

    tensors = named_tensors(model).tensors
    return TrainingState(model={n: dtensor_template(t, n, numpy_dtype(t, RestoreError, n)) if is_dtensor(t)
                                else np.empty(tuple(t.shape), numpy_dtype(t, RestoreError, n))
                                for n, t in tensors.items()})
