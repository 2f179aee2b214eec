"""``.pdparams`` / ``.pdopt`` interop without Paddle and without running code; :data:`FORMATS`
declares them to ``ckpt import`` / ``ckpt export``.

``paddle.save`` of a state dict pickles a plain ``dict`` of numpy arrays.  We
read it with a pure-Python unpickler restricted to what such files contain (numpy arrays, dtypes
and scalars, plain containers and values) and bounded in the memory a file may make it spend;
``_safe_pickle.py`` lists what it accepts and why.  Anything else raises
:class:`~ckptcore.errors.UnsafeCheckpointError` naming the file, before it can run.

The unpickled value is then checked as a state dict: every problem with its structure (a name
table that is not a dict of names, big-array slices that do not add up, a scheduler state without a
whole-number ``last_epoch``, ...) raises :class:`~ckptcore.errors.SchemaError` naming the file and
the key.

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

import contextlib
import math
import os
import pickle
from typing import Any, Iterator

import numpy as np

from ckptcore.adapter import FileFormat
from ckptcore.errors import CheckpointError, SchemaError
from ckptcore.state import OptimizerState, ScheduleState, TrainingState
from ckptcore.vocab import plain

from ._optimizer import MASTER_SLOT, SCHEDULER_EXTRA_ATTRS, adam_step, infer_optimizer_kind, split_accumulator_key
from ._safe_pickle import brief, brief_error, load_paddle_pickle

__all__ = ["FORMATS", "import_paddle_files", "export_paddle_files", "load_paddle_pickle"]

# Paddle's own keys in a state dict file that are not parameters: the structured-name table, and
# the table of big arrays that protocol-2 saves split into slices.
NAME_TABLE = "StructuredToParameterName@@"
BIG_PARAM_INFO = "UnpackBigParamInfor@@"  # sic: Paddle's spelling

_NUMERIC_KINDS = "biufc"
# Runtime names longer than this are not matched against .pdopt keys: Paddle's are short
# ("linear_0.w_0"), and the bound keeps matching linear in the file size (see _param_prefix).
_MAX_RUNTIME_NAME = 1024


# ----------------------------------------------------------------------------- import


@contextlib.contextmanager
def _structure_errors(source: str) -> Iterator[None]:
    """Backstop for the structure checks: a builtin error that slipped past them is a SchemaError too."""
    try:
        yield
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as e:
        raise SchemaError(f"{source}: not a paddle.save state dict ({type(e).__name__}: {brief_error(e)})") from e


def _state_dict_file(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str]]:
    """A file's arrays by key (big-array slices joined, ``(name, array)`` tuples unwrapped) and its name table."""
    source = os.fspath(path)
    obj = load_paddle_pickle(source)
    with _structure_errors(source):
        return _split_state_dict(obj, source)


def _split_state_dict(obj: Any, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    if not isinstance(obj, dict):
        raise SchemaError(f"{source}: holds a {type(obj).__name__}, not a paddle.save state dict")
    for key in obj:
        if type(key) is not str:
            raise SchemaError(f"{source}: key {brief(key)} is a {type(key).__name__}, not a name")
    obj = dict(obj)
    names = obj.pop(NAME_TABLE, None)
    names = {} if names is None else names
    if not isinstance(names, dict):
        raise SchemaError(f"{source}: {NAME_TABLE!r} is a {type(names).__name__}, not a dict of names")
    for key, name in names.items():
        if type(key) is not str or type(name) is not str:
            raise SchemaError(f"{source}: {NAME_TABLE!r} maps {brief(key)} to {brief(name)}; both must be names")
    names = dict(names)
    _join_big_arrays(obj, obj.pop(BIG_PARAM_INFO, None), source)
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if type(value) is tuple and len(value) == 2 and isinstance(value[1], np.ndarray):
            if type(value[0]) is not str:
                raise SchemaError(f"{source}: entry {brief(key)} pairs its array with a "
                                  f"{type(value[0]).__name__}, not a runtime name")
            names.setdefault(key, value[0])
            value = value[1]
        out[key] = value
    return out, names


def _join_big_arrays(obj: dict[str, Any], info: Any, source: str) -> None:
    """Replace the slices that protocol-2 saves split big arrays into by the arrays (in ``obj``)."""
    if info is None:
        return
    if not isinstance(info, dict):
        raise SchemaError(f"{source}: {BIG_PARAM_INFO!r} is a {type(info).__name__}, not a dict")
    for key, entry in info.items():
        where = f"{source}: {BIG_PARAM_INFO!r} entry {brief(key)}"
        if type(key) is not str:
            raise SchemaError(f"{where} is not keyed by a name")
        if not isinstance(entry, dict) or "slices" not in entry or "OriginShape" not in entry:
            raise SchemaError(f"{where} is not a dict with 'slices' and 'OriginShape'")
        slices, shape = entry["slices"], entry["OriginShape"]
        if type(slices) not in (list, tuple) or not slices or any(type(s) is not str for s in slices):
            raise SchemaError(f"{where}: 'slices' is {brief(slices)}, not a list of keys")
        if type(shape) not in (list, tuple) or len(shape) > 64 or \
                any(type(n) is not int or not 0 <= n < 1 << 62 for n in shape):
            raise SchemaError(f"{where}: 'OriginShape' is {brief(shape)}, not a shape")
        if key in obj:
            raise SchemaError(f"{where}: the file holds {brief(key)} whole as well as in slices")
        if len(set(slices)) != len(slices):
            raise SchemaError(f"{where}: 'slices' lists a key twice")
        missing = [s for s in slices if s not in obj]
        if missing:
            raise SchemaError(f"{where}: slices {brief(missing)} are not in the file (or belong to "
                              "another entry)")
        parts = [obj[s] for s in slices]
        if not all(isinstance(p, np.ndarray) for p in parts) or len({p.dtype for p in parts}) != 1:
            raise SchemaError(f"{where}: the slices are not arrays of one dtype")
        if sum(p.size for p in parts) != math.prod(shape):
            raise SchemaError(f"{where}: the slices hold {sum(p.size for p in parts)} values but "
                              f"'OriginShape' {tuple(shape)} needs {math.prod(shape)}")
        for s in slices:
            del obj[s]
        obj[key] = np.concatenate([p.reshape(-1) for p in parts]).reshape(tuple(shape))


def import_paddle_files(pdparams: str | os.PathLike, pdopt: str | os.PathLike | None = None) -> TrainingState:
    """Read ``paddle.save`` files of ``layer.state_dict()`` and ``optimizer.state_dict()`` as a state.

    Never imports Paddle and never runs code from the files (see the module docstring).

    Example:
        >>> state = import_paddle_files("mnist_epoch0.pdparams", "mnist_epoch0.pdopt")  # doctest: +SKIP
        >>> state.optimizer.slots["fc.weight"]["velocity"].shape                      # doctest: +SKIP
        (980, 10)

    Raises:
        UnsafeCheckpointError: a file asks for anything but numpy arrays and plain values, or for
            far more memory than its size justifies.
        CorruptCheckpointError: a file is not a readable pickle (truncated, malformed).
        SchemaError: a file is not a state dict, or the two files do not belong together.
    """
    source = os.fspath(pdparams)
    arrays, names = _state_dict_file(source)
    with _structure_errors(source):
        model, aliases = _model_arrays(arrays, names, source)
    extra: dict[str, Any] = {"param_names": {k: names[k] for k in model if k in names}}
    if aliases:
        extra["aliases"] = aliases
    state = TrainingState(framework="paddle", model=model,
                          metadata={"source": "paddle.save", "files": [source]})
    if pdopt is not None:
        opt_source = os.fspath(pdopt)
        raw, _ = _state_dict_file(opt_source)
        with _structure_errors(opt_source):
            _import_optimizer(state, raw, opt_source, {n: k for k, n in extra["param_names"].items()})
        state.metadata["files"].append(opt_source)
    state.extra = {"paddle": extra}
    return state


def _model_arrays(arrays: dict[str, Any], names: dict[str, str],
                  source: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    model: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    canonical_of: dict[str, str] = {}  # runtime name -> first structured name
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise SchemaError(f"{source}: entry {brief(key)} is a {type(value).__name__}, not an array")
        first = canonical_of.get(names.get(key, ""))
        if first is not None and model[first].shape == value.shape and model[first].dtype == value.dtype:
            aliases[key] = first
            continue
        if key in names:
            canonical_of.setdefault(names[key], key)
        model[key] = value
    return model, aliases


def _import_optimizer(state: TrainingState, raw: dict[str, Any], source: str,
                      runtime_to_struct: dict[str, str]) -> None:
    schedule = raw.pop("LR_Scheduler", None)
    if schedule is not None and not isinstance(schedule, dict):
        raise SchemaError(f"{source}: 'LR_Scheduler' is a {type(schedule).__name__}, not a dict")
    masters = raw.pop("master_weights", None)
    masters = {} if masters is None else masters
    if not isinstance(masters, dict):
        raise SchemaError(f"{source}: 'master_weights' is a {type(masters).__name__}, not a dict")
    lengths = sorted({len(n) for n in runtime_to_struct if 0 < len(n) <= _MAX_RUNTIME_NAME}, reverse=True)
    slots: dict[str, dict[str, np.ndarray]] = {}
    unmapped: list[str] = []
    opt_names: set[str] = set()
    for key, value in raw.items():
        if not isinstance(value, np.ndarray):
            raise SchemaError(f"{source}: entry {brief(key)} is a {type(value).__name__}, not an array")
        pname = _param_prefix(key, runtime_to_struct, lengths)
        if pname is None:
            unmapped.append(key)
            continue
        slot, opt_name, _ = split_accumulator_key(key[len(pname) + 1:])
        if opt_name:
            opt_names.add(opt_name)
        slots.setdefault(runtime_to_struct[pname], {})[slot] = value
    if unmapped:
        raise SchemaError(f"{source}: optimizer entries {brief(unmapped)} name no parameter of the "
                          ".pdparams file; pass the .pdparams written together with this .pdopt")
    for pname, value in masters.items():
        if type(value) is tuple and len(value) == 2 and type(value[0]) is str:
            value = value[1]  # (name, array) in non-state-dict saves
        if type(pname) is not str or not isinstance(value, np.ndarray):
            raise SchemaError(f"{source}: 'master_weights' maps {brief(pname)} to a "
                              f"{type(value).__name__}, not a name to an array")
        if pname in runtime_to_struct:
            slots.setdefault(runtime_to_struct[pname], {})[MASTER_SLOT] = value
    kind = infer_optimizer_kind({s for per in slots.values() for s in per})
    step = adam_step(slots, 0.9, 0.999) if kind == "adam" else None
    opt_extra: dict[str, Any] = {"step_source": "beta_pow_acc (default betas)" if step is not None else "none"}
    if len(opt_names) == 1:
        opt_extra["name"] = opt_names.pop()
    if schedule is not None:
        state.schedule = _schedule(schedule, source)
        if step is None:
            step, opt_extra["step_source"] = max(state.schedule.step, 0), "scheduler"
    state.optimizer = OptimizerState(kind=kind, step=int(step or 0), slots=slots, extra=opt_extra)
    state.step = state.optimizer.step


def _schedule(saved: dict[Any, Any], source: str) -> ScheduleState:
    try:
        _check_numbers(saved)
        saved = plain(saved)
    except (TypeError, ValueError) as e:  # a complex number; an int key too long to be written as a str
        raise SchemaError(f"{source}: 'LR_Scheduler' holds a value that is not plain ({brief_error(e)})") from e
    epoch, last_lr = saved.get("last_epoch", 0), saved.get("last_lr")
    if type(epoch) is float and epoch.is_integer():  # (inf and nan are not)
        epoch = int(epoch)
    if type(epoch) is not int or not -(1 << 63) <= epoch < 1 << 63:
        raise SchemaError(f"{source}: 'LR_Scheduler' has last_epoch {brief(epoch)}, not a whole number")
    if last_lr is not None and type(last_lr) not in (int, float):
        raise SchemaError(f"{source}: 'LR_Scheduler' has last_lr {brief(last_lr)}, not a number")
    return ScheduleState(kind="LRScheduler", step=epoch, last_lr=last_lr, state=saved)


def _check_numbers(value: Any) -> None:
    """Refuse what a scheduler's state_dict never holds and ``plain`` would turn into text."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_numbers(k)
            _check_numbers(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_numbers(v)
    elif isinstance(value, (complex, np.complexfloating)) or (
            isinstance(value, np.ndarray) and value.dtype.kind not in _NUMERIC_KINDS.replace("c", "")):
        raise TypeError(f"{type(value).__name__} {brief(value)} is not a plain number")


def _param_prefix(key: str, runtime_to_struct: dict[str, str], lengths: list[int]) -> str | None:
    """The longest runtime name that ``key`` starts with, followed by ``_``.

    Only the lengths of known names are tried (longest first, each at most _MAX_RUNTIME_NAME): a
    key of many underscores then costs one slice per name length, not one per underscore, which
    would be quadratic in the key's length.
    """
    for n in lengths:
        if n < len(key) and key[n] == "_" and key[:n] in runtime_to_struct:
            return key[:n]
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
    # paddle.save creates the folder it writes into; so does this (ckpt export to a new folder).
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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


# ----------------------------------------------------------------------------- ckpt import / export

_PDOPT_HELP = "the .pdopt file that goes with the .pdparams (default: beside it)"


def _check_options(options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"the pdparams format takes no option {', '.join(sorted(options))} "
                        f"(it takes: pdopt)")


def _read(src: str | os.PathLike, model: Any = None, optimizer: Any = None, *, pdopt: Any = None,
          **options: Any) -> TrainingState:
    """``ckpt import``: the ``.pdparams`` file ``src`` and its ``.pdopt`` (given, else beside it if present)."""
    _check_options(options)
    src = os.fspath(src)
    if pdopt is None:
        beside = (src[: -len(".pdparams")] if src.endswith(".pdparams") else src) + ".pdopt"
        pdopt = beside if os.path.isfile(beside) else None
    return import_paddle_files(src, pdopt)


def _write(state: TrainingState, dst: str | os.PathLike, model: Any = None, optimizer: Any = None, *,
           pdopt: Any = None, **options: Any) -> str:
    """``ckpt export``: ``dst`` (a ``.pdparams`` path or a prefix) and its ``.pdopt``.

    A live ``model`` supplies the runtime parameter names the ``.pdopt`` keys need where the state
    does not know them.  Returns the paths written, comma-separated.
    """
    _check_options(options)
    dst = os.fspath(dst)
    prefix = dst[: -len(".pdparams")] if dst.endswith(".pdparams") else dst
    names = None
    if model is not None:
        from ._tensors import named_tensors, unwrap
        names = {s: t.name for s, t in named_tensors(unwrap(model)[0])[0].items()}
    params_path, opt_path = export_paddle_files(state, prefix, param_names=names)
    if opt_path is not None and pdopt is not None and os.fspath(pdopt) != opt_path:
        os.replace(opt_path, os.fspath(pdopt))
        opt_path = os.fspath(pdopt)
    return ", ".join(p for p in (params_path, opt_path) if p)


def _is_dcp(path: str | os.PathLike) -> bool:
    import re
    try:
        return any(re.fullmatch(r"\d{1,9}\.metadata", f) for f in os.listdir(os.fspath(path)))
    except OSError:
        return False


def _read_dcp(src: str | os.PathLike, model: Any = None, optimizer: Any = None, *,
              unique_id: Any = None, **options: Any) -> TrainingState:
    """``ckpt import``: the folder of a ``paddle.distributed.save_state_dict`` checkpoint."""
    if options:
        raise TypeError(f"the paddle-dcp format takes no option {', '.join(sorted(options))} "
                        "(it takes: unique_id)")
    from ._dcp import import_paddle_dcp
    return import_paddle_dcp(src, unique_id=None if unique_id is None else int(unique_id))


FORMATS = (
    FileFormat(name="pdparams", framework="paddle",
               description="paddle.save files: a layer's .pdparams and its optimizer's .pdopt",
               detect=lambda p: os.fspath(p).endswith(".pdparams"), read=_read, write=_write,
               options={"pdopt": _PDOPT_HELP}),
    FileFormat(name="paddle-dcp", framework="paddle",
               description="a paddle.distributed.save_state_dict folder (<id>.metadata, "
                           "<rank>_<id>.distcp), read only",
               detect=_is_dcp, read=_read_dcp,
               options={"unique_id": "which save of the folder to read (default: the newest)"}),
)
