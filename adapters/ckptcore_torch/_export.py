"""``torch.save`` files written without PyTorch, for ``torch.load(weights_only=True)``.

:func:`export_torch_files` pickles (protocol 2, as torch does) ``{"model": state dict,
"optimizer": state dict with integer indices in parameter order, "scheduler": ...}`` (or the
model's state dict alone, ``model_only=True``) into the zip layout ``torch.save`` writes: tensors
are ``_rebuild_tensor_v2`` calls over typed storages, one per tensor, each record 64-byte aligned.
The globals are written by name (:class:`_Global`), so PyTorch is never imported.

The optimizer's integer indices follow the order ``model.parameters()`` gives an optimizer built
in the usual way: the model's entries without its buffers (:func:`parameter_keys`), unless the
state or the caller says otherwise.  The reader (``_files.py``) assumes the same order, so both
take it from here.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import numpy as np

from ckptcore.adapter import brief
from ckptcore.errors import SchemaError
from ckptcore.state import TrainingState

from ._safe_pickle import DTYPES, STORAGE_TYPES

__all__ = ["export_torch_files", "parameter_keys", "BUFFER_NAMES"]

# The buffers of torch's built-in modules, which a state dict lists beside the parameters.
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def parameter_keys(keys: Iterable[str]) -> list[str]:
    """The state-dict ``keys`` that are parameters (not :data:`BUFFER_NAMES`), in order: the
    order an optimizer built from ``model.parameters()`` numbers them."""
    return [k for k in keys if k.rsplit(".", 1)[-1] not in BUFFER_NAMES]


class _Global:
    """A ``GLOBAL module name`` to write without importing ``module`` (torch)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self) -> None:  # pragma: no cover - pickle only checks that it is callable
        raise TypeError("a marker for the pickle")


_REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")
_STORAGE_CLASS = {DTYPES[t]: _Global("torch", s) for s, t in STORAGE_TYPES.items()}


class _Tensor:
    def __init__(self, key: str, arr: np.ndarray) -> None:
        self.key, self.arr = key, arr

    def __reduce__(self) -> tuple:
        stride = tuple(int(np.prod(self.arr.shape[i + 1:])) for i in range(self.arr.ndim))
        return _REBUILD, (_StorageRef(self), 0, tuple(self.arr.shape), stride, False, OrderedDict())


class _StorageRef:
    def __init__(self, tensor: _Tensor) -> None:
        self.tensor = tensor


class _ModelDict(OrderedDict):
    """A state dict pickled as torch pickles one: an ``OrderedDict`` with its module versions."""

    versions: dict | None = None

    def __reduce__(self) -> tuple:
        state = None if self.versions is None else {"_metadata": OrderedDict(self.versions)}
        return OrderedDict, (), state, None, iter(self.items())


class _Pickler(pickle._Pickler):  # the pure-Python pickler: _Global is written, never looked up
    dispatch = dict(pickle._Pickler.dispatch)

    def save_marker(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_Global] = save_marker

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            arr = obj.tensor.arr
            return ("storage", _STORAGE_CLASS[arr.dtype.name], obj.tensor.key, "cpu", arr.size)
        return None


def _zip_bytes(obj: Any, tensors: list[_Tensor], path: str) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
            records = [("data.pkl", buf.getvalue()), (".format_version", b"1"),
                       (".storage_alignment", b"64"), ("byteorder", b"little")]
            records += [(f"data/{t.key}", t.arr.tobytes()) for t in tensors] + [("version", b"3")]
            for name, data in records:
                info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
                header = zf.fp.tell() + 30 + len(info.filename) + 4
                info.extra = b"FB" + (pad := -header % 64).to_bytes(2, "little") + b"Z" * pad
                zf.writestr(info, data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def export_torch_files(state: TrainingState, path: str | os.PathLike, *, model_only: bool = False,
                       param_names: Sequence[str] | None = None) -> str:
    """Write ``path``, a zip ``torch.save`` file that ``torch.load(path, weights_only=True)`` reads:
    ``{"model": state dict, "optimizer": optimizer state dict, "scheduler": its state dict,
    "epoch": ..., "step": ...}`` (entries the state has), or the model's state dict alone
    (``model_only=True``).  PyTorch is not needed.

    The optimizer's indices follow ``state.optimizer.extra["param_groups"]`` (a torch capture or
    import), else ``param_names``, else the model's entries without its buffers, in order: the
    order ``model.parameters()`` gives an optimizer built in the usual way.

    Raises:
        SchemaError: the state is not PyTorch's (convert it first), a dtype torch has no storage
            for, or an optimizer whose parameters cannot be put in order.
    """
    if state.framework not in ("torch", None):
        raise SchemaError(f"a {state.framework!r} state is not in PyTorch's layout; convert it first "
                          "(ckptcore.convert(state, 'torch', model, optimizer), or ckpt convert --to torch)")
    dst = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tensors: list[_Tensor] = []

    def tensor(name: str, value: Any) -> _Tensor:
        arr = np.asarray(value, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        if arr.dtype.name not in _STORAGE_CLASS:
            raise SchemaError(f"{name}: a {arr.dtype} array has no torch storage type")
        tensors.append(_Tensor(str(len(tensors)), arr.astype(arr.dtype.newbyteorder("<"))))
        return tensors[-1]

    model = _ModelDict((k, tensor(k, v)) for k, v in state.model.items())
    torch_extra = (state.extra or {}).get("torch") or {}
    if isinstance(torch_extra.get("module_versions"), dict):
        model.versions = torch_extra["module_versions"]
    for alias, key in (torch_extra.get("aliases") or {}).items():
        if key in model:
            model[alias] = model[key]
    if model_only:
        _zip_bytes(model, tensors, dst)
        return dst
    out: dict[str, Any] = {"model": model}
    if state.optimizer is not None:
        out["optimizer"] = _optimizer_dict(state, tensor, param_names)
    if state.schedule is not None and state.schedule.state:
        out["scheduler"] = dict(state.schedule.state)
    if state.epoch is not None:
        out["epoch"] = state.epoch
    out["step"] = state.step
    _zip_bytes(out, tensors, dst)
    return dst


def _optimizer_dict(state: TrainingState, tensor: Any, param_names: Sequence[str] | None) -> dict:
    opt = state.optimizer
    groups = opt.extra.get("param_groups")
    if not groups:
        order = list(param_names) if param_names is not None else parameter_keys(state.model)
        groups = [{**opt.hyperparams, "params": order}]
    index: dict[str, int] = {}
    out_groups = []
    for g in groups:
        hyper = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
                 for k, v in g.items() if k != "params"}
        out_groups.append({**hyper, "params": [index.setdefault(n, len(index)) for n in g["params"]]})
    stray = sorted(set(opt.slots) - set(index))
    if stray:
        raise SchemaError(f"optimizer state for {brief(stray)}, which no param group lists; pass "
                          "param_names=[...] in the optimizer's parameter order")
    st = {index[name]: {slot: tensor(f"optimizer/{name}/{slot}", v) for slot, v in slots.items()}
          for name, slots in sorted(opt.slots.items(), key=lambda kv: index[kv[0]])}
    return {"state": st, "param_groups": out_groups}
