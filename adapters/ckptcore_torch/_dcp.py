"""``torch.distributed.checkpoint`` folders read without PyTorch or running code, and written with it.

What torch 2.13 writes (``dcp.save``, read off real saves): ``.metadata``, a pickled ``Metadata``
dataclass (``state_dict_metadata``: each flat key's ``TensorStorageMetadata`` -- dtype, global
size, chunks as offsets and sizes -- or ``BytesStorageMetadata``; ``storage_data``: each chunk's
``MetadataIndex`` -> ``_StorageInfo`` (file, byte offset, length); ``planner_data``: each flat
key's path in the nested state dict), and ``__<rank>_<n>.distcp`` files in which each chunk, and
each non-tensor value, is a whole ``torch.save`` zip at its byte range.

The metadata goes through the restricted reader (``_safe_pickle.py``, ``dcp=True``: the dataclasses
above as plain records, torch dtypes, sizes, layouts, memory formats); each byte range through the
``torch.save`` reader.  Checked: a range lies inside its regular file (opened without following a
link or blocking); its file name is a bare name; a chunk has the tensor's rank, lies inside it and
holds its dtype and sizes; the chunks of a tensor cover it exactly once (no hole, no overlap); the
declared tensors fit in the data files' size before anything is allocated.

Keys: the nested state dict is rebuilt from ``planner_data`` (else split at dots): its ``"model"``
entry (or ``model_key``) is the model, its ``"optim"``/``"optimizer"`` entry (or
``optimizer_key``) an optimizer state dict keyed by parameter FQNs as
``torch.distributed.checkpoint.state_dict.get_state_dict`` makes it (``state.<fqn>.<slot>``,
``param_groups.<i>.params`` a list of FQNs), or by indices as ``optimizer.state_dict()``.
:func:`export_dcp` writes that same layout with ``dcp.save`` (one process, no process group).
"""

from __future__ import annotations

import io
import math
import os
import re
from typing import Any

import numpy as np

from ckptcore.adapter import brief, brief_error, open_regular, plain_records, restricted_load
from ckptcore.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                             IncompleteCheckpointError, SchemaError, StorageError)
from ckptcore.state import TrainingState

from ._files import OPTIMIZER_KEYS, model_entries, optimizer_state, param_order, set_step
from ._safe_pickle import DTYPES, TorchDType, TorchUnpickler, load_torch

__all__ = ["import_dcp", "export_dcp"]

_FILE = re.compile(r"[A-Za-z0-9_.\-]{1,128}\.distcp")  # a bare name in the folder, never a path
_MAX_DIMS, _MAX_DIM = 64, 1 << 62


def _open(path: str) -> tuple[Any, int]:
    try:
        fd, st = open_regular(path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: the metadata lists it, but it is missing") from None
    except CheckpointError:
        raise
    except OSError as e:
        raise StorageError(f"{path}: cannot be opened ({type(e).__name__}: {e})") from e
    return os.fdopen(fd, "rb"), st.st_size


def _metadata(folder: str) -> dict:
    path = os.path.join(folder, ".metadata")
    if not os.path.isdir(folder) or not os.path.lexists(path):
        raise CheckpointNotFoundError(f"{folder}: no .metadata; not a torch.distributed.checkpoint folder")
    f, size = _open(path)
    with f:
        raw = restricted_load(lambda f, s, n: TorchUnpickler(f, s, n, data_limit=0, dcp=True), f, path,
                              size, "torch.distributed.checkpoint .metadata")
    meta = plain_records(raw, path)
    if not isinstance(meta, dict) or meta.get("__record__") != "Metadata" or \
            not isinstance(meta.get("state_dict_metadata"), dict):
        raise CorruptCheckpointError(f"{path}: not the Metadata of a torch.distributed checkpoint", file=path)
    return meta


def _ranges(meta: dict, source: str) -> dict[tuple, tuple[str, int, int]]:
    out = {}
    data = meta.get("storage_data") or []
    for pair in data if isinstance(data, list) else []:
        index, info = pair
        if not isinstance(index, dict) or not isinstance(info, dict):
            raise SchemaError(f"{source}: a storage_data entry is not an index and a storage info")
        name, off, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if type(name) is not str or not _FILE.fullmatch(name) or type(off) is not int or \
                type(length) is not int or off < 0 or length < 0:
            raise SchemaError(f"{source}: storage info {brief(info)} (a file must be a bare .distcp name)")
        if info.get("transform_descriptors"):
            raise SchemaError(f"{source}: {index.get('fqn')!r} is stored transformed "
                              f"({brief(info['transform_descriptors'])}); not read")
        out[(index.get("fqn"), index.get("offset"))] = (name, off, length)
    return out


def _read_range(folder: str, where: tuple[str, int, int], sizes: dict, source: str) -> Any:
    name, off, length = where
    path = os.path.join(folder, name)
    f, size = _open(path)
    with f:
        sizes.setdefault(path, size)
        if off + length > size:
            raise CorruptCheckpointError(f"{path}: bytes {off}..{off + length} are listed, the file "
                                         f"has {size}", file=path)
        f.seek(off)
        return load_torch(io.BytesIO(f.read(length)), length, f"{path}@{off}")


def _declared(where: str, md: dict) -> tuple[np.dtype, tuple[int, ...], list]:
    """A tensor's dtype, shape and chunks as its metadata declares them, checked to be those."""
    dtype = md.get("properties", {}).get("dtype")
    shape, chunks = md.get("size"), md.get("chunks")
    if not isinstance(dtype, TorchDType) or dtype.name not in DTYPES or type(shape) is not tuple or \
            len(shape) > _MAX_DIMS or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape) or \
            type(chunks) is not list:
        raise SchemaError(f"{where}: malformed TensorStorageMetadata (dtype {brief(dtype)}, size "
                          f"{brief(shape)}, chunks a {type(chunks).__name__})")
    return _np_dtype(dtype.name), shape, chunks


def _tensor(key: str, md: dict, ranges: dict, folder: str, sizes: dict, budget: list) -> np.ndarray:
    where = f"{folder}: tensor {key!r}"
    dtype, shape, chunks = _declared(where, md)
    nbytes = math.prod(shape) * dtype.itemsize
    budget[0] -= nbytes  # charged before allocating: a damaged or hostile shape costs nothing
    if budget[0] < 0:
        raise SchemaError(f"{where}: its size {shape} of {dtype} declares {nbytes} bytes; the data "
                          f"files hold {budget[1]} in all, less what the tensors before it take")
    arr = np.empty(shape, dtype=dtype)
    covered = 0
    mask = np.zeros(shape, dtype=bool)
    for c in chunks:
        offs, szs = c.get("offsets"), c.get("sizes")
        if type(offs) is not tuple or type(szs) is not tuple or len(offs) != len(shape) or \
                len(szs) != len(shape) or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offs, szs, shape)):
            raise SchemaError(f"{where}: chunk at {brief(offs)} of size {brief(szs)} lies outside {shape}")
        if (key, offs) not in ranges:
            raise IncompleteCheckpointError(f"{where}: the chunk at {offs} has no storage entry")
        part = _read_range(folder, ranges[(key, offs)], sizes, f"{where}")
        if not isinstance(part, np.ndarray) or part.shape != szs or part.dtype != arr.dtype:
            raise SchemaError(f"{where}: the chunk at {offs} holds {brief(part)}, not {szs} {arr.dtype}")
        region = tuple(slice(o, o + s) for o, s in zip(offs, szs))
        if mask[region].any():
            raise SchemaError(f"{where}: chunks overlap at {offs}")
        mask[region] = True
        arr[region] = part
        covered += math.prod(szs)
    if covered != arr.size:
        raise IncompleteCheckpointError(f"{where}: its chunks cover {covered} of {arr.size} values")
    return arr


def _np_dtype(name: str) -> Any:
    from ckptcore.adapter import parse_dtype
    return parse_dtype(DTYPES[name])


def _nest(flat: dict[str, Any], planner: Any) -> dict:
    out: dict = {}
    for key, value in flat.items():
        route = planner.get(key) if isinstance(planner, dict) else None
        route = tuple(route) if isinstance(route, (tuple, list)) and route else tuple(key.split("."))
        node: Any = out
        for i, part in enumerate(route[:-1]):
            nxt = route[i + 1]
            if isinstance(node, list):
                while len(node) <= part:
                    node.append({})
                node = node[part]
            else:
                node = node.setdefault(part, [] if type(nxt) is int else {})
        if isinstance(node, list):
            while len(node) <= route[-1]:
                node.append(None)
        node[route[-1]] = value
    return out


def import_dcp(path: str | os.PathLike, *, model_key: str | None = None, optimizer_key: str | None = None,
               param_names: Any = None, optimizer_kind: str | None = None, step: int | None = None) -> TrainingState:
    """Read the ``torch.distributed.checkpoint`` folder ``path`` as a state (see the module docstring).

    Raises:
        CheckpointNotFoundError: no ``.metadata`` in the folder.
        UnsafeCheckpointError: the metadata or a value asks for anything but the admitted records,
            tensors and plain values; a link, FIFO or device stands where a file belongs.
        IncompleteCheckpointError: a data file is missing, or a tensor's chunks leave a hole.
        SchemaError / CorruptCheckpointError: the metadata and the data disagree.
    """
    folder = os.fspath(path)
    meta = _metadata(folder)
    source = os.path.join(folder, ".metadata")
    try:
        flat = _values(meta, folder, source)
        return _to_state(_nest(flat, meta.get("planner_data")), folder, model_key, optimizer_key,
                         param_names, optimizer_kind, step)
    except CheckpointError:
        raise
    except (TypeError, AttributeError, ValueError, LookupError, ArithmeticError) as e:
        # The metadata's records are unpickled as plain values of any shape: one of the wrong
        # kind where a tuple, dict or number belongs surfaces here.
        raise SchemaError(f"{source}: not a readable torch.distributed checkpoint "
                          f"({type(e).__name__}: {brief_error(e)})") from e


def _values(meta: dict, folder: str, source: str) -> dict[str, Any]:
    """Every flat key's value: tensors assembled from their chunks, other values unpickled."""
    ranges = _ranges(meta, source)
    total = 0
    for name in {r[0] for r in ranges.values()}:
        try:
            total += os.lstat(os.path.join(folder, name)).st_size
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{folder}: {name} is listed but missing") from None
    budget, sizes, flat = [total, total], {}, {}
    for key, md in meta["state_dict_metadata"].items():
        if md.get("__record__") == "TensorStorageMetadata":
            flat[key] = _tensor(key, md, ranges, folder, sizes, budget)
        elif (key, None) in ranges:
            flat[key] = _read_range(folder, ranges[(key, None)], sizes, source)
        else:
            raise IncompleteCheckpointError(f"{folder}: {key!r} has no storage entry")
    return flat


def _to_state(nested: dict, folder: str, model_key: Any, optimizer_key: Any, param_names: Any,
              optimizer_kind: Any, step: Any) -> TrainingState:
    sd = nested.get(model_key or "model", None if model_key else nested)
    model, aliases = model_entries(sd, folder)
    state = TrainingState(framework="torch", model=model,
                          metadata={"source": "torch.distributed.checkpoint", "files": [folder]})
    opt = nested.get(optimizer_key) if optimizer_key else next(
        (nested[k] for k in ("optim",) + OPTIMIZER_KEYS if k in nested), None)
    if isinstance(opt, dict):
        names = param_order(model, opt, param_names, folder)
        state.optimizer = optimizer_state(opt, names, model, folder, kind=optimizer_kind)
    set_step(state, step, {})
    state.extra = {"torch": {"aliases": aliases}} if aliases else {}
    return state


def export_dcp(state: TrainingState, path: str | os.PathLike, **options: Any) -> str:
    """Write ``state`` as a ``torch.distributed.checkpoint`` folder with ``dcp.save`` (imports
    PyTorch): ``{"model": state dict, "optim": FQN-keyed optimizer state dict}``, which
    ``dcp.load`` into ``get_state_dict(model, optimizer)`` and ``set_state_dict`` restore."""
    if options:
        raise TypeError(f"export_dcp takes no option {', '.join(sorted(options))}")
    if state.framework not in ("torch", None):
        raise SchemaError(f"a {state.framework!r} state is not in PyTorch's layout; convert it first")
    import torch
    import torch.distributed.checkpoint as dcp

    def t(a: np.ndarray) -> Any:
        a = np.asarray(a, order="C")
        if a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            raw = torch.from_numpy(a.view(np.int16 if a.itemsize == 2 else np.uint8).copy())
            return raw.view(getattr(torch, a.dtype.name))
        return torch.from_numpy(a.copy())

    out: dict[str, Any] = {"model": {k: t(v) for k, v in state.model.items()}}
    opt = state.optimizer
    if opt is not None:
        groups = opt.extra.get("param_groups") or [{**opt.hyperparams, "params": list(opt.slots)}]
        out["optim"] = {"state": {n: {s: t(v) for s, v in slots.items()} for n, slots in opt.slots.items()},
                        "param_groups": [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()}
                                         for g in groups]}
    dst = os.fspath(path)
    dcp.save(out, checkpoint_id=dst, no_dist=True)
    return dst
