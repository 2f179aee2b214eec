"""The restricted unpickler behind :mod:`pd_files`: reads ``paddle.save`` pickles without running code.

``paddle.save`` of a state dict pickles a plain ``dict`` of numpy arrays.  We
read it with the pure-Python unpickler restricted to what such files contain:

* ``numpy._core.multiarray._reconstruct`` (``numpy.core`` for numpy 1 writers), ``numpy.ndarray``
  and ``numpy.dtype``, each replaced by a stand-in that builds only plain numeric arrays: the
  ``BUILD`` step that fills an array or a dtype is checked field by field before numpy sees it, a
  dtype may change nothing but its byte order, and object arrays are refused;
* ``numpy._core.multiarray.scalar`` (0-d values), ``builtins.tuple`` and ``collections.OrderedDict``
  (non-state-dict saves), ``_codecs.encode`` with latin-1 only and ``builtins.bytes`` with no
  argument (how protocols below 3 store bytes);
* ``builtins.eval``, which static-mode saves use as ``eval("data", {"data": array})``: the stand-in
  never evaluates; it accepts only an identifier and returns that entry of the dict.

``paddle.distributed.save_state_dict`` writes one more kind of file, its ``.metadata``: a pickled
``Metadata`` dataclass holding ``LocalTensorMetadata`` and ``LocalTensorIndex`` dataclasses (the
latter as dict keys).  :func:`load_dcp_metadata` admits exactly these three classes, from the
modules Paddle has kept them in, each replaced by :class:`Record`, a plain record that takes only
``NEWOBJ`` with no arguments and one ``BUILD`` of a dict of its class's own field names (never
Paddle's class, which is not imported); the records are then turned into plain dicts.

Every other global, persistent id, ``BUILD`` target, call or opcode that ``paddle.save`` never
writes (``INST``/``OBJ``/``NEWOBJ``, sets, protocol-5 buffers) raises
:class:`~ckptcore.errors.UnsafeCheckpointError` naming the file and what was asked for, before it
can run.

The opcode-level restrictions and the resource bounds (a byte budget of twice the file size, key
types, the tree walk after loading) are the core's :class:`ckptcore.adapter.RestrictedUnpickler`;
this module adds the stand-ins for what ``paddle.save`` writes.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any, BinaryIO

import numpy as np

from ckptcore.adapter import (MAX_DEPTH, PLAIN_KEYS, Record, RecordClass, RestrictedUnpickler, brief,
                              brief_error, check_plain, plain_records, restricted_load)
from ckptcore.errors import CorruptCheckpointError

__all__ = ["load_paddle_pickle", "load_dcp_metadata", "Record", "brief", "brief_error"]

# The dataclasses of a paddle.distributed.save_state_dict ``.metadata`` file and their fields
# (Paddle 3.x: paddle/distributed/flex_checkpoint/dcp/metadata.py; 2.6-3.0: .../checkpoint/).
_DCP_MODULES = ("paddle.distributed.flex_checkpoint.dcp.metadata",
                "paddle.distributed.checkpoint.metadata")
DCP_RECORDS = {
    "Metadata": frozenset({"state_dict_metadata", "storage_metadata", "flat_mapping"}),
    "LocalTensorMetadata": frozenset({"global_offset", "local_shape", "dtype", "global_shape",
                                      "is_flattened", "flattened_range"}),
    "LocalTensorIndex": frozenset({"tensor_key", "global_offset", "is_flattened",
                                   "flattened_range", "replica_id", "local_shape"}),
}

_NUMERIC_KINDS = "biufc"
_MAX_DIM = 1 << 62  # larger than any array numpy can hold; keeps shape arithmetic small

# What _dcp.py uses under its historical names.
_check_plain, _plain_records = check_plain, plain_records


class _SafeUnpickler(RestrictedUnpickler):
    writer = "a paddle.save state dict"
    holds = "numpy arrays and plain values"
    loader = "paddle.load"

    def __init__(self, file: BinaryIO, source: str, size: int, *, records: bool = False):
        admitted: dict[tuple[str, str], Any] = {
            ("numpy._core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy.core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy._core.multiarray", "scalar"): self._scalar,
            ("numpy.core.multiarray", "scalar"): self._scalar,
            ("numpy", "ndarray"): self._ndarray_class(),
            ("numpy", "dtype"): self._dtype,
            ("builtins", "tuple"): self._tuple,
            ("collections", "OrderedDict"): self._ordered_dict,
            ("_codecs", "encode"): self._encode,
            ("builtins", "bytes"): self._empty_bytes,
            ("builtins", "eval"): self._eval,
        }
        if records:
            for module in _DCP_MODULES:
                for name, fields in DCP_RECORDS.items():
                    admitted[(module, name)] = RecordClass(name, fields)
        super().__init__(file, source, size, admitted)
        self.callables.discard(id(admitted[("numpy", "ndarray")]))  # only _reconstruct may use it

    def _ndarray_class(self) -> type:
        """Stands in for ``numpy.ndarray``: only ``_reconstruct`` may use it; calling it is refused."""
        class ndarray:  # noqa: N801 - named like what it replaces, for error messages
            pass

        return ndarray

    # ---- stand-ins

    def _dtype(self, obj: Any, align: Any = False, copy: Any = True) -> np.dtype:
        if type(obj) is not str or len(obj) > 32:  # numpy writes a short type code ("f4")
            raise self.refuse(f"numpy.dtype({brief(obj)})")
        try:
            d = np.dtype(obj)
        except (TypeError, ValueError, KeyError, SyntaxError) as e:
            raise self.refuse(f"numpy.dtype({obj!r})") from e
        if d.kind not in _NUMERIC_KINDS or d.fields is not None or d.subdtype is not None:
            raise self.refuse(f"numpy.dtype({obj!r}) (only plain numeric dtypes are read)")
        return np.dtype(obj, copy=True)  # a fresh instance: BUILD must never touch numpy's singletons

    def _reconstruct(self, subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
        if subtype is not self.admitted[("numpy", "ndarray")]:
            raise self.refuse(f"numpy _reconstruct of {brief(subtype)}")
        return np.empty((0,), dtype=np.uint8)  # BUILD gives it its real shape, dtype and data

    def _scalar(self, dtype: Any, data: Any = b"") -> np.generic:
        if not isinstance(dtype, np.dtype) or dtype.kind not in _NUMERIC_KINDS or \
                type(data) is not bytes or len(data) != dtype.itemsize:
            raise self.refuse("a numpy scalar that is not a plain number")
        return np.frombuffer(data, dtype=dtype)[0]

    def _encode(self, obj: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        if type(obj) is not str or type(encoding) is not str or \
                encoding.replace("-", "").replace("_", "").lower() != "latin1":
            raise self.refuse(f"_codecs.encode of a {type(obj).__name__} with {brief(encoding)}")
        self.charge(len(obj), "_codecs.encode of a string")
        return obj.encode("latin1")

    def _empty_bytes(self, *args: Any) -> bytes:
        if args:  # protocols < 3 write b"" as bytes(); anything else is not ours
            raise self.refuse(f"builtins.bytes{brief(args)}")
        return b""

    def _tuple(self, *args: Any) -> tuple:
        # Paddle's nested saves write a tensor as tuple((name, array)).
        if len(args) > 1 or (args and type(args[0]) not in (tuple, list)):
            raise self.refuse(f"builtins.tuple{brief(args)}")
        items = args[0] if args else ()
        self.charge(8 * len(items) + 64, "builtins.tuple")
        return tuple(items)

    def _ordered_dict(self, *args: Any) -> OrderedDict:
        if args:  # pickle writes OrderedDict() and fills it with SETITEMS
            raise self.refuse(f"collections.OrderedDict{brief(args)}")
        return OrderedDict()

    def _eval(self, expr: Any, namespace: Any = None, *rest: Any) -> Any:
        # paddle.save's static-mode pattern is eval("data", {"data": array}): look the name up.
        if not rest and type(expr) is str and expr.isidentifier() and type(namespace) is dict \
                and isinstance(namespace.get(expr), np.ndarray):
            return namespace[expr]
        raise self.refuse(f"builtins.eval({brief(expr)})")

    # ---- BUILD

    def build(self, inst: Any, state: Any) -> None:
        if isinstance(inst, np.dtype):
            self._build_dtype(inst, state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        else:
            super().build(inst, state)

    def build_record(self, rec: Record, fields: frozenset[str], state: Any) -> dict[str, Any]:
        out = super().build_record(rec, fields, state)
        if rec.kind != "Metadata":  # its fields are keys' parts: flat numbers, strings, tuples
            for k, v in out.items():
                if not (type(v) in PLAIN_KEYS or (type(v) is tuple and
                                                  all(type(x) in PLAIN_KEYS for x in v))):
                    raise self.refuse(f"field {k!r} of a {rec.kind} record holding a "
                                      f"{type(v).__name__}")
        return out

    def _build_dtype(self, d: np.dtype, state: Any) -> None:
        def is_int(x: Any, *allowed: int) -> bool:
            return type(x) is int and x in allowed

        ok = (type(state) is tuple and len(state) in (8, 9) and is_int(state[0], 3)
              and type(state[1]) is str and state[1] in ("<", ">", "|", "=")
              and state[2] is None and state[3] is None and state[4] is None
              and is_int(state[5], -1, d.itemsize) and is_int(state[6], -1, d.alignment)
              and is_int(state[7], d.flags) and (len(state) == 8 or state[8] is None))
        if not ok:
            raise self.refuse(f"dtype state {brief(state)}")
        d.__setstate__(state)

    def _build_array(self, arr: np.ndarray, state: Any) -> None:
        if type(state) is not tuple or len(state) not in (4, 5):
            raise self.refuse(f"an array state of unknown form {brief(state)}")
        version, (shape, dtype, fortran, raw) = (state[0], state[1:]) if len(state) == 5 else (1, state)
        if not (isinstance(dtype, np.dtype) and dtype.kind in _NUMERIC_KINDS and not dtype.hasobject
                and type(raw) in (bytes, str)):
            raise self.refuse(f"an array state with {type(raw).__name__} data and dtype {brief(dtype)} "
                              "(object arrays are refused)")
        if type(version) is not int or type(fortran) not in (bool, int) or type(shape) is not tuple \
                or len(shape) > MAX_DEPTH or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape):
            raise self.corrupt(f"a malformed array state (version {brief(version)}, shape {brief(shape)}, "
                               f"fortran flag {brief(fortran)})")
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise self.corrupt(f"an array of shape {shape} and dtype {dtype} holds {len(raw)} bytes")
        self.charge(len(raw), f"array data of shape {shape}")  # numpy may copy it (byte order, alignment)
        if type(raw) is str:
            self.charge(len(raw), f"array data of shape {shape}")
            raw = raw.encode("latin1")
        arr.__setstate__((version, shape, dtype, bool(fortran), raw))


def load_paddle_pickle(path: str | os.PathLike, *, records: bool = False) -> Any:
    """Unpickle a ``paddle.save`` file safely (see the module docstring); arrays come back as numpy.
    ``records``: admit the metadata dataclasses of a distributed checkpoint (see
    :func:`load_dcp_metadata`, which is what callers use)."""
    source = os.fspath(path)
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        obj = restricted_load(lambda f, s, n: _SafeUnpickler(f, s, n, records=records), f, source,
                              size, "paddle.save file")
    if records:
        obj = plain_records(obj, source, 0)
    # A tree-shaped pickle spends at least one byte per node (an array or a memo reference is one
    # node, and costs more); only containers referenced more than once, which paddle.save does not
    # write, make the tree larger than the file.  The slack admits a few small ones.
    check_plain(obj, source, size + (1 << 16))
    return obj


def load_dcp_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``.metadata`` file of a ``paddle.distributed.save_state_dict`` checkpoint, read without
    running code or importing Paddle, as plain values: ``{"state_dict_metadata": {key: [chunk
    dict, ...]}, "storage_metadata": [[index dict, file name], ...], "flat_mapping": {key:
    path tuple}}`` (each record a dict of its fields; see the module docstring)."""
    source = os.fspath(path)
    obj = load_paddle_pickle(source, records=True)
    if not isinstance(obj, dict) or obj.get("__record__") != "Metadata":
        raise CorruptCheckpointError(f"{source}: holds a {type(obj).__name__}, not the Metadata "
                                     "of a paddle.distributed checkpoint", file=source)
    return obj
