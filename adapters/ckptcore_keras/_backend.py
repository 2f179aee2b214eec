"""Which Keras backend runs, what needs TensorFlow, and integers moved between backends.

``ckptcore_keras`` works on Keras 3's TensorFlow, JAX and PyTorch backends alike (capture,
restore, ``BackupAndRestore``, ``dataset``).  What only TensorFlow has raises
:class:`UnsupportedBackendError` on the others, naming the backend: ``tf.train.Checkpoint``
import and export, ``process_group`` over ``tf.distribute`` workers.

TensorFlow is never imported here for a question about it: :func:`loaded_tensorflow` is the
module if something (Keras on its TensorFlow backend, ``tf.data``) imported it already, else
None, and then no value can be a ``tf.Variable``.

Backends keep some integers in different dtypes: the optimizer's iteration counter is int64 on
TensorFlow and int32 on JAX and PyTorch, a ``SeedGenerator``'s state int64 on TensorFlow,
uint32 on JAX and int32 on PyTorch (the uint32 seed's bits; Keras masks it with ``0xFFFFFFFF``).
:func:`fit_integers` converts such values for a state saved on another backend.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ckptcore.errors import CheckpointError, RestoreError

__all__ = ["UnsupportedBackendError", "backend", "require_tensorflow", "loaded_tensorflow",
           "fit_integers", "seed_words"]


class UnsupportedBackendError(CheckpointError, NotImplementedError):
    """A TensorFlow-only part of ``ckptcore_keras`` called with Keras on another backend."""


def backend() -> str:
    """The running Keras backend: ``"tensorflow"``, ``"jax"`` or ``"torch"`` (imports Keras)."""
    import keras

    return keras.backend.backend()


def require_tensorflow(what: str, instead: str = "") -> None:
    """Raise :class:`UnsupportedBackendError` unless Keras runs on TensorFlow."""
    name = backend()
    if name != "tensorflow":
        raise UnsupportedBackendError(
            f"{what} works with Keras on the TensorFlow backend only; this process runs Keras on "
            f"the {name!r} backend (KERAS_BACKEND={name})" + (f"; {instead}" if instead else ""))


def loaded_tensorflow() -> Any:
    """The ``tensorflow`` module if it is imported already, else None (never imports it)."""
    return sys.modules.get("tensorflow")


def seed_words(values: Any, dtype: Any) -> np.ndarray:
    """Seed-state integers in ``dtype``.  Every backend's seeds are uint32 words; PyTorch stores
    them as int32 (the same bits), so a value in ``[-2**31, 2**32)`` is a word: negative ones
    are taken as their bits.  Values outside that range (only TensorFlow's int64 can hold them)
    must fit ``dtype`` as they are."""
    dtype = np.dtype(dtype)
    words = np.asarray(values).astype(np.int64)
    if words.size and ((words < -(1 << 31)) | (words >= 1 << 32)).any():
        return _exact(words, dtype)
    words = np.where(words < 0, words + (1 << 32), words)
    if dtype == np.int32:
        return words.astype(np.uint32).view(np.int32)
    return _exact(words, dtype)


def fit_integers(name: str, value: np.ndarray, dtype: np.dtype, *, seed: bool = False) -> np.ndarray:
    """``value`` in the integer ``dtype`` of the target when both are integers and it fits
    (``seed``: a seed state, whose words keep their bits, see :func:`seed_words`); any other
    value is returned as it is, for the plan's dtype check to judge."""
    value = np.asarray(value)
    dtype = np.dtype(dtype)
    if value.dtype == dtype or value.dtype.kind not in "iu" or dtype.kind not in "iu":
        return value
    try:
        return seed_words(value, dtype) if seed else _exact(value, dtype)
    except ValueError as e:
        raise RestoreError(f"{name}: {e}") from None


def _exact(value: np.ndarray, dtype: Any) -> np.ndarray:
    info = np.iinfo(dtype)
    if value.size and (value.min() < info.min or value.max() > info.max):
        raise ValueError(f"the checkpoint's {value.dtype} values do not fit the target's "
                         f"{np.dtype(dtype)}")
    return value.astype(dtype)
