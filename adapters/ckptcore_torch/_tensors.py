"""Discovery of a PyTorch module's named tensors, and torch tensor <-> NumPy, bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow): the module's
``state_dict()`` keys (parameters and persistent buffers, e.g. ``0.weight``, ``bn.running_mean``),
without the components wrappers add: ``module.`` of ``DistributedDataParallel``/``DataParallel``
and ``_orig_mod.`` of ``torch.compile``, at the top or anywhere inside (a compiled block).  Only
the components a wrapper object really adds are removed, so a user's own submodule called
``module`` keeps its name.  A tensor reachable under several names (tied weights) is named once,
by its first name; the others are its aliases.

Values cross without pickle: a tensor's bytes as a NumPy array (``bfloat16``/``float8`` as their
``ml_dtypes`` types), from any device; restoring copies into the live tensor in place, on its own
device and dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

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
for _name, _alias in (("float8_e4m3fnuz", "float8_e4m3fnuz"), ("float8_e5m2fnuz", "float8_e5m2fnuz")):
    if hasattr(torch, _name):
        _EXTENDED[getattr(torch, _name)] = (_alias, torch.uint8)
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


def named_tensors(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state_dict()`` tensors by canonical name, each tensor once, and the aliases of repeated ones."""
    components = wrapper_components(model)
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue  # extra state (get_extra_state) is not a tensor: not ours to save
        name = canonical_name(key, components)
        if name in tensors or name in aliases:
            continue  # the same entry seen through two wrappers
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            tensors[name] = t
    return tensors, aliases


def numpy_dtype(t: Any) -> np.dtype:
    """The NumPy dtype holding ``t``'s values exactly (ml_dtypes for bfloat16 and float8)."""
    dtype = t.dtype if isinstance(t, torch.Tensor) else t
    if dtype in _NUMPY:
        return np.dtype(_NUMPY[dtype])
    if dtype in _EXTENDED:
        if ml_dtypes is None:
            raise TypeError(f"{dtype} tensors need the ml_dtypes package")
        return np.dtype(getattr(ml_dtypes, _EXTENDED[dtype][0]))
    raise TypeError(f"a {dtype} tensor has no NumPy form ckptcore can store")


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    dtype = np.dtype(dtype)
    if dtype in _TORCH:
        return _TORCH[dtype]
    for tdt, (name, _) in _EXTENDED.items():
        if dtype.name == name:
            return tdt
    raise TypeError(f"no torch dtype holds {dtype}")


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

