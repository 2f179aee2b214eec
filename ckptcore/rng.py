"""Capture and restore Python and numpy random states as plain, msgpack-able values.

:func:`capture_rng` returns a dict for ``TrainingState.rng``; adapters add
their framework's generators under their own keys next to these::

    {
      "python": {"version": 3, "state": uint32[625], "gauss_next": float | None},
      "numpy": {<bit-generator state>, "has_gauss": int, "gauss": float},
      "numpy_generators": {name: <bit-generator state>, ...},
    }

* ``"python"`` is ``random.getstate()``: ``state`` holds its 625 words (the
  Mersenne Twister's 624 plus the position) as a numpy ``uint32`` array.
* ``"numpy"`` is the global legacy ``RandomState`` behind ``np.random.*``
  (some frameworks' data loaders shuffle with it): ``np.random.get_state(legacy=False)``.
* ``"numpy_generators"`` maps each name given to ``capture_rng`` to its
  ``Generator.bit_generator.state``.

A bit-generator state is numpy's own dict (``{"bit_generator": "PCG64",
"state": {...}, ...}``) with two changes so that msgpack can hold it: numpy
scalars become Python ints, floats and bools, and an int outside the int64
range becomes its base-10 string (PCG64's ``state`` and ``inc`` are 128-bit;
msgpack stops at 64 bits).  Arrays stay ``numpy`` arrays; the codec stores them
as tensors.  On restore, every string except the ``"bit_generator"`` name is
read back as an int, so both forms are accepted.

Restoring reproduces the following draws bit for bit.  Everything is
validated before anything is changed, so a bad entry leaves every generator
as it was.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .errors import RestoreError, SchemaError

__all__ = ["capture_rng", "restore_rng"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_NAME = "bit_generator"
_STATE_ERRORS = (TypeError, ValueError, KeyError, IndexError, OverflowError)


def _encode(value: Any) -> Any:
    """numpy's state tree as msgpack-able values (see the module docstring)."""
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.copy()  # never share a buffer with a live generator
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        return {k: (v if k == _NAME else _decode(v, f"{where}[{k!r}]")) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        try:
            return int(value, 10)
        except ValueError:
            raise SchemaError(f"rng{where}: expected an int or its decimal string, "
                              f"got {value!r}") from None
    return value


def _bit_generator(obj: Any, name: str) -> np.random.BitGenerator:
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator
    if isinstance(obj, np.random.BitGenerator):
        return obj
    raise TypeError(f"generators[{name!r}] must be a numpy.random.Generator or BitGenerator, "
                    f"got {type(obj).__name__}")


def capture_rng(*, python: bool = True, numpy: bool = True,
                generators: Mapping[str, np.random.Generator] | None = None) -> dict[str, Any]:
    """Snapshot random states as plain values for ``TrainingState.rng``.

    Args:
        python: Include the global ``random`` module's state.
        numpy: Include the global legacy ``np.random`` state.
        generators: Named ``numpy.random.Generator`` (or ``BitGenerator``)
            objects to include under ``"numpy_generators"``.

    Returns:
        A new dict; nothing in it shares memory with a live generator.

    Example:
        >>> import random
        >>> saved = capture_rng()
        >>> a = random.random()
        >>> restore_rng(saved)
        >>> random.random() == a
        True
    """
    out: dict[str, Any] = {}
    if python:
        version, internal, gauss_next = random.getstate()
        out["python"] = {"version": version, "state": np.array(internal, dtype=np.uint32),
                         "gauss_next": gauss_next}
    if numpy:
        out["numpy"] = _encode(np.random.get_state(legacy=False))
    if generators is not None:
        if not isinstance(generators, Mapping):
            raise TypeError(f"generators must be a mapping of names to Generators, "
                            f"got {type(generators).__name__}")
        out["numpy_generators"] = {str(name): _encode(_bit_generator(g, name).state)
                                   for name, g in generators.items()}
    return out


def restore_rng(rng: Mapping[str, Any], *,
                generators: Mapping[str, np.random.Generator] | None = None) -> None:
    """Put back the states :func:`capture_rng` took.

    ``"python"`` and ``"numpy"`` are restored when present.  Named generators
    are restored only into the objects passed as ``generators``, which must
    use the same bit generator type as when captured; saved generators not
    named there are left alone.

    Raises:
        SchemaError: An entry is malformed; the message names its key.
        RestoreError: A saved generator does not fit the object given for it.

    Example:
        >>> import numpy as np
        >>> gen = np.random.default_rng(0)
        >>> saved = capture_rng(python=False, numpy=False, generators={"aug": gen})
        >>> x = gen.integers(1 << 62)
        >>> restore_rng(saved, generators={"aug": gen})
        >>> int(gen.integers(1 << 62)) == int(x)
        True
    """
    if not isinstance(rng, Mapping):
        raise SchemaError(f"rng state must be a mapping, got {type(rng).__name__}")
    apply: list[Callable[[], None]] = []  # run only after every entry validated
    if "python" in rng:
        apply.append(_check_python(rng["python"]))
    if "numpy" in rng:
        state = _check_bitgen_state(rng["numpy"], "['numpy']")
        _try(lambda: np.random.RandomState().set_state(state), "['numpy']")
        apply.append(lambda: np.random.set_state(state))
    for name, gen in (generators or {}).items():
        apply.append(_check_generator(rng, name, _bit_generator(gen, name)))
    for step in apply:
        step()


def _try(action: Callable[[], Any], where: str) -> None:
    try:
        action()
    except _STATE_ERRORS as e:
        raise SchemaError(f"rng{where}: not a valid random state ({e})") from e


def _check_python(entry: Any) -> Callable[[], None]:
    if not isinstance(entry, Mapping) or {"version", "state", "gauss_next"} - entry.keys():
        raise SchemaError("rng['python'] must be a mapping with 'version', 'state' and 'gauss_next'")
    words = np.asarray(entry["state"])
    if words.shape != (625,) or words.dtype.kind not in "ui":
        raise SchemaError(f"rng['python']['state'] must hold 625 integers, got shape "
                          f"{words.shape} of {words.dtype}")
    gauss = entry["gauss_next"]
    if gauss is not None and (isinstance(gauss, bool) or not isinstance(gauss, (int, float))):
        raise SchemaError(f"rng['python']['gauss_next'] must be a float or None, got {gauss!r}")
    state = (entry["version"], tuple(int(w) for w in words.tolist()),
             None if gauss is None else float(gauss))
    _try(lambda: random.Random().setstate(state), "['python']")
    return lambda: random.setstate(state)


def _check_bitgen_state(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, Mapping) or not isinstance(entry.get(_NAME), str):
        raise SchemaError(f"rng{where} must be a bit-generator state mapping with a "
                          f"{_NAME!r} name")
    return _decode(entry, where)


def _check_generator(rng: Mapping[str, Any], name: str,
                     bitgen: np.random.BitGenerator) -> Callable[[], None]:
    where = f"['numpy_generators'][{name!r}]"
    saved = rng.get("numpy_generators")
    if not isinstance(saved, Mapping) or name not in saved:
        raise SchemaError(f"rng{where} is missing: no generator named {name!r} was captured")
    state = _check_bitgen_state(saved[name], where)
    current = bitgen.state[_NAME]
    if state[_NAME] != current:
        raise RestoreError(f"rng{where} was captured from a {state[_NAME]} generator but the "
                           f"object given uses {current}; create it with "
                           f"numpy.random.Generator(numpy.random.{state[_NAME]}())")
    _try(lambda: setattr(type(bitgen)(), "state", state), where)
    return lambda: setattr(bitgen, "state", state)
