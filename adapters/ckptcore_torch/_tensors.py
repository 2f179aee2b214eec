"""Discovery of a PyTorch module's named tensors, and torch tensor <-> NumPy, bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow): the module's
``state_dict()`` keys (parameters and persistent buffers, e.g. ``0.weight``, ``bn.running_mean``),
without the components wrappers add: ``module.`` of ``DistributedDataParallel``/``DataParallel``
and ``_orig_mod.`` of ``torch.compile``, at the top or anywhere inside (a compiled block).  Only
the components a wrapper object really adds are removed, so a user's own submodule called
``module`` keeps its name.  A tensor reachable under several names (tied weights) is named once,
by its first name; the others are its aliases.

A module's extra state (``get_extra_state``, saved by torch as ``<module path>._extra_state``) is
no tensor of the module's: restore hands the saved value to the module's ``set_extra_state``,
as torch's ``load_state_dict`` does (copying it into what ``get_extra_state`` returned would
change nothing).  Any other ``state_dict()`` entry that is not a registered parameter or buffer
(a custom ``_save_to_state_dict`` or state-dict hook) cannot be put back in place: capture and
restore refuse it, naming it, rather than restore it into a throwaway.

Values cross without pickle: a tensor's bytes as a NumPy array (``bfloat16``/``float8`` as their
``ml_dtypes`` types), from any device; restoring copies into the live tensor in place, on its own
device and dtype.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

from ckptcore.errors import CaptureError, RestoreError

from . import _sharding  # [sharding hook] DTensors (FSDP2) in to_numpy

try:  # bfloat16/float8 have no numpy dtype of their own; ml_dtypes provides them
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with the core's dependencies
    ml_dtypes = None

# Wrapper class -> the attribute holding the wrapped module (its state_dict component).
WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod"}

# torch dtypes NumPy lacks, as (ml_dtypes name, the same-width integer torch can view them as).
_EXTENDED = {torch.bfloat16: ("bfloat16", torch.int16), torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8),
             torch.float8_e5m2: ("float8_e5m2", torch.uint8)}
for _name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name) and (ml_dtypes is None or hasattr(ml_dtypes, _name)):
        _EXTENDED[getattr(torch, _name)] = (_name, torch.uint8)
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
          torch.complex64: np.complex64, torch.complex128: np.complex128, torch.bool: np.bool_,
          torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NUMPY[getattr(torch, _name)] = getattr(np, _name)
_TORCH = {np.dtype(v): k for k, v in _NUMPY.items()}


def unwrap(model: Any) -> Any:
    """The plain module inside DDP/DataParallel/``torch.compile`` wrappers (outermost ones)."""
    while type(model).__name__ in WRAPPERS and hasattr(model, WRAPPERS[type(model).__name__]):
        model = getattr(model, WRAPPERS[type(model).__name__])
    return model


def wrapper_components(model: Any) -> set[str]:
    """The dotted paths (as state_dict spells them) of every component a wrapper adds."""
    out: set[str] = set()
    for path, mod in model.named_modules(remove_duplicate=False):
        attr = WRAPPERS.get(type(mod).__name__)
        if attr is not None and isinstance(getattr(mod, attr, None), torch.nn.Module):
            out.add(f"{path}.{attr}" if path else attr)
    return out


def canonical_name(key: str, components: set[str]) -> str:
    """``key`` without the wrapper components in ``components`` (see :func:`wrapper_components`)."""
    if not components:
        return key
    parts, kept, path = key.split("."), [], ""
    for part in parts:
        path = f"{path}.{part}" if path else part
        if path not in components:
            kept.append(part)
    return ".".join(kept)


# The key torch gives a module's extra state in its state_dict (prefix + this).
_EXTRA_KEY = getattr(torch.nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")


class Entries(NamedTuple):
    """A module's ``state_dict()`` by canonical name (see :func:`named_tensors`)."""

    tensors: dict[str, torch.Tensor]  # registered parameters and persistent buffers, each once
    aliases: dict[str, str]  # another name of a tensor (or of a shared module's extra state) -> its name
    extra: dict[str, tuple[torch.nn.Module, Any]]  # "<path>._extra_state" -> (module, get_extra_state())
    foreign: dict[str, str]  # any other entry -> a description of it, for the error


def named_tensors(model: Any) -> Entries:
    """``state_dict()`` by canonical name: the tensors (each once), the aliases of repeated ones,
    the modules' extra states and the entries ckptcore_torch cannot restore in place."""
    components = wrapper_components(model)
    # Registered tensors by identity: state_dict(keep_vars=True) hands out the objects themselves.
    registered = {id(t) for _, t in model.named_parameters(remove_duplicate=False)}
    registered.update(id(t) for _, t in model.named_buffers(remove_duplicate=False))
    owners: dict[str, torch.nn.Module] = {}  # extra-state key -> the module whose it is
    for path, mod in model.named_modules(remove_duplicate=False):
        if type(mod).get_extra_state is not torch.nn.Module.get_extra_state:
            owners[f"{path}.{_EXTRA_KEY}" if path else _EXTRA_KEY] = mod
    first: dict[int, str] = {}
    out = Entries({}, {}, {}, {})
    for key, t in model.state_dict(keep_vars=True).items():
        name = canonical_name(key, components)
        if name in out.tensors or name in out.aliases or name in out.extra or name in out.foreign:
            continue  # the same entry seen through two wrappers
        owner = owners.get(key)
        if owner is not None:  # a shared module's extra state is one state, under each name
            if id(owner) in first:
                out.aliases[name] = first[id(owner)]
            else:
                first[id(owner)] = name
                out.extra[name] = (owner, t)
        elif not isinstance(t, torch.Tensor) or id(t) not in registered:
            out.foreign[name] = (f"a {type(t).__name__}" if not isinstance(t, torch.Tensor)
                                 else f"a {t.dtype} tensor")
        elif id(t) in first:
            out.aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            out.tensors[name] = t
    return out


def foreign_message(names: dict[str, str], verb: str) -> str:
    """Why the ``state_dict()`` entries in ``names`` (see :class:`Entries`) cannot be ``verb``."""
    shown = ", ".join(f"{n} ({what})" for n, what in list(names.items())[:6])
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return (f"the model's state_dict() holds {shown}{more}, which is not a registered parameter, "
            f"buffer or extra state (a custom _save_to_state_dict or state-dict hook adds it): "
            f"ckptcore_torch restores every tensor in place and could not put it back, so it is not "
            f"{verb}. Register it as a buffer (register_buffer), or return it from "
            "get_extra_state() and take it back in set_extra_state()")


# What to cast a tensor of a dtype ckptcore cannot store to, for the error (a lossless cast where
# one exists).
_CAST_TO = {"complex32": "complex64 (.to(torch.complex64): exact)"}


def numpy_dtype(t: Any, error: type[Exception] = CaptureError, name: str | None = None) -> np.dtype:
    """The NumPy dtype holding ``t``'s values exactly (ml_dtypes for bfloat16 and float8).

    Raises:
        CaptureError (or ``error``): a dtype with no such form (complex32, quantized and packed
            dtypes), naming the tensor ``name`` when given.
    """
    dtype = t.dtype if isinstance(t, torch.Tensor) else t
    if dtype in _NUMPY:
        return np.dtype(_NUMPY[dtype])
    if dtype in _EXTENDED:
        if ml_dtypes is None:
            raise error(f"{name or 'a tensor'}: {dtype} tensors need the ml_dtypes package")
        return np.dtype(getattr(ml_dtypes, _EXTENDED[dtype][0]))
    cast = _CAST_TO.get(str(dtype).removeprefix("torch."), "a dtype it can store (float32, bfloat16, ...)")
    raise error(f"{name or 'a tensor'}: a {dtype} tensor has no NumPy form ckptcore can store bit for "
                f"bit; cast it to {cast} first")


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    dtype = np.dtype(dtype)
    if dtype in _TORCH:
        return _TORCH[dtype]
    for tdt, (name, _) in _EXTENDED.items():
        if dtype.name == name:
            return tdt
    raise RestoreError(f"the checkpoint holds a {dtype} array, which no torch dtype holds")


def to_numpy(t: torch.Tensor, copy: bool = True) -> np.ndarray:
    """``t``'s values: a copy later training cannot change, or with ``copy=False`` a view of a CPU
    tensor's own buffer where one exists (valid until the tensor changes)."""
    if _sharding.is_dtensor(t):  # [sharding hook] a DTensor: this rank's block, as a ckptcore.Shard
        return _sharding.capture_leaf(t, copy)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    dtype = numpy_dtype(t)
    if t.device.type != "cpu":
        t, copy = t.cpu(), False  # .cpu() made the copy already
    if t.dtype in _EXTENDED:
        arr = t.view(_EXTENDED[t.dtype][1]).numpy().view(dtype)
    else:
        arr = t.numpy()
    if copy:
        out = np.empty(arr.shape, arr.dtype)  # a contiguous copy whatever the tensor's strides
        np.copyto(out, arr)
        return out
    return arr


def from_numpy(value: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``value``'s bytes (no copy when it is contiguous): read it, never keep it."""
    value = np.asarray(value)
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value).reshape(value.shape)  # (ascontiguousarray makes 0-d 1-d)
    target = torch_dtype(value.dtype)
    raw = value
    if target in _EXTENDED:
        raw = value.view(np.int16 if value.dtype.itemsize == 2 else np.uint8)
    with warnings.catch_warnings():  # a read-only array (a loaded checkpoint): only read here
        warnings.simplefilter("ignore", UserWarning)
        out = torch.from_numpy(raw)
    return out.view(target) if target in _EXTENDED else out


def new_tensor(value: np.ndarray, like: torch.Tensor | None = None, *, device: Any = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh tensor holding ``value``, on ``like``'s device (or ``device``) and of ``dtype``
    (else ``value``'s own), sharing no memory with ``value``."""
    src = from_numpy(value)
    device = like.device if like is not None else (device or "cpu")
    out = torch.empty(src.shape, dtype=dtype or src.dtype, device=device)
    out.copy_(src)
    return out


def assign(target: torch.Tensor, value: np.ndarray) -> None:
    """Copy ``value`` into ``target`` in place, on its device (shape and dtype checked by the plan)."""
    with torch.no_grad():
        target.copy_(from_numpy(value).reshape(target.shape))



# ----------------------------------------------------------------------------- extra state

_INT_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what a checkpoint's msgpack tree holds


def plain_extra_state(value: Any, where: str) -> Any:
    """A module's extra state that is not a tensor, as plain data a checkpoint holds without
    pickle: numbers, strings, bytes, None, NumPy scalars, and lists, tuples and dicts (str or int
    keys) of these and of torch tensors (as arrays: :func:`revive_extra_state` makes them tensors
    again).  Anything else is a CaptureError naming ``where``: it would not come back as it was."""
    if value is None or isinstance(value, (bool, float, str, bytes, np.generic)):
        return value
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise CaptureError(f"{where}: the integer {value} does not fit in 64 bits; keep it as a string")
        return int(value)
    if isinstance(value, torch.Tensor):
        if _sharding.is_dtensor(value):
            raise CaptureError(f"{where} is a DTensor: return its full_tensor() from get_extra_state")
        return to_numpy(numpy_check(value, where), copy=True)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise CaptureError(f"{where}: the dict key {k!r} is a {type(k).__name__}; a checkpoint "
                                   "holds str and int keys")
            out[k] = plain_extra_state(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        items = [plain_extra_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    what = "a NumPy array (return a torch tensor instead)" if isinstance(value, np.ndarray) else \
        f"a {type(value).__module__}.{type(value).__qualname__}"
    raise CaptureError(f"{where} is {what}, which ckptcore cannot save without pickle; have "
                       "get_extra_state() return a tensor, or plain data (numbers, strings, bytes, "
                       "None, lists, tuples, dicts of these and of tensors), and set_extra_state() "
                       "take it back")


def numpy_check(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t``, once its dtype has a NumPy form (CaptureError naming ``name`` otherwise)."""
    numpy_dtype(t, CaptureError, name)
    return t


def revive_extra_state(value: Any) -> Any:
    """A saved plain extra state as ``get_extra_state`` returned it: arrays become (CPU) tensors."""
    if isinstance(value, np.ndarray):
        return new_tensor(value)
    if isinstance(value, dict):
        return {k: revive_extra_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [revive_extra_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(revive_extra_state(v) for v in value)
    return value
