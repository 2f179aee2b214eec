"""ckptcore adapter for JAX: Flax NNX models, Optax optimizer states, ``jax.random`` keys and
sharded ``jax.Array``s.

Importing this package does not import JAX; it loads on the first call that needs it.  The
registry finds :data:`ADAPTER` through the ``ckptcore.adapters`` entry point
(``jax = "ckptcore_jax:ADAPTER"``).

What can be captured and restored:

* ``model``: a Flax NNX ``Module`` (restored in place, variable by variable), a ``dict``-rooted
  pytree of arrays (its leaves replaced in place), or any pytree held in a :class:`Ref`;
* ``optimizer``: an ``nnx.Optimizer``, or an Optax state pytree held in a :class:`Ref`;
* ``cursor``: a :class:`ckptcore.DataCursor`; ``step``: the update count.

A restore target's leaves may be abstract (``jax.ShapeDtypeStruct``, from ``jax.eval_shape`` or
``nnx.eval_shape``): the restored arrays take their shape, dtype and sharding.

JAX arrays are immutable: a restore puts new arrays (same dtype, device and sharding as the live
ones) where the old ones were, which is why a bare Optax state (a tuple of NamedTuples) needs a
:class:`Ref` to be restored into.

Module map (the same as the other adapters'): ``_tensors`` (discovery of named leaves, typed
keys, moving bytes), ``_sharding`` (``jax.Array`` <-> ``ckptcore.Shard``/``Chunks``), ``_params``
(ParamInfo), ``_optimizer`` (Optax state keyed by parameter path), ``_rng`` (NNX RNG streams),
``_capture`` (capture/restore), ``_group`` (``process_group``), ``_files`` (Orbax checkpoints),
``_structure`` (what feeds what, from a traced forward pass), ``_optax`` (which optimizer an Optax
transformation is), ``_dialect`` (migration), ``_demo``.

Example:
    >>> import ckptcore, ckptcore_jax                                         # doctest: +SKIP
    >>> ckptcore.save_state("ckpts/step-100", model=model, optimizer=opt, cursor=cursor)  # doctest: +SKIP
    >>> ckptcore.load_state("ckpts/step-100", model=model, optimizer=opt, cursor=cursor,
    ...                     like=ckptcore_jax.template(model, opt))          # doctest: +SKIP
    >>> params, opt_state = ckptcore_jax.Ref(params), ckptcore_jax.Ref(opt_state)  # doctest: +SKIP
    >>> ckptcore_jax.restore(state, params, opt_state)   # params.value, opt_state.value: restored  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptcore.adapter import PackageAdapter, check_keywords

if TYPE_CHECKING:  # pragma: no cover
    import os

    from ckptcore.state import RestoreReport, TrainingState

__all__ = ["ADAPTER", "capture", "restore", "template", "process_group", "import_orbax",
           "export_orbax", "Ref", "NotYetImplementedError"]

_CAPTURE_KEYWORDS = frozenset({"model", "optimizer", "cursor", "rng", "copy", "step"})
_RESTORE_KEYWORDS = frozenset({"model", "optimizer", "cursor", "strict", "rng"})


class NotYetImplementedError(NotImplementedError):
    """A part of the JAX adapter that is planned (issue 26) but not built yet; the message says
    which part and what to use meanwhile."""


class Ref:
    """A mutable holder of an immutable pytree (parameters, an Optax state) for ``restore`` to
    put the restored pytree into: ``ref.value`` afterwards.  For an Optax state, ``tx=`` (the
    transformation that made it) lets a capture say which optimizer it is, which migration to
    another framework needs (an ``nnx.Optimizer`` carries its own ``tx``).

    >>> ref = Ref({"w": 1.0}); ref.value
    {'w': 1.0}
    """

    __slots__ = ("value", "tx")

    def __init__(self, value: Any, *, tx: Any = None) -> None:
        self.value = value
        self.tx = tx

    def __repr__(self) -> str:
        return f"ckptcore_jax.Ref({type(self.value).__name__})"


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True,
            copy: bool = True, step: int | None = None) -> TrainingState:
    """Snapshot an NNX model (or a parameter pytree), an ``nnx.Optimizer`` (or an Optax state),
    its RNG streams and a data cursor (see ``_capture.py``)."""
    from ._capture import capture as _capture
    return _capture(model, optimizer, cursor=cursor, rng=rng, copy=copy, step=step)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, warn_data: bool = True) -> RestoreReport:
    """Put a captured state back, bit for bit, every array with the dtype, devices and sharding
    of the live one it replaces (see ``_capture.py``)."""
    from ._capture import restore as _restore
    return _restore(state, model, optimizer, cursor=cursor, strict=strict, rng=rng,
                    warn_data=warn_data)


def template(model: Any, optimizer: Any = None) -> TrainingState:
    """The ``like=`` state for ``ckptcore.load_state`` that asks for exactly the blocks the live
    arrays of ``model`` and ``optimizer`` hold on this process's devices (see ``_sharding.py``):
    a load into another mesh reads only those bytes."""
    from ._capture import template as _template
    return _template(model, optimizer)


def process_group() -> Any:
    """This JAX job's processes as a ``ckptcore.ProcessGroup``: a group of one in a single
    process, else the processes of ``jax.distributed`` over its coordination service (see
    ``_group.py``)."""
    from ._group import process_group as _process_group
    return _process_group()


def import_orbax(path: str | os.PathLike, **options: Any) -> TrainingState:
    """Read an Orbax step (``StandardCheckpointer``/``CheckpointManager``; OCDBT or not, zarr v2
    or zarr3) through TensorStore, treating the folder as untrusted (see ``_files.py``)."""
    from ._files import import_orbax as _import
    return _import(path, **options)


def export_orbax(state: TrainingState, path: str | os.PathLike, **options: Any) -> Any:
    """Write an Orbax checkpoint that ``StandardCheckpointer().restore(path, target)`` restores
    bit for bit (``target=``: that pytree, whose structure is written; ``overwrite=True`` replaces
    a folder already at ``path``; see ``_files.py``)."""
    from ._files import export_orbax as _export
    return _export(state, path, **options)


def _jax_leaf(obj: object) -> bool:
    return any(getattr(c, "__module__", "").startswith(("jax", "jaxlib")) and c.__name__ in
               ("ArrayImpl", "Array", "PRNGKeyArray", "ShapeDtypeStruct") for c in type(obj).__mro__)


class JaxAdapter(PackageAdapter):
    """The registry's view of this package (the :class:`ckptcore.adapter.Adapter` protocol)."""

    name = "jax"
    # capture(copy=False) returns zero-copy NumPy views of CPU buffers: JAX never changes an
    # array, but a jitted step that donates its inputs reuses their memory.
    capture_views = True

    def handles(self, obj: object) -> bool:
        # Class and module names only, so asking never imports JAX: an NNX Module, a Ref, or a
        # dict/list pytree whose first leaf is a jax.Array.
        if isinstance(obj, Ref):
            return True
        if any(c.__name__ == "Module" and getattr(c, "__module__", "").startswith("flax.nnx")
               for c in type(obj).__mro__):
            return True
        node: Any = obj
        for _ in range(32):
            if isinstance(node, dict) and node:
                node = next(iter(node.values()))
            elif isinstance(node, (list, tuple)) and node:
                node = node[0]
            else:
                break
        return node is not obj and _jax_leaf(node)

    def capture(self, **objects: Any) -> TrainingState:
        check_keywords(__name__, "capture", objects, _CAPTURE_KEYWORDS)
        return capture(**objects)

    def restore(self, state: TrainingState, **objects: Any) -> RestoreReport:
        check_keywords(__name__, "restore", objects, _RESTORE_KEYWORDS)
        # load_state and the manager warn about a data position left unapplied themselves.
        return restore(state, warn_data=False, **objects)


ADAPTER = JaxAdapter()
