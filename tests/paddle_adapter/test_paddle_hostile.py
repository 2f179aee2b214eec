"""Hostile ``.pdparams``/``.pdopt`` files: each must end in a CheckpointError naming the file, run no
code, and the whole corpus must load in one process within a bounded memory.

The corpus is generated here: hand-assembled pickle opcodes for what ``pickle.dumps`` cannot make
(memo bombs, deep nesting, lying length fields) and crafted dicts pickled normally for broken state
dicts.  It runs in one child process (``python test_paddle_hostile.py DIR``) so that a memory bomb
that gets through shows up as that process's peak RSS (or kills it) instead of taking pytest down;
the child writes one result per case and the tests below check them.  Paddle is never imported.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import resource
import struct
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

NAME_TABLE = "StructuredToParameterName@@"
BIG = "UnpackBigParamInfor@@"
MIB = 1 << 20
MAX_RSS_MB = 600


# ----------------------------------------------------------------------------- pickle assembly


def u(s: str) -> bytes:
    """BINUNICODE: a str of any length."""
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def b_(data: bytes) -> bytes:
    """BINBYTES (protocol 3)."""
    return b"B" + struct.pack("<I", len(data)) + data


def i4(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def put(k: int) -> bytes:
    return b"r" + struct.pack("<I", k)  # LONG_BINPUT


def get(k: int) -> bytes:
    return b"j" + struct.pack("<I", k)  # LONG_BINGET


def call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"


def pk(*ops: bytes, proto: int = 3) -> bytes:
    return b"\x80" + bytes([proto]) + b"".join(ops) + b"."


def dtype_op(code: str, order: str = "<", elsize: int = -1, align: int = -1, flags: int = 0) -> bytes:
    """numpy.dtype(code) followed by its BUILD, as numpy pickles it."""
    return (call(glob("numpy", "dtype"), u(code), b"\x89\x88")
            + b"(" + i4(3) + u(order) + b"NNN" + i4(elsize) + i4(align) + i4(flags) + b"tb")


def array_op(shape: tuple, dtype: bytes, raw: bytes, fortran: bytes = b"\x89") -> bytes:
    """_reconstruct(ndarray, (0,), b'b') and a BUILD of (1, shape, dtype, fortran, raw)."""
    shape_op = b"(" + b"".join(i4(n) if -2**31 <= n < 2**31 else long_op(n) for n in shape) + b"t"
    return (call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), i4(0) + b"\x85",
                 b_(b"b"))
            + b"(" + i4(1) + shape_op + dtype + fortran + raw + b"tb")


def long_op(n: int) -> bytes:
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8b" + struct.pack("<I", len(data)) + data  # LONG4


def inner(obj: object) -> bytes:
    """``obj`` pickled (protocol 3) without its header and STOP, to embed among other opcodes.
    Uses memo slots from 0 up: hand-written opcodes around it use slots from 1000."""
    raw = pickle.dumps(obj, protocol=3)
    assert raw[:2] == b"\x80\x03" and raw[-1:] == b"."
    return raw[2:-1]


def pkl(obj: object, protocol: int = 4) -> bytes:
    return pickle.dumps(obj, protocol=protocol)


class _Reduce:
    """Pickles as ``func(*args)`` (with an optional BUILD ``state``): how malicious pickles are made."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def memo_refs(k: int, n: int) -> bytes:
    """A tuple of ``n`` references to memo slot ``k``."""
    return b"(" + get(k) * n + b"t"


# ----------------------------------------------------------------------------- the corpus

F4 = np.arange(4, dtype="float32")
GOOD_PARAMS = {"fc.weight": np.ones((2, 2), "float32"), "fc.bias": np.zeros(2, "float32"),
               NAME_TABLE: {"fc.weight": "linear_0.w_0", "fc.bias": "linear_0.b_0"}}
GOOD_OPT = {"linear_0.w_0_moment1_0": np.zeros((2, 2), "float32"),
            "linear_0.b_0_moment1_0": np.zeros(2, "float32"),
            "LR_Scheduler": {"last_epoch": 3, "last_lr": 0.1}, NAME_TABLE: {}}


class Case(NamedTuple):
    name: str
    expect: str  # the CheckpointError subclass expected, by name
    make: Callable[[Path], bytes]  # canary path -> file contents
    call: str = "params"  # params: import_paddle_files(file); opt: import_paddle_files(good, file); load
    match: str = ""  # a fragment the message must hold: the case was refused for the reason it tests


CASES: list[Case] = []


def case(name: str, expect: str, make: Callable[[Path], bytes], call: str = "params", match: str = "") -> None:
    CASES.append(Case(name, expect, make, call, match))


def _touch(canary: Path) -> str:
    return f"touch {canary}"


# -- globals not on the allow-list: each would create the canary if it ran

case("os.system", "UnsafeCheckpointError", lambda c: pkl(_Reduce(os.system, (_touch(c),))), match="posix.system")
case("posix.system protocol 0", "UnsafeCheckpointError",
     lambda c: b"cposix\nsystem\n(V" + _touch(c).encode() + b"\ntR.", match="posix.system")
case("builtins.exec", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(exec, (f"open({str(c)!r}, 'w')",))), match="builtins.exec")
case("__builtin__.exec (python 2 name)", "UnsafeCheckpointError",
     lambda c: pk(call(glob("__builtin__", "exec"), u(f"open({str(c)!r}, 'w')")), proto=2), match="builtins.exec")
case("builtins.open", "UnsafeCheckpointError", lambda c: pkl(_Reduce(open, (str(c), "w"))), match="io.open")
case("subprocess.Popen", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(subprocess.Popen, (["touch", str(c)],))), match="subprocess.Popen")
case("subprocess.check_output", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(subprocess.check_output, (["touch", str(c)],))))
case("numpy.load", "UnsafeCheckpointError", lambda c: pkl(_Reduce(np.load, (str(c),))), match="numpy.load")
case("numpy.save", "UnsafeCheckpointError", lambda c: pkl(_Reduce(np.save, (str(c), F4))))
case("numpy.frombuffer", "UnsafeCheckpointError", lambda c: pkl(_Reduce(np.frombuffer, (b"\0" * 4, "f4"))))
case("numpy._core.numeric._frombuffer (protocol 5 arrays)", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy._core.numeric", "_frombuffer"), b_(b"\0" * 4), u("f4")), proto=4))
case("functools.partial", "UnsafeCheckpointError",
     lambda c: pkl(functools.partial(os.system, _touch(c))), match="functools.partial")
case("builtins.getattr chain", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(getattr, (_Reduce(__import__, ("os",)), "system"))))
case("importlib.import_module", "UnsafeCheckpointError",
     lambda c: pk(call(glob("importlib", "import_module"), u("os"))))
case("pickle.loads of a nested pickle", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(pickle.loads, (pkl(_Reduce(os.system, (_touch(c),))),))))
case("copyreg._reconstructor", "UnsafeCheckpointError",
     lambda c: pk(call(glob("copyreg", "_reconstructor"), glob("builtins", "object"), glob("builtins", "object"),
                       b"N")))
case("dotted global os.path.os.system", "UnsafeCheckpointError",
     lambda c: pk(u("os"), u("path.os.system"), b"\x93(" + u(_touch(c)) + b"tR", proto=4), match="os.path.os.system")
case("dotted global numpy.ndarray.tofile", "UnsafeCheckpointError",
     lambda c: pk(u("numpy"), u("ndarray.tofile"), b"\x93" + b"(" + u(str(c)) + b"tR", proto=4))
case("a 1 MiB module name", "UnsafeCheckpointError",
     lambda c: pk(u("m" * MIB), u("system"), b"\x93" + b"(tR", proto=4), call="load")

# -- persistent ids and calls the allow-list does not cover

case("persistent id (protocol 4)", "UnsafeCheckpointError", lambda c: pk(b"}", u("k"), u("payload"), b"Qs"),
     match="persistent id")
case("persistent id (protocol 0)", "UnsafeCheckpointError", lambda c: b"Ppayload\n.", match="persistent id")
case("eval with code", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(eval, (f"__import__('os').system({_touch(c)!r})",))))
case("eval with code and an array namespace", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(eval, (f"open({str(c)!r}, 'w')", {"data": F4}))))
case("eval of a name that is not an array", "UnsafeCheckpointError", lambda c: pkl(_Reduce(eval, ("os", {"os": 1}))))
case("eval with a locals argument", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(eval, ("data", {"data": F4}, {}))))
case("REDUCE on a string", "UnsafeCheckpointError", lambda c: pk(u("os.system"), b"(" + u(_touch(c)) + b"tR"),
     match="calling")
case("REDUCE on a dict", "UnsafeCheckpointError", lambda c: pk(b"}", b")R"))
case("REDUCE with a list of arguments", "UnsafeCheckpointError",
     lambda c: pk(glob("numpy", "dtype"), b"(" + u("f4") + b"lR"), match="a call with arguments")
case("REDUCE with a 1 MiB string as arguments", "UnsafeCheckpointError",
     lambda c: pk(glob("builtins", "bytes"), u("x" * MIB), b"R"))
case("_codecs.encode with rot13", "UnsafeCheckpointError",
     lambda c: pk(call(glob("_codecs", "encode"), u("abc"), u("rot13")), proto=2))
case("_codecs.encode of bytes", "UnsafeCheckpointError",
     lambda c: pk(call(glob("_codecs", "encode"), b_(b"abc"), u("latin1"))))
case("bytes(10**9)", "UnsafeCheckpointError", lambda c: pk(call(glob("builtins", "bytes"), i4(10**9))),
     match="builtins.bytes")
case("tuple of a 1 MiB string", "UnsafeCheckpointError", lambda c: pk(call(glob("builtins", "tuple"), u("x" * MIB))))
case("OrderedDict given items", "UnsafeCheckpointError",
     lambda c: pkl(_Reduce(OrderedDict, ([("a", 1)],))))
case("OrderedDict given attributes", "UnsafeCheckpointError", lambda c: pkl(_Reduce(OrderedDict, (), {"x": 1})))
case("ndarray called directly", "UnsafeCheckpointError", lambda c: pkl(_Reduce(np.ndarray, ((3,), "f4"))))
case("_reconstruct of numpy.dtype", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "dtype"), i4(0) + b"\x85",
                       b_(b"b"))))
case("NEWOBJ", "UnsafeCheckpointError", lambda c: pk(glob("builtins", "tuple"), b")\x81", proto=2), match="NEWOBJ")
case("NEWOBJ_EX", "UnsafeCheckpointError", lambda c: pk(glob("builtins", "tuple"), b")}\x92", proto=4))
case("INST", "UnsafeCheckpointError", lambda c: b"(ibuiltins\ntuple\n.", match="INST")
case("OBJ", "UnsafeCheckpointError", lambda c: pk(b"(" + glob("collections", "OrderedDict") + b"o"), match="OBJ opcode")
case("frozenset", "UnsafeCheckpointError", lambda c: pk(b"(" + u("a") + b"\x91", proto=4), match="frozenset")
case("set", "UnsafeCheckpointError", lambda c: pk(b"\x8f(" + u("a") + b"\x90", proto=4))
case("protocol-5 bytearray of 4 GiB", "UnsafeCheckpointError",
     lambda c: pk(b"\x96" + struct.pack("<Q", 4 << 30), proto=5), match="bytearray")
case("protocol-5 out-of-band buffer", "UnsafeCheckpointError", lambda c: pk(b"\x97", proto=5))

# -- BUILD on what is not an array or a dtype, and dtypes/arrays that are not plain numbers

case("BUILD on a list", "UnsafeCheckpointError", lambda c: pk(b"]}b"), match="state of a list")
case("BUILD on a string", "UnsafeCheckpointError", lambda c: pk(u("x"), b"}b"))
case("BUILD on a numpy scalar", "UnsafeCheckpointError", lambda c: pk(inner(np.float32(1.0)), b"}b"))
case("object array", "UnsafeCheckpointError", lambda c: pkl(np.array([1, "x"], dtype=object)), match="numpy.dtype('O")
case("object dtype", "UnsafeCheckpointError", lambda c: pk(call(glob("numpy", "dtype"), u("O"), b"\x89\x88")))
case("datetime dtype", "UnsafeCheckpointError", lambda c: pkl(np.zeros(2, "datetime64[ns]")))
case("string dtype", "UnsafeCheckpointError", lambda c: pkl(np.array(["abc"])))
case("structured dtype", "UnsafeCheckpointError", lambda c: pkl(np.zeros(2, dtype=[("a", "f4"), ("b", "i4")])))
case("dtype with a 1 MiB type code", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy", "dtype"), u("f" * MIB), b"\x89\x88")))
case("dtype state claiming to hold objects", "UnsafeCheckpointError", lambda c: pk(dtype_op("f8", flags=63)),
     match="dtype state")
case("dtype state changing the item size", "UnsafeCheckpointError", lambda c: pk(dtype_op("f4", elsize=8)))
case("dtype state with field names", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy", "dtype"), u("f4"), b"\x89\x88")
                  + b"(" + i4(3) + u("<") + b"N(" + u("a") + b"t}" + b"N" + i4(-1) + i4(-1) + i4(0) + b"tb"))
case("dtype state as a list", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy", "dtype"), u("f4"), b"\x89\x88") + b"(" + i4(3) + u("<") + b"lb"))
case("array state with a list of objects as data", "UnsafeCheckpointError",
     lambda c: pk(array_op((2,), dtype_op("f8"), b"(" + u("a") + u("b") + b"l")))
case("array state with a type code instead of a dtype", "UnsafeCheckpointError",
     lambda c: pk(array_op((1,), u("f4"), b_(b"\0" * 4))))
case("array state of unknown form", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), i4(0) + b"\x85",
                       b_(b"b")) + b"(" + i4(1) + b"tb"))
case("huge declared shape with 8 bytes of data", "CorruptCheckpointError",
     lambda c: pk(array_op((1 << 40,), dtype_op("f4"), b_(b"\0" * 8))), match="holds 8 bytes")
case("shape whose product overflows", "CorruptCheckpointError",
     lambda c: pk(array_op((1 << 61, 1 << 61), dtype_op("f4"), b_(b"\0" * 8))))
case("negative dimension", "CorruptCheckpointError", lambda c: pk(array_op((-1,), dtype_op("f4"), b_(b"\0" * 4))),
     match="shape (-1,)")
case("100 dimensions", "CorruptCheckpointError", lambda c: pk(array_op((1,) * 100, dtype_op("f4"), b_(b"\0" * 4))))
case("shape as a string", "CorruptCheckpointError",
     lambda c: pk(call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), i4(0) + b"\x85",
                       b_(b"b")) + b"(" + i4(1) + u("4,") + dtype_op("f4") + b"\x89" + b_(b"\0" * 16) + b"tb"))
case("fortran flag as a string", "CorruptCheckpointError",
     lambda c: pk(array_op((1,), dtype_op("f4"), b_(b"\0" * 4), fortran=u("F"))), match="fortran flag 'F'")
case("numpy scalar with the wrong number of bytes", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy.core.multiarray", "scalar"), dtype_op("f8"), b_(b"\0" * 3))))
case("item assignment on an array", "UnsafeCheckpointError",
     lambda c: pk(inner(np.zeros(4, "float32")), b"(" + b"]" + b"K\x00a" * 1000 + b"t" + b"K\x01s"),
     match="filling a ndarray")
case("APPEND on a dict", "UnsafeCheckpointError", lambda c: pk(b"}Na"), match="filling a dict")

# -- memory: memo references, amplifying stand-ins, lying length fields, exponential trees

BIG_STR = "A" * MIB


def _memo_bomb(build_target: bytes) -> Callable[[Path], bytes]:
    return lambda c: pk(u(BIG_STR), put(1000), b"0", build_target, memo_refs(1000, 2000), b"b")


case("memo bomb: 2000 refs to a 1 MiB string as a dtype state", "UnsafeCheckpointError",
     _memo_bomb(call(glob("numpy", "dtype"), u("f4"), b"\x89\x88")), match="dtype state")
case("memo bomb: 2000 refs to a 1 MiB string as an array state", "UnsafeCheckpointError",
     _memo_bomb(call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), i4(0) + b"\x85",
                     b_(b"b"))), match="array state of unknown form")
case("memo bomb: BUILD on the tuple of refs itself", "UnsafeCheckpointError", _memo_bomb(memo_refs(1000, 2000)),
     match="state of a tuple")
case("memo bomb: persistent id", "UnsafeCheckpointError",
     lambda c: pk(u(BIG_STR), put(1000), b"0", memo_refs(1000, 2000), b"Q"), match="persistent id")
case("memo bomb: eval of a tuple", "UnsafeCheckpointError",
     lambda c: pk(u(BIG_STR), put(1000), b"0", glob("builtins", "eval"), b"(", memo_refs(1000, 2000), b"tR"),
     match="builtins.eval")
case("memo bomb: a dict key", "UnsafeCheckpointError",
     lambda c: pk(u(BIG_STR), put(1000), b"0", b"}", b"(" + memo_refs(1000, 2000) + b"t", b"Ns"),
     match="dict key of type tuple")
case("memo bomb: in the name table", "SchemaError",
     lambda c: pk(u(BIG_STR), put(1000), b"0", b"}", u(NAME_TABLE), b"}", u("w"), memo_refs(1000, 2000), b"ss"),
     match="maps 'w' to")
case("memo bomb: as a parameter", "SchemaError",
     lambda c: pk(u(BIG_STR), put(1000), b"0", b"}", u("w"), memo_refs(1000, 2000), b"s"), match="entry 'w' is a tuple")
case("_codecs.encode 2000 times on one 1 MiB string", "UnsafeCheckpointError",
     lambda c: pk(u(BIG_STR), put(1000), b"0", glob("_codecs", "encode"), put(1001), b"0",
                  b"(" + (get(1001) + b"(" + get(1000) + u("latin1") + b"tR") * 2000 + b"l", proto=2),
     match="would take more than")
case("2000 byte-swapped arrays sharing 1 MiB of data", "UnsafeCheckpointError",
     lambda c: pk(b_(b"\0" * MIB), put(1000), b"0",
                  b"(" + array_op((MIB // 4,), dtype_op("f4", order=">"), get(1000)) * 2000 + b"l"),
     match="would take more than")
case("2000 arrays from one 1 MiB latin-1 string", "UnsafeCheckpointError",
     lambda c: pk(u("\0" * MIB), put(1000), b"0",
                  b"(" + array_op((MIB,), dtype_op("u1", order="|"), get(1000)) * 2000 + b"l", proto=2),
     match="would take more than")
case("tuple() 2000 times on one list of 100,000 items", "UnsafeCheckpointError",
     lambda c: pk(b"(" + b"N" * 100_000 + b"l", put(1000), b"0", glob("builtins", "tuple"), put(1001), b"0",
                  b"(" + (get(1001) + b"(" + get(1000) + b"tR") * 2000 + b"l"), match="would take more than")
case("bytes with a declared length of 2**40", "CorruptCheckpointError",
     lambda c: pk(b"\x8e" + struct.pack("<Q", 1 << 40) + b"xx", proto=4), match="a record needs")
case("str with a declared length of 2**40", "CorruptCheckpointError",
     lambda c: pk(b"\x8d" + struct.pack("<Q", 1 << 40) + b"xx", proto=4), match="a record needs")
case("frame with a declared length of 2**40", "CorruptCheckpointError",
     lambda c: pk(b"\x95" + struct.pack("<Q", 1 << 40) + b"}", proto=4), match="a record needs")


def _doubling(levels: int) -> bytes:
    """[x, x] nested ``levels`` times: a few bytes per level, 2**levels leaves as a tree."""
    ops = b"N"
    for _ in range(levels):
        ops += put(1000) + b"0" + b"(" + get(1000) + get(1000) + b"l"
    return ops


case("exponential tree: 60 levels of [x, x]", "UnsafeCheckpointError", lambda c: pk(_doubling(60)),
     call="load", match="structure of more than")
case("exponential tree in LR_Scheduler (25 levels)", "UnsafeCheckpointError",
     lambda c: pk(b"}", u("LR_Scheduler"), b"}", u("last_epoch"), i4(1), b"s", u("x"), _doubling(25), b"ss"),
     call="opt", match="structure of more than")
case("list that holds itself", "CorruptCheckpointError", lambda c: pk(b"]", put(1000), get(1000), b"a"),
     match="contains itself")
case("1 MiB of empty dicts left on the stack", "CorruptCheckpointError", lambda c: pk(b"}" * MIB),
     match="unused objects")
case("1 MiB of memo entries for one dict", "CorruptCheckpointError", lambda c: pk(b"}" + b"\x94" * MIB + b"]", proto=4),
     match="unused objects")
case("deep nesting: 10,000 levels of lists", "CorruptCheckpointError",
     lambda c: pk(b"]" * 10_001 + b"a" * 10_000), match="nested more than 64")
case("deep nesting: 10,000 levels of dicts", "CorruptCheckpointError",
     lambda c: pk(b"}" + (u("k") + b"}") * 10_000 + b"s" * 10_000), match="nested more than 64")
case("deep nesting: a dict key of 1,000,000 nested tuples", "UnsafeCheckpointError",
     lambda c: pk(b"}", b")" + b"\x85" * 1_000_000, b"Ns", proto=2), match="dict key of type tuple")
case("deep nesting: DICT with a key of 1,000,000 nested tuples", "UnsafeCheckpointError",
     lambda c: pk(b"(", b")" + b"\x85" * 1_000_000, b"Nd", proto=2), match="dict key of type tuple")
case("a 1 MiB integer as a dtype state", "UnsafeCheckpointError",
     lambda c: pk(call(glob("numpy", "dtype"), u("f4"), b"\x89\x88"), b"\x8b" + struct.pack("<I", MIB) + b"\x7f" * MIB,
                  b"b"), match="<int of")

# -- not a pickle at all

case("empty file", "CorruptCheckpointError", lambda c: b"", match="file ends")
case("only a protocol header", "CorruptCheckpointError", lambda c: b"\x80\x04")
case("garbage", "CorruptCheckpointError", lambda c: b"\x00\x01garbage\xff" * 10, match="invalid opcode")
case("unsupported protocol 9", "CorruptCheckpointError", lambda c: b"\x80\x09}.")
case("truncated state dict", "CorruptCheckpointError", lambda c: pkl(GOOD_PARAMS, 2)[:-40])
case("truncated to half", "CorruptCheckpointError", lambda c: pkl(GOOD_PARAMS, 4)[: len(pkl(GOOD_PARAMS, 4)) // 2])
case("STOP on an empty stack", "CorruptCheckpointError", lambda c: pk())
case("POP_MARK without a mark", "CorruptCheckpointError", lambda c: pk(b"N1"))
case("BINGET of a missing memo slot", "CorruptCheckpointError", lambda c: pk(b"h\x05"))
case("EXT1 of an unregistered code", "CorruptCheckpointError", lambda c: pk(b"\x82\x07"))
case("two objects left at STOP", "CorruptCheckpointError", lambda c: pk(b"N}"), match="unused objects")
case("protocol 0 INT of a million digits", "CorruptCheckpointError", lambda c: b"I" + b"9" * MIB + b"\n.")
case("protocol 0 GET of a million digits", "CorruptCheckpointError", lambda c: b"N(g" + b"9" * MIB + b"\n.")
case("a global named by a 1 MiB line without a newline", "UnsafeCheckpointError", lambda c: b"c" + b"x" * MIB)

# -- state dicts whose structure is wrong (import_paddle_files)


def _p(obj: object, protocol: int = 2) -> Callable[[Path], bytes]:
    return lambda c: pkl(obj, protocol)


def _big(info: object, **extra: object) -> dict:
    return {"w@@.0": np.arange(6, dtype="float32"), "w@@.1": np.arange(4, dtype="float32"), BIG: info, **extra}


case("top level is a list", "SchemaError", _p([F4]))
case("top level is an array", "SchemaError", _p(F4))
case("non-string key", "SchemaError", _p({1: F4}), match="key 1 is a int")
case("tuple key", "SchemaError", _p({("a", 1): F4}))
case("bytes key", "SchemaError", _p({b"w": F4}))
case("value is a dict", "SchemaError", _p({"w": {"x": F4}}))
case("value is a tuple of the wrong length", "SchemaError", _p({"w": ("linear_0.w_0", F4, 1)}))
case("(name, array) with a non-string name", "SchemaError", _p({"w": (7, F4)}))
case("name table is a list", "SchemaError", _p({"w": F4, NAME_TABLE: ["w", "linear_0.w_0"]}),
     match="StructuredToParameterName@@")
case("name table maps to an int", "SchemaError", _p({"w": F4, NAME_TABLE: {"w": 3}}))
case("name table keyed by an int", "SchemaError", _p({"w": F4, NAME_TABLE: {3: "linear_0.w_0"}}))
case("big-param info is a list", "SchemaError", _p(_big(["w"])))
case("big-param entry is a string", "SchemaError", _p(_big({"w": "slices"})))
case("big-param entry without OriginShape", "SchemaError", _p(_big({"w": {"slices": ["w@@.0", "w@@.1"]}})))
case("big-param slices naming missing keys", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "nope"], "OriginShape": (10,)}})), match="'nope'")
case("big-param slices as a string", "SchemaError", _p(_big({"w": {"slices": "w@@.0", "OriginShape": (10,)}})))
case("big-param slice listed twice", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.0"], "OriginShape": (12,)}})))
case("big-param slices that are not arrays", "SchemaError",
     _p({"w@@.0": "x", BIG: {"w": {"slices": ["w@@.0"], "OriginShape": (1,)}}}))
case("big-param slices of two dtypes", "SchemaError",
     _p({"a": np.zeros(2, "float32"), "b": np.zeros(2, "int64"),
         BIG: {"w": {"slices": ["a", "b"], "OriginShape": (4,)}}}))
case("big-param OriginShape that does not fit", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.1"], "OriginShape": (3, 3)}})), match="needs 9")
case("big-param OriginShape with a negative dim", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.1"], "OriginShape": (-10,)}})))
case("big-param OriginShape of 2**70", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.1"], "OriginShape": (0, 1 << 70)}})))
case("big-param OriginShape as a string", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.1"], "OriginShape": "10"}})))
case("big-param key also held whole", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.1"], "OriginShape": (10,)}}, w=F4)))
case("big-param keyed by an int", "SchemaError",
     _p(_big({5: {"slices": ["w@@.0", "w@@.1"], "OriginShape": (10,)}})))
case("two big params sharing a slice", "SchemaError",
     _p(_big({"w": {"slices": ["w@@.0", "w@@.1"], "OriginShape": (10,)},
              "v": {"slices": ["w@@.1"], "OriginShape": (4,)}})))

# -- optimizer files (import_paddle_files(good.pdparams, file))


def _opt(**changes: object) -> Callable[[Path], bytes]:
    obj = {**GOOD_OPT, **changes}
    return lambda c: pkl({k: v for k, v in obj.items() if v is not _DROP}, 2)


_DROP = object()

case("pdopt: top level is a list", "SchemaError", lambda c: pkl([F4], 2), call="opt")
case("pdopt: key naming no parameter", "SchemaError", _opt(linear_9_w_0_moment1_0=F4),
     call="opt", match="linear_9_w_0_moment1_0")
case("pdopt: entry that is not an array", "SchemaError", _opt(**{"linear_0.w_0_moment2_0": "x"}), call="opt")
case("pdopt: non-string key", "SchemaError", lambda c: pkl({**GOOD_OPT, 7: F4}, 2), call="opt")
case("pdopt: LR_Scheduler is a list", "SchemaError", _opt(LR_Scheduler=[3, 0.1]),
     call="opt", match="'LR_Scheduler' is a list")
case("pdopt: LR_Scheduler is an array", "SchemaError", _opt(LR_Scheduler=F4), call="opt")
case("pdopt: last_epoch = inf", "SchemaError", _opt(LR_Scheduler={"last_epoch": math.inf}),
     call="opt", match="last_epoch inf")
case("pdopt: last_epoch = nan", "SchemaError", _opt(LR_Scheduler={"last_epoch": math.nan}), call="opt")
case("pdopt: last_epoch is a string", "SchemaError", _opt(LR_Scheduler={"last_epoch": "3"}), call="opt")
case("pdopt: last_epoch = 10**30", "SchemaError", _opt(LR_Scheduler={"last_epoch": 10**30}), call="opt")
case("pdopt: last_epoch of 5000 digits", "SchemaError", _opt(LR_Scheduler={"last_epoch": 10**5000}), call="opt")
case("pdopt: last_lr is a string", "SchemaError", _opt(LR_Scheduler={"last_epoch": 1, "last_lr": "0.1"}),
     call="opt")
case("pdopt: LR_Scheduler holds a complex number", "SchemaError",
     _opt(LR_Scheduler={"last_epoch": 1, "x": np.complex64(1j)}), call="opt")
case("pdopt: LR_Scheduler keyed by a 5000-digit int", "SchemaError",
     _opt(LR_Scheduler={"last_epoch": 1, 10**5000: 1}), call="opt")
case("pdopt: master_weights is a list", "SchemaError", _opt(master_weights=[F4]), call="opt", match="'master_weights'")
case("pdopt: master_weights value is an int", "SchemaError", _opt(master_weights={"linear_0.w_0": 3}), call="opt")
case("pdopt: master_weights keyed by an int", "SchemaError", _opt(master_weights={3: F4}), call="opt", match="maps 3")
case("pdopt: master_weights tuple of the wrong length", "SchemaError",
     _opt(master_weights={"linear_0.w_0": ("linear_0.w_0", F4, 1)}), call="opt")
case("pdopt: big-param slices naming missing keys", "SchemaError",
     _opt(**{BIG: {"w": {"slices": ["nope"], "OriginShape": (1,)}}}), call="opt")
case("pdopt: 50 keys of 40,000 underscores (quadratic prefix search)", "SchemaError",
     lambda c: pkl({"_" * 40_000 + str(i): F4 for i in range(50)}, 4), call="opt", match="name no parameter")


# ----------------------------------------------------------------------------- the child process


def run_corpus(directory: Path) -> dict:
    """Write every case's file, read each, and report what happened (run in a child process)."""
    from ckptcore.errors import CheckpointError
    from ckptcore_paddle._files import import_paddle_files, load_paddle_pickle

    canary_dir = directory / "canary"
    canary_dir.mkdir()
    canary = canary_dir / "ran"
    good = directory / "good.pdparams"
    good.write_bytes(pkl(GOOD_PARAMS, 2))
    results = {}
    for n, c in enumerate(CASES):
        path = directory / f"case{n:03d}{'.pdopt' if c.call == 'opt' else '.pdparams'}"
        path.write_bytes(c.make(canary))
        start = time.monotonic()
        try:
            if c.call == "params":
                import_paddle_files(path)
            elif c.call == "opt":
                import_paddle_files(good, path)
            else:
                load_paddle_pickle(path)
            outcome = {"raised": None}
        except BaseException as e:  # noqa: BLE001 - anything but a CheckpointError is the finding
            causes, cause = [], e.__cause__
            while cause is not None:
                causes.append(type(cause).__name__)
                cause = cause.__cause__
            outcome = {"raised": type(e).__name__, "checkpoint_error": isinstance(e, CheckpointError),
                       "names_file": str(path) in str(e), "message": str(e)[:2000], "causes": causes}
        outcome.update(seconds=time.monotonic() - start, canary=sorted(p.name for p in canary_dir.iterdir()),
                       maxrss_mb=_peak_rss_mb(),
                       size=path.stat().st_size)
        results[c.name] = outcome
        path.unlink()
    paddle_loaded = sorted(m for m in sys.modules if m == "paddle" or m.startswith("paddle."))
    return {"cases": results, "maxrss_mb": _peak_rss_mb(),
            "paddle_loaded": paddle_loaded}


def _peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: Linux carries a parent's ru_maxrss into a child across fork and exec,
    # so a child of a large pytest process would report the parent's size.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def _child_main(directory: str) -> None:
    # A safety net for the machine should a bomb get through: past this address-space limit the
    # child gets MemoryError (recorded as a cause) long before the host runs out of memory.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 3 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    out = run_corpus(Path(directory))
    (Path(directory) / "results.json").write_text(json.dumps(out))


if __name__ == "__main__":
    _child_main(sys.argv[1])
    sys.exit(0)


# ----------------------------------------------------------------------------- the tests

import pytest  # noqa: E402 - the child process above needs no pytest



@pytest.fixture(scope="module")
def corpus(tmp_path_factory, run_python_module):
    d = tmp_path_factory.mktemp("hostile")
    start = time.monotonic()
    run_python_module(__file__, d, timeout=600)  # fails the test unless the child exits with 0
    out = json.loads((d / "results.json").read_text())
    out["seconds"] = time.monotonic() - start
    return out


def test_corpus_is_large_and_names_are_unique():
    assert len(CASES) >= 50
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_hostile_file_is_refused_with_a_checkpoint_error(corpus, name):
    expected, match = next((c.expect, c.match) for c in CASES if c.name == name)
    got = corpus["cases"][name]
    assert got["raised"] is not None, f"{name}: loaded without an error"
    assert got["checkpoint_error"], f"{name}: raised {got['raised']}: {got['message'][:500]}"
    assert got["raised"] == expected, f"{name}: raised {got['raised']}, not {expected}: {got['message'][:500]}"
    assert match in got["message"], f"{name}: refused for another reason: {got['message'][:500]}"
    assert got["names_file"], f"{name}: the message does not name the file: {got['message'][:500]}"
    assert len(got["message"]) < 1000, f"{name}: a {len(got['message'])}-character message"
    assert "MemoryError" not in got["causes"], f"{name}: refused only after running out of memory"
    assert got["canary"] == [], f"{name}: code ran"
    assert got["seconds"] < 20, f"{name}: took {got['seconds']:.1f} s"


def test_no_case_ran_code_or_imported_paddle(corpus):
    assert all(r["canary"] == [] for r in corpus["cases"].values())
    assert corpus["paddle_loaded"] == []


def test_whole_corpus_stays_within_bounded_memory(corpus):
    # Each case's high-water mark is kept, so a failure names the case that raised it.
    marks, previous, jumps = corpus["cases"], 0.0, []
    for name, r in marks.items():
        jumps.append((r["maxrss_mb"] - previous, name))
        previous = max(previous, r["maxrss_mb"])
    worst = sorted(jumps, reverse=True)[:3]
    assert corpus["maxrss_mb"] < MAX_RSS_MB, f"peak RSS {corpus['maxrss_mb']:.0f} MB; largest rises: {worst}"


def test_memory_bombs_are_small_files():
    """The bombs are worth testing only if the files are small: a 1 MiB string shared 2000 times."""
    sizes = {c.name: len(c.make(Path("/nonexistent/canary"))) for c in CASES if "memo bomb" in c.name
             or "2000" in c.name}
    assert sizes and all(s < 3 * MIB for s in sizes.values()), sizes


# ----------------------------------------------------------------------------- legitimate files near the bounds


def _legit_near_the_bounds() -> dict[str, object]:
    tied = np.arange(6, dtype="float32")
    return {
        # protocol 2 stores array bytes as a latin-1 str that _codecs.encode copies and BUILD copies
        # again: all-zero data makes the file barely larger than the data, the budget's tightest case
        "zeros": np.zeros(1 << 20, "float32"),
        "swapped": np.arange(1 << 16, dtype=">f8"),
        # many tiny entries: the most values per byte a state dict has
        **{f"layer.{i}.b": np.float32(i).reshape(1) for i in range(3000)},
        NAME_TABLE: {f"layer.{i}.b": f"linear_{i}.b_0" for i in range(3000)},
        # one array under many keys (tied weights): each extra key costs a memo reference
        **{f"tied.{i}": tied for i in range(500)},
    }


def test_legitimate_files_near_the_bounds_load(tmp_path):
    from ckptcore_paddle._files import import_paddle_files, load_paddle_pickle

    saved = _legit_near_the_bounds()
    for protocol in (0, 1, 2, 3, 4):
        path = tmp_path / f"p{protocol}.pdparams"
        path.write_bytes(pickle.dumps(saved, protocol=protocol))
        state = import_paddle_files(path)
        assert np.array_equal(state.model["zeros"], saved["zeros"]), protocol
        assert np.array_equal(state.model["swapped"], saved["swapped"]), protocol
        assert state.model["layer.2999.b"][0] == 2999, protocol
        assert state.extra["paddle"]["param_names"]["layer.7.b"] == "linear_7.b_0", protocol
        assert sum(k.startswith("tied.") for k in state.model) == 500, protocol
    nested = {"model": OrderedDict(w=("linear_0.w_0", F4)), "epoch": 3, "lrs": [0.1, 0.01],
              "static": _Reduce(eval, ("data", {"data": F4}))}
    path = tmp_path / "nested.pd"
    path.write_bytes(pickle.dumps(nested, protocol=2))
    got = load_paddle_pickle(path)
    assert isinstance(got["model"], OrderedDict) and got["model"]["w"][0] == "linear_0.w_0"
    assert np.array_equal(got["model"]["w"][1], F4) and np.array_equal(got["static"], F4)
    assert got["epoch"] == 3 and got["lrs"] == [0.1, 0.01]
