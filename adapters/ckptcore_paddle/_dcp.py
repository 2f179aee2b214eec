"""Import a ``paddle.distributed.save_state_dict`` checkpoint without running code or importing Paddle.

What Paddle 3.3 writes into the folder (read off real saves, 1 and 2 gloo processes on CPU):

* ``<id>.metadata``: a pickled ``Metadata`` dataclass: ``state_dict_metadata`` maps each flat key
  (``"model.0.weight"``) to the chunks the ranks hold of it (``LocalTensorMetadata``: global
  offset, local shape, dtype name, global shape), ``storage_metadata`` maps each chunk
  (``LocalTensorIndex``: key and global offset) to the file holding it, ``flat_mapping`` maps
  each flat key to its path in the nested state dict (``("model", "0.weight")``).  ``<id>`` is
  0 for the first save into a folder and grows by one with each later save into it.
* ``<rank>_<id>.distcp``: one per rank, a ``paddle.save``-style pickle of ``{flat key: that
  rank's chunk as a numpy array}`` plus the name table ``"StructuredToParameterName@@"`` (flat
  key -> the tensor's runtime name, e.g. ``linear_0.w_0``).  A replicated tensor is written by
  one rank only.

Both are read with the restricted unpickler (``_safe_pickle.py``; the metadata's three
dataclasses become plain records).  Each tensor is assembled from its chunks and must be covered
whole; every chunk is checked against the metadata (shape, dtype) before it is placed.  Paddle
keeps no checksums there, so damage inside an array's bytes cannot be detected; everything
ckptcore writes from the imported state on is checksummed.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from ckptcore import _codec
from ckptcore.errors import (CheckpointNotFoundError, IncompleteCheckpointError, SchemaError,
                             UnsupportedCheckpointError)
from ckptcore.state import TrainingState

from ._files import NAME_TABLE, _import_optimizer, _model_arrays, _structure_errors
from ._safe_pickle import brief, load_dcp_metadata, load_paddle_pickle

_METADATA = re.compile(r"(\d{1,9})\.metadata")
_DATA = re.compile(r"\d{1,9}_\d{1,9}\.distcp")  # a bare file name: no path can be smuggled in
_OPTIMIZER_KEYS = ("optimizer", "opt")
_MAX_DIMS = 64


def import_paddle_dcp(path: str | os.PathLike, *, unique_id: int | None = None,
                      model_key: str | None = None,
                      optimizer_key: str | None = None) -> TrainingState:
    """Read the ``paddle.distributed.save_state_dict`` checkpoint in folder ``path`` as a state.

    ``unique_id`` picks one of several saves into the folder (default: the newest).  The state
    dict's entry ``model_key`` (default ``"model"`` when there is one, else the whole state dict,
    as in ``save_state_dict(layer.state_dict(), path)``) becomes ``state.model``; the entry
    ``optimizer_key`` (default ``"optimizer"`` or ``"opt"``) becomes ``state.optimizer``, mapped
    onto the model's parameters through the files' name tables.  Any other entries are kept under
    ``state.extra["paddle_dcp"]`` by their flat keys.

    Raises:
        CheckpointNotFoundError: no ``.metadata`` file (of ``unique_id``) in the folder.
        UnsafeCheckpointError: a file asks for anything but arrays, plain values and Paddle's three
            metadata records.
        IncompleteCheckpointError: a chunk's file is missing, or a tensor's chunks leave a hole.
        SchemaError: the metadata and the data disagree (shape, dtype, keys).
        UnsupportedCheckpointError: flattened chunks (sharding stage 1 v2), not read yet.
    """
    folder = os.fspath(path)
    meta_path = _metadata_file(folder, unique_id)
    meta = load_dcp_metadata(meta_path)
    chunks, storage, mapping = _sections(meta, meta_path)
    files: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    arrays: dict[str, np.ndarray] = {}
    for key, parts in chunks.items():
        arrays[key] = _assemble(folder, key, parts, storage, files, names, meta_path)
    return _to_state(arrays, mapping, names, folder, [meta_path, *sorted(
        os.path.join(folder, f) for f in files)], model_key, optimizer_key)


def _metadata_file(folder: str, unique_id: int | None) -> str:
    try:
        listing = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(f"{folder}: not a folder of a paddle.distributed "
                                      "checkpoint") from e
    ids = sorted(int(m.group(1)) for f in listing if (m := _METADATA.fullmatch(f)))
    if not ids:
        raise CheckpointNotFoundError(f"{folder}: no <id>.metadata file; not a "
                                      "paddle.distributed.save_state_dict checkpoint")
    if unique_id is None:
        unique_id = ids[-1]
    elif unique_id not in ids:
        raise CheckpointNotFoundError(f"{folder}: no {unique_id}.metadata (saves here: {ids})")
    return os.path.join(folder, f"{unique_id}.metadata")


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or len(value) > _MAX_DIMS or \
            not all(type(d) is int and 0 <= d < 1 << 62 for d in value):
        raise SchemaError(f"{where}: {brief(value)} is not a shape or offset")
    return tuple(value)


def _sections(meta: dict, source: str) -> tuple[dict, dict, dict]:
    sdm, sm, fm = (meta.get(k) for k in ("state_dict_metadata", "storage_metadata", "flat_mapping"))
    if not isinstance(sdm, dict) or not isinstance(sm, (list, dict)) or not isinstance(fm, (dict, type(None))):
        raise SchemaError(f"{source}: the Metadata lacks its state_dict_metadata or storage_metadata")
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...] | None]]] = {}
    for key, parts in sdm.items():
        where = f"{source}: tensor {brief(key)}"
        if type(key) is not str or type(parts) is not list or not parts:
            raise SchemaError(f"{where}: not a name with a list of chunks")
        out = []
        for p in parts:
            if not isinstance(p, dict) or p.get("__record__") != "LocalTensorMetadata":
                raise SchemaError(f"{where}: a chunk is a {type(p).__name__}, not a LocalTensorMetadata")
            if p.get("is_flattened"):
                raise UnsupportedCheckpointError(
                    f"{where}: flattened chunks (written by sharding stage 1 v2 with split "
                    "parameters) are not read by this version; save with whole-parameter sharding")
            offset, shape = _dims(p.get("global_offset"), where), _dims(p.get("local_shape"), where)
            gshape = p.get("global_shape")
            gshape = None if gshape is None else _dims(gshape, where)
            if type(p.get("dtype")) is not str or len({len(offset), len(shape)} |
                                                       ({len(gshape)} if gshape else set())) != 1:
                raise SchemaError(f"{where}: a chunk's dtype, offset and shapes do not agree")
            out.append((offset, shape, p["dtype"], gshape))
        chunks[key] = out
    storage: dict[tuple[str, tuple[int, ...]], str] = {}
    for pair in (sm.items() if isinstance(sm, dict) else sm):
        if len(pair) != 2 or not isinstance(pair[0], dict) or type(pair[1]) is not str:
            raise SchemaError(f"{source}: a storage_metadata entry is not an index and a file name")
        index, name = pair
        if not _DATA.fullmatch(name):
            raise SchemaError(f"{source}: storage_metadata names the file {brief(name)}, not a "
                              "<rank>_<id>.distcp file of this folder")
        storage[(index.get("tensor_key"), _dims(index.get("global_offset"), source))] = name
    mapping: dict[str, tuple[str, ...]] = {}
    for key, route in (fm or {}).items():
        if type(route) not in (tuple, list) or not route or not all(type(r) is str for r in route):
            raise SchemaError(f"{source}: flat_mapping maps {brief(key)} to {brief(route)}")
        mapping[key] = tuple(route)
    return chunks, storage, mapping


def _data_file(folder: str, name: str, files: dict, names: dict) -> dict[str, Any]:
    if name not in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise IncompleteCheckpointError(f"{path}: the metadata lists it, but it is missing")
        obj = load_paddle_pickle(path)
        if not isinstance(obj, dict):
            raise SchemaError(f"{path}: holds a {type(obj).__name__}, not a dict of arrays")
        table = obj.pop(NAME_TABLE, None)
        if isinstance(table, dict):
            names.update({k: v for k, v in table.items() if type(k) is str and type(v) is str})
        files[name] = obj
    return files[name]


def _assemble(folder: str, key: str, parts: list, storage: dict, files: dict, names: dict,
              source: str) -> np.ndarray:
    where = f"{folder}: tensor {key!r}"
    dtype = _codec.parse_dtype(parts[0][2], where=where)
    gshape = parts[0][3] or tuple(max(o[d] + s[d] for o, s, _, _ in parts)
                                  for d in range(len(parts[0][0])))
    out = np.empty(gshape, dtype)
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}
    covered = 0
    for offset, shape, dtype_name, g in parts:
        if (g or gshape) != gshape or dtype_name != parts[0][2]:
            raise SchemaError(f"{where}: its chunks disagree on its global shape or dtype")
        if any(o + s > n for o, s, n in zip(offset, shape, gshape)):
            raise SchemaError(f"{where}: a chunk at {offset} of shape {shape} lies outside {gshape}")
        if offset in seen:  # the same block listed twice (a replica): read it once
            if seen[offset] != shape:
                raise SchemaError(f"{where}: two chunks at {offset} of shapes {seen[offset]} and {shape}")
            continue
        seen[offset] = shape
        name = storage.get((key, offset))
        if name is None:
            raise IncompleteCheckpointError(f"{source}: no file holds the chunk of {key!r} at "
                                            f"{offset}")
        data = _data_file(folder, name, files, names).get(key)
        if not isinstance(data, np.ndarray) or data.shape != shape or data.dtype.newbyteorder("=") \
                != dtype.newbyteorder("="):
            raise SchemaError(f"{os.path.join(folder, name)}: {key!r} is "
                              f"{brief(getattr(data, 'dtype', type(data).__name__))}"
                              f"{list(getattr(data, 'shape', []))}; the metadata says "
                              f"{dtype}{list(shape)}")
        out[tuple(slice(o, o + s) for o, s in zip(offset, shape))] = data
        covered += math.prod(shape)
    if covered != math.prod(gshape):  # (chunks of one tensor never overlap in Paddle's saves)
        raise IncompleteCheckpointError(f"{where}: its chunks hold {covered} of its "
                                        f"{math.prod(gshape)} values")
    return out


def _to_state(arrays: dict[str, np.ndarray], mapping: dict[str, tuple[str, ...]],
              names: dict[str, str], folder: str, sources: list[str],
              model_key: str | None, optimizer_key: str | None) -> TrainingState:
    route = {k: mapping.get(k, (k,)) for k in arrays}
    tops = {r[0] for r in route.values() if len(r) > 1}
    if model_key is None:
        model_key = "model" if "model" in tops else None
    if optimizer_key is None:
        optimizer_key = next((k for k in _OPTIMIZER_KEYS if k in tops), None)
    for given, what in ((model_key, "model_key"), (optimizer_key, "optimizer_key")):
        if given is not None and given not in tops:
            raise SchemaError(f"{folder}: {what}={given!r}, but the state dict's entries are "
                              f"{sorted(tops) or 'flat'}")

    def entries(top: str | None) -> dict[str, str]:  # flat key -> name inside the entry
        if top is None:
            return {k: ".".join(r) for k, r in route.items() if len(r) == 1 or r[0] not in tops}
        return {k: ".".join(r[1:]) for k, r in route.items() if len(r) > 1 and r[0] == top}

    model_keys = entries(model_key)
    with _structure_errors(folder):
        model, aliases = _model_arrays({n: arrays[k] for k, n in model_keys.items()},
                                       {n: names[k] for k, n in model_keys.items() if k in names},
                                       folder)
    param_names = {n: names[k] for k, n in model_keys.items() if k in names and n in model}
    extra: dict[str, Any] = {"param_names": param_names}
    if aliases:
        extra["aliases"] = aliases
    state = TrainingState(framework="paddle", model=model,
                          metadata={"source": "paddle.distributed.save_state_dict",
                                    "files": sources})
    used = set(model_keys)
    if optimizer_key is not None:
        opt_keys = entries(optimizer_key)
        with _structure_errors(folder):
            _import_optimizer(state, {n: arrays[k] for k, n in opt_keys.items()}, folder,
                              {r: s for s, r in param_names.items()})
        used |= set(opt_keys)
    rest = {k: arrays[k] for k in arrays if k not in used}
    if rest:
        state.extra = {"paddle_dcp": rest}
    state.extra = {**(state.extra or {}), "paddle": extra}
    return state
