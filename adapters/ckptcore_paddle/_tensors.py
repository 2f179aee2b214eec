"""Discovery of a Paddle model's named tensors, and Paddle tensor <-> numpy, bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow): the layer's ``state_dict()``
keys (structured names such as ``conv1.weight``, ``bn._mean``), without a ``paddle.DataParallel``
wrapper's ``_layers.`` prefix.  A tensor reachable under several names (``nn.LSTM`` lists each
weight both as ``weight_ih_l0`` and ``0.cell.weight_ih``) is named once, by its first name; the
others are its aliases.

Nothing here imports Paddle: tensors are handled through their own methods.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable

import numpy as np

from ckptcore.adapter import value_check

try:  # bfloat16/float8 have no numpy dtype of their own; ml_dtypes provides them
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with the core's dependencies
    ml_dtypes = None

_EXTENDED = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_PREFIX = "_layers."


# Wrappers whose parameters are the plain layer's, replicated on every rank (``ShardingParallel``
# is fleet's model wrapper under ZeRO stage 1: only the optimizer states are partitioned).
_REPLICATING = ("DataParallel", "ShardingParallel")


def unwrap(model: Any) -> tuple[Any, Any]:
    """The plain layer inside a hapi ``Model`` and/or ``DataParallel`` (or fleet's
    ``ShardingParallel``), and a hapi model's optimizer."""
    opt = None
    if type(model).__name__ == "Model" and hasattr(model, "network"):
        model, opt = model.network, getattr(model, "_optimizer", None)
    while type(model).__name__ in _REPLICATING and hasattr(model, "_layers"):
        model = model._layers
    return model, opt


def named_tensors(layer: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``state_dict()`` tensors by structured name, each tensor once, and the aliases of repeated ones."""
    first: dict[int, str] = {}
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, t in layer.state_dict().items():
        while name.startswith(_PREFIX):
            name = name[len(_PREFIX):]
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            tensors[name] = t
    return tensors, aliases


# Paddle dtype -> (numpy dtype, whether it is one of _EXTENDED): str(t.dtype) and np.dtype.name
# cost microseconds, a model has hundreds of tensors and a handful of dtypes.
_DTYPES: dict[Any, tuple[np.dtype, bool]] = {}


def _dtype_facts(pd_dtype: Any) -> tuple[np.dtype, bool]:
    facts = _DTYPES.get(pd_dtype)
    if facts is None:
        name = str(pd_dtype).rsplit(".", 1)[-1].lower()
        if name in _EXTENDED:
            if ml_dtypes is None:
                raise TypeError(f"{name} tensors need the ml_dtypes package")
            facts = (np.dtype(getattr(ml_dtypes, name)), True)
        else:
            facts = (np.dtype(name), False)
        _DTYPES[pd_dtype] = facts
    return facts


def numpy_dtype(t: Any) -> np.dtype:
    """The numpy dtype holding ``t``'s values exactly (ml_dtypes for bfloat16 and float8)."""
    return _dtype_facts(t.dtype)[0]


def to_numpy(t: Any, copy: bool = True) -> np.ndarray:
    """``t``'s values: a copy that later training steps cannot change, or with ``copy=False`` a
    view of a CPU tensor's own buffer where DLPack allows (valid until the tensor changes)."""
    if isinstance(t, np.ndarray):  # e.g. values parked by set_state_dict(paddle.load(..., return_numpy=True))
        return t.copy() if copy else t
    dtype, extended = _dtype_facts(t.dtype)
    if extended:
        # Paddle hands these out as raw uint16/uint8 bits; reinterpret them.
        return np.ascontiguousarray(t.numpy()).view(dtype)
    try:
        # DLPack shares the buffer: no copy through .numpy(), and we choose how to copy.
        view = np.from_dlpack(t.detach())
    except (BufferError, RuntimeError, TypeError, ValueError):
        return np.asarray(t.numpy())
    return _copy(view) if copy else view


def _copy(view: np.ndarray) -> np.ndarray:
    out = np.empty(view.shape, view.dtype)  # empty + copyto: measured ~2x less CPU than np.array(copy=True)
    np.copyto(out, view)
    return out


def assign(target: Any, value: np.ndarray) -> None:
    """Copy ``value`` into ``target`` in place (same shape and dtype, checked by the RestorePlan)."""
    value = np.ascontiguousarray(value)
    if value.dtype.name in _EXTENDED:
        value = value.view(np.uint16 if value.dtype.itemsize == 2 else np.uint8)
    target.set_value(value)


# ----------------------------------------------------------------------------- cached views
#
# A DLPack view of a tensor costs a few microseconds (``detach`` and the capsule), and a model has
# hundreds of tensors.  Parameters, BatchNorm statistics and optimizer accumulators keep their
# buffers from step to step (Paddle updates them in place), so a view made once stays a view of the
# tensor's current values for as long as the tensor is the same object with the same data pointer,
# shape and dtype.  An equal pointer is never a reused address: the cached view holds the buffer
# it was made of, so no other allocation can sit there while the entry exists.  Whatever differs
# (a replaced, reshaped, re-typed or reallocated tensor) gets a fresh view, and each call keeps only
# the entries of the tensors it was given, so a replaced buffer is released at the next call.
# Gradients are reallocated by every backward pass: they are not cached.

_VIEWS: weakref.WeakKeyDictionary[Any, dict[int, tuple]] = weakref.WeakKeyDictionary()


def views(owner: Any, tensors: Iterable[Any]) -> list[np.ndarray | None]:
    """A view of each tensor's buffer, cached on ``owner`` (a layer or an optimizer); None where
    there is none (a GPU tensor, bfloat16/float8, an uninitialised tensor, a parked numpy value).

    A view shares the tensor's memory both ways: read it for a synchronous save, write it (with
    ``np.copyto``) to set the tensor in place, as ``set_value`` does.
    """
    try:
        cache = _VIEWS.get(owner) or {}
    except TypeError:  # an owner that cannot be weakly referenced or hashed: no caching
        cache = {}
    fresh: dict[int, tuple] = {}
    out: list[np.ndarray | None] = []
    for t in tensors:
        entry = cache.get(id(t))
        if entry is not None and entry[0]() is t:
            try:
                # ``is not`` for the dtype: Paddle hands out one object per dtype, and its ``!=``
                # costs five times the rest of this check (another object only means a new view).
                if t.data_ptr() != entry[1] or t.shape != entry[2] or t.dtype is not entry[3]:
                    entry = None
            except (AttributeError, RuntimeError, ValueError):
                entry = None
        else:
            entry = None
        if entry is None:
            entry = _view_entry(t)
        if entry is None:
            out.append(None)
        else:
            fresh[id(t)] = entry
            out.append(entry[4])
    try:
        _VIEWS[owner] = fresh
    except TypeError:
        pass
    return out


def _view_entry(t: Any) -> tuple | None:
    if isinstance(t, np.ndarray):
        return None
    try:
        dtype, extended = _dtype_facts(t.dtype)
        if extended:
            return None
        view = np.from_dlpack(t.detach())
        ptr, shape = t.data_ptr(), t.shape
        ref = weakref.ref(t)
    except (AttributeError, BufferError, RuntimeError, TypeError, ValueError):
        return None
    if view.dtype != dtype or list(view.shape) != list(shape) or (view.size and view.ctypes.data != ptr):
        return None  # not the plain view of the whole tensor this cache relies on
    return ref, ptr, shape, t.dtype, view


def values(owner: Any, tensors: list[Any], copy: bool) -> list[np.ndarray]:
    """:func:`to_numpy` of each tensor, through the views cached on ``owner``."""
    return [to_numpy(t, copy) if v is None else (_copy(v) if copy else v)
            for t, v in zip(tensors, views(owner, tensors))]


class Copies:
    """A restore's copies into tensor views, planned on ``plan`` in groups of about
    :data:`GROUP` bytes (one ``assign_many`` each: every value checked as ``assign`` checks it),
    a large group copied by two threads.

    Why: once the planning is lean, copying is most of a restore (40 MB for mobilenet_v2 with
    Adam, 300 MB for resnet50); numpy's checksum and copy release the GIL, so with ``helper`` a
    second thread takes half of each group.  In a streaming load each group verifies its own
    values (``ckptcore.adapter.value_check``), in the threads that copy them, right before:
    the bytes are read from memory once and from the cache the second time, and no
    verification thread runs ahead.  A group is written only once all of it is verified, so a
    damaged tensor leaves its group and every later one untouched.

    :meth:`flush` plans what is left: call it before the plan is applied.  :meth:`close` ends
    the helper thread (the restore's, applied or not)."""

    def __init__(self, plan: Any, *, helper: bool = False) -> None:
        self._plan = plan
        self._items: list[tuple[str, np.ndarray, tuple, np.dtype]] = []
        self._pairs: list[tuple[np.ndarray, np.ndarray]] = []
        self._bytes = 0
        # What the planned puts hold: never this object, which holds the plan (a cycle would
        # keep the loaded arrays, and the mapped shard under them, alive until a collection).
        self._helper = _Helper() if helper else None

    def add(self, name: str, target: Any, view: np.ndarray | None, value: np.ndarray) -> None:
        """Plan ``value`` into ``target``: through ``view`` in a group, or by :func:`assign`
        at once where there is no writable view."""
        if view is None or not view.flags.writeable:  # a view someone made read-only stays so
            self.flush()  # the group before it first: puts stay in the model's order
            self._plan.assign(name, value, shape=target.shape, dtype=numpy_dtype(target),
                              put=functools.partial(assign, target, value))
            return
        self._items.append((name, value, view.shape, view.dtype))
        self._pairs.append((view, value))
        self._bytes += view.nbytes
        if self._bytes >= GROUP:
            self.flush()

    def flush(self) -> None:
        if self._items:
            self._plan.assign_many(self._items, functools.partial(_copy_group, self._pairs, self._bytes,
                                                                  self._helper), verifies=True)
            self._items, self._pairs, self._bytes = [], [], 0

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()


class _Helper:
    """The second thread of a restore's copies, started at its first large group."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptcore-paddle-copy")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _copy_group(pairs: list[tuple[np.ndarray, np.ndarray]], nbytes: int, helper: _Helper | None) -> None:
    """A planned group: every value verified (``value_check``), then every value written; from
    :data:`_SPLIT` bytes on with a helper, half of each by the helper thread."""
    check = value_check()  # here, in the applying thread: the helper gets the callable
    if nbytes < _SPLIT or helper is None:
        for _, src in pairs:
            check(src)
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    first, second = _halves(pairs, nbytes)
    _both(helper.pool(), check, first, second)


GROUP = 16 << 20  # bytes per planned group of copies
_SPLIT = 1 << 20  # a group this large is halved between two threads

_Part = list  # [(target view, saved array, the array to verify or None)]


def _check_then_copy(part: _Part, check: Callable[[Any], None], barrier: threading.Barrier) -> None:
    """Verify ``part``, wait until the other half is verified too (the barrier), then write it.
    A failure breaks the barrier: neither half writes anything."""
    try:
        for _, _, whole in part:
            if whole is not None:
                check(whole)
        barrier.wait()  # BrokenBarrierError: the other half failed (its error is the one raised)
    except threading.BrokenBarrierError:
        raise
    except BaseException:  # a failed check, or an interrupt while waiting: neither half writes
        barrier.abort()
        raise
    for dst, src, _ in part:
        np.copyto(dst, src)


def _both(pool: ThreadPoolExecutor, check: Callable[[Any], None], first: _Part, second: _Part) -> None:
    """``second`` in the helper and ``first`` here, each verified then written; returns once
    both are done, raising the first half's error before the second's (the earlier tensors')."""
    barrier = threading.Barrier(2)
    fut = pool.submit(contextvars.copy_context().run, _check_then_copy, second, check, barrier)
    mine: BaseException | None = None
    try:
        _check_then_copy(first, check, barrier)
    except BaseException as e:  # noqa: BLE001 - raised below, after the helper is done
        mine = e
        barrier.abort()  # (an interrupt anywhere here): the helper must not wait for this half
    wait([fut])
    theirs = fut.exception()
    if mine is not None and not (isinstance(mine, threading.BrokenBarrierError) and theirs is not None):
        raise mine
    if theirs is not None:
        raise theirs


def _halves(pairs: list[tuple[np.ndarray, np.ndarray]], nbytes: int) -> tuple[_Part, _Part]:
    """``pairs`` split into two parts of about ``nbytes / 2`` each; the array across the middle
    is cut in two flat pieces when both sides are C-contiguous (so that reshape makes views:
    of anything else it would make a copy, and the copy into it would be lost).  A cut array is
    verified whole by the first part only (both parts are verified before either is written)."""
    first: _Part = []
    done, half = 0, nbytes // 2
    for k, (dst, src) in enumerate(pairs):
        if done + dst.nbytes <= half:
            first.append((dst, src, src))
            done += dst.nbytes
            continue
        rest = [(d, s, s) for d, s in pairs[k + 1:]]
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            return first, [(dst, src, src)] + rest
        cut = (half - done) // max(dst.itemsize, 1)
        d, s = dst.reshape(-1), src.reshape(-1)
        return first + [(d[:cut], s[:cut], src)], [(d[cut:], s[cut:], None)] + rest
    return first, []
