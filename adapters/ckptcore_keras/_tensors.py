"""Model variables under stable names, matching saved names to a live model, and moving bytes.

A model's state is every variable in ``model.variables`` (weights, batch-norm
statistics, seed-generator states, ``keras.Variable`` held in lists) under its
Keras path, plus raw ``tf.Variable`` objects a custom ``train_step`` keeps as
attributes (e.g. a step counter and gradient accumulators of a ``train_step``
that applies every few batches).  Keras does not track the latter; they are
named ``<owner path>/<attribute>[/<index or key>]``.

On the TensorFlow backend bytes move through TensorFlow's bare variable ops (see
:func:`to_numpy` and :func:`assign`); on JAX and PyTorch through ``keras.ops`` and the
variable's own ``assign`` (``_backend.py``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import numpy as np

from ._backend import loaded_tensorflow

_AUTO_SUFFIX = re.compile(r"_\d+(?=/|#|$)")


def walk_layers(model: Any) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """``(layer, ancestors)`` for ``model`` and every sublayer, depth first in model order."""
    seen: set[int] = set()

    def visit(layer: Any, ancestors: tuple[Any, ...]) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        yield layer, ancestors
        for sub in getattr(layer, "_layers", None) or ():
            yield from visit(sub, ancestors + (layer,))

    yield from visit(model, ())


def layer_path(layer: Any) -> str:
    return getattr(layer, "path", None) or layer.name


# What an attribute value is, by its exact type: looking the type up once per type instead of
# running isinstance against the tf.Variable and Sequence/Mapping ABCs for every attribute of
# every layer (tens of thousands of checks on a real model, the largest cost of a capture).
_SKIP, _VARIABLE, _SEQUENCE, _MAPPING = 0, 1, 2, 3
_KIND_OF_TYPE: dict[type, int] = {}


def _kind(value: Any) -> int:
    kind = _KIND_OF_TYPE.get(type(value))
    if kind is None:
        tf = loaded_tensorflow()  # not imported: no value is a tf.Variable

        if tf is not None and isinstance(value, tf.Variable):
            kind = _VARIABLE
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            kind = _SEQUENCE
        elif isinstance(value, Mapping):
            kind = _MAPPING
        else:
            kind = _SKIP
        _KIND_OF_TYPE[type(value)] = kind
    return kind


def _raw_variables(model: Any, known: set[int]) -> Iterator[tuple[str, Any, Any]]:
    """``(name, tf.Variable, owner)`` for untracked TF variables held as layer attributes."""
    kinds = _KIND_OF_TYPE
    for layer, _ in walk_layers(model):
        base = layer_path(layer)
        # Direct attributes first, then containers; TF's own tracking tables ("_self_...") never.
        attrs = [(a, v, k if (k := kinds.get(type(v))) is not None else _kind(v))
                 for a, v in vars(layer).items()]
        attrs = [x for x in attrs if x[2] != _SKIP and not x[0].startswith("_self_")]
        for attr, value, kind in [x for x in attrs if x[2] == _VARIABLE] + \
                [x for x in attrs if x[2] != _VARIABLE]:
            if kind == _VARIABLE:
                items = [(f"{base}/{attr}", value)]
            elif kind == _SEQUENCE:
                items = [(f"{base}/{attr}/{i}", v) for i, v in enumerate(value)
                         if kinds.get(type(v)) == _VARIABLE or _kind(v) == _VARIABLE]
            else:
                items = [(f"{base}/{attr}/{k}", v) for k, v in value.items()
                         if kinds.get(type(v)) == _VARIABLE or _kind(v) == _VARIABLE]
            for name, var in items:
                if id(var) not in known:
                    known.add(id(var))
                    yield name, var, layer


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """Every variable of ``model`` as ``(name, variable)`` in a stable order.

    Names are Keras variable paths; a path that occurs twice gets ``#1``, ``#2``...
    """
    out: list[tuple[str, Any]] = []
    used: set[str] = set()

    def add(name: str, var: Any) -> None:
        unique, k = name, 0
        while unique in used:
            k += 1
            unique = f"{name}#{k}"
        used.add(unique)
        out.append((unique, var))

    known: set[int] = set()
    for v in model.variables:
        known.add(id(v))
        known.add(id(getattr(v, "value", v)))
        add(v.path, v)
    for name, var, _ in _raw_variables(model, known):
        add(name, var)
    return out


def raw_owners(model: Any) -> dict[int, Any]:
    """``id(tf.Variable) -> owning layer`` for the untracked variables of :func:`named_tensors`."""
    known = {id(v) for v in model.variables} | {id(getattr(v, "value", v)) for v in model.variables}
    return {id(var): owner for _, var, owner in _raw_variables(model, known)}


def normalize(name: str) -> str:
    """A name without Keras' per-process auto-name suffixes (``dense_3/kernel`` -> ``dense/kernel``)."""
    return _AUTO_SUFFIX.sub("", name)


def match_names(saved: Sequence[str], target: Sequence[str]) -> dict[str, str]:
    """Map saved names to target names.

    Exact names are used when one side's names all occur in the other (the same
    architecture built in another process, or a model that gained or lost
    layers).  Otherwise the names were uniquified differently, e.g. a second
    copy of the model built in the same process (``dense_2`` for ``dense``):
    names are then compared without auto-name suffixes and matched in order.
    """
    s, t = set(saved), set(target)
    if s <= t or t <= s:
        return {n: n for n in saved if n in t}
    groups: dict[str, list[str]] = {}
    for n in target:
        groups.setdefault(normalize(n), []).append(n)
    out: dict[str, str] = {}
    taken: dict[str, int] = {}
    for n in saved:
        key = normalize(n)
        i = taken.get(key, 0)
        if i < len(groups.get(key, ())):
            out[n] = groups[key][i]
            taken[key] = i + 1
    return out


_NP_DTYPES: dict[Any, np.dtype] = {}


def np_dtype(var: Any) -> np.dtype:
    dtype = var.dtype
    out = _NP_DTYPES.get(dtype)
    if out is None:
        if hasattr(dtype, "as_numpy_dtype"):  # tf.DType
            out = np.dtype(dtype.as_numpy_dtype)
        else:
            import keras
            out = np.dtype(keras.backend.standardize_dtype(dtype))
        _NP_DTYPES[dtype] = out
    return out


def shape_of(var: Any) -> tuple[int | None, ...]:
    """The variable's shape as a tuple (what ``RestorePlan.assign`` compares against).

    A ``keras.Variable`` keeps it as a tuple already; its ``shape`` property builds a
    ``tf.TensorShape`` that the check would only take apart again.
    """
    shape = getattr(var, "_shape", None)
    return shape if type(shape) is tuple else tuple(var.shape)


def _plain_tf_variable(var: Any) -> Any | None:
    """The ``tf.Variable`` behind ``var`` (a ``keras.Variable`` or a raw one) when it is a plain,
    single-device resource variable, else None (a mirrored or otherwise distributed variable,
    which reads and writes through its own methods, or a JAX or PyTorch one)."""
    if loaded_tensorflow() is None:
        return None
    from tensorflow.python.ops.resource_variable_ops import ResourceVariable

    if type(var) is ResourceVariable:
        return var
    # keras.Variable keeps its backend variable in ``_value``; its ``value`` property (checks for
    # a stateless scope and autocasting) costs more than the read itself.
    tf_var = getattr(var, "_value", None)
    if type(tf_var) is not ResourceVariable:
        tf_var = getattr(var, "value", None)
    return tf_var if type(tf_var) is ResourceVariable else None


def to_numpy(var: Any, copy: bool = True) -> np.ndarray:
    """The variable's value now, as a read-only numpy array that later updates never change.

    On TensorFlow no copy is made, whatever ``copy`` says: the array views the tensor a read of
    the variable returns, which shares the variable's buffer.  TensorFlow
    variables are copy-on-write: while that tensor lives, an update (``assign*``,
    an optimizer step) writes a new buffer, so the array stays a snapshot; a copy
    would only cost time and memory.  ``copy`` is accepted so that every adapter
    has the same signature (``copy=False`` elsewhere means "may view live
    buffers"; here both give the same immutable snapshot).  Mirrored variables
    give the first replica's value.

    A plain variable is read with the bare ``ReadVariableOp`` (the op ``read_value`` runs,
    without its Python layers: gradient-tape bookkeeping, dispatch, an ``identity``), a third of
    the cost on a model of hundreds of variables.

    On JAX and PyTorch the value is copied (``keras.ops.convert_to_numpy``, then a copy):
    PyTorch updates its tensors in place, and Keras' JAX trainer donates its buffers.
    """
    del copy  # a snapshot either way, see above
    plain_var = _plain_tf_variable(var)
    tf = loaded_tensorflow()
    if plain_var is not None:
        arr = np.asarray(tf.raw_ops.ReadVariableOp(resource=plain_var.handle, dtype=plain_var.dtype))
    elif tf is not None and isinstance(tf_var := var if isinstance(var, tf.Variable)
                                       else getattr(var, "value", None), tf.Variable):
        arr = np.asarray(tf_var.read_value())  # a mirrored or distributed variable
    else:
        arr = _backend_numpy(var)
    if arr.flags.writeable:  # make every capture read-only alike
        arr.flags.writeable = False
    return arr


def _backend_numpy(var: Any) -> np.ndarray:
    """A copy of a JAX or PyTorch variable's value (or of a tensor) as a numpy array."""
    import keras

    value = getattr(var, "value", var)  # keras.Variable -> its backend tensor
    if sys.modules.get("torch") is not None and hasattr(value, "detach"):
        value = value.detach()
    return np.array(keras.ops.convert_to_numpy(value), copy=True)


# TensorFlow adopts a numpy array's memory as a tensor's buffer, without copying it, when the
# data is aligned for Eigen (64 bytes covers every CPU build); otherwise it copies.
_ALIGN = 64


def _private_copy(value: np.ndarray) -> np.ndarray:
    """A copy of ``value`` in new memory aligned so that TensorFlow adopts it as it is."""
    raw = np.empty(value.nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    np.copyto(out, value)
    return out


def assign(target: Any, value: np.ndarray) -> None:
    """Write ``value`` (already checked to fit, see ``RestorePlan.assign``) into ``target``.

    ``value`` is copied once, into new memory that becomes the variable's buffer: the array
    may map a checkpoint file or belong to the caller, so the variable never shares it.  A
    plain variable takes the copy through the bare ``AssignVariableOp`` (the op ``assign``
    runs, without the Python layers of ``keras.Variable.assign`` and ``tf.Variable.assign``:
    conversion, shape check, dispatch, done here and by the plan), which adopts aligned memory
    as it is; ``tf.constant`` would copy twice (a numpy copy, then again into aligned memory
    for most arrays), and on a real model of hundreds of variables those layers and copies
    cost more than the data.  Other variables (mirrored, other dtypes, a ``StatelessScope``)
    go through their own ``assign``.  Converting on several threads was measured slower:
    each thread's allocations take fresh pages instead of the buffers the swaps just freed.
    """
    plain_var = _plain_tf_variable(target)
    if (plain_var is None or getattr(value, "dtype", None) != np_dtype(plain_var)
            or np.shape(value) != tuple(plain_var.shape) or _in_stateless_scope()):
        target.assign(value)  # casts, checks the shape, or goes through the scope, as it always did
        return
    import tensorflow as tf

    value = np.asarray(value)
    # Only a private copy may be handed to the op: it adopts aligned memory without copying.
    tensor = _private_copy(value) if value.nbytes and not value.dtype.hasobject \
        else tf.constant(value)  # empty, or strings: nothing to adopt
    tf.raw_ops.AssignVariableOp(resource=plain_var.handle, value=tensor)


def _in_stateless_scope() -> bool:
    """Whether Keras routes assignments to a ``StatelessScope`` (then only ``assign`` does it)."""
    try:
        from keras.src.backend.common.stateless_scope import in_stateless_scope
    except ImportError:  # pragma: no cover - another Keras layout: never skip its assign
        return True
    return in_stateless_scope()
