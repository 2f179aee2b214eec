"""``torch.save`` files read without PyTorch and without running code; :data:`FORMATS` declares
them (and DCP folders) to ``ckpt import`` / ``ckpt export``.  Writing is ``_export.py``'s.

Reading (``_safe_pickle.py`` lists what the restricted reader admits and why): the file holds a
model's state dict, an optimizer's, or a dict of both as people save them (``{"model": ...,
"optimizer": ..., "epoch": ..., "scheduler": ...}``, or ``state_dict`` / ``model_state_dict`` /
``optimizer_state_dict``...; :data:`MODEL_KEYS` and the others below).  Model keys lose the
wrappers' ``module.`` and ``_orig_mod.`` components.

Optimizer state is keyed by integer index: torch numbers the parameters in the order of
``param_groups[*]["params"]``, which for an optimizer built from ``model.parameters()`` is the
model's state-dict order without its buffers.  A file cannot tell buffers from parameters, so the
usual buffer names (:data:`BUFFER_NAMES`) are left out, and ``param_names=[...]`` says exactly;
counts or slot shapes that do not fit are refused (``SchemaError``) with that advice.  The
optimizer's kind comes from its hyperparameter keys and slot names (``optimizer_kind=`` overrides;
an ambiguous guess is recorded in ``optimizer.extra["kind_source"]`` and warned about).
:func:`param_order`, :func:`optimizer_state` and :func:`set_step` serve ``_dcp.py`` too.
"""

from __future__ import annotations

import os
import re
import warnings
import zipfile
from typing import Any, Sequence

import numpy as np

from ckptcore.adapter import FileFormat, brief, open_regular
from ckptcore.errors import CheckpointError, SchemaError, StorageError
from ckptcore.state import OptimizerState, ScheduleState, TrainingState
from ckptcore.vocab import plain

from ._export import BUFFER_NAMES, export_torch_files, parameter_keys
from ._safe_pickle import StateDict, load_torch

__all__ = ["FORMATS", "import_torch_files", "export_torch_files", "load_torch_file",
           "optimizer_state", "model_entries", "param_order", "set_step", "schedule_state",
           "MODEL_KEYS", "OPTIMIZER_KEYS", "BUFFER_NAMES"]

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "net", "network")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt", "optimizer_state")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict")
_WRAPPERS = re.compile(r"(?:^|(?<=\.))(?:module|_orig_mod)\.")
# Hyperparameter keys only one optimizer class has (torch 2.x), then slot names.
_KIND_BY_HYPER = (("momentum_decay", "nadam"), ("lr_decay", "adagrad"), ("rho", "adadelta"),
                  ("centered", "rmsprop"), ("dampening", "sgd"), ("nesterov", "sgd"))
_KIND_BY_SLOT = (("mu_product", "nadam"), ("exp_inf", "adamax"), ("acc_delta", "adadelta"),
                 ("grad_avg", "rmsprop"), ("square_avg", "rmsprop"), ("sum", "adagrad"),
                 ("momentum_buffer", "sgd"))
_SCHEDULE_KEYS = (("total_steps", "OneCycleLR"), ("_schedulers", "SequentialLR"),
                  ("patience", "ReduceLROnPlateau"), ("T_0", "CosineAnnealingWarmRestarts"),
                  ("T_max", "CosineAnnealingLR"), ("milestones", "MultiStepLR"),
                  ("step_size", "StepLR"), ("lr_lambdas", "LambdaLR"), ("power", "PolynomialLR"),
                  ("start_factor", "LinearLR"), ("factor", "ConstantLR"), ("gamma", "ExponentialLR"))


# ----------------------------------------------------------------------------- import


def load_torch_file(path: str | os.PathLike) -> Any:
    """The object a ``torch.save`` file holds, tensors as NumPy arrays (no code run, no torch);
    the path is opened without following a link or blocking on a FIFO."""
    source = os.fspath(path)
    try:
        fd, st = open_regular(source)
    except CheckpointError:
        raise
    except OSError as e:
        raise StorageError(f"{source}: cannot be opened ({type(e).__name__}: {e})") from e
    with os.fdopen(fd, "rb") as f:
        return load_torch(f, st.st_size, source)


def _pick(obj: dict, keys: Sequence[str], chosen: str | None, source: str) -> Any:
    if chosen is not None:
        if chosen not in obj:
            raise SchemaError(f"{source}: no entry {chosen!r} (entries: {brief(list(obj))})")
        return obj[chosen]
    return next((obj[k] for k in keys if k in obj), None)


def _is_optimizer(x: Any) -> bool:
    return isinstance(x, dict) and "state" in x and "param_groups" in x


def _is_tensors(x: Any) -> bool:
    return isinstance(x, dict) and bool(x) and all(type(k) is str and isinstance(v, np.ndarray)
                                                    for k, v in x.items())


def model_entries(sd: Any, source: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A state dict's tensors by key without wrapper prefixes, and the aliases (a tensor stored
    under two keys, shared storage and view: tied weights) as ``{alias: key}``."""
    if not isinstance(sd, dict):
        raise SchemaError(f"{source}: the model entry is a {type(sd).__name__}, not a state dict")
    model: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for raw, value in sd.items():
        if type(raw) is not str or not isinstance(value, np.ndarray):
            raise SchemaError(f"{source}: state dict entry {brief(raw)} is a "
                              f"{type(value).__name__}, not a tensor")
        key = _WRAPPERS.sub("", raw)
        if key in model or key in aliases:
            raise SchemaError(f"{source}: two entries are {key!r} once 'module.'/'_orig_mod.' are removed")
        ident = (value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
        if value.size and value.base is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen.setdefault(ident, key)
        model[key] = value
    return model, aliases


def import_torch_files(path: str | os.PathLike, optimizer_path: str | os.PathLike | None = None, *,
                       model_key: str | None = None, optimizer_key: str | None = None,
                       param_names: Sequence[str] | None = None, optimizer_kind: str | None = None,
                       step: int | None = None) -> TrainingState:
    """Read a ``torch.save`` file (and an optimizer's in ``optimizer_path``) as a state.

    Never imports PyTorch and never runs code from the files (see the module docstring).

    Example:
        >>> state = import_torch_files("ckpt.pt")                             # doctest: +SKIP
        >>> state.optimizer.slots["fc.weight"]["exp_avg"].shape               # doctest: +SKIP
        (10, 980)

    Raises:
        UnsafeCheckpointError: a file asks for anything but tensors and plain values, or for far
            more memory than its size justifies; a link, FIFO or device stands at the path.
        CorruptCheckpointError: a file is not a readable torch.save file (truncated, damaged).
        SchemaError: no state dict in it; the optimizer's parameters do not fit the model's.
    """
    source = os.fspath(path)
    obj = load_torch_file(source)
    files = [source]
    if not isinstance(obj, dict):
        raise SchemaError(f"{source}: holds a {type(obj).__name__}, not a state dict")
    if _is_optimizer(obj):
        raise SchemaError(f"{source}: holds an optimizer's state dict alone; pass the model's file "
                          "as path and this one as optimizer_path")
    entries: dict[str, Any] = {}
    if _is_tensors(obj) and model_key is None:
        sd = obj
    else:
        sd = _pick(obj, MODEL_KEYS, model_key, source)
        if sd is None:
            raise SchemaError(f"{source}: no model state dict (looked for {', '.join(MODEL_KEYS)}; "
                              f"entries: {brief(list(obj))}); pass model_key=")
        entries = dict(obj)
    model, aliases = model_entries(sd, source)
    opt = None if not entries else _pick(entries, OPTIMIZER_KEYS, optimizer_key, source)
    if optimizer_path is not None:
        opt_source = os.fspath(optimizer_path)
        files.append(opt_source)
        loaded = load_torch_file(opt_source)
        opt = loaded if _is_optimizer(loaded) else _pick(loaded, OPTIMIZER_KEYS, optimizer_key, opt_source) \
            if isinstance(loaded, dict) else None
        if opt is None:
            raise SchemaError(f"{opt_source}: holds no optimizer state dict")
    torch_extra: dict[str, Any] = {}
    if aliases:
        torch_extra["aliases"] = aliases
    if isinstance(sd, StateDict) and sd.module_versions is not None:
        torch_extra["module_versions"] = plain(dict(sd.module_versions))
    state = TrainingState(framework="torch", model=model,
                          metadata={"source": "torch.save", "files": files})
    _file_entries(state, entries, torch_extra, source)
    if opt is not None:
        names = param_order(model, opt, param_names, source)
        state.optimizer = optimizer_state(opt, names, model, source, kind=optimizer_kind)
    set_step(state, step, entries)
    state.extra = {"torch": torch_extra}
    return state


def _file_entries(state: TrainingState, entries: dict, torch_extra: dict, source: str) -> None:
    """The schedule, scaler, epoch and plain extras of a checkpoint dict."""
    sched = _pick(entries, SCHEDULER_KEYS, None, source) if entries else None
    if isinstance(sched, dict):
        state.schedule = schedule_state(sched, source)
    scaler = _pick(entries, SCALER_KEYS, None, source) if entries else None
    if isinstance(scaler, dict):
        torch_extra["grad_scaler"] = plain(scaler)
    if type(entries.get("epoch")) is int:
        state.epoch = entries["epoch"]
    used = set(MODEL_KEYS + OPTIMIZER_KEYS + SCHEDULER_KEYS + SCALER_KEYS)
    others = {k: v for k, v in entries.items() if k not in used and type(k) is str}
    plain_others = {k: v for k, v in others.items() if isinstance(v, (int, float, str, bool, type(None)))}
    if plain_others:
        torch_extra["file_entries"] = plain_others
    if set(others) - set(plain_others):
        torch_extra["skipped_entries"] = sorted(set(others) - set(plain_others))


def schedule_state(sd: dict, source: str) -> ScheduleState:
    """An LR scheduler's state dict as a :class:`ScheduleState` (kind from its keys)."""
    kind = next((k for key, k in _SCHEDULE_KEYS if key in sd), "LRScheduler")
    if kind == "SequentialLR" and "_milestones" not in sd:
        kind = "ChainedScheduler"
    epoch = sd.get("last_epoch", 0)
    last = sd.get("_last_lr")
    return ScheduleState(kind=kind, step=int(epoch) if isinstance(epoch, (int, float)) else 0,
                         last_lr=float(last[0]) if isinstance(last, list) and last else None,
                         state=plain(sd))


def param_order(model: dict[str, np.ndarray], opt: dict, param_names: Sequence[str] | None,
                 source: str) -> list[str]:
    """The model keys of an optimizer state dict's parameters, in its index order: its own FQNs
    (``get_state_dict``'s form), else ``param_names``, else :func:`parameter_keys` of the model."""
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise SchemaError(f"{source}: the optimizer's param_groups are not a list of groups with params")
    ids = [i for g in groups for i in g["params"]]
    if ids and all(type(i) is str for i in ids):  # get_state_dict's FQN-keyed form
        return [_WRAPPERS.sub("", i) for i in ids]
    if param_names is not None:
        names = [_WRAPPERS.sub("", n) for n in param_names]
        where = "param_names"
    else:
        names = parameter_keys(model)
        where = "the model's entries without its buffers (running_mean, running_var, num_batches_tracked)"
    if len(names) != len(ids):
        raise SchemaError(f"{source}: the optimizer holds {len(ids)} parameters, {where} "
                          f"{len(names)}; pass param_names=[...] (the model's parameter names in "
                          "model.parameters() order, as the optimizer was built)")
    missing = [n for n in names if n not in model]
    if missing:
        raise SchemaError(f"{source}: param_names {brief(missing)} are not entries of the model")
    return names


def optimizer_state(opt: dict, order: list[str], model: dict[str, np.ndarray], source: str, *,
                    kind: str | None = None) -> OptimizerState:
    """An optimizer's state dict, re-keyed from its indices (or FQNs) to parameter names."""
    groups = opt["param_groups"]
    ids = [i for g in groups for i in g["params"]]
    name_of = dict(zip(ids, order))
    raw = opt.get("state")
    if not isinstance(raw, dict):
        raise SchemaError(f"{source}: the optimizer's state is a {type(raw).__name__}, not a dict")
    slots: dict[str, dict[str, np.ndarray]] = {}
    for idx, per in raw.items():
        if idx not in name_of or not isinstance(per, dict):
            raise SchemaError(f"{source}: optimizer state for {brief(idx)}, which no param group lists")
        name = name_of[idx]
        out = {}
        for slot, value in per.items():
            arr = np.asarray(value, dtype=np.float32) if slot == "step" and not isinstance(value, np.ndarray) \
                else value
            if not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
                raise SchemaError(f"{source}: optimizer state {name}/{slot} is a {type(value).__name__}")
            if arr.ndim and name in model and arr.shape != model[name].shape:
                raise SchemaError(f"{source}: optimizer slot {slot!r} of {name!r} has shape "
                                  f"{arr.shape}, the parameter {model[name].shape}: the optimizer's "
                                  "parameter order is not the model's; pass param_names=[...]")
            out[str(slot)] = arr
        slots[name] = out
    hyper = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
    found, why = _kind(hyper, {s for per in slots.values() for s in per})
    steps = [float(per["step"]) for per in slots.values() if "step" in per and per["step"].size == 1]
    extra = {"param_groups": [plain({**{k: v for k, v in g.items() if k != "params"},
                                     "params": [name_of[i] for i in g["params"]]}) for g in groups],
             "kind_source": "optimizer_kind=" if kind else why}
    if steps:
        extra["step_source"] = "per-parameter step"
    if kind is None and why.startswith("ambiguous"):
        warnings.warn(f"{source}: the optimizer's kind is {why}; pass optimizer_kind= to say",
                      stacklevel=3)
    return OptimizerState(kind=kind or found, step=int(max(steps)) if steps else 0,
                          hyperparams=plain(hyper), slots=slots, extra=extra)


def _kind(hyper: dict, slot_names: set[str]) -> tuple[str, str]:
    for key, kind in _KIND_BY_HYPER:
        if key in hyper:
            return kind, f"hyperparameter {key!r}"
    for slot, kind in _KIND_BY_SLOT:
        if slot in slot_names:
            return kind, f"slot {slot!r}"
    if "betas" in hyper or "exp_avg" in slot_names:
        if "amsgrad" not in hyper and "decoupled_weight_decay" in hyper:
            return "radam", "betas without amsgrad"
        if "decoupled_weight_decay" in hyper:
            return ("adamw" if hyper["decoupled_weight_decay"] else "adam"), "decoupled_weight_decay"
        return "adam", "ambiguous: adam or adamw (a file of torch < 2.5 does not say)"
    return "unknown", "ambiguous: no known hyperparameter or slot"


def set_step(state: TrainingState, step: int | None, entries: dict) -> None:
    """Set ``state.step`` (and the optimizer's): the per-parameter step, else ``step=``, else the
    scheduler's, else a file entry (``step``, ``global_step``...); the source goes in
    ``optimizer.extra["step_source"]``."""
    opt = state.optimizer
    if opt is not None and opt.extra.get("step_source") == "per-parameter step":
        state.step = opt.step
        return
    for value, source in ((step, "step="), (state.schedule.step if state.schedule else None, "scheduler"),
                          (next((entries[k] for k in ("step", "global_step", "iteration")
                                 if type(entries.get(k)) is int), None), "file entry")):
        if value is not None:
            state.step = max(int(value), 0)
            break
    else:
        source = "none"
    if opt is not None:
        opt.step = state.step
        opt.extra["step_source"] = source


# ----------------------------------------------------------------------------- ckpt import / export

_OPTIONS = {"optimizer-path": "a torch.save file of the optimizer's state dict, when apart",
            "param-names": "the model's parameter names in optimizer order, comma-separated",
            "optimizer-kind": "the optimizer's class in lower case, when the file leaves it ambiguous"}


def _names(text: Any) -> list[str] | None:
    return None if text is None else [n for n in str(text).split(",") if n]


def _read(src: str | os.PathLike, model: Any = None, optimizer: Any = None, *,
          optimizer_path: Any = None, param_names: Any = None, optimizer_kind: Any = None) -> TrainingState:
    """``ckpt import --from torch``: a live ``model`` (``--model``) names the parameters."""
    names = _names(param_names)
    if names is None and model is not None:
        names = [n for n, _ in model.named_parameters()]
    return import_torch_files(src, optimizer_path, param_names=names, optimizer_kind=optimizer_kind)


def _write(state: TrainingState, dst: str | os.PathLike, model: Any = None, optimizer: Any = None, *,
           optimizer_path: Any = None, param_names: Any = None, optimizer_kind: Any = None) -> str:
    """``ckpt export --to torch``."""
    if optimizer_path is not None or optimizer_kind is not None:
        raise TypeError("--optimizer-path and --optimizer-kind apply to ckpt import")
    names = _names(param_names)
    if names is None and model is not None:
        names = [n for n, _ in model.named_parameters()]
    return export_torch_files(state, dst, param_names=names)


def _is_torch_file(path: str | os.PathLike) -> bool:
    try:
        with open(os.fspath(path), "rb") as f:
            head = f.read(4)
            if head == b"PK\x03\x04":
                return any(n.endswith("/data.pkl") for n in zipfile.ZipFile(f).namelist())
            return head[:1] == b"\x80" and os.fspath(path).endswith((".pt", ".pth", ".bin", ".ckpt"))
    except (OSError, zipfile.BadZipFile):
        return False


def _is_dcp(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def _read_dcp(src: str | os.PathLike, model: Any = None, optimizer: Any = None, **options: Any) -> TrainingState:
    from ._dcp import import_dcp
    return import_dcp(src, **options)


def _write_dcp(state: TrainingState, dst: str | os.PathLike, model: Any = None, optimizer: Any = None,
               **options: Any) -> str:
    from ._dcp import export_dcp
    return export_dcp(state, dst, **options)


FORMATS = (
    FileFormat(name="torch", framework="torch",
               description="torch.save files (zip or legacy) of a state dict, or of "
                           "{'model': ..., 'optimizer': ...}; read without PyTorch",
               detect=_is_torch_file, read=_read, write=_write, options=_OPTIONS),
    FileFormat(name="torch-dcp", framework="torch",
               description="a torch.distributed.checkpoint folder (.metadata, *.distcp)",
               detect=_is_dcp, read=_read_dcp, write=_write_dcp),
)
