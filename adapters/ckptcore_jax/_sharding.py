"""``jax.Array``s sharded over devices as ``ckptcore.Shard``/``Chunks`` leaves, and back into
any sharding.

Capture (:func:`array_leaf`): an array whole on every device that holds it (one device, or fully
replicated) is a plain NumPy array.  Otherwise each distinct block this process holds is one
``Shard`` with its global offsets (JAX's ``addressable_shards``: a block's ``index`` gives the
offsets, ``replica_id == 0`` picks one copy of each block, so replicas are written once); several
blocks are one ``Chunks`` leaf.  A process holding only replicas of its blocks (in a
multi-process job) contributes an empty ``Shard``.

Restore (:func:`rebuild`): the live leaf's sharding says which block each device needs; the
block is cut from a whole saved array, or found among the blocks of a ``Shard``/``Chunks`` value
(a load with ``like=``:func:`template_leaf`, which reads only those blocks), and
``jax.make_array_from_callback`` places them.  Any saved mesh restores into any live one, and
into an abstract leaf (``jax.ShapeDtypeStruct``) laid out by its ``sharding``.

Weak types (:func:`weaken`): an array made from a Python scalar (``jnp.asarray(0.5)``) is weakly
typed, which decides what it promotes to (``bf16 * it`` stays bfloat16); a restored array is
weakly typed when the live leaf it replaces is, or when an abstract leaf is restored into and the
capture recorded the saved one as weak (the adapter keeps those names in its extra metadata).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from ckptcore.errors import CaptureError, RestoreError
from ckptcore.sharding import Chunks, Shard

from ._tensors import to_numpy

__all__ = ["array_leaf", "template_leaf", "rebuild", "is_sharded", "global_shape", "value_dtype",
           "weaken", "is_weak"]

_log = logging.getLogger("ckptcore")


def is_sharded(x: Any) -> bool:
    """``x`` is a jax.Array (or an abstract ``jax.ShapeDtypeStruct`` with a sharding) cut into
    blocks (not whole on each device that holds it)."""
    sharding = getattr(x, "sharding", None)
    return (isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and sharding is not None
            and not sharding.is_fully_replicated and len(sharding.device_set) > 1)


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A device's index into an array of ``shape`` as (offsets, block shape)."""
    offsets, sizes = [], []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise RestoreError(f"a block with stride {step} is not a box")
        offsets.append(start)
        sizes.append(max(stop - start, 0))
    return tuple(offsets), tuple(sizes)


def array_leaf(x: Any, copy: bool = True) -> np.ndarray | Shard | Chunks:
    """Leaf ``x`` as a state value: the whole array, or this process's distinct blocks."""
    if not is_sharded(x):
        return to_numpy(x, copy)
    shape = tuple(int(d) for d in x.shape)
    parts = []
    for s in x.addressable_shards:
        if s.replica_id != 0:
            continue
        offsets, _ = _box(s.index, shape)
        parts.append(Shard(np.ascontiguousarray(to_numpy(s.data, copy)), shape, offsets))
    if not parts:  # a replica everywhere on this process: another process writes the blocks
        return Shard(np.empty((0, *shape[1:]), np.dtype(x.dtype)), shape, (0,) * len(shape))
    parts.sort(key=lambda p: p.offsets)
    return parts[0] if len(parts) == 1 else Chunks(tuple(parts))


def template_leaf(x: Any) -> Shard | Chunks | None:
    """The ``like=`` leaf asking a load for the blocks live array ``x`` holds on this process
    (None: ``x`` is whole, load it whole)."""
    if not is_sharded(x):
        return None
    shape = tuple(int(d) for d in x.shape)
    dtype = np.dtype(x.dtype)
    boxes = sorted({_box(idx, shape) for idx in x.sharding.addressable_devices_indices_map(shape).values()})
    parts = tuple(Shard(np.broadcast_to(np.zeros((), dtype), size), shape, off) for off, size in boxes)
    return parts[0] if len(parts) == 1 else Chunks(parts)


def global_shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, (Shard, Chunks)):
        return tuple(value.global_shape)
    return tuple(int(d) for d in np.shape(value))


def value_dtype(value: Any) -> np.dtype:
    if isinstance(value, (Shard, Chunks)):
        return np.dtype(value.dtype)
    return np.asarray(value).dtype


def _block(value: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], name: str) -> np.ndarray:
    """The box (``offsets``, ``sizes``) of the saved global array: cut from a whole array or
    from the one saved block that contains it."""
    if not isinstance(value, (Shard, Chunks)):
        return np.asarray(value)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
    parts = value.parts if isinstance(value, Chunks) else (value,)
    for p in parts:
        inside = all(po <= o and o + n <= po + pn
                     for o, n, po, pn in zip(offsets, sizes, p.offsets, p.data.shape))
        if inside:
            return p.data[tuple(slice(o - po, o - po + n)
                                for o, n, po in zip(offsets, sizes, p.offsets))]
    raise RestoreError(f"{name}: the blocks loaded do not hold the block {list(sizes)} at "
                       f"{list(offsets)} this device needs; load with "
                       "like=ckptcore_jax.template(model, optimizer) of this run, or without like=")


def rebuild(value: Any, like: Any, name: str) -> Any:
    """A jax.Array with the values of ``value`` (an array, ``Shard`` or ``Chunks`` of the same
    global shape and dtype as ``like``) laid out as ``like`` is: same sharding and devices."""
    shape = tuple(int(d) for d in like.shape)
    sharding = like.sharding
    if sharding is None or not getattr(like, "committed", True):
        # An abstract leaf without a sharding goes to the default device.
        # An array JAX placed on its default device by itself (jnp.zeros, optax's counts) may
        # follow its operands anywhere; one put on a device explicitly may not.  The restored
        # leaf keeps that freedom.
        whole = value if not isinstance(value, (Shard, Chunks)) else _block(value, (0,) * len(shape), shape, name)
        return jax.device_put(np.asarray(whole))
    if not isinstance(value, (Shard, Chunks)) and len(sharding.device_set) == 1:
        return jax.device_put(np.asarray(value), sharding)

    def block(index: tuple[slice, ...]) -> np.ndarray:
        offsets, sizes = _box(index, shape)
        # np.asarray, not np.ascontiguousarray: that makes a 0-d block 1-d.
        return np.asarray(_block(value, offsets, sizes, name), order="C")

    return jax.make_array_from_callback(shape, sharding, block)


def is_weak(x: Any) -> bool:
    """``x`` is a weakly typed jax.Array or abstract leaf (never a typed key)."""
    from ._tensors import is_key

    return (isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and bool(getattr(x, "weak_type", False))
            and not is_key(x))


def _weak_copy(zero: Any, x: Any) -> Any:
    # Weak zeros laid out as x, then x's values put over them by a scatter: a scatter keeps its
    # operand's weak type (jnp's .at[].set converts its result to it) and takes the update's
    # values bit for bit (the same dtype: no conversion).  The zeros are made here, inside the
    # jit, with x's sharding, so each device holds only its block and the scatter needs no
    # collective (in a mesh of explicit axes too).  No public function makes a strong array
    # weak otherwise.
    base = jax.lax.full_like(zero, 0, shape=x.shape, sharding=jax.typeof(x).sharding)
    return base.at[...].set(x)


def weaken(x: Any, like: Any, name: str) -> Any:
    """``x`` (a strongly typed jax.Array laid out as ``like``) weakly typed: the same values,
    dtype and sharding.  ``like`` is the weak live leaf, or an abstract leaf, whose weak zero
    is made from a Python scalar: that has only JAX's default dtype of each kind
    (``float32``/``int32``/``complex64``, their 64-bit ones with ``jax_enable_x64``)."""
    if isinstance(like, jax.Array):
        # A weak 0-d zero of the live leaf's dtype: its values are not read, so a live leaf
        # whose buffer a jitted step donated will do.
        zero = jax.lax.full_like(like, 0, shape=())
    else:
        scalar = {"f": 0.0, "i": 0, "c": 0j}.get(np.dtype(like.dtype).kind)
        zero = None if scalar is None else jax.lax.full_like(scalar, 0)
        if zero is None or zero.dtype != like.dtype:
            _log.warning("restore: %s: cannot make a weakly typed %s array for an abstract leaf "
                         "(only a Python scalar's default dtype can be); it is restored strongly "
                         "typed", name, np.dtype(like.dtype))
            return x
    if like.sharding is not None and getattr(like, "committed", True):
        return jax.jit(_weak_copy, out_shardings=like.sharding)(zero, x)
    # An array JAX placed by itself (uncommitted) stays free to follow its operands.
    return jax.jit(_weak_copy)(zero, x)


# --- one leaf, whatever it is: a jax.Array (sharded or not), a typed key, a NumPy array, a scalar


def capture_leaf(x: Any, copy: bool = True, *, name: str = "") -> tuple[Any, str | None]:
    """Leaf ``x`` (``name`` in messages) as (state value, key implementation name or None): a
    typed key is stored as its uint32 ``key_data``, sharded like the key array.

    Raises:
        CaptureError: ``x`` is abstract, or no array or scalar a restore could put back (a
            string, a tuple of arrays held in one NNX Variable): saving it would write a
            checkpoint that cannot be restored."""
    from ._tensors import is_abstract, is_key, is_leaf_value, key_data, key_impl

    if is_abstract(x):
        raise CaptureError(f"{name}: an abstract leaf ({x}) holds no values to save: restore "
                           "into it, or save the concrete model")
    if not is_leaf_value(x):
        raise CaptureError(
            f"{name}: a leaf of type {type(x).__module__}.{type(x).__qualname__} cannot be "
            "saved (a restore could not put it back): leaves are jax.Arrays, NumPy arrays and "
            "scalars, Python bool/int/float/complex; keep other values out of the state, and "
            "split an NNX Variable holding several arrays into one Variable per array")
    if is_key(x):
        return array_leaf(key_data(x), copy), key_impl(x)
    return array_leaf(x, copy), None


def plan_leaf(plan: Any, qname: str, saved: Any, live: Any, *, saved_impl: str | None,
              put: Any, saved_weak: bool = False) -> None:
    """Plan restoring ``saved`` into the place of ``live`` (checked now: shape, dtype, key
    implementation), calling ``put(new_leaf)`` when the plan is applied.  ``saved_weak``: the
    capture recorded the leaf as weakly typed, which an abstract ``live`` leaf then is too (a
    concrete one says itself)."""
    from ._tensors import assign, is_abstract, is_key, key_data, key_impl

    impl = key_impl(live) if is_key(live) else None
    if impl != saved_impl:
        raise RestoreError(f"{qname}: the checkpoint holds "
                           f"{'a ' + saved_impl + ' key' if saved_impl else 'an array'}, the "
                           f"target is {'a ' + impl + ' key' if impl else 'an array'}")
    like = key_data(live) if impl else live
    want_shape = tuple(int(d) for d in np.shape(like))
    want_dtype = np.dtype(like.dtype) if hasattr(like, "dtype") else np.asarray(like).dtype
    got_shape, got_dtype = global_shape(saved), value_dtype(saved)
    if got_shape != want_shape:
        raise RestoreError(f"{qname}: the checkpoint holds shape {list(got_shape)}, the target "
                           f"has {list(want_shape)}")
    if got_dtype != want_dtype:
        raise RestoreError(f"{qname}: the checkpoint holds {got_dtype}, the target is {want_dtype}")

    weak = is_weak(like) or (saved_weak and is_abstract(like) and not impl)

    def do_put() -> None:
        if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
            new = rebuild(saved, like, qname)
            if weak:
                new = weaken(new, like, qname)
            if impl:
                new = jax.random.wrap_key_data(new, impl=impl)
                if getattr(live, "committed", True) and live.sharding is not None:
                    new = jax.device_put(new, live.sharding)
        else:
            whole = saved if not isinstance(saved, (Shard, Chunks)) else _block(
                saved, (0,) * len(want_shape), want_shape, qname)
            new = assign(live, whole, qname)
        put(new)

    # Shape and dtype are checked above (a Shard's are its global ones); the plan's own check
    # would look at a block.  The value is handed over for a streaming load to wait on.
    plan.assign(qname, saved, shape=None, dtype=None, put=do_put)
