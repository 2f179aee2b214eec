"""``tf.data`` (or ``DataLoader``) input that follows a :class:`ckptcore.DataCursor`, so a run resumes mid-epoch.

Who advances the cursor
-----------------------
The dataset never moves the cursor.  Each time an iterator over it starts
(Keras' ``fit`` starts one per epoch), it copies the cursor's position and
yields the rest of that epoch from the copy, then ends.  tf.data fetches ahead
(prefetching, ``steps_per_execution``, a strategy's device buffers), so the
position it reads can only be trusted if it counts batches *trained*, not
fetched.  Therefore the trainer advances the cursor after each step:

* in ``model.fit``, :class:`ckptcore_keras.BackupAndRestore` (given the same
  cursor) does it in ``on_train_batch_end`` and ends each Keras epoch exactly
  when the cursor rolls over to the next epoch;
* in a custom loop, call ``cursor.next_batch()`` once per trained step (its
  return value is the batch just trained; ignore it).

Without either, every iterator starts at the same place: each epoch repeats the
first one's order.  A checkpoint taken after a step holds the cursor at the
next unseen batch, so a resumed run starts its first iterator there: nothing
is replayed or skipped, in O(1).

Forgetting ``cursor.next_batch()``
----------------------------------
A cursor that iterators have drawn batches from but that never moved would be saved
at the position it had before the loop started (position 0 all through the first
epoch).  Saving it therefore raises ``ValueError`` naming the fix, as the Paddle
adapter's ``ResumableBatchSampler`` does: the first ``dataset()`` over a cursor makes
its ``state_dict()`` (which every save calls) check that the cursor has moved once
batches were drawn.  Once it has moved, the check is a comparison.

``model.fit``'s ``shuffle``
---------------------------
``model.fit`` defaults to ``shuffle=True`` and warns that it ignores it for a
``tf.data.Dataset``.  The cursor already shuffles (``DataCursor(..., seed=)``): pass
``shuffle=False`` to ``fit``, as the examples do.

The order is :class:`~ckptcore.DataCursor`'s (a seeded permutation per epoch),
identical in every process, on every machine and in the Paddle adapter.
"""

from __future__ import annotations

import copy
import threading
import types
import weakref
from typing import Any, Callable

__all__ = ["dataset"]

# Taken by the snapshot an iterator makes and by BackupAndRestore's advance, so a
# snapshot never sees the cursor half-way through a rollover.
_LOCK = threading.Lock()



class _Track:
    """What the iterators of ``dataset()`` drew from one cursor, and whether it has moved since."""

    __slots__ = ("at", "handed", "moved")

    def __init__(self, at: tuple[int, int]):
        self.at, self.handed, self.moved = at, 0, False


# The global DataCursor -> its _Track, for cursors a dataset() iterator has read.
_TRACKS: weakref.WeakKeyDictionary[Any, _Track] = weakref.WeakKeyDictionary()


def _base(cursor: Any) -> Any:
    return getattr(cursor, "cursor", cursor)  # a CursorShard's global cursor


def _where(base: Any) -> tuple[int, int]:
    return base.epoch, base.position


def _moved(track: _Track, base: Any) -> bool:
    """Whether the cursor has left the position the first iterator read (once true, for good)."""
    if not track.moved and _where(base) != track.at:
        track.moved = True
    return track.moved


def state_dict(self: Any) -> dict[str, Any]:
    """The cursor's ``state_dict()``, refused while it is stale (see :func:`check_not_stale`).

    Bound to a cursor as an instance attribute by the first ``dataset()`` iterator over it
    (named ``state_dict``, so that a pickled cursor loads with its class's plain method).
    """
    check_not_stale(self)
    return type(self).state_dict(self)


def _track(base: Any) -> _Track:
    """The cursor's track, started (at its current position) by the first iterator over it."""
    track = _TRACKS.get(base)
    if track is None:
        track = _TRACKS[base] = _Track(_where(base))
        try:
            base.state_dict = types.MethodType(state_dict, base)
        except (AttributeError, TypeError):  # a cursor type with __slots__: nothing to hook
            pass
    return track


def check_not_stale(cursor: Any) -> None:
    """Refuse to save a cursor that ``dataset()`` iterators drew batches from but that never moved.

    Such a cursor still holds the position it had before the loop started, so a run resumed
    from it would train those batches again.

    Raises:
        ValueError: naming the two ways to keep the cursor current.
    """
    base = _base(cursor)
    with _LOCK:
        track = _TRACKS.get(base)
        if track is None or track.handed == 0 or _moved(track, base):
            return
        handed = track.handed
    raise ValueError(
        f"ckptcore_keras.dataset(cursor, ...) has handed out {handed} batch(es) but the cursor "
        "never moved, so the saved data position would be stale (the batches already trained "
        "would be trained again after a resume). In a custom loop call cursor.next_batch() once "
        "after each training step (before saving); in model.fit pass the same cursor to "
        "ckptcore_keras.BackupAndRestore(..., cursor=cursor), which advances it")


def snapshot(cursor: Any) -> Any:
    """An independent copy of ``cursor`` (a ``DataCursor`` or a ``CursorShard`` view)."""
    with _LOCK:
        return copy.deepcopy(cursor)


def _start(cursor: Any) -> tuple[Any, _Track]:
    """A new iterator's copy of ``cursor``, and the cursor's track (to count what it hands out)."""
    base = _base(cursor)
    with _LOCK:
        track = _track(base)
        _moved(track, base)
        return copy.deepcopy(cursor), track


def _handed(track: _Track) -> None:
    with _LOCK:
        track.handed += 1


def advance(cursor: Any, batches: int) -> tuple[int, bool]:
    """Mark up to ``batches`` batches as trained: ``(batches advanced, rolled over to a new epoch)``.

    Stops at the end of the epoch: one Keras step cannot train batches of the
    next epoch, because the dataset ends each epoch.
    """
    base = _base(cursor)
    with _LOCK:
        epoch = base.epoch
        n = max(0, min(batches, cursor.steps_remaining_in_epoch))
        for _ in range(n):
            cursor.next_batch()
        track = _TRACKS.get(base)
        if track is not None and n:
            track.moved = True
        return n, base.epoch != epoch


def _check_arrays(cursor: Any, arrays: tuple[Any, ...]) -> Any:
    import keras

    base = getattr(cursor, "cursor", cursor)
    for a in keras.tree.flatten(arrays):
        if not hasattr(a, "shape") or not hasattr(a, "__getitem__"):
            raise TypeError(f"dataset() takes array-likes with a .shape (numpy arrays), got "
                            f"{type(a).__name__}; for data not in memory pass map_fn= instead")
        if not a.shape or a.shape[0] != base.num_samples:
            raise ValueError(f"an array has {a.shape[0] if a.shape else 'no'} rows but the "
                             f"cursor walks {base.num_samples} samples; they must match")
    return arrays[0] if len(arrays) == 1 else arrays


def dataset(cursor: Any, *arrays: Any, map_fn: Callable[..., Any] | None = None,
            prefetch: bool = True) -> Any:
    """A dataset of the cursor's batches for ``fit``: the rest of its current epoch per iterator.

    On Keras' TensorFlow backend it is a ``tf.data.Dataset``; on JAX also, when TensorFlow is
    installed (Keras reads ``tf.data`` on every backend), else a ``torch.utils.data.DataLoader``;
    on PyTorch a ``DataLoader`` over an ``IterableDataset`` (no worker processes: the batches
    are rows of in-memory arrays).  Each behaves alike: every iterator yields the rest of the
    cursor's epoch.

    Args:
        cursor: A :class:`ckptcore.DataCursor` (global batches) or a ``CursorShard``
            view of one (this worker's part of each global batch).
        *arrays: In-memory data with one row per sample: numpy arrays or nested
            tuples/dicts of them (``x, y``, ``x, y, sample_weight``,
            ``{"a": xa, "b": xb}, y``).  Each batch is ``array[indices]`` for all.
        map_fn: Applied to each batch with ``Dataset.map`` (in parallel, order
            kept).  With ``arrays`` it receives the batch's arrays; without, it
            receives the batch's int64 sample indices and must return the batch,
            which is how data that is not in memory is read (wrap Python code in
            ``tf.numpy_function``).  With a ``DataLoader`` it is called in Python on
            numpy arrays, one batch after the other.
        prefetch: Prefetch batches in the background (safe: the position is
            counted by whoever trains, see the module docstring); ``tf.data`` only.

    Returns:
        A finite dataset; its cardinality is unknown, since an iterator started
        mid-epoch yields fewer batches.

    Example:
        >>> cursor = ckptcore.DataCursor(len(x), 32, seed=0)                    # doctest: +SKIP
        >>> cb = ckptcore_keras.BackupAndRestore("s3://b/run", cursor=cursor, save_freq=100)  # doctest: +SKIP
        >>> model.fit(ckptcore_keras.dataset(cursor, x, y), epochs=5, callbacks=[cb],  # doctest: +SKIP
        ...           shuffle=False)  # the cursor shuffles; fit's shuffle=True would be ignored (warned)
        >>> def load(indices):  # data on disk                                  # doctest: +SKIP
        ...     return tf.numpy_function(read_samples, [indices], (tf.float32, tf.int64))
        >>> ds = ckptcore_keras.dataset(cursor, map_fn=load)                    # doctest: +SKIP
    """
    if not hasattr(cursor, "iter_epoch") or not hasattr(cursor, "state_dict"):
        raise TypeError(f"cursor must be a ckptcore.DataCursor or a CursorShard, got "
                        f"{type(cursor).__name__}")
    if not _use_tf_data():
        return _torch_loader(cursor, arrays, map_fn)
    import tensorflow as tf

    batches, signature = _batch_source(cursor, arrays)
    ds = tf.data.Dataset.from_generator(batches, output_signature=signature)
    if map_fn is not None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if prefetch:
        ds = ds.prefetch(tf.data.AUTOTUNE)
    return ds


def _batch_source(cursor: Any, arrays: tuple[Any, ...]) -> tuple[Callable[[], Any], Any]:
    """``dataset``'s generator (each call: one iterator, the rest of the cursor's epoch) and its
    output signature: each batch's rows of ``arrays``, or without arrays its sample indices."""
    import tensorflow as tf

    if arrays:
        data = _check_arrays(cursor, arrays)
        signature = tf.nest.map_structure(
            lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), data)

        def batches():
            snap, track = _start(cursor)
            for idx in snap.iter_epoch():
                _handed(track)
                yield tf.nest.map_structure(lambda a: a[idx], data)
    else:
        signature = tf.TensorSpec((None,), tf.int64)

        def batches():
            snap, track = _start(cursor)
            for idx in snap.iter_epoch():
                _handed(track)
                yield idx
    return batches, signature


def _use_tf_data() -> bool:
    """``tf.data`` on the TensorFlow backend, and on JAX when TensorFlow is installed."""
    import importlib.util

    from ._backend import UnsupportedBackendError, backend

    name = backend()
    if name == "tensorflow":
        return True
    if name == "jax" and importlib.util.find_spec("tensorflow") is not None:
        return True
    if importlib.util.find_spec("torch") is None:
        raise UnsupportedBackendError(
            f"ckptcore_keras.dataset() on Keras' {name!r} backend needs TensorFlow (tf.data) or "
            "PyTorch (a DataLoader) installed, which Keras reads on every backend")
    return False


def _torch_loader(cursor: Any, arrays: tuple[Any, ...], map_fn: Callable[..., Any] | None) -> Any:
    """A ``DataLoader`` whose every iterator yields the rest of the cursor's epoch (numpy
    batches, which the loader turns into tensors); ``map_fn`` is applied to each."""
    import keras
    import torch.utils.data

    data = _check_arrays(cursor, arrays) if arrays else None

    class CursorBatches(torch.utils.data.IterableDataset):
        def __iter__(self):
            snap, track = _start(cursor)
            for idx in snap.iter_epoch():
                _handed(track)
                batch = idx if data is None else keras.tree.map_structure(lambda a: a[idx], data)
                if map_fn is not None:
                    batch = map_fn(*batch) if isinstance(batch, tuple) else map_fn(batch)
                yield batch

    # A generator of its own: each DataLoader iterator draws a seed from it, which would otherwise
    # come from torch's global RNG (Keras' unseeded Dropout draws there), shifting that stream by
    # one draw per epoch at a different point in a resumed run.
    return torch.utils.data.DataLoader(CursorBatches(), batch_size=None,
                                       generator=torch.Generator().manual_seed(0))
