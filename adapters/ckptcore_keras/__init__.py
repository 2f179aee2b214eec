"""ckptcore adapter for Keras 3 on its TensorFlow, JAX and PyTorch backends.

Capture, restore, ``BackupAndRestore`` and ``dataset`` work on every backend, and a state
saved on one restores on another; ``import_tf_checkpoint``/``export_tf_checkpoint`` need the
TensorFlow backend and raise :class:`UnsupportedBackendError` naming the backend on the others.

Importing this package imports neither TensorFlow nor Keras; they load on the
first call that needs them.  The registry finds :data:`ADAPTER` through the
``ckptcore.adapters`` entry point (``keras = "ckptcore_keras:ADAPTER"``).

The package namespace is the public API; the modules behind it are private:
``_capture`` (capture/restore), ``_tensors`` (variables under stable names, bytes in
and out), ``_params`` (ParamInfo), ``_optimizer`` (slots, schedule, accumulation),
``_rng`` (TensorFlow's, Keras' and PyTorch's RNGs), ``_backend`` (the running backend,
what needs TensorFlow, integer dtypes between backends), ``_callback`` (``BackupAndRestore``: exact
resume in ``model.fit``), ``_data`` (``dataset``: ``tf.data`` input that follows a
``DataCursor``), ``_files`` and ``_tf_bundle`` (``tf.train.Checkpoint`` files).

Example:
    >>> import ckptcore_keras                                           # doctest: +SKIP
    >>> state = ckptcore_keras.capture(model, optimizer, cursor=cursor)  # doctest: +SKIP
    >>> ckptcore_keras.restore(state, new_model, new_optimizer)          # doctest: +SKIP
    >>> cb = ckptcore_keras.BackupAndRestore("s3://b/run", cursor=cursor, save_freq=100)  # doctest: +SKIP
    >>> model.fit(ckptcore_keras.dataset(cursor, x, y), epochs=5, callbacks=[cb], shuffle=False)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptcore.adapter import PackageAdapter

if TYPE_CHECKING:  # pragma: no cover
    from ckptcore.state import RestoreReport, TrainingState

__all__ = ["ADAPTER", "capture", "restore", "import_tf_checkpoint", "export_tf_checkpoint",
           "dataset", "BackupAndRestore", "process_group", "UnsupportedBackendError"]

# Top-level packages whose classes this adapter handles (tf.keras is Keras 3 in TF >= 2.16).
_MODULES = ("keras", "tensorflow", "tf_keras")


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True,
            copy: bool = True, **objects: Any) -> TrainingState:
    """Snapshot a Keras model, its optimizer, RNG states and a data cursor (see ``_capture.py``)."""
    from ._capture import capture as _capture
    return _capture(model, optimizer, cursor=cursor, rng=rng, copy=copy, **objects)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, **objects: Any) -> RestoreReport:
    """Put a captured state back into a Keras model and optimizer (see ``_capture.py``)."""
    from ._capture import restore as _restore
    return _restore(state, model, optimizer, cursor=cursor, strict=strict, rng=rng, **objects)


def process_group(strategy: Any = None) -> Any:
    """The workers of a ``MultiWorkerMirroredStrategy`` as a ``ckptcore.ProcessGroup``, over
    TensorFlow's coordination service (see ``_group.py``); a group of one without workers."""
    from ._group import process_group as _process_group
    return _process_group(strategy)


def import_tf_checkpoint(prefix_or_dir: Any, *, model: Any = None,
                         optimizer: Any = None) -> TrainingState:
    """Read a ``tf.train.Checkpoint`` file as a state (see ``_files.py``)."""
    from ._files import import_tf_checkpoint as _import
    return _import(prefix_or_dir, model=model, optimizer=optimizer)


def export_tf_checkpoint(state: TrainingState, prefix: Any, model: Any,
                         optimizer: Any = None, *, strict: bool = True) -> str:
    """Write a state as a ``tf.train.Checkpoint`` file (see ``_files.py``)."""
    from ._files import export_tf_checkpoint as _export
    return _export(state, prefix, model, optimizer, strict=strict)


def dataset(cursor: Any, *arrays: Any, map_fn: Any = None, prefetch: bool = True) -> Any:
    """A ``tf.data.Dataset`` (a ``DataLoader`` on PyTorch) of a ``DataCursor``'s batches,
    resumable mid-epoch (see ``_data.py``)."""
    from ._data import dataset as _dataset
    return _dataset(cursor, *arrays, map_fn=map_fn, prefetch=prefetch)


from ._backend import UnsupportedBackendError  # noqa: E402 - imports numpy and ckptcore only


def __getattr__(name: str) -> Any:
    # BackupAndRestore subclasses keras.callbacks.Callback: defining it imports Keras.
    if name == "BackupAndRestore":
        from ._callback import BackupAndRestore
        return BackupAndRestore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class KerasAdapter(PackageAdapter):
    """The registry's view of this package (the ``ckptcore.adapter.Adapter`` protocol)."""

    name = "keras"
    # capture() never returns views of *live* buffers: its read-only arrays share TensorFlow's
    # copy-on-write buffers, which training replaces rather than changes, so they are snapshots an
    # asynchronous save may keep without copying them first.
    capture_views = False

    def handles(self, obj: object) -> bool:
        # Looks only at module names, so asking never imports TensorFlow.
        return any(getattr(cls, "__module__", "").split(".")[0] in _MODULES
                   for cls in type(obj).__mro__)

    def capture(self, **objects: Any) -> TrainingState:
        return capture(**objects)

    def restore(self, state: TrainingState, **objects: Any) -> RestoreReport:
        # load_state and CheckpointManager.restore warn about an unapplied data position
        # themselves, once per restore, whatever the framework.
        from ._capture import restore as _restore
        return _restore(state, warn_data=False, **objects)


ADAPTER = KerasAdapter()
