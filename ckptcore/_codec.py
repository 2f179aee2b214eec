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

import contextvars
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np

from .errors import SchemaError, UnsupportedCheckpointError
from .sharding import Chunks, Shard
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
# Matched with fullmatch: re.match with "$" would admit a trailing newline.  0: numpy allows V0.
_SIZED = re.compile(r"([USV])(0|[1-9][0-9]{0,8})")
_TIME = re.compile(r"(datetime64|timedelta64)(\[[0-9]*(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?")


def dtype_name(dtype: np.dtype, *, where: str = "array") -> str:
    """The format's name for ``dtype``; ``TypeError`` for dtypes that cannot be stored as raw bytes."""
    # numpy's dtype.name is slow Python, and a state repeats a few dtypes thousands of times.
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        pass
    name = _dtype_name(np.dtype(dtype), where)
    if isinstance(dtype, np.dtype) and len(_NAMES) < 256:
        _NAMES[dtype] = name
    return name


_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype, where: str) -> str:
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"{where}: dtype {dtype} cannot be stored (object and structured dtypes "
                        "would need pickle); convert it to a plain numeric, string or bytes dtype")
    if dtype.kind in "USV" and dtype.name not in _ML:
        return f"{dtype.kind}{dtype.itemsize // (4 if dtype.kind == 'U' else 1)}"
    if dtype.kind in "mM" or dtype.name in _PLAIN or dtype.name in _ML:
        return dtype.name
    raise TypeError(f"{where}: dtype {dtype} is not supported")


@functools.lru_cache(maxsize=256)
def parse_known(name: str) -> np.dtype | None:
    """The dtype of a valid name, cached (a manifest repeats a few names thousands of times)."""
    try:
        return parse_dtype(name)
    except SchemaError:
        return None


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
        m = _SIZED.fullmatch(name)
        if m:
            return np.dtype(f"<{m.group(1)}{m.group(2)}")
        if _TIME.fullmatch(name):
            return np.dtype(name).newbyteorder("<")
    except (AttributeError, ImportError) as e:  # an older ml_dtypes: the file may be fine
        raise UnsupportedCheckpointError(f"{where}: dtype {name!r} is not available here ({e}); "
                                         "upgrade ml_dtypes") from e
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{where}: dtype {short_repr(name)} is not valid ({e})") from e
    raise SchemaError(f"{where}: unknown dtype {short_repr(name)}")


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
class TensorRef:
    """A reference from the tree to tensor ``index`` of the tensor table (``scalar``: a numpy
    scalar, stored as a 0-d tensor).  A plain slotted class, not a dataclass: a manifest holds one
    per tensor, and a frozen dataclass costs a microsecond each to build."""

    __slots__ = ("index", "scalar")

    def __init__(self, index: int, scalar: bool = False) -> None:
        self.index, self.scalar = index, scalar

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorRef) and self.index == other.index
                and self.scalar == other.scalar)

    def __hash__(self) -> int:
        return hash((self.index, self.scalar))

    def __repr__(self) -> str:
        return f"TensorRef(index={self.index!r}, scalar={self.scalar!r})"


@dataclass
class Chunking:
    """Where each array of an :class:`Encoded` state sits (parallel lists): the logical tensor
    it is a chunk of (what the tree refers to), that tensor's global shape and the chunk's
    offsets in it.  A plain array is one chunk covering its whole tensor."""

    tensor: list[int]
    global_shapes: list[tuple[int, ...]]
    starts: list[tuple[int, ...]]

    @classmethod
    def whole(cls, arrays: list[np.ndarray]) -> Chunking:
        """Every array a whole tensor of its own (a plain state written as version 3)."""
        return cls(list(range(len(arrays))), [a.shape for a in arrays],
                   [(0,) * a.ndim for a in arrays])


@dataclass
class Encoded:
    """A state split into a packable tree, its arrays and their names (parallel lists).

    Without ``Shard`` leaves, array *i* is tensor *i* of the tree and ``chunks`` is None.  With
    them (``chunks`` set), the arrays are chunks: a ``Shard`` leaf is one array, a ``Chunks``
    leaf one per part, all under the leaf's name and one tree reference (a logical index)."""

    tree: dict[str, Any]
    arrays: list[np.ndarray]
    names: list[str]
    dtypes: list[str]  # the format's dtype name of each array
    chunks: Chunking | None = None
    leaves: dict[str, Any] = field(default_factory=dict)  # name -> its Shard or Chunks leaf


class _Encoder:
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.names: list[str] = []
        self.dtypes: list[str] = []
        self._seen: set[str] = set()
        # Set once the first Shard leaf is met: from then on, per array, its logical tensor,
        # global shape and start (before it, array i is tensor i, whole).
        self.chunks: Chunking | None = None
        self._count = 0  # logical tensors so far
        self.leaves: dict[str, Any] = {}

    def _add_chunks(self, value: Shard | Chunks, path: tuple) -> int:
        """A ``Shard`` or ``Chunks`` leaf: one logical tensor, an array per block."""
        parts = value.parts if isinstance(value, Chunks) else (value,)
        if self.chunks is None:
            self.chunks = Chunking.whole(self.arrays)
        chunks = self.chunks
        k = self._add(parts[0].data, path)
        chunks.global_shapes[-1], chunks.starts[-1] = parts[0].global_shape, parts[0].offsets
        name, dtype = self.names[-1], self.dtypes[-1]
        self.leaves[name] = value
        for part in parts[1:]:
            self.arrays.append(part.data)
            self.names.append(name)
            self.dtypes.append(dtype)
            chunks.tensor.append(k)
            chunks.global_shapes.append(part.global_shape)
            chunks.starts.append(part.offsets)
        return k

    def _add(self, arr: np.ndarray, path: tuple, name: str | None = None) -> int:
        if name is None:
            name = "/".join(map(str, path))
        dtype = _NAMES.get(arr.dtype) or dtype_name(arr.dtype, where=f"tensor {name!r}")
        self.dtypes.append(dtype)
        unique, n = name, 1
        while unique in self._seen:  # "a/b" as a key and as a nested path would collide
            unique, n = f"{name}#{n}", n + 1
        self._seen.add(unique)
        self.arrays.append(arr)
        self.names.append(unique)
        if self.chunks is not None:
            self.chunks.tensor.append(self._count)
            self.chunks.global_shapes.append(arr.shape)
            self.chunks.starts.append((0,) * arr.ndim)
        self._count += 1
        return self._count - 1

    def encode(self, value: Any, path: tuple) -> Any:
        if len(path) > MAX_DEPTH and isinstance(value, (dict, list, tuple)):
            # Readers refuse deeper trees (as hostile), so never write one.
            raise TypeError(f"{_where(path[:3])}...: nested more than {MAX_DEPTH} levels deep; "
                            "flatten it")
        if type(value) is dict:  # the most common container by far: before the isinstance chain
            return self._dict(value, path)
        # numpy scalars first: np.float64, np.str_ and np.bytes_ subclass float, str and bytes,
        # and would otherwise come back as plain Python values.
        if isinstance(value, np.generic):
            return _ext(EXT_SCALAR, self._add(np.asarray(value), path))
        if value is None or isinstance(value, (bool, bytes, float)):
            return value
        if isinstance(value, (str, int)):
            return _check_atom(value, path)
        if isinstance(value, np.ndarray):
            return _ext(EXT_TENSOR, self._add(value, path))
        if isinstance(value, (Shard, Chunks)):
            return _ext(EXT_TENSOR, self._add_chunks(value, path))
        if isinstance(value, dict):
            return self._dict(value, path)
        if isinstance(value, list):
            return [v if _plain_atom(v) else self.encode(v, path + (i,)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.encode(v, path + (i,)) for i, v in enumerate(value)]
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
        raise TypeError(f"{_where(path)}: cannot store a {type(value).__module__}.{type(value).__qualname__}; "
                        "use numpy arrays, numbers, strings, bytes, lists, tuples and dicts")

    def _dict(self, value: dict, path: tuple) -> dict:
        out = {}
        prefix = None
        safe = _SAFE_ATOMS
        for k, v in value.items():
            # ASCII str keys (nearly all) need no UTF-8 check; anything else gets the full one.
            if type(k) is not str or not k.isascii():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"{_where(path)}: dict keys must be str or int, got {k!r}")
                _check_atom(k, path)
            # Arrays and plain atoms (see _plain_atom) inline: a model map holds thousands of
            # arrays, the params section thousands of atoms; no call, no path tuple for each.
            t = type(v)
            if t is np.ndarray:
                if prefix is None:
                    prefix = "/".join(map(str, path)) + "/"
                out[k] = _ext(EXT_TENSOR, self._add(v, path, prefix + str(k)))
            elif t is str and v.isascii() or t is int and _INT_MIN <= v <= _UINT_MAX or t in safe:
                out[k] = v
            else:
                out[k] = self.encode(v, path + (k,))
        return out


# The packed index of tensors 0..127 is one byte; msgpack.ExtType's own constructor is Python code
# that checks its arguments (which are right by construction here), so tuple's is called instead.
# Larger indices are packed once each and kept (up to _INDEX_CACHED): states are saved again and
# again with the same number of tensors, often more than 128.
_INDEX = [bytes([i]) for i in range(128)]
_INDEX_CACHED = 1 << 16
_new_ext = tuple.__new__


def _ext(code: int, index: int) -> msgpack.ExtType:
    table = _INDEX
    if index >= len(table):
        if index >= _INDEX_CACHED:
            return _new_ext(msgpack.ExtType, (code, msgpack.packb(index)))
        table = _grow_index(index)
    return _new_ext(msgpack.ExtType, (code, table[index]))


def _grow_index(index: int) -> list[bytes]:
    global _INDEX
    old = _INDEX
    end = max(index + 1, min(2 * len(old), _INDEX_CACHED))
    grown = old + [msgpack.packb(i) for i in range(len(old), end)]
    _INDEX = grown  # a new list bound at once: a save in another thread reads either, both right
    return grown


_SAFE_ATOMS = frozenset({float, bool, bytes, type(None)})


def _plain_atom(v: Any) -> bool:
    """Whether ``v`` is stored as it is with no check to make: exactly a float, bool, bytes or
    None, an ASCII str (valid UTF-8), or an int msgpack holds.  numpy scalars are not (their
    exact types differ): they take :meth:`_Encoder.encode`'s way, as does anything to refuse."""
    t = type(v)
    if t is str:
        return v.isascii()
    if t is int:
        return _INT_MIN <= v <= _UINT_MAX
    return t in _SAFE_ATOMS


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


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def pack_values(value: Any) -> bytes:
    """``value``, made of plain values only (numbers, strings, bytes, None, lists, tuples, maps;
    no arrays), as msgpack that :func:`unpack` turns back into an equal value, tuples included.
    ``TypeError`` for anything else."""
    enc = _Encoder()
    tree = enc.encode(value, ("value",))
    if enc.arrays:
        raise TypeError(f"{_where(('value',))}: holds arrays, not only plain values")
    return pack(tree)


# A state tree may nest containers (maps, arrays, tuples) this deep, counted from the tree's root
# (the section maps are level 1).  Real states nest < 10 (optimizer -> slots -> param -> slot).
# The bound makes every walk over a decoded tree safe from stack exhaustion; writers refuse deeper
# trees, so anything deeper is hostile or damaged (docs/FORMAT.md, section 6).
MAX_DEPTH = 64


def _unpack_raw(data: bytes) -> Any:
    # TUPLE extensions come back as msgpack.ExtType and are resolved by the bounded walk below,
    # one level at a time: a hook that re-entered msgpack for every nested TUPLE let ~200 nested
    # extensions exhaust the C stack (SIGSEGV) before any Python depth check ran.  References
    # (TENSOR, SCALAR) never nest, so the hook turns them into TensorRef at once: a manifest has
    # one per tensor, and an ExtType each (a Python namedtuple) would cost more than the rest.
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=_ext_hook)


def _ext_hook(code: int, data: bytes) -> Any:
    cache = _REFS.get(code)
    if cache is None:
        return msgpack.ExtType(code, data)
    # A reference's payload is one of a few bytes, and a save's references repeat load after
    # load: each distinct payload is decoded once (TensorRef is never changed once made).
    ref = cache.get(data)
    if ref is None:
        ref = _new_ref(code, data)
        if len(cache) < _REFS_CACHED:
            cache[data] = ref
    return ref


def _new_ref(code: int, data: bytes) -> TensorRef:
    idx = _FIXINT.get(data)
    if idx is None:
        try:
            idx = msgpack.unpackb(data)
        except Exception as e:
            raise SchemaError(f"bad tensor reference payload ({type(e).__name__})") from e
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise SchemaError(f"bad tensor reference {short_repr(idx)}")
    return TensorRef(idx, code == EXT_SCALAR)


_REFS: dict[int, dict[bytes, TensorRef]] = {EXT_TENSOR: {}, EXT_SCALAR: {}}
_REFS_CACHED = 1 << 16  # payloads kept per kind (a hostile manifest fills it with valid ones only)


def unpack(data: bytes) -> Any:
    """msgpack -> Python with the tree's extensions; every decoding failure becomes ``SchemaError``.

    Containers may nest at most :data:`MAX_DEPTH` levels (extension payloads included).
    """
    return resolve(unpack_raw(data))


def unpack_raw(data: bytes) -> Any:
    """msgpack -> Python, references as TensorRef, other extensions left as ``msgpack.ExtType``
    (see :func:`resolve`)."""
    try:
        return _unpack_raw(data)
    except SchemaError:
        raise
    except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise SchemaError(f"not valid msgpack: {type(e).__name__}: {e}") from e


def resolve(value: Any, refs: list[TensorRef] | None = None) -> Any:
    """Turn the extensions of a raw-unpacked tree into TensorRef and tuples, checking map keys
    and the nesting depth; ``SchemaError`` for anything malformed.  Every reference made is
    appended to ``refs`` (in tree order), so that nobody has to walk the tree again to find them."""
    try:
        return _Resolver(refs if refs is not None else []).walk(value, 0)
    except SchemaError:
        raise
    except RecursionError as e:
        raise SchemaError("the state tree is nested too deeply") from e
    except Exception as e:  # an extension payload that is not msgpack
        raise SchemaError(f"not valid msgpack: {type(e).__name__}: {e}") from e


_ATOMS = (str, int, float, bytes, type(None))
_ATOM_TYPES = frozenset({str, int, float, bytes, type(None), bool})
# The payload of a reference to tensor 0..127 is one positive-fixint byte: decoded without msgpack.
_FIXINT = {bytes([i]): i for i in range(128)}


class _Resolver:
    def __init__(self, refs: list[TensorRef]) -> None:
        self.refs = refs

    def walk(self, value: Any, depth: int) -> Any:
        """Replace ExtType by tuples (references are TensorRef already: see :func:`_ext_hook`),
        checking keys and depth and collecting references; containers are rebuilt in place."""
        if isinstance(value, _ATOMS):
            return value
        if type(value) is TensorRef:
            self.refs.append(value)
            return value
        if depth >= MAX_DEPTH:
            raise SchemaError(f"the state tree nests containers more than {MAX_DEPTH} levels deep")
        if isinstance(value, dict):
            return self._dict(value, depth)
        if isinstance(value, list):
            for i, v in enumerate(value):
                if type(v) is TensorRef:
                    self.refs.append(v)
                elif not isinstance(v, _ATOMS):
                    value[i] = self.walk(v, depth + 1)
            return value
        if isinstance(value, msgpack.ExtType):
            if value.code != EXT_TUPLE:
                raise SchemaError(f"unknown msgpack extension type {value.code}")
            items = _unpack_raw(value.data)
            if not isinstance(items, list):
                raise SchemaError("bad tuple payload")
            return tuple(self.walk(items, depth))
        raise SchemaError(f"unexpected msgpack value {type(value).__name__}")  # pragma: no cover

    def _dict(self, value: dict, depth: int) -> dict:
        refs, atoms = self.refs, _ATOM_TYPES
        for k, v in value.items():
            if type(k) is not str and (type(k) is not int):
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise SchemaError(f"a map key is a {type(k).__name__}; keys are str or int")
            # msgpack builds exact types: one set lookup tells an atom (most values) apart.
            t = type(v)
            if t in atoms:
                continue
            if t is TensorRef:
                refs.append(v)
            elif t is dict:
                if depth + 1 >= MAX_DEPTH:
                    raise SchemaError(f"the state tree nests containers more than {MAX_DEPTH} levels deep")
                self._dict(v, depth + 1)
            elif not isinstance(v, _ATOMS):
                value[k] = self.walk(v, depth + 1)
        return value


def _repr_limited() -> Any:
    import reprlib
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = 60
    return r


_REPR = _repr_limited()


def short_repr(value: Any) -> str:
    """A repr cut to about 80 characters without building a huge one first (a hostile manifest
    may hold a 100 MB string where a name belongs)."""
    return _REPR.repr(value)[:80]


def substitute(tree: Any, fetch: Callable[[TensorRef], Any]) -> Any:
    """Replace every TensorRef in ``tree`` by ``fetch(ref)`` (a new tree; ``tree`` is unchanged)."""
    kind = type(tree)
    if kind is dict:
        # Leaves are by far the most common values (10,000 tensors in one map): test them inline.
        return {k: (v if type(v) in _LEAVES else fetch(v) if type(v) is TensorRef
                    else substitute(v, fetch)) for k, v in tree.items()}
    if kind is TensorRef:
        return fetch(tree)
    if kind is list:
        return [substitute(v, fetch) for v in tree]
    if kind is tuple:
        return tuple(substitute(v, fetch) for v in tree)
    return tree


_LEAVES = frozenset({str, int, float, bytes, bool, type(None)})


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
        if not isinstance(arr, (np.ndarray, Shard, Chunks)):
            raise TypeError(f"state.model[{name!r}]: expected numpy.ndarray or ckptcore.Shard, "
                            f"got {type(arr).__name__}")
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
    return Encoded(tree, enc.arrays, enc.names, enc.dtypes, enc.chunks, enc.leaves)


def _section(tree: dict, key: str, kind: type, default: Any) -> Any:
    value = tree.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise SchemaError(f"section {key!r}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _map(d: dict, key: str, where: str) -> dict:
    """An optional map field: missing or nil is ``{}``."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SchemaError(f"{where}.{key}: expected a map, got {type(value).__name__}")
    return value


def _count_field(d: dict, key: str, where: str, *, default: int | None = None) -> int:
    """An integer field, in the range msgpack can hold (what any writer could have stored).
    Writers store ints; a finite integral float is accepted (older writers stored whatever the
    user set); bools, inf, NaN and fractions are not."""
    if key not in d:
        if default is None:
            raise SchemaError(f"{where}: missing field {key!r}")
        return default
    value = d[key]
    if isinstance(value, np.integer):
        value = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SchemaError(f"{where}.{key}: expected an integer, got {short_repr(value)}")
    if not _INT_MIN <= value <= _UINT_MAX:
        raise SchemaError(f"{where}.{key}: {value} is out of range")
    return value


def _text(d: dict, key: str, where: str, *, optional: bool = False) -> str | None:
    value = d.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise SchemaError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def _tensors(d: dict, where: str | Callable[[], str]) -> dict[str, np.ndarray]:
    """``d``, once every value is a tensor; ``where`` names it in the error (a callable: built
    only then, for the optimizer's hundreds of slot maps)."""
    refs = _REFS_ARE_TENSORS.get()
    for k, v in d.items():
        if type(v) is np.ndarray or (refs and type(v) is TensorRef and not v.scalar):
            continue
        if not isinstance(v, (np.ndarray, Shard, Chunks)):
            name = where if isinstance(where, str) else where()
            raise SchemaError(f"{name}[{short_repr(k)}] is a {type(v).__name__}, not a tensor")
    return d


# Whether references to n-d tensors count as tensors while a tree is decoded: when a manifest's
# tree is checked, before any tensor is read.
_REFS_ARE_TENSORS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ckptcore_refs_are_tensors", default=False)


def _slots_where(param: Any) -> str:
    return f"optimizer.slots[{short_repr(param)}]"


def _optimizer(o: dict) -> OptimizerState:
    slots = _map(o, "slots", "optimizer")
    for param, per in slots.items():
        if not isinstance(per, dict):
            raise SchemaError(f"optimizer.slots[{short_repr(param)}]: expected a map of slot tensors")
        _tensors(per, functools.partial(_slots_where, param))
    return OptimizerState(kind=_text(o, "kind", "optimizer"),
                          step=_count_field(o, "step", "optimizer"),
                          hyperparams=_map(o, "hyperparams", "optimizer"), slots=slots,
                          extra=_map(o, "extra", "optimizer"))


def _schedule(s: dict) -> ScheduleState:
    last_lr = s.get("last_lr")
    if last_lr is not None and (isinstance(last_lr, bool)
                                or not isinstance(last_lr, (int, float, np.number))):
        raise SchemaError(f"schedule.last_lr: expected a number, got {type(last_lr).__name__}")
    return ScheduleState(kind=_text(s, "kind", "schedule"), config=_map(s, "config", "schedule"),
                         step=_count_field(s, "step", "schedule"), last_lr=last_lr,
                         state=_map(s, "state", "schedule"))


def _param_info(name: Any, d: Any) -> ParamInfo:
    # The common, valid entry is checked inline (a model has hundreds; a manifest is decoded
    # when it is published and twice per load); anything else takes the checked way below.
    if type(d) is dict:
        index, layer, kind, role = d.get("index"), d.get("layer"), d.get("kind"), d.get("role")
        layout, attrs = d.get("layout"), d.get("attrs")
        if (type(index) is int and _INT_MIN <= index <= _UINT_MAX and type(layer) is str
                and type(kind) is str and type(role) is str
                and (layout is None or type(layout) is str) and (attrs is None or type(attrs) is dict)):
            return ParamInfo(index=index, layer=layer, kind=kind, role=role, layout=layout,
                             attrs={} if attrs is None else attrs)
    return _param_info_checked(name, d)


def _param_info_checked(name: Any, d: Any) -> ParamInfo:
    where = f"params[{short_repr(name)}]"
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected a map")
    return ParamInfo(index=_count_field(d, "index", where), layer=_text(d, "layer", where),
                     kind=_text(d, "kind", where), role=_text(d, "role", where),
                     layout=_text(d, "layout", where, optional=True), attrs=_map(d, "attrs", where))


def decode_state(tree: Any, *, refs: bool = False) -> TrainingState:
    """Build a TrainingState from a tree whose references are already substituted (``refs``:
    or still in place, standing for their tensors, to check a manifest's tree before reading).

    Every field is type- and range-checked: a malformed tree is a ``SchemaError`` naming the field.
    """
    if not isinstance(tree, dict):
        raise SchemaError("state tree must be a map")
    token = _REFS_ARE_TENSORS.set(refs)
    try:
        return _decode(tree)
    finally:
        _REFS_ARE_TENSORS.reset(token)


def _decode(tree: dict) -> TrainingState:
    try:
        o = _section(tree, "optimizer", dict, None)
        s = _section(tree, "schedule", dict, None)
        a = _section(tree, "accumulation", dict, None)
        return TrainingState(
            model=_tensors(_section(tree, "model", dict, {}) or {}, "model"),
            optimizer=None if o is None else _optimizer(o),
            schedule=None if s is None else _schedule(s),
            rng=_section(tree, "rng", dict, {}) or {},
            data=_section(tree, "data", dict, {}) or {},
            accumulation=None if a is None else AccumulationState(
                every=_count_field(a, "every", "accumulation"),
                count=_count_field(a, "count", "accumulation"),
                buffers=_tensors(_map(a, "buffers", "accumulation"), "accumulation.buffers")),
            step=_count_field(tree, "step", "state", default=0),
            epoch=_count_field(tree, "epoch", "state", default=0),
            framework=_section(tree, "framework", str, None),
            metadata=_section(tree, "metadata", dict, {}) or {},
            extra=_section(tree, "extra", dict, {}) or {},
            params={k: _param_info(k, v) for k, v in (_section(tree, "params", dict, {}) or {}).items()},
        )
    except SchemaError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:  # backstop
        raise SchemaError(f"malformed state tree: {type(e).__name__}: {e}") from e


def count_field(tree: Any, key: str) -> int:
    """``step``/``epoch`` of an undecoded tree, checked like :func:`decode_state` does."""
    if not isinstance(tree, dict):
        raise SchemaError("state tree must be a map")
    if tree.get(key) is None:
        return 0
    return _count_field(tree, key, "state", default=0)


def nbytes_of(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def unpack_plain(data: bytes, source: str) -> Any:
    """msgpack without extensions, for the manifest's outer envelope.

    A flat map of string keys to scalars (what every writer produces) is parsed here without
    copying: a ``bin`` value comes back as a ``memoryview`` into ``data``, so the body of a large
    manifest is not held twice (file bytes and a copy) while it is decoded.  Anything else goes
    through msgpack, which copies.
    """
    try:
        flat = _flat_envelope(memoryview(data))
    except (IndexError, ValueError, UnicodeDecodeError):
        flat = None
    if flat is not None:
        return flat
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise SchemaError(f"{source}: not a valid manifest ({type(e).__name__}: {e})") from e


_MAP_HEADERS = {0xDE: 2, 0xDF: 4}
_BIN_HEADERS = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_STR_HEADERS = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}
_NUM_SIZES = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
              0xD3: 8}


def _flat_envelope(buf: memoryview) -> dict | None:
    """``{str: nil/bool/int/float/str/bin}`` read straight from ``buf`` (bin values as views),
    or ``None`` when ``buf`` is anything else (msgpack then decodes or rejects it)."""
    pos, first = 1, buf[0]
    if 0x80 <= first <= 0x8F:
        count = first & 0x0F
    elif first in _MAP_HEADERS:
        n = _MAP_HEADERS[first]
        count, pos = int.from_bytes(buf[1:1 + n], "big"), 1 + n
    else:
        return None
    if count > 16:
        return None
    items: list[Any] = []
    for _ in range(2 * count):
        tag = buf[pos]
        if tag <= 0x7F or tag >= 0xE0:  # fixint
            value, pos = (tag if tag <= 0x7F else tag - 0x100), pos + 1
        elif 0xA0 <= tag <= 0xBF or tag in _STR_HEADERS or tag in _BIN_HEADERS:
            if 0xA0 <= tag <= 0xBF:
                n, start = tag & 0x1F, pos + 1
            else:
                width = _STR_HEADERS.get(tag) or _BIN_HEADERS[tag]
                n, start = int.from_bytes(buf[pos + 1:pos + 1 + width], "big"), pos + 1 + width
            if start + n > len(buf):
                return None
            value = buf[start:start + n] if tag in _BIN_HEADERS else str(buf[start:start + n], "utf-8")
            pos = start + n
        elif tag in _CONSTANTS:
            value, pos = _CONSTANTS[tag], pos + 1
        elif tag in _NUM_SIZES:
            size = _NUM_SIZES[tag]
            if pos + 1 + size > len(buf):
                return None
            value = msgpack.unpackb(buf[pos:pos + 1 + size])
            pos += 1 + size
        else:
            return None
        items.append(value)
    if pos != len(buf):  # trailing bytes: msgpack names the error
        return None
    keys, values = items[0::2], items[1::2]
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        return None
    return dict(zip(keys, values))
