"""Discovery of a model's (or an optimizer's) named leaves, and moving bytes between them and a
state.

Names are paths joined by ``/``: an NNX variable's graph path (``lin/kernel``, ``bn/mean``), a
pytree leaf's key path (dict keys, sequence indices, attribute names: ``0/mu/lin/kernel``).

A :class:`Leaves` is one target's leaves in order, each with a way to put a new value back: an
NNX ``Variable`` is set in place, a ``dict``/``list`` container item is replaced in place, a
:class:`~ckptcore_jax.Ref`'s pytree is rebuilt with the new leaves once all of them are in.

Typed ``jax.random`` keys (``jax.random.key``) are stored as their ``key_data`` (uint32) with the
key's implementation name beside them; raw keys (``PRNGKey``) are plain uint32 arrays already.

A restore target's leaf may be abstract, a ``jax.ShapeDtypeStruct`` (``jax.eval_shape``,
``nnx.eval_shape``; with a ``sharding`` or without: then the default device), as Orbax restores
into: the restored array is made with its shape, dtype and sharding, and nothing is allocated
for the leaf before.

A leaf is a ``jax.Array``, a NumPy array or scalar (``np.float32(1)``), or a Python ``bool``/
``int``/``float``/``complex``: what :func:`assign` can put back.  An NNX ``Variable`` whose value
has no pytree leaves (``None``, an empty tuple, Optax's ``MaskedNode``, which ``optax.masked`` and
``optax.multi_transform`` leave for the parameters a transformation does not touch) holds
nothing: it is no leaf, on capture and on restore alike, as ``jax.tree_util`` flattening drops
such values from a pytree.  Any other value (a string, a tuple of arrays in one ``Variable``) is
a CaptureError when saved, never a checkpoint that cannot be restored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ckptcore.errors import RestoreError

__all__ = ["Leaves", "named_tensors", "pytree_leaves", "nnx_leaves", "path_name", "is_key",
           "is_abstract", "key_impl", "to_numpy", "key_data", "assign", "is_leaf_value",
           "holds_nothing"]

# The Python scalar leaves assign() puts back as their own type.
_SCALARS = (bool, int, float, complex)


def path_name(path: tuple[Any, ...]) -> str:
    """A key path (NNX graph path or ``jax.tree_util`` keys) as a ``/``-joined name."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr) and not isinstance(k, (str, int)):
                k = getattr(k, attr)
                break
        parts.append(str(k))
    return "/".join(parts)


def is_key(x: Any) -> bool:
    """``x`` is a typed ``jax.random`` key array (``key<fry>``...)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_abstract(x: Any) -> bool:
    """``x`` is a ``jax.ShapeDtypeStruct``: a leaf to restore into that holds no data yet."""
    return isinstance(x, jax.ShapeDtypeStruct)


def key_impl(x: Any) -> str:
    if is_abstract(x):
        # jax.random.key_impl takes only concrete keys; an abstract key's dtype (key<fry>) holds
        # the implementation it names.
        return str(x.dtype._impl.name)
    return str(jax.random.key_impl(x))


def key_data(x: Any) -> Any:
    if is_abstract(x):
        return jax.eval_shape(jax.random.key_data, x)
    return jax.random.key_data(x)


def is_leaf_value(x: Any) -> bool:
    """``x`` is a value :func:`assign` can put back (or an abstract leaf to restore into)."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, *_SCALARS))


def holds_nothing(x: Any) -> bool:
    """``x`` (an NNX Variable's value) has no pytree leaves: ``None``, an empty tuple or
    NamedTuple (Optax's ``MaskedNode``), an empty dict."""
    return not is_leaf_value(x) and not jax.tree_util.tree_leaves(x)


@dataclass
class Leaves:
    """One target's leaves: ``values[name]`` is the live leaf; :meth:`put` records a new value,
    :meth:`commit` writes every recorded value back into the target at once.  ``empty`` holds
    the NNX Variables that hold nothing (:func:`holds_nothing`), by name: no leaves, but a
    checkpoint written before they were left out holds an empty array under their names."""

    values: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # name -> NNX variable class name
    empty: dict[str, Any] = field(default_factory=dict)
    _setters: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    _finish: Callable[[dict[str, Any]], None] | None = None
    _new: dict[str, Any] = field(default_factory=dict)

    def put(self, name: str, value: Any) -> None:
        self._new[name] = value

    def commit(self) -> None:
        new, self._new = self._new, {}
        if self._finish is not None:
            self._finish(new)
            return
        for name, value in new.items():
            self._setters[name](value)


def nnx_leaves(obj: Any, *, skip: tuple[str, ...] = ()) -> tuple[Leaves, Leaves]:
    """An NNX object's variables: (its other variables, its RNG stream variables), by graph
    path.  Path components listed in ``skip`` are left out of the names (``opt_state``)."""
    from flax import nnx

    main, rngs = Leaves(), Leaves()
    for path, node in nnx.iter_graph(obj):
        if not isinstance(node, nnx.Variable):
            continue
        name = path_name(tuple(p for p in path if p not in skip))
        target = rngs if isinstance(node, nnx.RngState) else main
        value = node.get_value()
        if holds_nothing(value):
            target.empty[name] = value
            continue
        target.values[name] = value
        target.kinds[name] = type(node).__name__
        target._setters[name] = node.set_value
    return main, rngs


def pytree_leaves(tree: Any, owner: Any = None) -> Leaves:
    """A pytree's leaves by key path.  With ``owner`` (a :class:`~ckptcore_jax.Ref`), new
    values rebuild the pytree into ``owner.value``; without, ``tree`` must be made of dicts and
    lists, whose items are replaced in place."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = Leaves()
    names = [path_name(p) for p, _ in flat]
    if len(set(names)) != len(names):
        raise TypeError("two leaves of the pytree have the same path name; use distinct keys")
    for name, (path, leaf) in zip(names, flat):
        leaves.values[name] = leaf
        if owner is None:
            leaves._setters[name] = _container_setter(tree, path)
    if owner is not None:
        def finish(new: dict[str, Any]) -> None:
            values = [new.get(n, leaves.values[n]) for n in names]
            owner.value = jax.tree_util.tree_unflatten(treedef, values)
        leaves._finish = finish
    return leaves


def _container_setter(tree: Any, path: tuple[Any, ...]) -> Callable[[Any], None]:
    node = tree
    for k in path[:-1]:
        node = node[_index(k)]
    last = _index(path[-1]) if path else None
    if not isinstance(node, (dict, list)) or last is None:
        raise TypeError(f"{path_name(path)}: the pytree holds it in a "
                        f"{type(node).__name__}, which cannot be changed in place; wrap the "
                        "pytree in ckptcore_jax.Ref(tree) and read ref.value after restore")

    def put(value: Any) -> None:
        node[last] = value
    return put


def _index(k: Any) -> Any:
    for attr in ("key", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"pytree key {k!r} is not a dict key or a list index")


def named_tensors(model: Any) -> tuple[Leaves, Leaves]:
    """A model's leaves: (model variables, NNX RNG stream variables).  ``model`` is an NNX
    Module, a Ref of a pytree, or a dict-rooted pytree."""
    from ckptcore_jax import Ref

    if _is_nnx(model):
        return nnx_leaves(model)
    if isinstance(model, Ref):
        return pytree_leaves(model.value, model), Leaves()
    if isinstance(model, (dict, list)):
        return pytree_leaves(model), Leaves()
    raise TypeError(f"ckptcore_jax needs a flax.nnx.Module, a dict of arrays or a "
                    f"ckptcore_jax.Ref(pytree) as the model, got "
                    f"{type(model).__module__}.{type(model).__qualname__}")


def _is_nnx(obj: Any) -> bool:
    if not any(getattr(c, "__module__", "").startswith("flax.") for c in type(obj).__mro__):
        return False
    from flax import nnx
    return isinstance(obj, (nnx.Module, nnx.Pytree)) if hasattr(nnx, "Pytree") else isinstance(obj, nnx.Module)


def to_numpy(x: Any, copy: bool = True) -> np.ndarray:
    """A single-block leaf as a NumPy array: a copy, or with ``copy=False`` a zero-copy view of
    the buffer where JAX allows one."""
    return np.array(x, copy=True) if copy else np.asarray(x)


def assign(like: Any, array: Any, name: str) -> Any:
    """``array`` (a jax.Array of the live leaf's block layout) as the live leaf ``like`` is:
    same dtype, devices and sharding; Python scalars and NumPy leaves stay what they were."""
    if isinstance(like, jax.Array):
        return array
    if isinstance(like, np.ndarray):
        return np.asarray(array).astype(like.dtype, copy=False)
    # Before the Python scalars: np.float64 and np.complex128 are float and complex too, and
    # must come back as themselves.  Indexing a 0-d array of the dtype gives its NumPy scalar,
    # the same bits.
    if isinstance(like, np.generic):
        return np.asarray(array).astype(like.dtype, copy=False)[()]
    if isinstance(like, _SCALARS):
        return type(like)(np.asarray(array)[()])
    raise RestoreError(f"{name}: cannot restore into a leaf of type {type(like).__name__}")
