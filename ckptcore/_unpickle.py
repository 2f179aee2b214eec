"""A restricted unpickler for frameworks' native checkpoint files: reads a pickle without running code.

Frameworks save state as pickles (``paddle.save``, ``torch.save``, the ``.metadata`` of their
distributed checkpoints).  :class:`RestrictedUnpickler` is the pure-Python unpickler with every
door closed that such a file does not need: an adapter subclasses it, names the globals it admits
(each replaced by a stand-in of its own that builds only plain values; the real class or function
is never imported) and the dataclasses it admits as :class:`Record` s.  Everything else -- any other
global, a persistent id the subclass does not resolve, calling anything but an admitted stand-in,
``BUILD`` on anything but a record or what the subclass builds, ``INST``/``OBJ``/``NEWOBJ_EX``,
sets, protocol-5 buffers, a byte that is no opcode -- raises
:class:`~ckptcore.errors.UnsafeCheckpointError` (or ``CorruptCheckpointError``) naming the file
and what was asked for, before it can run.

Resources.  A hostile file must not cost much more memory or time than its size:

* a length field can ask only for bytes the file still has (:class:`BoundedReader`);
* what stand-ins allocate in proportion to their input is charged (:meth:`RestrictedUnpickler.charge`)
  to a byte budget of ``2 x file size + 1 MiB``: a legitimate file's data appears once in it and
  is copied at most twice, so reusing one memoized string thousands of times is refused;
* dict keys must be numbers, strings, flat tuples of them or built records (hashing a tuple nested
  a million levels deep overflows the C stack), and ``SETITEM``/``APPEND`` fill only dicts and lists;
* after loading, :func:`check_plain` walks the result as the tree later steps treat it as: a few
  bytes of memo references can make a list that holds itself, or a chain of lists each holding the
  next one twice, whose tree is exponentially large; both are refused;
* messages use :func:`brief`, which never builds the full repr of a large object.

The unpickler's own bookkeeping (the stack, the memo, a fresh empty container per opcode) is not
charged: it is at most about 80 bytes per byte of the file.
"""

from __future__ import annotations

import itertools
import pickle
import reprlib
import struct
from typing import Any, BinaryIO, Callable, Mapping

import numpy as np

from .errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["RestrictedUnpickler", "Record", "RecordClass", "BoundedReader", "restricted_load",
           "plain_records", "check_plain", "brief", "brief_error", "PLAIN_KEYS", "MAX_DEPTH"]

PLAIN_KEYS = (str, bytes, int, float, bool, type(None))
_SCALARS = (str, bytes, int, float, bool, type(None), np.generic)
MAX_DEPTH = 64
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


class BoundedReader:
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
        line = self._f.readline(self._left + 1)
        self._left -= len(line)
        return line


class RecordClass:
    """What ``find_class`` returns for an admitted dataclass: only NEWOBJ may instantiate it."""

    def __init__(self, name: str, fields: frozenset[str]) -> None:
        self.name, self.fields = name, fields

    def __repr__(self) -> str:
        return f"<record class {self.name}>"


class Record:
    """A plain stand-in for an admitted dataclass: its class name and fields (filled by BUILD)."""

    __slots__ = ("kind", "fields", "_hash")

    def __init__(self, kind: str) -> None:
        self.kind, self.fields, self._hash = kind, None, None

    def __hash__(self) -> int:  # (records are dict keys in metadata files, once built)
        if self._hash is None:
            self._hash = hash((self.kind, tuple(sorted((self.fields or {}).items()))))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and (self.kind, self.fields) == (other.kind, other.fields)

    def __repr__(self) -> str:
        return f"{self.kind}({brief(self.fields)})"


def _refusing(what: str) -> Any:
    def load(self: RestrictedUnpickler) -> None:
        raise self.refuse(f"{what} ({self.writer} never writes it)")
    return load


def _invalid(code: int) -> Any:
    def load(self: RestrictedUnpickler) -> None:
        raise pickle.UnpicklingError(f"invalid opcode {code:#04x}")
    return load


class RestrictedUnpickler(pickle._Unpickler):  # the pure-Python unpickler lets us check each opcode
    """Unpickle only what a subclass admits (see the module docstring).

    Args:
        file, source, size: the open file (positioned at the pickle), its name for messages and
            the number of bytes the pickle may read from it.
        admitted: ``{(module, name): stand-in}``; a stand-in that is callable may be called by
            ``REDUCE`` (with at most ``max_args`` arguments); a :class:`RecordClass` may be
            instantiated by ``NEWOBJ`` with no arguments and filled by one ``BUILD``.

    Subclasses set ``writer`` (what writes such files, for messages), ``holds`` (what they hold)
    and ``loader`` (the framework's own loader, to name in a refusal), and may override
    :meth:`persistent`, :meth:`build` (``BUILD`` on their own stand-ins' results) and
    :meth:`build_record` (a record's state in another form than a dict of its fields).
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    writer = "this format"
    holds = "plain values"
    loader = "the framework's loader"
    max_args = 3

    def __init__(self, file: BinaryIO, source: str, size: int, admitted: Mapping[tuple[str, str], Any]):
        super().__init__(BoundedReader(file, size), encoding="latin1")
        self.source, self.size = source, size
        self.budget, self.spent = 2 * size + _SLACK, 0
        self.admitted = dict(admitted)
        self.callables = {id(f) for f in self.admitted.values()
                          if callable(f) and not isinstance(f, RecordClass)}
        self.record_kinds = {f.name: f.fields for f in self.admitted.values()
                             if isinstance(f, RecordClass)}

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.source}: refused {what}; {self.writer} holds only {self.holds}, so this file may "
            f"try to run code. Load it with {self.loader} only if you trust its origin")

    def corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {what}", file=self.source)

    def charge(self, n: int, what: str) -> None:
        """Count ``n`` bytes about to be allocated for ``what``; refuse past the budget."""
        self.spent += n
        if self.spent > self.budget:
            raise UnsafeCheckpointError(
                f"{self.source}: refused {what}: the data unpickled so far would take more than "
                f"{self.budget} bytes, which a file of {self.size} bytes cannot hold (its data "
                "appears once in the file and is copied at most twice); the file is built to "
                "exhaust memory")

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module
        if (module, name) not in self.admitted:
            raise self.refuse(f"global {_cut(module, 100)}.{_cut(name, 100)}")
        return self.admitted[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        return self.persistent(pid)

    def persistent(self, pid: Any) -> Any:
        """Resolve a persistent id (refused unless a subclass knows its form)."""
        raise self.refuse(f"persistent id {brief(pid)}")

    def build(self, inst: Any, state: Any) -> None:
        """``BUILD`` on ``inst`` (a subclass's stand-in's result); refused here."""
        raise self.refuse(f"setting the state of a {type(inst).__name__}")

    def build_record(self, rec: Record, fields: frozenset[str], state: Any) -> dict[str, Any]:
        """The fields of record ``rec`` from its ``BUILD`` state: a dict of its own field names."""
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            raise self.refuse(f"the state {brief(state)} of a {rec.kind} record (it takes one dict "
                              f"of the fields {sorted(fields)})")
        return dict(state)

    # ---- opcodes

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in self.callables:
            raise self.refuse(f"calling {brief(func)}")
        if type(args) is not tuple or len(args) > self.max_args:  # pickle always writes a tuple
            raise self.refuse(f"a call with arguments {brief(args)}")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(cls, RecordClass) or args != ():
            raise self.refuse(f"the NEWOBJ opcode on {brief(cls)} ({self.writer} never writes it)")
        self.charge(256, f"a {cls.name} record")
        rec = Record(cls.name)
        if not cls.fields:  # a dataclass without fields is pickled without a BUILD
            rec.fields = {}
        self.append(rec)

    def key(self, key: Any) -> Any:
        if type(key) in PLAIN_KEYS or isinstance(key, np.generic) or \
                (type(key) is tuple and all(type(k) in PLAIN_KEYS for k in key)):
            return key
        if type(key) is Record and key.fields is not None and all(
                type(v) in PLAIN_KEYS or (type(v) is tuple and all(type(x) in PLAIN_KEYS for x in v))
                for v in key.fields.values()):  # built from flat values: hashable, cheaply
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
        self.append({self.key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._target(dict)[self.key(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target(dict)
        for i in range(0, len(items), 2):
            target[self.key(items[i])] = items[i + 1]

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

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is Record:
            if inst.fields is not None:
                raise self.refuse(f"a second state for a {inst.kind} record")
            inst.fields = self.build_record(inst, self.record_kinds[inst.kind], state)
        else:
            self.build(inst, state)

    for _op, _fn in ((pickle.REDUCE, load_reduce), (pickle.NEWOBJ, load_newobj),
                     (pickle.DICT, load_dict), (pickle.SETITEM, load_setitem),
                     (pickle.SETITEMS, load_setitems), (pickle.APPEND, load_append),
                     (pickle.APPENDS, load_appends), (pickle.STOP, load_stop),
                     (pickle.BUILD, load_build)):
        dispatch[_op[0]] = _fn
    for _op, _what in ((pickle.INST, "the INST opcode"), (pickle.OBJ, "the OBJ opcode"),
                       (pickle.NEWOBJ_EX, "the NEWOBJ_EX opcode"),
                       (pickle.EMPTY_SET, "a set"), (pickle.FROZENSET, "a frozenset"),
                       (pickle.ADDITEMS, "a set"), (pickle.BYTEARRAY8, "a protocol-5 bytearray"),
                       (pickle.NEXT_BUFFER, "a protocol-5 buffer"),
                       (pickle.READONLY_BUFFER, "a protocol-5 buffer")):
        dispatch[_op[0]] = _refusing(_what)
    del _op, _fn, _what
    for _code in range(256):  # a byte that is no opcode: say so, not KeyError
        dispatch.setdefault(_code, _invalid(_code))
    del _code


def restricted_load(make: Callable[[BinaryIO, str, int], RestrictedUnpickler], f: BinaryIO,
                    source: str, size: int, what: str) -> Any:
    """``make(f, source, size).load()``, every failure a :class:`~ckptcore.CheckpointError` naming
    ``source``: what the pickle machinery raises on a malformed file becomes a
    ``CorruptCheckpointError`` saying it is not a readable ``what``."""
    try:
        return make(f, source, size).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, struct.error, ValueError, TypeError, LookupError,
            AttributeError, ArithmeticError, RecursionError, MemoryError) as e:
        detail = brief_error(e) or ("the file ends before the pickle does" if isinstance(e, EOFError) else "")
        raise CorruptCheckpointError(f"{source}: not a readable {what} ({type(e).__name__}"
                                     f"{': ' + detail if detail else ''})", file=source) from e


def plain_records(x: Any, source: str, depth: int = 0) -> Any:
    """Records as dicts (with their class under ``"__record__"``); dicts keyed by records as lists
    of ``[key, value]`` pairs.  Containers are rebuilt: the walk's depth is bounded."""
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{source}: nested more than {MAX_DEPTH} levels deep", file=source)
    if type(x) is Record:
        if x.fields is None:
            raise UnsafeCheckpointError(f"{source}: refused a {x.kind} record that was never filled")
        return {"__record__": x.kind, **{k: plain_records(v, source, depth + 1)
                                         for k, v in x.fields.items()}}
    if isinstance(x, dict):
        if any(type(k) is Record for k in x):
            return [[plain_records(k, source, depth + 1), plain_records(v, source, depth + 1)]
                    for k, v in x.items()]
        return {k: plain_records(v, source, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [plain_records(v, source, depth + 1) for v in x]
    if type(x) is tuple:
        return tuple(plain_records(v, source, depth + 1) for v in x)
    return x


def check_plain(obj: Any, source: str, max_nodes: int, leaves: tuple[type, ...] = ()) -> None:
    """Refuse what is not plain data (scalars, arrays, ``leaves``), nesting past 64 levels, cycles,
    and trees of over ``max_nodes`` nodes.

    Later steps (``plain()``, the state's codec) copy the value as a tree, so it is measured as one;
    each container is walked once and remembered by identity, so measuring costs no more than the file.
    """
    walked: dict[int, tuple[int, int]] = {}  # id -> (nodes, height) of a container already measured
    open_: set[int] = set()

    def walk(x: Any, depth: int) -> tuple[int, int]:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{source}: nested more than {MAX_DEPTH} levels deep", file=source)
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise UnsafeCheckpointError(f"{source}: refused an object array")
            return 1, 0
        if not isinstance(x, (dict, list, tuple)):
            if not isinstance(x, _SCALARS + leaves) or (isinstance(x, np.generic) and x.dtype.hasobject):
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
        if depth + height > MAX_DEPTH:
            raise CorruptCheckpointError(f"{source}: nested more than {MAX_DEPTH} levels deep", file=source)
        return nodes, height

    walk(obj, 0)

