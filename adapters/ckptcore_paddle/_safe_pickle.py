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

Resources.  A hostile file must not cost much more memory or time than its size:

* a length field can ask only for bytes the file still has (:class:`_BoundedReader`);
* what the stand-ins allocate in proportion to their input (``_codecs.encode``, array data copied by
  ``BUILD``, ``tuple(...)``) is charged to a byte budget of ``2 x file size + 1 MiB``, so reusing one
  memoized string thousands of times is refused instead of multiplying it;
* dict keys must be numbers, strings or flat tuples of them (hashing a tuple nested a million
  levels deep overflows the C stack), and ``SETITEM``/``APPEND`` fill only dicts and lists;
* after loading, the result is walked as the tree every later step treats it as: a few bytes of
  memo references can make a list that holds itself, or a chain of lists each holding the next one
  twice, whose tree is exponentially large; both are refused;
* error messages use :func:`brief`, which never builds the full repr of a large object.

The unpickler's own bookkeeping (the stack, the memo, a fresh empty container per opcode) is not
charged: it is at most about 80 bytes per byte of the file.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import reprlib
import struct
from collections import OrderedDict
from typing import Any, BinaryIO

import numpy as np

from ckptcore.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

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


class _RecordClass:
    """What ``find_class`` returns for an admitted dataclass: only NEWOBJ may instantiate it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<record class {self.name}>"


class Record:
    """A plain stand-in for one of Paddle's metadata dataclasses: its class name and fields."""

    __slots__ = ("kind", "fields", "_hash")

    def __init__(self, kind: str) -> None:
        self.kind, self.fields, self._hash = kind, None, None

    def __hash__(self) -> int:  # (a LocalTensorIndex is a dict key, once built)
        if self._hash is None:
            self._hash = hash((self.kind, tuple(sorted((self.fields or {}).items()))))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and (self.kind, self.fields) == (other.kind, other.fields)

    def __repr__(self) -> str:
        return f"{self.kind}({brief(self.fields)})"

_NUMERIC_KINDS = "biufc"
_SCALARS = (str, bytes, int, float, bool, type(None), np.generic)
_KEY_SCALARS = (str, bytes, int, float, bool, type(None))
_MAX_DEPTH = 64
_MAX_DIM = 1 << 62  # larger than any array numpy can hold; keeps shape arithmetic small
_SLACK = 1 << 20


class _BriefRepr(reprlib.Repr):
    """reprlib with small limits, extended so that no branch builds the full repr of a large object
    (reprlib itself falls back to ``repr()`` for bytes, arrays and dict subclasses)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60
        self.maxtuple = self.maxlist = self.maxdict = 4

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, np.ndarray):
            return f"array(shape={self.repr1(x.shape, level)}, dtype={x.dtype})"
        if isinstance(x, (bytes, bytearray)):
            head = bytes(x[:self.maxstring])
            return repr(head) + ("..." if len(x) > len(head) else "")
        if type(x) is int and x.bit_length() > 128:  # repr() refuses ints of more than 4300 digits
            return f"<int of {x.bit_length()} bits>"
        if isinstance(x, dict):
            return self.repr_dict(x, level)
        if isinstance(x, (str, int, float, tuple, list, type(None), np.generic, np.dtype)):
            return super().repr1(x, level)
        return f"<{type(x).__name__}>"

    def repr_dict(self, x: dict, level: int) -> str:  # reprlib sorts every key first: not for a big dict
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"


brief = _BriefRepr().repr


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def brief_error(e: BaseException) -> str:
    """An exception's message, cut short (``str(KeyError(key))`` would repr the whole key)."""
    args = e.args
    if len(args) == 1:
        return _cut(args[0]) if isinstance(args[0], str) else brief(args[0])
    return brief(args) if args else ""


class _BoundedReader:
    """The file as the unpickler reads it: a length field asking for more than is left is an error
    at once, instead of a read (or ``bytearray(n)``) that allocates the declared size first."""

    def __init__(self, f: BinaryIO, size: int):
        self._f, self._left = f, size

    def read(self, n: int) -> bytes:
        if n > self._left:
            if self._left == 0 and n == 1:
                return b""  # the next opcode is missing: pickle reports "Ran out of input"
            raise EOFError(f"a record needs {n} bytes but the file has only {self._left} left")
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def readline(self) -> bytes:
        line = self._f.readline()
        self._left -= len(line)
        return line


def _refusing(what: str) -> Any:
    def load(self: _SafeUnpickler) -> None:
        raise self.refuse(what)
    return load


def _invalid(code: int) -> Any:
    def load(self: _SafeUnpickler) -> None:
        raise pickle.UnpicklingError(f"invalid opcode {code:#04x}")
    return load


class _SafeUnpickler(pickle._Unpickler):  # the pure-Python unpickler lets us check each opcode
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO, source: str, size: int, *, records: bool = False):
        super().__init__(_BoundedReader(file, size), encoding="latin1")
        self.source, self.size = source, size
        # Every copy a legitimate file makes is of data the file holds once: protocol 2 stores an
        # array's bytes as a latin-1 string that _codecs.encode turns into bytes (one copy) which
        # BUILD may copy again into the array (two).  Hence twice the file size; the MiB covers the
        # fixed costs of small files (tuple() of a few items).
        self.budget, self.spent = 2 * size + _SLACK, 0
        self.globals = {
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
        self.callables = {id(f) for f in self.globals.values()}
        if records:
            for module in _DCP_MODULES:
                for name in DCP_RECORDS:
                    self.globals[(module, name)] = _RecordClass(name)

    def _ndarray_class(self) -> type:
        """Stands in for ``numpy.ndarray``: only ``_reconstruct`` may use it; calling it is refused."""
        refuse = self.refuse

        class ndarray:  # noqa: N801 - named like what it replaces, for error messages
            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                raise refuse("calling numpy.ndarray directly")

        return ndarray

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.source}: refused {what}; a paddle.save state dict holds only numpy arrays and plain "
            "values, so this file may try to run code. Load it with paddle.load only if you trust its origin")

    def corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {what}", file=self.source)

    def charge(self, n: int, what: str) -> None:
        """Count ``n`` bytes about to be allocated for ``what``; refuse past the budget."""
        self.spent += n
        if self.spent > self.budget:
            raise UnsafeCheckpointError(
                f"{self.source}: refused {what}: the data unpickled so far would take more than "
                f"{self.budget} bytes, which a paddle.save file of {self.size} bytes cannot hold "
                "(its data appears once in the file and is copied at most twice); the file is built "
                "to exhaust memory")

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module
        if (module, name) not in self.globals:
            raise self.refuse(f"global {_cut(module, 100)}.{_cut(name, 100)}")
        return self.globals[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise self.refuse(f"persistent id {brief(pid)}")

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
        if subtype is not self.globals[("numpy", "ndarray")]:
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

    # ---- opcodes

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in self.callables:
            raise self.refuse(f"calling {brief(func)}")
        if type(args) is not tuple or len(args) > 3:  # pickle always writes a tuple; ours take <= 3
            raise self.refuse(f"a call with arguments {brief(args)}")
        self.stack[-1] = func(*args)

    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(cls, _RecordClass) or args != ():
            raise self.refuse(f"the NEWOBJ opcode on {brief(cls)} (paddle.save never writes it)")
        self.charge(256, f"a {cls.name} record")
        self.append(Record(cls.name))

    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def _key(self, key: Any) -> Any:
        if type(key) in _KEY_SCALARS or isinstance(key, np.generic) or \
                (type(key) is tuple and all(type(k) in _KEY_SCALARS for k in key)):
            return key
        if type(key) is Record and key.fields is not None:  # built from flat values: hashable
            return key
        raise self.refuse(f"a dict key of type {type(key).__name__} (keys are names, numbers or flat "
                          "tuples of them)")

    def _target(self, kind: type) -> Any:
        target = self.stack[-1]
        if not isinstance(target, kind):  # e.g. item assignment on an array would run numpy indexing
            raise self.refuse(f"filling a {type(target).__name__} as a {kind.__name__}")
        return target

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append({self._key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._target(dict)[self._key(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target(dict)
        for i in range(0, len(items), 2):
            target[self._key(items[i])] = items[i + 1]

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target(list).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target(list).extend(items)

    def load_stop(self) -> None:
        value = self.stack.pop()
        if self.stack or self.metastack:  # pickle.dump leaves exactly one object
            raise pickle.UnpicklingError(f"the pickle ends with {len(self.stack)} unused objects "
                                         f"and {len(self.metastack)} open marks")
        raise pickle._Stop(value)

    for _op, _fn in ((pickle.DICT, load_dict), (pickle.SETITEM, load_setitem),
                     (pickle.SETITEMS, load_setitems), (pickle.APPEND, load_append),
                     (pickle.APPENDS, load_appends), (pickle.STOP, load_stop)):
        dispatch[_op[0]] = _fn
    for _op, _what in ((pickle.INST, "the INST opcode"), (pickle.OBJ, "the OBJ opcode"),
                       (pickle.NEWOBJ_EX, "the NEWOBJ_EX opcode"),
                       (pickle.EMPTY_SET, "a set"), (pickle.FROZENSET, "a frozenset"),
                       (pickle.ADDITEMS, "a set"), (pickle.BYTEARRAY8, "a protocol-5 bytearray"),
                       (pickle.NEXT_BUFFER, "a protocol-5 buffer"),
                       (pickle.READONLY_BUFFER, "a protocol-5 buffer")):
        dispatch[_op[0]] = _refusing(f"{_what} (paddle.save never writes it)")
    del _op, _fn, _what
    for _code in range(256):  # a byte that is no opcode: say so, not KeyError
        dispatch.setdefault(_code, _invalid(_code))
    del _code

    # ---- BUILD

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, np.dtype):
            self._build_dtype(inst, state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        elif type(inst) is Record:
            self._build_record(inst, state)
        else:
            raise self.refuse(f"setting the state of a {type(inst).__name__}")

    dispatch[pickle.BUILD[0]] = load_build

    def _build_record(self, rec: Record, state: Any) -> None:
        allowed = DCP_RECORDS[rec.kind]
        if rec.fields is not None or type(state) is not dict or \
                not all(type(k) is str and k in allowed for k in state):
            raise self.refuse(f"the state {brief(state)} of a {rec.kind} record (it takes one dict "
                              f"of the fields {sorted(allowed)})")
        if rec.kind != "Metadata":  # its fields are keys' parts: flat numbers, strings, tuples
            for k, v in state.items():
                if not (type(v) in _KEY_SCALARS or (type(v) is tuple and
                                                    all(type(x) in _KEY_SCALARS for x in v))):
                    raise self.refuse(f"field {k!r} of a {rec.kind} record holding a "
                                      f"{type(v).__name__}")
        rec.fields = dict(state)

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
                or len(shape) > _MAX_DEPTH or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape):
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
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            obj = _SafeUnpickler(f, source, size, records=records).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, struct.error, ValueError, TypeError, LookupError,
            AttributeError, ArithmeticError, RecursionError, MemoryError) as e:
        detail = brief_error(e) or ("the file ends before the pickle does" if isinstance(e, EOFError) else "")
        raise CorruptCheckpointError(f"{source}: not a readable paddle.save file ({type(e).__name__}"
                                     f"{': ' + detail if detail else ''})", file=source) from e
    if records:
        obj = _plain_records(obj, source, 0)
    # A tree-shaped pickle spends at least one byte per node (an array or a memo reference is one
    # node, and costs more); only containers referenced more than once, which paddle.save does not
    # write, make the tree larger than the file.  The slack admits a few small ones.
    _check_plain(obj, source, size + (1 << 16))
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


def _plain_records(x: Any, source: str, depth: int) -> Any:
    """Records as dicts (with their class under ``"__record__"``); dicts keyed by records as lists
    of ``[key, value]`` pairs.  Containers are rebuilt: the walk's depth is bounded."""
    if depth > _MAX_DEPTH:
        raise CorruptCheckpointError(f"{source}: nested more than {_MAX_DEPTH} levels deep", file=source)
    if type(x) is Record:
        if x.fields is None:
            raise UnsafeCheckpointError(f"{source}: refused a {x.kind} record that was never filled")
        return {"__record__": x.kind, **{k: _plain_records(v, source, depth + 1)
                                         for k, v in x.fields.items()}}
    if isinstance(x, dict):
        if any(type(k) is Record for k in x):
            return [[_plain_records(k, source, depth + 1), _plain_records(v, source, depth + 1)]
                    for k, v in x.items()]
        return {k: _plain_records(v, source, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain_records(v, source, depth + 1) for v in x]
    if type(x) is tuple:
        return tuple(_plain_records(v, source, depth + 1) for v in x)
    return x


def _check_plain(obj: Any, source: str, max_nodes: int) -> None:
    """Refuse what is not plain data, nesting past 64 levels, cycles, and trees of over ``max_nodes`` nodes.

    Later steps (``plain()``, the state's codec) copy the value as a tree, so it is measured as one;
    each container is walked once and remembered by identity, so measuring costs no more than the file.
    """
    walked: dict[int, tuple[int, int]] = {}  # id -> (nodes, height) of a container already measured
    open_: set[int] = set()

    def walk(x: Any, depth: int) -> tuple[int, int]:
        if depth > _MAX_DEPTH:
            raise CorruptCheckpointError(f"{source}: nested more than {_MAX_DEPTH} levels deep", file=source)
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise UnsafeCheckpointError(f"{source}: refused an object array")
            return 1, 0
        if not isinstance(x, (dict, list, tuple)):
            if not isinstance(x, _SCALARS) or (isinstance(x, np.generic) and x.dtype.hasobject):
                raise UnsafeCheckpointError(f"{source}: refused a {type(x).__name__} value")
            return 1, 0
        key = id(x)
        if key not in walked:
            if key in open_:
                raise CorruptCheckpointError(f"{source}: a {type(x).__name__} contains itself", file=source)
            open_.add(key)
            nodes, height = 1, 0
            for child in (itertools.chain.from_iterable(x.items()) if isinstance(x, dict) else x):
                n, h = walk(child, depth + 1)
                nodes, height = nodes + n, max(height, h + 1)
                if nodes > max_nodes:  # every container's count stays small, so this never overflows
                    raise UnsafeCheckpointError(
                        f"{source}: refused a structure of more than {max_nodes} values: containers "
                        "referenced many times from a file this small would expand far beyond it "
                        "when copied")
            open_.discard(key)
            walked[key] = (nodes, height)
        nodes, height = walked[key]
        if depth + height > _MAX_DEPTH:
            raise CorruptCheckpointError(f"{source}: nested more than {_MAX_DEPTH} levels deep", file=source)
        return nodes, height

    walk(obj, 0)
