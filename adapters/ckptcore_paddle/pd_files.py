"""``.pdparams`` / ``.pdopt`` interop without Paddle and without running code.

``paddle.save`` of a state dict pickles a plain ``dict`` of numpy arrays (FRAMEWORKS.md §9).  We
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

Every other global, persistent id or ``BUILD`` target raises
:class:`~ckptcore.errors.UnsafeCheckpointError` naming the file and what was asked for, before it
can run.

Names: ``.pdparams`` keys are structured names and become ``state.model`` keys; the
``StructuredToParameterName@@`` table gives each one's runtime name (``linear_0.w_0``), kept in
``state.extra["paddle"]["param_names"]``; keys sharing a runtime name are aliases (see
``_capture.py``).  A ``.pdopt`` key ``<runtime name>_<slot>_<k>`` goes to
``optimizer.slots[<structured name>][<slot>]`` through that table.

Writing: :func:`export_paddle_files` needs each parameter's runtime name in the process that will
call ``paddle.load``; Paddle's ``set_state_dict`` looks accumulators up by
``f"{param.name}_{slot}_0"``.  They come from the ``param_names`` argument, else from the state
(captured from a live model, or imported).  A model built the same way in a fresh process gets
the same runtime names, since Paddle's name counters start from zero.
"""

from __future__ import annotations

import math
import os
import pickle
from collections import OrderedDict
from typing import Any, BinaryIO

import numpy as np

from ckptcore.errors import CorruptCheckpointError, SchemaError, UnsafeCheckpointError
from ckptcore.state import OptimizerState, ScheduleState, TrainingState

from ._common import (BIG_PARAM_INFO, MASTER_SLOT, NAME_TABLE, SCHEDULER_EXTRA_ATTRS, adam_step,
                      infer_optimizer_kind, plain, split_accumulator_key)

__all__ = ["import_paddle_files", "export_paddle_files", "load_paddle_pickle"]

_NUMERIC_KINDS = "biufc"
_SCALARS = (str, bytes, int, float, bool, type(None), np.generic)


class _SafeUnpickler(pickle._Unpickler):  # the pure-Python unpickler lets us check BUILD
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO, source: str):
        super().__init__(file, encoding="latin1")
        self.source = source
        self.globals = {
            ("numpy._core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy.core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy._core.multiarray", "scalar"): self._scalar,
            ("numpy.core.multiarray", "scalar"): self._scalar,
            ("numpy", "ndarray"): self._ndarray_class(),
            ("numpy", "dtype"): self._dtype,
            ("builtins", "tuple"): tuple,
            ("collections", "OrderedDict"): OrderedDict,
            ("_codecs", "encode"): self._encode,
            ("builtins", "bytes"): self._empty_bytes,
            ("builtins", "eval"): self._eval,
        }

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

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module
        if (module, name) not in self.globals:
            raise self.refuse(f"global {module}.{name}")
        return self.globals[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise self.refuse(f"persistent id {pid!r}")

    # ---- stand-ins

    def _dtype(self, obj: Any, align: Any = False, copy: Any = True) -> np.dtype:
        if not isinstance(obj, str):
            raise self.refuse(f"numpy.dtype({obj!r})")
        try:
            d = np.dtype(obj)
        except TypeError as e:
            raise self.refuse(f"numpy.dtype({obj!r})") from e
        if d.kind not in _NUMERIC_KINDS or d.fields is not None or d.subdtype is not None:
            raise self.refuse(f"numpy.dtype({obj!r}) (only plain numeric dtypes are read)")
        return np.dtype(obj, copy=True)  # a fresh instance: BUILD must never touch numpy's singletons

    def _reconstruct(self, subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
        if subtype is not self.globals[("numpy", "ndarray")]:
            raise self.refuse(f"numpy _reconstruct of {subtype!r}")
        return np.empty((0,), dtype=np.uint8)  # BUILD gives it its real shape, dtype and data

    def _scalar(self, dtype: Any, data: Any = b"") -> np.generic:
        if not isinstance(dtype, np.dtype) or dtype.kind not in _NUMERIC_KINDS or \
                not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise self.refuse("a numpy scalar that is not a plain number")
        return np.frombuffer(data, dtype=dtype)[0]

    def _encode(self, obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        if not isinstance(obj, str) or encoding.replace("-", "").lower() != "latin1":
            raise self.refuse(f"_codecs.encode with {encoding!r}")
        return obj.encode("latin1")

    def _empty_bytes(self, *args: Any) -> bytes:
        if args:  # protocols < 3 write b"" as bytes(); anything else is not ours
            raise self.refuse(f"builtins.bytes{args!r:.80}")
        return b""

    def _eval(self, expr: Any, namespace: Any = None, *_: Any) -> Any:
        # paddle.save's static-mode pattern is eval("data", {"data": array}): look the name up.
        if isinstance(expr, str) and expr.isidentifier() and isinstance(namespace, dict) \
                and isinstance(namespace.get(expr), np.ndarray):
            return namespace[expr]
        raise self.refuse(f"builtins.eval({str(expr)[:80]!r})")

    # ---- BUILD

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, np.dtype):
            self._build_dtype(inst, state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        else:
            raise self.refuse(f"setting the state of a {type(inst).__name__}")

    dispatch[pickle.BUILD[0]] = load_build

    def _build_dtype(self, d: np.dtype, state: Any) -> None:
        ok = (isinstance(state, tuple) and len(state) in (8, 9) and state[0] == 3
              and state[1] in ("<", ">", "|", "=") and state[2:5] == (None, None, None)
              and state[5] in (-1, d.itemsize) and state[6] in (-1, d.alignment) and state[7] == d.flags
              and (len(state) == 8 or state[8] is None))
        if not ok:
            raise self.refuse(f"dtype state {state!r:.120}")
        d.__setstate__(state)

    def _build_array(self, arr: np.ndarray, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise self.refuse("an array state of unknown form")
        version, (shape, dtype, fortran, raw) = (state[0], state[1:]) if len(state) == 5 else (None, state)
        if isinstance(raw, str):
            raw = raw.encode("latin1")
        if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)
                and isinstance(dtype, np.dtype) and dtype.kind in _NUMERIC_KINDS and not dtype.hasobject
                and isinstance(fortran, (bool, int)) and isinstance(raw, (bytes, bytearray))):
            raise self.refuse(f"an array state with {type(raw).__name__} data (object arrays are refused)")
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise CorruptCheckpointError(f"{self.source}: an array of shape {shape} and dtype {dtype} "
                                         f"holds {len(raw)} bytes")
        arr.__setstate__((1 if version is None else version, shape, dtype, bool(fortran), raw))


def load_paddle_pickle(path: str | os.PathLike) -> Any:
    """Unpickle a ``paddle.save`` file safely (see the module docstring); arrays come back as numpy."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            obj = _SafeUnpickler(f, source).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            RecursionError, MemoryError) as e:
        raise CorruptCheckpointError(f"{source}: not a readable paddle.save file ({type(e).__name__}: {e})") from e
    _check_plain(obj, source, 0)
    return obj


def _check_plain(obj: Any, source: str, depth: int) -> None:
    if depth > 64:
        raise CorruptCheckpointError(f"{source}: nested more than 64 levels deep")
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsafeCheckpointError(f"{source}: refused an object array")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_plain(k, source, depth + 1)
            _check_plain(v, source, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _check_plain(v, source, depth + 1)
    elif not isinstance(obj, _SCALARS) or (isinstance(obj, np.generic) and obj.dtype.hasobject):
        raise UnsafeCheckpointError(f"{source}: refused a {type(obj).__name__} value")


# ----------------------------------------------------------------------------- import


def _state_dict_file(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str]]:
    """A file's arrays by key (big-array slices joined, ``(name, array)`` tuples unwrapped) and its name table."""
    obj = load_paddle_pickle(path)
    if not isinstance(obj, dict):
        raise SchemaError(f"{os.fspath(path)}: holds a {type(obj).__name__}, not a paddle.save state dict")
    obj = dict(obj)
    names = dict(obj.pop(NAME_TABLE, None) or {})
    for key, info in (obj.pop(BIG_PARAM_INFO, None) or {}).items():
        obj[key] = np.concatenate([obj.pop(part).reshape(-1) for part in info["slices"]]).reshape(info["OriginShape"])
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], np.ndarray):
            names.setdefault(key, str(value[0]))
            value = value[1]
        out[str(key)] = value
    return out, {str(k): str(v) for k, v in names.items()}


def import_paddle_files(pdparams: str | os.PathLike, pdopt: str | os.PathLike | None = None) -> TrainingState:
    """Read ``paddle.save`` files of ``layer.state_dict()`` and ``optimizer.state_dict()`` as a state.

    Never imports Paddle and never runs code from the files (see the module docstring).

    Example:
        >>> state = import_paddle_files("mnist_epoch0.pdparams", "mnist_epoch0.pdopt")  # doctest: +SKIP
        >>> state.optimizer.slots["fc.weight"]["velocity"].shape                      # doctest: +SKIP
        (980, 10)

    Raises:
        UnsafeCheckpointError: a file asks for anything but numpy arrays and plain values.
        SchemaError: a file is not a state dict.
    """
    arrays, names = _state_dict_file(pdparams)
    model: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    canonical_of: dict[str, str] = {}  # runtime name -> first structured name
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise SchemaError(f"{os.fspath(pdparams)}: entry {key!r} is a {type(value).__name__}, not an array")
        first = canonical_of.get(names.get(key, ""))
        if first is not None and model[first].shape == value.shape and model[first].dtype == value.dtype:
            aliases[key] = first
            continue
        if key in names:
            canonical_of.setdefault(names[key], key)
        model[key] = value
    extra: dict[str, Any] = {"param_names": {k: names[k] for k in model if k in names}}
    if aliases:
        extra["aliases"] = aliases
    state = TrainingState(framework="paddle", model=model,
                          metadata={"source": "paddle.save", "files": [os.fspath(pdparams)]})
    if pdopt is not None:
        _import_optimizer(state, pdopt, {n: k for k, n in extra["param_names"].items()}, extra)
        state.metadata["files"].append(os.fspath(pdopt))
    state.extra = {"paddle": extra}
    return state


def _import_optimizer(state: TrainingState, path: str | os.PathLike, runtime_to_struct: dict[str, str],
                      extra: dict[str, Any]) -> None:
    raw, _ = _state_dict_file(path)
    schedule = raw.pop("LR_Scheduler", None)
    masters = raw.pop("master_weights", None) or {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    unmapped: list[str] = []
    opt_names: set[str] = set()
    for key, value in raw.items():
        if not isinstance(value, np.ndarray):
            raise SchemaError(f"{os.fspath(path)}: entry {key!r} is a {type(value).__name__}, not an array")
        pname = _param_prefix(key, runtime_to_struct)
        if pname is None:
            unmapped.append(key)
            continue
        slot, opt_name, _ = split_accumulator_key(key[len(pname) + 1:])
        if opt_name:
            opt_names.add(opt_name)
        slots.setdefault(runtime_to_struct[pname], {})[slot] = value
    for pname, value in masters.items():
        if pname in runtime_to_struct:
            value = value[1] if isinstance(value, tuple) else value  # (name, array) in non-state-dict saves
            slots.setdefault(runtime_to_struct[pname], {})[MASTER_SLOT] = np.asarray(value)
    if unmapped:
        raise SchemaError(f"{os.fspath(path)}: optimizer entries {unmapped[:5]} name no parameter of the "
                          ".pdparams file; pass the .pdparams written together with this .pdopt")
    kind = infer_optimizer_kind({s for per in slots.values() for s in per})
    step = adam_step(slots, 0.9, 0.999) if kind == "adam" else None
    opt_extra: dict[str, Any] = {"step_source": "beta_pow_acc (default betas)" if step is not None else "none"}
    if len(opt_names) == 1:
        opt_extra["name"] = opt_names.pop()
    if schedule is not None:
        schedule = plain(schedule)
        state.schedule = ScheduleState(kind="LRScheduler", step=int(schedule.get("last_epoch", 0)),
                                       last_lr=schedule.get("last_lr"), state=schedule)
        if step is None:
            step, opt_extra["step_source"] = max(state.schedule.step, 0), "scheduler"
    state.optimizer = OptimizerState(kind=kind, step=int(step or 0), slots=slots, extra=opt_extra)
    state.step = state.optimizer.step


def _param_prefix(key: str, runtime_to_struct: dict[str, str]) -> str | None:
    i = len(key)
    while (i := key.rfind("_", 0, i)) > 0:
        if key[:i] in runtime_to_struct:
            return key[:i]
    return None


# ----------------------------------------------------------------------------- export


def _exportable(name: str, value: Any) -> np.ndarray:
    arr = np.ascontiguousarray(value)
    if arr.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return arr.view(np.uint16 if arr.dtype.itemsize == 2 else np.uint8)  # Paddle's own raw form
    if arr.dtype.kind not in _NUMERIC_KINDS:
        raise SchemaError(f"{name}: a {arr.dtype} array cannot be written for Paddle")
    return arr


def _write_pickle(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=4)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def export_paddle_files(state: TrainingState, prefix: str | os.PathLike, *,
                        param_names: dict[str, str] | None = None) -> tuple[str, str | None]:
    """Write ``prefix.pdparams`` and, if the state has an optimizer or schedule, ``prefix.pdopt``.

    The files are what ``paddle.save`` writes (protocol-4 pickles of plain dicts of numpy arrays), so
    ``net.set_state_dict(paddle.load(...))`` and ``opt.set_state_dict(paddle.load(...))`` accept
    them.  Paddle is not needed.  ``param_names`` maps structured names to runtime names
    (``{"fc.weight": "linear_0.w_0"}``) where the state does not know them.

    Returns:
        The paths written (``.pdopt`` is None when not written).

    Raises:
        SchemaError: a runtime name needed for an optimizer key is unknown, or a value is not numeric.
    """
    extra = (state.extra or {}).get("paddle") or {}
    names = {**(extra.get("param_names") or {}), **(param_names or {})}
    aliases = {a: c for a, c in (extra.get("aliases") or {}).items() if c in state.model}
    params: dict[str, Any] = {k: _exportable(k, v) for k, v in state.model.items()}
    for alias, canonical in aliases.items():
        params[alias] = params[canonical]
        if canonical in names:
            names.setdefault(alias, names[canonical])
    if all(k in names for k in params):
        params[NAME_TABLE] = {k: names[k] for k in params}
    base = os.fspath(prefix)
    _write_pickle(base + ".pdparams", params)
    if state.optimizer is None and state.schedule is None:
        return base + ".pdparams", None
    _write_pickle(base + ".pdopt", _optimizer_dict(state, names, extra))
    return base + ".pdparams", base + ".pdopt"


def _optimizer_dict(state: TrainingState, names: dict[str, str], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    masters: dict[str, np.ndarray] = {}
    opt = state.optimizer
    tag = f"{opt.extra['name']}_" if opt is not None and opt.extra.get("name") else ""
    for param, slots in (opt.slots if opt is not None else {}).items():
        if param not in names:
            raise SchemaError(f"the runtime name of {param!r} is unknown, so its optimizer entries cannot be "
                              "keyed for Paddle; pass param_names={structured name: param.name}")
        runtime = names[param]
        base = f"{runtime}_fp32_master_0" if MASTER_SLOT in slots else runtime
        for slot, value in slots.items():
            if slot == MASTER_SLOT:
                masters[runtime] = _exportable(f"{param}/{slot}", value)
            else:
                out[f"{base}_{tag}{slot}_0"] = _exportable(f"{param}/{slot}", value)
    table = {k: k for k in out}
    if masters:
        out["master_weights"] = masters
    if state.schedule is not None:
        saved = dict(state.schedule.state or (extra.get("scheduler") or {}).get("state") or {})
        for attr in SCHEDULER_EXTRA_ATTRS.get(state.schedule.kind, ()):
            saved.pop(attr, None)  # not Paddle's: its set_state_dict would warn about unused values
        out["LR_Scheduler"] = saved or {"last_epoch": int(state.schedule.step), "last_lr": state.schedule.last_lr}
    out[NAME_TABLE] = table
    return out
