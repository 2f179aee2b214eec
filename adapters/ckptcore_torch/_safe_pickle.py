"""The restricted reader of ``torch.save`` files: their pickles unpickled without PyTorch or code.

``torch.save`` of a state dict pickles (protocol 2) plain dicts, lists and numbers, the
``OrderedDict`` of a module's state dict, and tensors as ``torch._utils._rebuild_tensor_v2(storage,
offset, size, stride, requires_grad, hooks)``, whose storage is a persistent id ``("storage",
torch.FloatStorage, key, location, numel)``.  The zip format keeps storage ``key`` in the record
``<archive>/data/<key>``; the legacy format (``_use_new_zipfile_serialization=False``) appends
the storages after the pickle, each as its element count (int64) and its bytes.

Admitted, each replaced by a stand-in (the real one is never imported): ``_rebuild_tensor_v2``
(and ``_rebuild_tensor``), ``_rebuild_parameter`` (and ``_with_state`` with no state), the typed
storage classes (``torch.FloatStorage``...: a dtype), ``torch.Size`` (a tuple),
``collections.OrderedDict`` (whose ``BUILD`` may set only the module versions ``_metadata``)
and, for the ``.metadata`` of ``torch.distributed.checkpoint`` folders (``dcp=True``), the torch
dtypes, ``torch.serialization._get_layout`` of ``"torch.strided"``, ``_MEM_FORMAT_ENCODING`` and
the metadata's dataclasses as plain records.  The opcode-level restrictions and the memory budget
are the core's :class:`ckptcore.adapter.RestrictedUnpickler`.

A tensor stand-in is a :class:`Pending` view, checked when built: its storage's declared bytes must
fit in what the file can hold, and its offset, sizes and strides must stay inside the storage.
:func:`materialize` then reads each storage once (sizes checked against the record) and turns the
views into NumPy arrays: a contiguous view shares its storage's bytes, any other is copied and
the copy charged to the budget (an expanded view of one element is refused, not allocated).
"""

from __future__ import annotations

import io
import math
import re
import struct
import zipfile
from collections import OrderedDict
from typing import Any, BinaryIO, Callable

import numpy as np

from ckptcore.adapter import (PLAIN_KEYS, Record, RecordClass, RestrictedUnpickler, brief,
                              brief_error, check_plain, parse_dtype, restricted_load)
from ckptcore.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["TorchUnpickler", "Pending", "Storage", "StateDict", "DTYPES", "STORAGE_TYPES",
           "materialize", "load_torch", "TorchDType"]

# torch dtype name -> NumPy dtype name (bfloat16 and float8 through ml_dtypes).
DTYPES = {"float32": "float32", "float64": "float64", "float16": "float16", "bfloat16": "bfloat16",
          "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
          "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
          "complex64": "complex64", "complex128": "complex128",
          "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
# The typed storage classes torch.save names -> torch dtype name.
STORAGE_TYPES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
                 "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
                 "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
                 "UInt16Storage": "uint16", "UInt32Storage": "uint32", "UInt64Storage": "uint64",
                 "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
                 "ComplexDoubleStorage": "complex128", "Float8_e4m3fnStorage": "float8_e4m3fn",
                 "Float8_e5m2Storage": "float8_e5m2"}
# The dataclasses of a torch.distributed.checkpoint .metadata file (torch 2.13) and their fields.
DCP_RECORDS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"):
        frozenset({"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"):
        frozenset({"properties", "size", "chunks"}),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): frozenset({"offsets", "sizes"}),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"):
        frozenset({"dtype", "layout", "requires_grad", "memory_format", "pin_memory"}),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): frozenset(),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"): frozenset({"fqn", "offset", "index"}),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"):
        frozenset({"checkpoint_id", "save_id", "load_id", "modules"}),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        frozenset({"relative_path", "offset", "length", "transform_descriptors"}),
}
_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")  # a storage key: a record name part, never a path
_MAX_DIMS = 64
_MAX_DIM = 1 << 62


class StateDict(OrderedDict):
    """A module's state dict as unpickled: an ``OrderedDict`` with its module versions."""

    module_versions: Any = None


class TorchDType:
    """A ``torch.<dtype>`` global (``name``: ``"float32"``...)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class Storage:
    """One storage a persistent id names: its key, dtype and element count (bytes read later)."""

    def __init__(self, key: str, dtype: np.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel
        self.data: np.ndarray | None = None


class Pending:
    """A tensor: a checked strided view of a storage, made an array by :func:`materialize`."""

    def __init__(self, storage: Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    def __repr__(self) -> str:
        return f"tensor(shape={self.size}, dtype={self.storage.dtype})"


class TorchUnpickler(RestrictedUnpickler):
    writer = "a torch.save state dict"
    holds = "tensors, their storages and plain values"
    loader = "torch.load(weights_only=True)"
    max_args = 7  # _rebuild_tensor_v2's

    def __init__(self, file: BinaryIO, source: str, size: int, *, data_limit: int,
                 storages: dict[str, Storage] | None = None, dcp: bool = False) -> None:
        admitted: dict[tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_tensor"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self._rebuild_parameter,
            ("collections", "OrderedDict"): self._ordered_dict,
            ("torch", "Size"): self._size,
        }
        for name, dtype in STORAGE_TYPES.items():
            admitted[("torch", name)] = ("storage type", dtype)
        if dcp:
            for name in DTYPES:
                admitted[("torch", name)] = TorchDType(name)
            admitted[("torch.serialization", "_get_layout")] = self._layout
            admitted[("pathlib", "PosixPath")] = self._path  # StorageMeta.checkpoint_id
            admitted[("pathlib", "WindowsPath")] = self._path
            admitted[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = self._mem_format
            for (module, name), fields in DCP_RECORDS.items():
                admitted[(module, name)] = RecordClass(name, fields)
        super().__init__(file, source, size, admitted)
        if dcp:  # (for refusals' messages)
            self.writer, self.holds = "torch.distributed.checkpoint's .metadata", "its records and plain values"
            self.loader = "torch.distributed.checkpoint.load"
        # The bytes all storages together may declare: what the file (or its data section) holds.
        self.data_limit, self.declared = data_limit, 0
        self.storages = {} if storages is None else storages

    # ---- persistent ids: storages

    def persistent(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) not in (5, 6) or pid[0] != "storage":
            return super().persistent(pid)
        kind, key, location, numel = pid[1:5]
        if type(kind) is not tuple or kind[0] != "storage type":
            raise self.refuse(f"a storage of type {brief(kind)}")
        if type(key) is not str or not _KEY.fullmatch(key) or type(location) is not str or \
                type(numel) is not int or not 0 <= numel < _MAX_DIM:
            raise self.refuse(f"storage persistent id {brief(pid)} (a key must name a record of "
                              "this file, not a path)")
        if len(pid) == 6 and pid[5] is not None:
            raise self.corrupt(f"storage {key!r} is a view of another (pre-1.0 files); not read")
        dtype = parse_dtype(DTYPES[kind[1]])
        known = self.storages.get(key)
        if known is not None:
            if (known.dtype, known.numel) != (dtype, numel):
                raise self.corrupt(f"storage {key!r} is declared twice, as {known.numel} "
                                   f"{known.dtype} and as {numel} {dtype}")
            return known
        self.declared += numel * dtype.itemsize
        if self.declared > self.data_limit:
            raise self.corrupt(f"storage {key!r} declares {numel} {dtype} values; the storages "
                               f"declared so far need {self.declared} bytes, more than the "
                               f"{self.data_limit} the file holds")
        self.storages[key] = Storage(key, dtype, numel)
        return self.storages[key]

    # ---- stand-ins

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Pending:
        if type(storage) is not Storage:
            raise self.refuse(f"rebuilding a tensor from a {type(storage).__name__}")
        if len(rest) >= 2 and (not isinstance(rest[1], dict) or rest[1]):
            raise self.refuse("a tensor with backward hooks")
        for what, dims in (("size", size), ("stride", stride)):
            if type(dims) is not tuple or len(dims) > _MAX_DIMS or \
                    not all(type(d) is int and 0 <= d < _MAX_DIM for d in dims):
                raise self.corrupt(f"a tensor's {what} {brief(dims)} is not a shape")
        if len(size) != len(stride) or type(offset) is not int or offset < 0:
            raise self.corrupt(f"a tensor of size {size}, stride {stride}, offset {brief(offset)}")
        if 0 not in size:
            last = offset + sum((n - 1) * s for n, s in zip(size, stride))
            if last >= storage.numel:
                raise self.corrupt(f"a tensor of size {size}, stride {stride} at offset {offset} "
                                   f"reaches element {last} of a storage of {storage.numel}")
        return Pending(storage, offset, size, stride)

    def _rebuild_parameter(self, data: Any, requires_grad: Any = False, hooks: Any = None,
                           state: Any = None) -> Pending:
        if type(data) is not Pending or (hooks is not None and (not isinstance(hooks, dict) or hooks)) \
                or (state is not None and state != {} and state != (None, None)):
            raise self.refuse("a parameter with hooks or state (a tensor subclass)")
        return data

    def _ordered_dict(self, *args: Any) -> StateDict:
        if args:  # pickle writes OrderedDict() and fills it with SETITEMS
            raise self.refuse(f"collections.OrderedDict{brief(args)}")
        return StateDict()

    def _size(self, dims: Any = ()) -> tuple:
        if type(dims) is not tuple or len(dims) > _MAX_DIMS or not all(type(d) is int for d in dims):
            raise self.refuse(f"torch.Size({brief(dims)})")
        return dims

    def _layout(self, name: Any) -> str:
        if name != "torch.strided":
            raise self.refuse(f"torch layout {brief(name)} (only strided tensors are read)")
        return "strided"

    def _path(self, *parts: Any) -> str:
        if not all(type(p) is str for p in parts):
            raise self.refuse(f"pathlib path of {brief(parts)}")
        return "/".join(parts)

    def _mem_format(self, code: Any) -> int:
        if type(code) is not int or code not in (0, 1, 2):
            raise self.refuse(f"memory format {brief(code)}")
        return code

    # ---- BUILD

    def build(self, inst: Any, state: Any) -> None:
        if type(inst) is StateDict and type(state) is dict and set(state) <= {"_metadata"}:
            inst.module_versions = state.get("_metadata")
            return
        super().build(inst, state)

    def build_record(self, rec: Record, fields: frozenset[str], state: Any) -> dict[str, Any]:
        if rec.kind == "TensorProperties" and type(state) is tuple and len(state) == 5:
            return dict(zip(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), state))
        out = super().build_record(rec, fields, state)
        if rec.kind in ("MetadataIndex", "ChunkStorageMetadata", "_StorageInfo"):
            for k, v in out.items():  # keys' parts: flat numbers, strings, tuples
                if not (type(v) in PLAIN_KEYS or (type(v) is tuple and all(type(x) in PLAIN_KEYS for x in v))):
                    raise self.refuse(f"field {k!r} of a {rec.kind} record holding a {type(v).__name__}")
        return out


def materialize(obj: Any, read: Callable[[Storage], np.ndarray], charge: Callable[[int, str], None],
                source: str, depth: int = 0) -> Any:
    """``obj`` with every :class:`Pending` tensor made an array (containers rebuilt, module
    versions kept); ``read(storage)`` returns a storage's elements (checked against its numel)."""
    if depth > _MAX_DIMS:
        raise CorruptCheckpointError(f"{source}: nested more than {_MAX_DIMS} levels deep", file=source)
    if type(obj) is Pending:
        st = obj.storage
        if st.data is None:
            st.data = read(st)
        n = math.prod(obj.size)
        itemsize = st.dtype.itemsize
        contiguous = all(s == math.prod(obj.size[i + 1:]) for i, s in enumerate(obj.stride) if obj.size[i] > 1)
        if n == 0:
            return np.zeros(obj.size, dtype=st.dtype)
        if contiguous:
            return st.data[obj.offset:obj.offset + n].reshape(obj.size)
        charge(n * itemsize, f"a strided view of shape {obj.size}")
        view = np.lib.stride_tricks.as_strided(st.data[obj.offset:], shape=obj.size,
                                               strides=tuple(s * itemsize for s in obj.stride))
        return np.array(view)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is StateDict else {}
        if type(obj) is StateDict:
            out.module_versions = obj.module_versions
        for k, v in obj.items():
            out[k] = materialize(v, read, charge, source, depth + 1)
        return out
    if isinstance(obj, list):
        return [materialize(v, read, charge, source, depth + 1) for v in obj]
    if type(obj) is tuple:
        return tuple(materialize(v, read, charge, source, depth + 1) for v in obj)
    return obj


# ----------------------------------------------------------------------------- the two formats

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def load_torch(f: BinaryIO, size: int, source: str) -> Any:
    """The object a ``torch.save`` file holds (``f`` positioned at its start, ``size`` bytes
    long), tensors as NumPy arrays; zip or legacy format by the first bytes."""
    start = f.tell()
    head = f.read(4)
    f.seek(start)
    if head == b"PK\x03\x04":
        return _load_zip(f, size, source)
    if head[:1] == b"\x80":
        return _load_legacy(f, size, source)
    raise CorruptCheckpointError(f"{source}: neither a zip nor a legacy torch.save file "
                                 f"(starts with {brief(head)}; tar files of torch < 0.4 are not read)",
                                 file=source)


def _unpickle(f: BinaryIO, source: str, size: int, **kw: Any) -> tuple[Any, TorchUnpickler]:
    made: list[TorchUnpickler] = []

    def make(f: BinaryIO, s: str, n: int) -> TorchUnpickler:
        made.append(TorchUnpickler(f, s, n, **kw))
        return made[-1]

    obj = restricted_load(make, f, source, size, "torch.save pickle")
    check_plain(obj, source, size + (1 << 16), leaves=(Pending, TorchDType))
    return obj, made[0]


def _load_zip(f: BinaryIO, size: int, source: str) -> Any:
    try:
        zf = zipfile.ZipFile(_Window(f, size))
        infos = {i.filename: i for i in zf.infolist()}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error, NotImplementedError) as e:
        raise CorruptCheckpointError(f"{source}: not a readable zip ({type(e).__name__}: "
                                     f"{brief_error(e)})", file=source) from e
    for name, info in infos.items():
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or ".." in parts:
            raise UnsafeCheckpointError(f"{source}: refused the zip entry {brief(name)} (a path "
                                        "outside the archive's folder)")
        # torch.save stores records as they are: a compressed record, or one declaring more
        # bytes than it occupies or than the file has, is built to make a reader inflate it.
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > size or \
                info.compress_size != info.file_size:
            how = f"compressed (method {info.compress_type})" if info.compress_type else \
                f"declaring {info.file_size} bytes, {info.compress_size} stored in a file of {size}"
            raise UnsafeCheckpointError(f"{source}: refused the zip entry {brief(name)}, {how}; "
                                        "torch.save stores each record uncompressed, as it is")
    pkls = [n for n in infos if n.count("/") == 1 and n.endswith("/data.pkl")]
    if len(pkls) != 1:
        raise CorruptCheckpointError(f"{source}: {len(pkls)} <archive>/data.pkl records; not a "
                                     "torch.save zip file", file=source)
    prefix = pkls[0][: -len("data.pkl")]

    def record(name: str) -> bytes:
        try:
            return zf.read(infos[name])
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error, NotImplementedError) as e:
            raise CorruptCheckpointError(f"{source}: record {name} is damaged ({type(e).__name__}: "
                                         f"{brief_error(e)})", file=source) from e

    order = record(prefix + "byteorder").decode("latin1") if prefix + "byteorder" in infos else "little"
    if order not in ("little", "big"):
        raise CorruptCheckpointError(f"{source}: byteorder {brief(order)}", file=source)
    pickled = record(pkls[0])
    obj, up = _unpickle(io.BytesIO(pickled), source, len(pickled), data_limit=size)

    def read(st: Storage) -> np.ndarray:
        name = f"{prefix}data/{st.key}"
        if name not in infos:
            raise CorruptCheckpointError(f"{source}: the pickle names storage {st.key!r}, but the "
                                         f"file has no record {name}", file=source)
        if infos[name].file_size != st.numel * st.dtype.itemsize:
            raise CorruptCheckpointError(f"{source}: record {name} holds {infos[name].file_size} "
                                         f"bytes; its {st.numel} {st.dtype} values need "
                                         f"{st.numel * st.dtype.itemsize}", file=source)
        return _elements(record(name), st.dtype, order)

    return materialize(obj, read, up.charge, source)


def _elements(raw: bytes, dtype: np.dtype, order: str) -> np.ndarray:
    arr = np.frombuffer(bytearray(raw), dtype=dtype)
    if order == "big" and dtype.itemsize > 1:
        arr = arr.view(dtype.newbyteorder(">")).astype(dtype)
    return arr


def _load_legacy(f: BinaryIO, size: int, source: str) -> Any:
    end = f.tell() + size

    def header(what: str) -> Any:
        return _unpickle(f, source, end - f.tell(), data_limit=0)[0]

    magic, protocol, info = header("magic"), header("protocol"), header("sys_info")
    if magic != _LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL or not isinstance(info, dict):
        raise CorruptCheckpointError(f"{source}: not a torch.save file (a pickle without "
                                     "torch's magic number)", file=source)
    order = "little" if info.get("little_endian", True) else "big"
    obj, up = _unpickle(f, source, end - f.tell(), data_limit=end - f.tell())
    keys = header("storage keys")
    if type(keys) is not list or set(keys) != set(up.storages) or len(keys) != len(up.storages):
        raise CorruptCheckpointError(f"{source}: the storage list {brief(keys)} does not match the "
                                     "storages the pickle names", file=source)
    for key in keys:
        st = up.storages[key]
        count = f.read(8)
        if len(count) != 8 or struct.unpack("<q", count)[0] != st.numel or \
                st.numel * st.dtype.itemsize > end - f.tell():
            raise CorruptCheckpointError(f"{source}: storage {key!r} is not the {st.numel} "
                                         f"{st.dtype} values the pickle declares, or the file ends "
                                         "before it", file=source)
        st.data = _elements(f.read(st.numel * st.dtype.itemsize), st.dtype, order)
    return materialize(obj, lambda st: st.data, up.charge, source)


class _Window(io.RawIOBase):
    """``size`` bytes of ``f`` from its current position, as a seekable file of their own (a
    DCP data file holds one torch.save zip per byte range)."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f, self._start, self._size, self._pos = f, f.tell(), size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, [pos, self._pos + pos, self._size + pos][whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)
