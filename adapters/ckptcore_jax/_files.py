"""Orbax checkpoints read into a TrainingState and written from one; :data:`FORMATS` declares
them to ``ckpt import --from orbax`` / ``ckpt export --to orbax``.

Reading (:func:`import_orbax`) takes a step folder of a ``StandardCheckpointer`` /
``PyTreeCheckpointer`` (its ``_METADATA`` at the top), a ``CheckpointManager`` step (the item
folder ``default/`` inside, or the one item there is), or a ``CheckpointManager`` root (its newest
step, or ``step=N``).  OCDBT and plain folders, zarr v2 and zarr3 are all read through
TensorStore (installed with orbax-checkpoint), never through Orbax's own restore.  The folder is
untrusted:

* every entry is looked at without following links before anything is read: a symlink, FIFO,
  socket or device anywhere is an :class:`~ckptcore.errors.UnsafeCheckpointError`;
* ``_METADATA`` is JSON, bounded by the manifest size limit and checked field by field; a leaf's
  path components must be plain names (no ``/``, no ``..``): a plain (non-OCDBT) checkpoint keeps
  each array in a folder named after its path;
* every array's shape and dtype are read from its own metadata and checked before its data: a
  numeric dtype, and all arrays together at most ``max_bytes`` (default: this machine's memory);
* anything TensorStore refuses is a :class:`~ckptcore.errors.CorruptCheckpointError` naming the
  leaf.  Only ``CheckpointError``s (and ``FileNotFoundError`` for a missing folder) come out.

Layout: the conventional top-level keys become the state's sections: ``params``/``model`` (the
model, leaf names ``/``-joined), ``opt_state``/``optimizer``/``opt`` (an Optax state, keyed by
parameter path as ``_optimizer.py`` keys one), ``step``; any other top-level key is kept in
``state.extra["orbax"]``.  A tree without ``params``/``model`` is all model.  An NNX state saved
as it is (``nnx.state(model)``: every leaf under a ``value`` key) loses that last component.
Typed keys (Orbax notes their implementation) come back as their key data, the implementation in
``extra["jax"]["keys"]``.

Writing (:func:`export_orbax`) uses Orbax itself (``PyTreeCheckpointHandler``: OCDBT by
default, zarr3 on request).  With ``target`` (the pytree the run will restore into, e.g.
``{"params": params, "opt_state": opt_state, "step": 0}``) the written tree has exactly its
structure, dtypes and shardings, so ``StandardCheckpointer().restore(path, target)`` gives the
state's values bit for bit; without it, nested dicts of NumPy arrays in the layout above.  A state
captured from sharded arrays (``Shard``/``Chunks`` leaves covering each array) is written whole;
a folder already at the path is a CheckpointExistsError unless ``overwrite=True``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Any

import numpy as np

from ckptcore.adapter import FileFormat, knobs, open_regular
from ckptcore.errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                             CorruptCheckpointError, SchemaError, UnsafeCheckpointError)
from ckptcore.state import OptimizerState, TrainingState

__all__ = ["FORMATS", "import_orbax", "export_orbax", "is_orbax"]

MODEL_KEYS = ("params", "model")
OPTIMIZER_KEYS = ("opt_state", "optimizer", "opt")
STEP_KEYS = ("step",)
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
_SKIP_TYPES = ("None", "Dict", "List", "Tuple", "NamedTuple")  # empty nodes
_MAX_ENTRIES = 1_000_000
_MAX_DEPTH = 64

log = logging.getLogger("ckptcore")


# --- finding the item folder -------------------------------------------------------------------


def is_orbax(path: str) -> bool:
    """Whether ``path`` looks like an Orbax step, item or manager root (no import of Orbax)."""
    try:
        return _item_folder(os.fspath(path), None, quiet=True) is not None
    except (OSError, CheckpointError):
        return False


def _steps(root: str) -> list[int]:
    out = []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if name.isdigit() and not os.path.islink(full) and os.path.isdir(full) \
                and os.path.exists(os.path.join(full, "_CHECKPOINT_METADATA")):
            out.append(int(name))
    return sorted(out)


def _item_folder(path: str, step: int | None, quiet: bool = False) -> str | None:
    if os.path.islink(path):
        raise UnsafeCheckpointError(f"{path}: is a symbolic link; give the folder itself")
    if not os.path.isdir(path):
        if quiet:
            return None
        raise CheckpointNotFoundError(f"{path}: no Orbax checkpoint folder there")
    if step is None and os.path.isfile(os.path.join(path, "_METADATA")):
        return path
    steps = _steps(path)
    if steps and (step is not None or not os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA"))):
        chosen = steps[-1] if step is None else int(step)
        if chosen not in steps:
            raise CheckpointNotFoundError(f"{path}: no committed Orbax step {chosen} (steps: {steps})")
        return _item_folder(os.path.join(path, str(chosen)), None, quiet)
    items = [n for n in sorted(os.listdir(path))
             if not os.path.islink(os.path.join(path, n))
             and os.path.isfile(os.path.join(path, n, "_METADATA"))]
    if "default" in items:
        return os.path.join(path, "default")
    if len(items) == 1:
        return os.path.join(path, items[0])
    if quiet:
        return None
    if items:
        raise SchemaError(f"{path}: an Orbax step of several items ({', '.join(items)}); give "
                          "the item's folder")
    raise CheckpointNotFoundError(f"{path}: no Orbax _METADATA (not a StandardCheckpointer step, "
                                  "CheckpointManager step or root)")


def _check_tree(folder: str) -> int:
    """Every entry under ``folder`` is a folder or a regular file (nothing followed); returns
    the bytes of its files."""
    total, count = 0, 0
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            count += 1
            if count > _MAX_ENTRIES:
                raise UnsafeCheckpointError(f"{folder}: more than {_MAX_ENTRIES} entries")
            full = os.path.join(root, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeCheckpointError(f"{full}: a symbolic link inside an Orbax checkpoint")
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise UnsafeCheckpointError(f"{full}: not a regular file or folder (a FIFO, socket "
                                            "or device) inside an Orbax checkpoint")
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _read_json(path: str, what: str, required: bool = True) -> Any:
    try:
        fd, st = open_regular(path)
    except FileNotFoundError:
        if required:
            raise CheckpointNotFoundError(f"{path}: the Orbax {what} is missing") from None
        return None
    with os.fdopen(fd, "rb") as f:
        limit = knobs.max_manifest_bytes()
        if st.st_size > limit:
            raise UnsafeCheckpointError(f"{path}: {st.st_size} bytes of {what}, more than the "
                                        f"{limit} allowed (CKPTCORE_MAX_MANIFEST_BYTES)")
        data = f.read(limit + 1)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SchemaError(f"{path}: the Orbax {what} is not JSON: {e}") from None


# --- metadata ---------------------------------------------------------------------------------


def _leaves(meta: Any, path: str) -> list[tuple[tuple[str, ...], str]]:
    """``(key path, value type)`` of every leaf ``_METADATA`` declares, checked."""
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise SchemaError(f"{path}: _METADATA has no tree_metadata object")
    out = []
    for label, entry in meta["tree_metadata"].items():
        where = f"{path}: _METADATA entry {str(label)[:80]!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("key_metadata"), list) \
                or not isinstance(entry.get("value_metadata"), dict):
            raise SchemaError(f"{where}: needs key_metadata (a list) and value_metadata (an object)")
        keys = entry["key_metadata"]
        if not keys or len(keys) > _MAX_DEPTH:
            raise SchemaError(f"{where}: a key path of {len(keys)} components")
        parts = []
        for k in keys:
            name = k.get("key") if isinstance(k, dict) else None
            if not isinstance(name, str) or not name or "/" in name or "\\" in name \
                    or "\x00" in name or name in (".", ".."):
                raise UnsafeCheckpointError(f"{where}: key {name!r} is not a plain name")
            parts.append(name)
        vtype = entry["value_metadata"].get("value_type")
        if not isinstance(vtype, str):
            raise SchemaError(f"{where}: value_type is not a string")
        if entry["value_metadata"].get("skip_deserialize") is True or vtype in _SKIP_TYPES:
            continue
        if vtype not in _ARRAY_TYPES:
            raise SchemaError(f"{where}: value_type {vtype[:40]!r} is not one ckptcore reads "
                              f"({', '.join(_ARRAY_TYPES)})")
        out.append((tuple(parts), vtype))
    return out


def _key_impls(folder: str) -> dict[str, str]:
    """Orbax's note of each typed key's implementation (``array_metadatas/process_*``)."""
    out: dict[str, str] = {}
    base = os.path.join(folder, "array_metadatas")
    if not os.path.isdir(base):
        return out
    for name in sorted(os.listdir(base))[:4096]:
        doc = _read_json(os.path.join(base, name), "array metadata", required=False)
        entries = doc.get("array_metadatas") if isinstance(doc, dict) else None
        for e in entries if isinstance(entries, list) else ():
            meta = e.get("array_metadata") if isinstance(e, dict) else None
            ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
            impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
            if isinstance(impl, str) and isinstance(meta.get("param_name"), str):
                out[meta["param_name"]] = impl
    return out


# --- reading ----------------------------------------------------------------------------------


def _memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 34


def _open(folder: str, name: str, meta: dict) -> Any:
    import tensorstore as ts

    if meta.get("use_ocdbt", False):
        kv = {"driver": "ocdbt", "base": f"file://{os.path.abspath(folder)}/", "path": name + "/"}
    else:
        kv = {"driver": "file", "path": os.path.join(os.path.abspath(folder), name) + "/"}
    driver = "zarr3" if meta.get("use_zarr3", False) else "zarr"
    try:
        return ts.open({"driver": driver, "kvstore": kv}, open=True, read=True).result()
    except Exception as e:  # TensorStore's errors are ValueError/OSError... of its own wording
        raise CorruptCheckpointError(f"{folder}: array {name!r}: {str(e)[:300]}") from None


def import_orbax(path: str | os.PathLike, *, step: int | None = None, max_bytes: int | None = None,
                 **options: Any) -> TrainingState:
    """Read an Orbax checkpoint (see the module's docstring) into a TrainingState.

    Raises:
        CheckpointNotFoundError: no Orbax checkpoint at ``path`` (or no step ``step``).
        UnsafeCheckpointError: links, FIFOs, devices, key paths that are not plain names, or
            arrays larger in all than ``max_bytes``.
        SchemaError, CorruptCheckpointError: metadata or data that do not parse.
    """
    if options:
        raise TypeError(f"import_orbax does not take {', '.join(sorted(options))}")
    folder = _item_folder(os.fspath(path), step)
    _check_tree(folder)
    meta = _read_json(os.path.join(folder, "_METADATA"), "tree metadata")
    leaves = _leaves(meta, folder)
    impls = _key_impls(folder)
    limit = _memory() if max_bytes is None else int(max_bytes)
    stores, total = [], 0
    for keys, _vtype in leaves:
        name = ".".join(keys)
        store = _open(folder, name, meta)
        dtype = np.dtype(store.dtype.numpy_dtype)
        if dtype.kind not in "biufcV" or dtype.hasobject:
            raise SchemaError(f"{folder}: array {name!r} has dtype {dtype}, not a numeric one")
        shape = tuple(int(d) for d in store.shape)
        total += int(np.prod(shape, dtype=object)) * dtype.itemsize
        if total > limit:
            raise UnsafeCheckpointError(f"{folder}: array {name!r} of shape {list(shape)} takes the "
                                        f"arrays past {limit} bytes (max_bytes)")
        stores.append((keys, name, store))
    values = {}
    for keys, name, store in stores:
        try:
            values[keys] = (np.asarray(store.read().result()), impls.get(name))
        except Exception as e:
            raise CorruptCheckpointError(f"{folder}: array {name!r}: {str(e)[:300]}") from None
    return _state(values, folder)


def _strip_value(items: dict[tuple[str, ...], Any]) -> dict[tuple[str, ...], Any]:
    """An NNX state saved as it is has every leaf under ``value``: drop that component."""
    if items and all(len(k) > 1 and k[-1] == "value" for k in items):
        return {k[:-1]: v for k, v in items.items()}
    return items


def _state(values: dict[tuple[str, ...], tuple[np.ndarray, str | None]], folder: str) -> TrainingState:
    from ._optimizer import split_name

    tops = {k[0] for k in values}
    has_model = bool(tops & set(MODEL_KEYS))
    model_part = {k[1:]: v for k, v in values.items() if k[0] in MODEL_KEYS and len(k) > 1} \
        if has_model else dict(values)
    model_part = _strip_value(model_part)
    model = {"/".join(k): a for k, (a, _) in model_part.items()}
    keys = {"/".join(k): impl for k, (_, impl) in model_part.items() if impl}
    state = TrainingState(framework="jax", model=model,
                          metadata={"source": "orbax", "path": folder})
    opt_part = _strip_value({k[1:]: v for k, v in values.items() if k[0] in OPTIMIZER_KEYS and len(k) > 1})
    if opt_part:
        slots: dict[str, dict[str, np.ndarray]] = {}
        others: dict[str, np.ndarray] = {}
        for k, (arr, _) in opt_part.items():
            name = "/".join(k)
            where = split_name(name, arr, model)
            if where is None:
                others[name] = arr
            else:
                slots.setdefault(where[0], {})[where[1]] = arr
        state.optimizer = OptimizerState(kind="optax", slots=slots,
                                         extra={"leaves": others, "container": "orbax"})
    for k, (arr, _) in values.items():
        if k[0] in STEP_KEYS and len(k) == 1 and arr.ndim == 0 and arr.dtype.kind in "iu":
            state.step = int(arr)
    if state.optimizer is not None:
        state.optimizer.step = state.step
    rest = {"/".join(k): a for k, (a, _) in values.items()
            if has_model and k[0] not in MODEL_KEYS + OPTIMIZER_KEYS + STEP_KEYS}
    state.extra = {"jax": {"keys": keys}}
    if rest:
        state.extra["orbax"] = rest
    return state


# --- writing ----------------------------------------------------------------------------------


def _whole(value: Any, name: str) -> np.ndarray:
    """The whole array of a leaf: blocks (a capture's, or a load's that covers the array) are
    put together; blocks that leave part of it out are refused."""
    from ckptcore.sharding import Chunks, Shard

    if not isinstance(value, (Shard, Chunks)):
        return np.asarray(value)
    parts = value.parts if isinstance(value, Chunks) else (value,)
    first = parts[0]
    out = np.empty(first.global_shape, first.dtype)
    covered = np.zeros(first.global_shape, bool)
    for part in parts:
        out[part.index()] = part.data
        covered[part.index()] = True
    if not covered.all():
        raise SchemaError(f"{name}: holds only blocks of a sharded array ({int(covered.sum())} of "
                          f"{covered.size} elements): load the checkpoint without like= to export "
                          "whole arrays")
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        parts = name.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _default_tree(state: TrainingState) -> dict[str, Any]:
    tree: dict[str, Any] = {"params": _nested({n: _whole(a, n) for n, a in state.model.items()})}
    if state.optimizer is not None:
        flat = {f"{s}/{p}": _whole(a, f"{p}/{s}") for p, slots in state.optimizer.slots.items()
                for s, a in slots.items()}
        flat.update({n: _whole(a, n) for n, a in (state.optimizer.extra.get("leaves") or {}).items()})
        tree["opt_state"] = _nested(flat)
    tree["step"] = np.int64(state.step)
    return tree


def _from_target(state: TrainingState, target: Any) -> Any:
    """``target``'s structure with every leaf taken from ``state`` (its dtype and sharding)."""
    import jax

    from ._optimizer import split_name
    from ._tensors import is_key, path_name

    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    others = dict(state.optimizer.extra.get("leaves") or {}) if state.optimizer else {}
    keys = dict((state.extra.get("jax") or {}).get("keys") or {})
    missing = []
    # The parameters' global shapes, which say which optimizer leaves are their slots (a sharded
    # parameter is a Shard/Chunks leaf: its own .shape, if any, is a block's).
    shapes = {n: jax.ShapeDtypeStruct(getattr(v, "global_shape", np.shape(v)), np.float32)
              for n, v in state.model.items()}
    for path, like in flat:
        full = path_name(path)
        top, _, rest = full.partition("/")
        value, impl = None, None
        if top in MODEL_KEYS:
            value, impl = state.model.get(rest), keys.get(rest)
        elif top in OPTIMIZER_KEYS and state.optimizer is not None:
            where = split_name(rest, like, shapes)
            value = (state.optimizer.slots.get(where[0]) or {}).get(where[1]) if where else others.get(rest)
        elif top in STEP_KEYS and not rest:
            value = np.asarray(state.step, dtype=np.asarray(like).dtype)
        if value is None:
            missing.append(full)
            leaves.append(like)
            continue
        value = _whole(value, full)
        if is_key(like):
            value = jax.random.wrap_key_data(value, impl=impl or str(jax.random.key_impl(like)))
        elif np.dtype(getattr(like, "dtype", np.asarray(like).dtype)) != value.dtype or \
                tuple(np.shape(like)) != value.shape:
            raise SchemaError(f"{full}: the state holds {value.dtype}{list(value.shape)}, the target "
                             f"{np.asarray(like).dtype}{list(np.shape(like))}")
        if isinstance(like, jax.Array):
            value = jax.device_put(value, like.sharding)
        leaves.append(value)
    if missing:
        raise SchemaError(f"export_orbax: the state has nothing for {', '.join(missing[:20])} of "
                          "the target")
    return jax.tree_util.tree_unflatten(treedef, leaves)


def export_orbax(state: TrainingState, path: str | os.PathLike, *, target: Any = None,
                 zarr3: bool = False, ocdbt: bool = True, overwrite: bool = False,
                 **options: Any) -> str:
    """Write ``state`` as an Orbax checkpoint at ``path`` (see the module's docstring); returns
    the path.  ``target``: the pytree Orbax will restore into (its structure is written).
    Something already at ``path`` is a CheckpointExistsError unless ``overwrite``: then Orbax
    removes it first (``force=True``, logged; not atomic, as in Orbax)."""
    if options:
        raise TypeError(f"export_orbax does not take {', '.join(sorted(options))}")
    dst = os.path.abspath(os.fspath(path))
    if os.path.lexists(dst):
        if not overwrite:
            raise CheckpointExistsError(f"{dst}: already exists; export_orbax(..., overwrite=True) "
                                        "replaces it (or remove it first)")
        log.info("export_orbax: replacing %s (Orbax removes it, then writes)", dst)
    import orbax.checkpoint as ocp

    tree = _default_tree(state) if target is None else _from_target(state, target)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(dst, args=ocp.args.PyTreeSave(tree), force=overwrite)
    return dst


def _read(src: str, model: Any = None, optimizer: Any = None, **options: Any) -> TrainingState:
    return import_orbax(src, **{k: v for k, v in options.items() if v is not None})


def _write(state: TrainingState, dst: str, model: Any = None, optimizer: Any = None,
           **options: Any) -> str:
    return export_orbax(state, dst, **{k: v for k, v in options.items() if v is not None})


FORMATS = (
    FileFormat(name="orbax", framework="jax",
               description="an Orbax checkpoint (StandardCheckpointer/CheckpointManager step; OCDBT "
                           "or not, zarr v2 or zarr3), read through TensorStore",
               detect=is_orbax, read=_read, write=_write),
)
