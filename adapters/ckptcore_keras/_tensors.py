"""Model variables under stable names, matching saved names to a live model, and moving bytes.

A model's state is every variable in ``model.variables`` (weights, batch-norm
statistics, seed-generator states, ``keras.Variable`` held in lists) under its
Keras path, plus raw ``tf.Variable`` objects a custom ``train_step`` keeps as
attributes (e.g. a step counter and gradient accumulators of a ``train_step``
that applies every few batches).  Keras does not track the latter; they are
named ``<owner path>/<attribute>[/<index or key>]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import numpy as np

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


def _raw_variables(model: Any, known: set[int]) -> Iterator[tuple[str, Any, Any]]:
    """``(name, tf.Variable, owner)`` for untracked TF variables held as layer attributes."""
    import tensorflow as tf

    for layer, _ in walk_layers(model):
        base = layer_path(layer)
        # Direct attributes first, then containers; TF's own tracking tables ("_self_...") never.
        attrs = [(a, v) for a, v in vars(layer).items() if not a.startswith("_self_")]
        attrs.sort(key=lambda av: not isinstance(av[1], tf.Variable))
        for attr, value in attrs:
            if isinstance(value, tf.Variable):
                items = [(f"{base}/{attr}", value)]
            elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
                items = [(f"{base}/{attr}/{i}", v) for i, v in enumerate(value)]
            elif isinstance(value, Mapping):
                items = [(f"{base}/{attr}/{k}", v) for k, v in value.items()]
            else:
                continue
            for name, var in items:
                if isinstance(var, tf.Variable) and id(var) not in known:
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


def np_dtype(var: Any) -> np.dtype:
    dtype = var.dtype
    if hasattr(dtype, "as_numpy_dtype"):  # tf.DType
        return np.dtype(dtype.as_numpy_dtype)
    import keras
    return np.dtype(keras.backend.standardize_dtype(dtype))


def to_numpy(var: Any, copy: bool = True) -> np.ndarray:
    """The variable's value now, as a read-only numpy array that later updates never change.

    No copy is made, whatever ``copy`` says: the array views the tensor a read of
    the variable returns, which shares the variable's buffer.  TensorFlow
    variables are copy-on-write: while that tensor lives, an update (``assign*``,
    an optimizer step) writes a new buffer, so the array stays a snapshot; a copy
    would only cost time and memory.  ``copy`` is accepted so that every adapter
    has the same signature (``copy=False`` elsewhere means "may view live
    buffers"; here both give the same immutable snapshot).  Mirrored variables
    give the first replica's value.
    """
    del copy  # a snapshot either way, see above
    import tensorflow as tf

    tf_var = var if isinstance(var, tf.Variable) else getattr(var, "value", None)  # keras.Variable
    arr = np.asarray(tf_var.read_value() if isinstance(tf_var, tf.Variable) else var.numpy())
    if arr.flags.writeable:  # a path that copied: fine, but make every capture read-only alike
        arr.flags.writeable = False
    return arr


def assign(target: Any, value: np.ndarray) -> None:
    """Write ``value`` (already checked to fit, see ``RestorePlan.assign``) into ``target``.

    The assign copies the array into a new TensorFlow buffer (conversion never
    aliases numpy memory), then swaps it in.  Converting on several threads was
    measured slower: each thread's allocations take fresh pages instead of the
    buffers the swaps just freed.
    """
    target.assign(value)
