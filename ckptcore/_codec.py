"""TrainingState <-> (msgpack-able tree with tensor references, list of arrays); dtype names.

The tree keeps every non-array value as msgpack data.  Arrays are replaced by
msgpack extension objects pointing into the manifest's tensor table, so a user
dict can never be mistaken for a reference:

* ext 1 ``TENSOR``: payload is a msgpack uint, the tensor's index.
* ext 2 ``TUPLE``:  payload is a msgpack array (packed with the same rules),
  so tuples come back as tuples (``random.getstate()`` needs that).
* ext 3 ``SCALAR``: a numpy scalar (``np.float32(1.5)``), stored as a 0-d
  tensor; payload is the tensor's index.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import numpy as np

from .errors import SchemaError
from .state import (AccumulationState, OptimizerState, ParamInfo, ScheduleState,
                    TrainingState)

EXT_TENSOR, EXT_TUPLE, EXT_SCALAR = 1, 2, 3
_INT_MIN, _UINT_MAX = -(2 ** 63), 2 ** 64 - 1

# ---------------------------------------------------------------------------------------- dtypes
_PLAIN = ("bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
          "float128 complex64 complex128 complex256").split()
_ML = ("bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e4m3b11fnuz "
       "float8_e3m4 float8_e4m3 float8_e8m0fnu float6_e2m3fn float6_e3m2fn float4_e2m1fn "
       "int2 int4 uint2 uint4").split()
_SIZED = re.compile(r"^([USV])(0|[1-9][0-9]{0,8})$")  # 0: numpy allows zero-width V0
_TIME = re.compile(r"^(datetime64|timedelta64)(\[[0-9]*(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?$")


def dtype_name(dtype: np.dtype, *, where: str = "array") -> str:
    """The format's name for ``dtype``; ``TypeError`` for dtypes that cannot be stored as raw bytes."""
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"{where}: dtype {dtype} cannot be stored (object and structured dtypes "
                        "would need pickle); convert it to a plain numeric, string or bytes dtype")
    if dtype.kind in "USV" and dtype.name not in _ML:
        return f"{dtype.kind}{dtype.itemsize // (4 if dtype.kind == 'U' else 1)}"
    if dtype.kind in "mM" or dtype.name in _PLAIN or dtype.name in _ML:
        return dtype.name
    raise TypeError(f"{where}: dtype {dtype} is not supported")


def parse_dtype(name: object, *, where: str = "tensor") -> np.dtype:
    """The little-endian numpy dtype a stored name denotes; ``SchemaError`` for unknown names."""
    if not isinstance(name, str):
        raise SchemaError(f"{where}: dtype must be a string, got {type(name).__name__}")
    try:
        if name in _PLAIN and hasattr(np, name):
            return np.dtype(name).newbyteorder("<")
        if name in _ML:
            import ml_dtypes
            return np.dtype(getattr(ml_dtypes, name))
        m = _SIZED.match(name)
        if m:
            return np.dtype(f"<{m.group(1)}{m.group(2)}")
        if _TIME.match(name):
            return np.dtype(name).newbyteorder("<")
    except (TypeError, AttributeError, ImportError) as e:
        raise SchemaError(f"{where}: dtype {name!r} is not available here ({e})") from e
    raise SchemaError(f"{where}: unknown dtype {name!r}")


def to_little_endian(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous, little-endian array with ``arr``'s values (no copy when already so)."""
    if arr.dtype.byteorder == ">":
        little = arr.dtype.newbyteorder("<")
        if arr.dtype.kind in "mM":  # numpy's cast skips the byte swap for generic-unit datetimes
            arr = np.ascontiguousarray(arr).reshape(arr.shape).byteswap().view(little)
        else:
            arr = arr.astype(little)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr).reshape(arr.shape)
    return arr


# ------------------------------------------------------------------------------------------ tree
@dataclass(frozen=True)
class TensorRef:
    index: int
    scalar: bool = False


@dataclass
class Encoded:
    """A state split into a packable tree, its arrays and their names (parallel lists)."""

    tree: dict[str, Any]
    arrays: list[np.ndarray]
    names: list[str]


class _Encoder:
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.names: list[str] = []
        self._seen: set[str] = set()

    def _add(self, arr: np.ndarray, path: tuple) -> int:
        name = "/".join(str(p) for p in path)
        dtype_name(arr.dtype, where=f"tensor {name!r}")
        unique, n = name, 1
        while unique in self._seen:  # "a/b" as a key and as a nested path would collide
            unique, n = f"{name}#{n}", n + 1
        self._seen.add(unique)
        self.arrays.append(arr)
        self.names.append(unique)
        return len(self.arrays) - 1

    def encode(self, value: Any, path: tuple) -> Any:
        # numpy scalars first: np.float64, np.str_ and np.bytes_ subclass float, str and bytes,
        # and would otherwise come back as plain Python values.
        if isinstance(value, np.generic):
            idx = self._add(np.asarray(value), path)
            return msgpack.ExtType(EXT_SCALAR, msgpack.packb(idx))
        if value is None or isinstance(value, (bool, bytes, float)):
            return value
        if isinstance(value, (str, int)):
            return _check_atom(value, path)
        if isinstance(value, np.ndarray):
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb(self._add(value, path)))
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"{_where(path)}: dict keys must be str or int, got {k!r}")
                out[_check_atom(k, path)] = self.encode(v, path + (k,))
            return out
        if isinstance(value, list):
            return [self.encode(v, path + (i,)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.encode(v, path + (i,)) for i, v in enumerate(value)]
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
        raise TypeError(f"{_where(path)}: cannot store a {type(value).__module__}.{type(value).__qualname__}; "
                        "use numpy arrays, numbers, strings, bytes, lists, tuples and dicts")


def _check_atom(value: str | int, path: tuple) -> str | int:
    """A str or int (value or dict key) that msgpack can hold, else ``TypeError`` naming ``path``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates
            raise TypeError(f"{_where(path)}: string {value!r} is not valid UTF-8 ({e.reason})") from e
    elif not _INT_MIN <= value <= _UINT_MAX:
        raise TypeError(f"{_where(path)}: integer {value} does not fit in 64 bits; store it as a string")
    return value


def _where(path: tuple) -> str:
    return "state." + "".join(f"[{p!r}]" if i else str(p) for i, p in enumerate(path))


def _ext_hook(code: int, data: bytes) -> Any:
    if code in (EXT_TENSOR, EXT_SCALAR):
        idx = msgpack.unpackb(data)
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise SchemaError(f"bad tensor reference {idx!r}")
        return TensorRef(idx, scalar=code == EXT_SCALAR)
    if code == EXT_TUPLE:
        items = unpack(data)
        if not isinstance(items, list):
            raise SchemaError("bad tuple payload")
        return tuple(items)
    raise SchemaError(f"unknown msgpack extension type {code}")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """msgpack -> Python with the tree's extensions; every decoding failure becomes ``SchemaError``."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook,
                               use_list=True)
    except SchemaError:
        raise
    except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise SchemaError(f"not valid msgpack: {type(e).__name__}: {e}") from e


def substitute(tree: Any, fetch: Callable[[TensorRef], Any]) -> Any:
    """Replace every TensorRef in ``tree`` by ``fetch(ref)``."""
    if isinstance(tree, TensorRef):
        return fetch(tree)
    if isinstance(tree, dict):
        return {k: substitute(v, fetch) for k, v in tree.items()}
    if isinstance(tree, list):
        return [substitute(v, fetch) for v in tree]
    if isinstance(tree, tuple):
        return tuple(substitute(v, fetch) for v in tree)
    return tree


def refs(tree: Any) -> list[TensorRef]:
    found: list[TensorRef] = []
    substitute(tree, lambda r: found.append(r))
    return found


# ------------------------------------------------------------------------- TrainingState <-> tree
def encode_state(state: TrainingState) -> Encoded:
    """Split ``state`` into a packable tree and its arrays; ``TypeError`` names any bad value."""
    if not isinstance(state, TrainingState):
        raise TypeError(f"expected a ckptcore.TrainingState, got {type(state).__name__}")
    for name, arr in state.model.items():
        if not isinstance(name, str):
            raise TypeError(f"state.model: parameter names must be str, got {name!r}")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"state.model[{name!r}]: expected numpy.ndarray, got {type(arr).__name__}")
    enc = _Encoder()
    tree = {
        "model": dict(state.model),
        "optimizer": None if state.optimizer is None else {
            "kind": state.optimizer.kind, "step": state.optimizer.step,
            "hyperparams": state.optimizer.hyperparams, "slots": state.optimizer.slots,
            "extra": state.optimizer.extra},
        "schedule": None if state.schedule is None else {
            "kind": state.schedule.kind, "config": state.schedule.config,
            "step": state.schedule.step, "last_lr": state.schedule.last_lr,
            "state": state.schedule.state},
        "rng": state.rng, "data": state.data,
        "accumulation": None if state.accumulation is None else {
            "every": state.accumulation.every, "count": state.accumulation.count,
            "buffers": state.accumulation.buffers},
        "step": state.step, "epoch": state.epoch, "framework": state.framework,
        "metadata": state.metadata, "extra": state.extra,
        "params": {k: v.to_dict() for k, v in state.params.items()},
    }
    tree = {k: enc.encode(v, (k,)) for k, v in tree.items()}
    return Encoded(tree, enc.arrays, enc.names)


def _section(tree: dict, key: str, kind: type, default: Any) -> Any:
    value = tree.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise SchemaError(f"section {key!r}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def decode_state(tree: Any) -> TrainingState:
    """Build a TrainingState from a tree whose references are already substituted."""
    if not isinstance(tree, dict):
        raise SchemaError("state tree must be a map")
    try:
        model = _section(tree, "model", dict, {})
        for k, v in model.items():
            if not isinstance(v, np.ndarray):
                raise SchemaError(f"model[{k!r}] is not a tensor")
        o = _section(tree, "optimizer", dict, None)
        s = _section(tree, "schedule", dict, None)
        a = _section(tree, "accumulation", dict, None)
        return TrainingState(
            model=model,
            optimizer=None if o is None else OptimizerState(
                kind=o["kind"], step=int(o["step"]), hyperparams=o.get("hyperparams") or {},
                slots=o.get("slots") or {}, extra=o.get("extra") or {}),
            schedule=None if s is None else ScheduleState(
                kind=s["kind"], config=s.get("config") or {}, step=int(s["step"]),
                last_lr=s.get("last_lr"), state=s.get("state") or {}),
            rng=_section(tree, "rng", dict, {}) or {},
            data=_section(tree, "data", dict, {}) or {},
            accumulation=None if a is None else AccumulationState(
                every=int(a["every"]), count=int(a["count"]), buffers=a.get("buffers") or {}),
            step=int(tree.get("step", 0)), epoch=int(tree.get("epoch", 0)),
            framework=_section(tree, "framework", str, None),
            metadata=_section(tree, "metadata", dict, {}) or {},
            extra=_section(tree, "extra", dict, {}) or {},
            params={k: ParamInfo.from_dict(v) for k, v in (_section(tree, "params", dict, {}) or {}).items()},
        )
    except SchemaError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SchemaError(f"malformed state tree: {type(e).__name__}: {e}") from e


def nbytes_of(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def unpack_plain(data: bytes, source: str) -> Any:
    """msgpack without extensions, for the manifest's outer envelope."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise SchemaError(f"{source}: not a valid manifest ({type(e).__name__}: {e})") from e
