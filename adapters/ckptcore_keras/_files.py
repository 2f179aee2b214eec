"""Read and write ``tf.train.Checkpoint(model=..., optimizer=...)`` files as training states.

A checkpoint stores each variable once, under its shortest object path (trainable
weights under ``optimizer/_trainable_variables/<i>`` when the optimizer is saved
too), and the object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``) lists every path
to it.  The import walks that graph instead of parsing keys:

* model variables are the variable nodes reachable from ``model`` (not through
  its ``optimizer``); they are named by the Keras path recorded with them
  (``full_name``), or, when ``model=`` is given, by the same names
  :func:`ckptcore_keras.capture` gives the live model's variables;
* an optimizer list attribute with one entry per ``_trainable_variables`` holds a
  slot of each parameter (``_momentums/<i>`` belongs to ``_trainable_variables/<i>``);
  ``_accumulated_gradients`` are the ``gradient_accumulation_steps`` buffers.

The files are validated before TensorFlow's reader sees them (a crafted checkpoint can crash
or hang it; see ``_tf_bundle.py``): damage or hostile content raises a
:class:`ckptcore.errors.CheckpointError` naming the file and tensor.

TensorFlow checkpoints do not hold Keras seed-generator states (Dropout) nor
``keras.Variable`` objects kept in Python lists on a layer, so a state imported
from one restores into a model that has them only with ``strict=False``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import numpy as np

from ckptcore.adapter import check_url
from ckptcore.adapter import FileFormat
from ckptcore.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                             SchemaError, UnsafeCheckpointError)
from ckptcore.state import AccumulationState, OptimizerState, ScheduleState, TrainingState
from ckptcore.vocab import plain

from ._backend import require_tensorflow
from ._optimizer import ensure_built, unwrap, variable_roles
from ._params import describe_params
from ._tensors import named_tensors
from ._tf_bundle import (FIXED, GRAPH_KEY, MAX_STATE_BYTES, Bundle, Files, dtype_name, inside,
                         is_remote)

__all__ = ["import_tf_checkpoint", "export_tf_checkpoint", "FORMATS"]

_VALUE = "VARIABLE_VALUE"
_INSTEAD = ("ckptcore.save_state / load_state (and BackupAndRestore) work on every backend, and a "
            "state saved on one restores on another")
# Children of a model that hold training bookkeeping, not model state.
_SKIP = {"optimizer", "_loss_tracker", "_compile_metrics", "_compile_loss", "_metrics",
         "metrics", "_metrics_list", "_compiled_trainable_state"}
_OPT_FIXED = {"_variables", "_trainable_variables", "_trainable_variables_indices",
              "_iterations", "_learning_rate", "inner_optimizer", "_accumulated_gradients"}


class _Graph:
    """The object graph of one checkpoint, with values read on demand."""

    def __init__(self, bundle: Bundle):
        from tensorflow.core.protobuf import trackable_object_graph_pb2

        self.bundle = bundle
        self.proto = trackable_object_graph_pb2.TrackableObjectGraph()
        try:
            self.proto.ParseFromString(bundle.object_graph())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise CorruptCheckpointError(f"{bundle.prefix}: tensor {GRAPH_KEY!r} is not a "
                                         "TrackableObjectGraph", tensor=GRAPH_KEY) from e
        count = len(self.proto.nodes)
        if not count:
            raise SchemaError(f"{bundle.prefix}: the object graph ({GRAPH_KEY!r}) has no nodes")
        for i, node in enumerate(self.proto.nodes):
            for c in node.children:
                if not 0 <= c.node_id < count:
                    raise SchemaError(f"{bundle.prefix}: node {i} of the object graph ({GRAPH_KEY!r}) "
                                      f"has a child {c.local_name!r} at node {c.node_id}, but the graph "
                                      f"has {count} nodes")

    def children(self, node: int) -> dict[str, int]:
        return {c.local_name: c.node_id for c in self.proto.nodes[node].children}

    def attribute(self, node: int) -> Any:
        for a in self.proto.nodes[node].attributes:
            if a.name == _VALUE:
                return a
        return None

    def value(self, node: int) -> np.ndarray:
        return self.bundle.read(self.attribute(node).checkpoint_key, node)

    def leaf_name(self, node: int) -> str:
        return self.attribute(node).full_name.rsplit("/", 1)[-1]

    def variables(self, node: int, skip: set[str] = frozenset()) -> Iterator[tuple[int, list[str]]]:
        """``(variable node, path from node)`` depth first, each variable once.

        An explicit stack: a crafted graph can nest deeper than Python's recursion limit.
        """
        seen: set[int] = set()
        stack: list[tuple[int, list[str]]] = [(node, [])]
        while stack:
            n, path = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if self.attribute(n) is not None:
                yield n, path
            kids = [(name, child) for name, child in self.children(n).items()
                    if not (path == [] and name in skip)]
            stack.extend((child, path + [name]) for name, child in reversed(kids))

    def list_of_variables(self, node: int) -> dict[int, int] | None:
        """``{index: variable node}`` if ``node`` is a list of variables."""
        kids = self.children(node)
        if not kids or not all(k.isdigit() and self.attribute(v) is not None for k, v in kids.items()):
            return None
        return {int(k): v for k, v in kids.items()}


def resolve(prefix_or_dir: Any) -> tuple[str, str]:
    """``(prefix, directory its files must stay in)`` for a prefix or a CheckpointManager directory."""
    import tensorflow as tf
    from google.protobuf import text_format
    from tensorflow.python.training import checkpoint_state_pb2

    path = check_url(prefix_or_dir, "prefix_or_dir")
    if not (tf.io.gfile.isdir(path) if is_remote(path) else os.path.isdir(path)):
        return path, os.path.dirname(path) or "."
    files = Files(path)
    state_path = os.path.join(path, "checkpoint")
    size = files.size(state_path, "the 'checkpoint' state file", CheckpointNotFoundError(
        f"{path}: no TensorFlow checkpoint in this directory (no 'checkpoint' file naming one)"))
    if size > MAX_STATE_BYTES:
        raise CorruptCheckpointError(f"{state_path}: {size} bytes is too large for a checkpoint "
                                     "state file", file=state_path)
    state = checkpoint_state_pb2.CheckpointState()
    try:
        text_format.Parse(files.read(state_path, 0, size).decode("utf-8"), state)
    except (UnicodeDecodeError, text_format.ParseError) as e:
        raise CorruptCheckpointError(f"{state_path}: not a checkpoint state file: {e}",
                                     file=state_path) from e
    name = state.model_checkpoint_path
    if not name:
        raise CheckpointNotFoundError(f"{state_path}: names no checkpoint (empty model_checkpoint_path)")
    prefix = name if os.path.isabs(name) or is_remote(name) else os.path.join(path, name)
    if not inside(prefix, path):
        raise UnsafeCheckpointError(f"{state_path}: names the checkpoint {name!r}, which is outside "
                                    f"{path}; refusing to read it")
    return prefix, path


def _live_names(graph: _Graph, node: int, obj: Any, names: dict[int, str]) -> dict[int, str]:
    """Checkpoint variable node -> the live variable's state name, walking both graphs together."""
    out: dict[int, str] = {}
    seen: set[int] = set()

    def visit(n: int, live: Any) -> None:
        if n in seen or live is None:
            return
        seen.add(n)
        if graph.attribute(n) is not None:
            name = names.get(id(live)) or names.get(id(getattr(live, "value", None)))
            if name is not None:
                out[n] = name
            return
        try:
            kids = live._trackable_children(save_type="checkpoint")
        except (AttributeError, TypeError):
            return
        for local, child in graph.children(n).items():
            visit(child, kids.get(local))

    visit(node, obj)
    return out


def import_tf_checkpoint(prefix_or_dir: Any, *, model: Any = None,
                         optimizer: Any = None) -> TrainingState:
    """Read a ``tf.train.Checkpoint(model=..., optimizer=...)`` file as a :class:`TrainingState`.

    Args:
        prefix_or_dir: A checkpoint prefix (``.../ckpt-3``) or a
            ``tf.train.CheckpointManager`` directory (its latest checkpoint is read).
        model: Optional: the model the checkpoint belongs to.  Names then match
            :func:`ckptcore_keras.capture` exactly (including raw ``tf.Variable``
            attributes) and ``state.params`` is filled.  The model's values are not changed.
        optimizer: Optional: its optimizer (defaults to ``model.optimizer``; built over the
            model if it has not been).  Needed to read hyperparameters, the schedule and
            ``gradient_accumulation_steps``, and to place slots of optimizers whose slot
            lists TensorFlow does not track (Adafactor); otherwise slots are found
            through the lists parallel to ``_trainable_variables`` in the checkpoint.

    Raises:
        UnsupportedBackendError: Keras runs on JAX or PyTorch (``tf.train.Checkpoint`` files are
            TensorFlow's: read them in a process with ``KERAS_BACKEND=tensorflow``, save the
            state with ``ckptcore.save_state``; it restores on every backend).
        CheckpointNotFoundError: No checkpoint at ``prefix_or_dir``.
        IncompleteCheckpointError: A data shard is missing or shorter than the index says.
        CorruptCheckpointError: The index, a shard, a tensor or the state file is damaged.
        UnsafeCheckpointError: A file or the state file leads outside the checkpoint's
            directory, or is not a regular file (a FIFO would block forever).
        SchemaError: The object graph or a tensor does not fit a Keras model and optimizer
            (or, with ``model=``, a saved variable's shape or dtype differs from the model's).
        UnsupportedCheckpointError: Sliced (TF1 partitioned) tensors, unknown dtypes.

    Example:
        >>> state = ckptcore_keras.import_tf_checkpoint("/tmp/training_checkpoints")  # doctest: +SKIP
        >>> state.optimizer.slots["sequential/dense/kernel"]                           # doctest: +SKIP
    """
    require_tensorflow("ckptcore_keras.import_tf_checkpoint()", _INSTEAD)
    path, directory = resolve(prefix_or_dir)
    graph = _Graph(Bundle(path, directory))
    try:
        return _import(graph, path, model, optimizer)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        # The graph passed the structural checks but its objects do not fit together (a slot list
        # longer than the parameters, a non-scalar step...): it was not written by Keras.
        raise SchemaError(f"{path}: the object graph does not describe a Keras model and optimizer "
                          f"that ckptcore can read ({type(e).__name__}: {e})") from e


def _import(graph: _Graph, path: str, model: Any, optimizer: Any) -> TrainingState:
    import keras
    import tensorflow as tf

    root = graph.children(0)
    model_node = root.get("model")
    opt_node = root.get("optimizer")
    if opt_node is None and model_node is not None:
        opt_node = graph.children(model_node).get("optimizer")
    if optimizer is None and model is not None:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and model is not None and opt_node is not None:
        ensure_built(optimizer, model)  # its variables' order tells what each saved one is

    names: dict[int, str] = {}
    order: list[str] = []
    live: dict[int, str] = {}
    if model is not None and model_node is not None:
        live_vars = dict(named_tensors(model))
        live = _live_names(graph, model_node, model, {id(v): n for n, v in live_vars.items()})
        _check_live(graph, live, live_vars)
    if model_node is not None:
        for n, rel in graph.variables(model_node, _SKIP):
            name = live.get(n) or _checkpoint_name(graph, n, rel)
            if model is not None and n not in live:
                continue  # metric or other bookkeeping state the live model does not have
            name = _unique(name, names.values())
            names[n] = name
            order.append(name)
    state = TrainingState(framework="keras", model={names[n]: graph.value(n) for n in names},
                          extra={"keras": {"variables": order, "source": "tf.train.Checkpoint"}},
                          metadata={"versions": {"tensorflow": tf.__version__,
                                                 "keras": keras.__version__},
                                    "source": path})
    if model is not None:
        by_id = {id(v): n for n, v in named_tensors(model) if n in state.model}
        state.params = describe_params(model, by_id)
    if opt_node is not None:
        _import_optimizer(graph, opt_node, names, optimizer, state)
    return state


def _check_live(graph: _Graph, live: dict[int, str], live_vars: dict[str, Any]) -> None:
    """Each saved variable has its live counterpart's shape and dtype (TensorFlow's restore insists too)."""
    import keras
    import tensorflow as tf

    bundle = graph.bundle
    for n, name in live.items():
        key = graph.attribute(n).checkpoint_key
        entry = bundle.entry(key)
        var = live_vars[name]
        have = (tf.as_dtype(entry.dtype).name if entry.dtype in FIXED else dtype_name(entry.dtype),
                bundle.shape(entry))
        want = (keras.backend.standardize_dtype(getattr(var.dtype, "name", var.dtype)),
                tuple(int(d) for d in var.shape))
        if have != want:
            raise SchemaError(f"{bundle.prefix}: tensor {key!r} is {have[0]} {have[1]} in the checkpoint "
                              f"but the model's {name!r} is {want[0]} {want[1]}")


def _checkpoint_name(graph: _Graph, node: int, rel: list[str]) -> str:
    full = graph.attribute(node).full_name
    return full if "/" in full else "/".join(rel)  # raw tf.Variables have no Keras path


def _unique(name: str, used: Any) -> str:
    used = set(used)
    unique, k = name, 0
    while unique in used:
        k += 1
        unique = f"{name}#{k}"
    return unique


def _roles_from_graph(graph: _Graph, kids: dict[str, int], params: dict[int, int]) -> dict[int, tuple]:
    """Slot roles found in the checkpoint's own structure (lists parallel to the parameters)."""
    prefix = {i: graph.attribute(v).full_name.replace("/", "_") + "_" for i, v in params.items()}
    roles: dict[int, tuple] = {}
    known = {kids.get("_iterations"), kids.get("_learning_rate")} | set(params.values())
    for attr, child in kids.items():
        items = None if attr in _OPT_FIXED else graph.list_of_variables(child)
        if not items or max(items) >= len(params) or set(items.values()) & (known | set(roles)):
            continue
        for i, v in items.items():
            leaf = graph.leaf_name(v)
            roles[v] = ("slot", i, leaf[len(prefix[i]):] if leaf.startswith(prefix[i]) else attr.strip("_"))
    accum = graph.list_of_variables(kids["_accumulated_gradients"]) if "_accumulated_gradients" in kids else {}
    roles.update({v: ("accumulator", i) for i, v in (accum or {}).items()})
    attr_of = {v: a.strip("_") for a, v in kids.items() if graph.attribute(v) is not None}
    others = graph.list_of_variables(kids["_variables"]) if "_variables" in kids else {}
    for _, v in sorted((others or {}).items()):
        if v not in known and v not in roles:
            roles[v] = ("extra", attr_of.get(v, graph.leaf_name(v)))
    return roles


def _roles_from_live(graph: _Graph, kids: dict[str, int], inner_opt: Any) -> dict[int, tuple] | None:
    """Roles from the live optimizer: ``_variables/<i>`` is ``optimizer.variables[i]``.

    Needed for optimizers whose slot lists TensorFlow does not track (e.g. Adafactor).
    """
    saved = graph.list_of_variables(kids["_variables"]) if "_variables" in kids else None
    if inner_opt is None or not inner_opt.built or not saved:
        return None
    roles = variable_roles(inner_opt)
    if sorted(saved) != list(range(len(roles))):
        return None
    return {v: roles[i] for i, v in saved.items() if roles[i][0] in ("slot", "accumulator", "extra")}


def _import_optimizer(graph: _Graph, node: int, names: dict[int, str], optimizer: Any,
                      state: TrainingState) -> None:
    kids = graph.children(node)
    extra: dict[str, Any] = {}
    inner_opt, wrapper = unwrap(optimizer) if optimizer is not None else (None, None)
    if "inner_optimizer" in kids:
        outer = graph.list_of_variables(kids["_variables"]) if "_variables" in kids else {}
        extra["loss_scale"] = {"variables": {graph.leaf_name(v): graph.value(v)
                                             for _, v in sorted((outer or {}).items())}}
        if wrapper is not None:
            extra["loss_scale"]["config"] = {"initial_scale": float(wrapper.initial_scale),
                                             "dynamic_growth_steps": int(wrapper.dynamic_growth_steps)}
        node, kids = kids["inner_optimizer"], graph.children(kids["inner_optimizer"])
    params = graph.list_of_variables(kids["_trainable_variables"]) if "_trainable_variables" in kids else None
    params = params or {}
    pname = {i: names.get(v) or graph.attribute(v).full_name for i, v in params.items()}
    roles = _roles_from_live(graph, kids, inner_opt) or _roles_from_graph(graph, kids, params)
    slots: dict[str, dict[str, np.ndarray]] = {}
    buffers: dict[str, np.ndarray] = {}
    for v, role in sorted(roles.items()):
        if role[0] == "slot":
            slots.setdefault(pname[role[1]], {})[role[2]] = graph.value(v)
        elif role[0] == "accumulator":
            buffers[pname[role[1]]] = graph.value(v)
        else:
            extra.setdefault("variables", {})[role[1]] = graph.value(v)
    slots = {pname[i]: slots[pname[i]] for i in sorted(pname) if pname[i] in slots}  # parameter order
    raw = int(graph.value(kids["_iterations"])) if "_iterations" in kids else 0
    hyper: dict[str, Any] = plain(inner_opt.get_config()) if inner_opt is not None else {}
    if "_learning_rate" in kids:
        hyper["learning_rate"] = float(graph.value(kids["_learning_rate"]))
    every = 0
    if buffers:
        every = int((inner_opt.gradient_accumulation_steps or 0) if inner_opt is not None else 0)
        if not every:
            raise SchemaError("the checkpoint holds gradient-accumulation buffers: pass the "
                              "optimizer (built with gradient_accumulation_steps) as optimizer=")
        buffers = {pname[i]: buffers[pname[i]] for i in sorted(pname) if pname[i] in buffers}
        state.accumulation = AccumulationState(every=every, count=raw % every, buffers=buffers)
    kind = type(inner_opt).__name__.lower() if inner_opt is not None else _kind_from_name(
        graph.attribute(kids["_iterations"]).full_name if "_iterations" in kids else "")
    state.optimizer = OptimizerState(kind=kind, step=raw // every if every else raw,
                                     hyperparams=hyper, slots=slots, extra=extra)
    state.step = state.optimizer.step
    _import_schedule(inner_opt, raw, state)


def _import_schedule(inner_opt: Any, raw: int, state: TrainingState) -> None:
    if inner_opt is None:
        return
    from keras.optimizers.schedules import LearningRateSchedule

    sched = inner_opt._learning_rate
    if isinstance(sched, LearningRateSchedule):
        lr = float(np.asarray(sched(raw)))
        state.schedule = ScheduleState(kind=type(sched).__name__, config=plain(sched.get_config()),
                                       step=raw, last_lr=lr)
        state.optimizer.hyperparams["learning_rate"] = lr


def _kind_from_name(full_name: str) -> str:
    # Keras names optimizers snake_case(ClassName)[_N]: "adam_w_1" -> "adamw".
    return re.sub(r"_\d+$", "", full_name.split("/")[0]).replace("_", "")


def export_tf_checkpoint(state: TrainingState, prefix: Any, model: Any,
                         optimizer: Any = None, *, strict: bool = True) -> str:
    """Write ``state`` as a checkpoint that ``tf.train.Checkpoint(model=, optimizer=)`` restores.

    The state is restored into ``model`` and ``optimizer`` (which end up holding its
    values; global RNGs are left alone; a state of another framework is converted first),
    then written with ``tf.train.Checkpoint(model=model, optimizer=optimizer)``.  The file
    includes a ``save_counter``, so ``Checkpoint(...).restore(path).assert_consumed()``
    passes into a model whose optimizer is built.

    Returns:
        The path written (``prefix``).

    Raises:
        UnsupportedBackendError: Keras runs on JAX or PyTorch (the files are written by
            TensorFlow from the live TensorFlow variables).
        TypeError: ``model`` is missing (the files are named after the live objects).
        RestoreError: the state does not fit ``model`` (with ``strict``, also missing or
            unexpected names).

    Example:
        >>> ckptcore_keras.export_tf_checkpoint(state, "/tmp/tf/ckpt", model, opt)  # doctest: +SKIP
        '/tmp/tf/ckpt'
    """
    require_tensorflow("ckptcore_keras.export_tf_checkpoint()", _INSTEAD)
    if model is None:
        raise TypeError("export_tf_checkpoint needs the Keras model the checkpoint is written "
                        "from (model=...); its object graph names the files' tensors")
    import tensorflow as tf

    from ._capture import restore

    opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    restore(state, model, opt, strict=strict, rng=False, warn_data=False)  # files hold no cursor
    if opt is not None:
        ensure_built(opt, model)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt) if opt is not None \
        else tf.train.Checkpoint(model=model)
    _ = ckpt.save_counter  # created now so that it is written, as save() would
    return ckpt.write(os.fspath(prefix))


# -- the command line's view ------------------------------------------------------------------------

def _detect(path: str) -> bool:
    """Whether ``path`` is a checkpoint prefix (``<path>.index`` exists) or a
    ``tf.train.CheckpointManager`` directory (it holds a ``checkpoint`` state file).

    Looks at names only, through fsspec: asking never imports TensorFlow.
    """
    import fsspec

    try:
        fs, local = fsspec.core.url_to_fs(os.fspath(path))
        if fs.isdir(local):
            return fs.isfile(local.rstrip("/") + "/checkpoint")
        return fs.isfile(local + ".index")
    except (OSError, ValueError, ImportError):
        return False


def _no_options(options: dict[str, Any]) -> None:
    given = sorted(k for k, v in options.items() if v is not None)  # None: not on the command line
    if given:
        raise TypeError(f"the tf-checkpoint format takes no options, got {given}")


def _read(src: Any, model: Any = None, optimizer: Any = None, *, strict: bool | None = None,
          **options: Any) -> TrainingState:
    # Reading matches names only where a model is given, and never refuses a name: strict has
    # nothing to decide here (ckpt import --strict is accepted and changes nothing).
    _no_options(options)
    return import_tf_checkpoint(src, model=model, optimizer=optimizer)


def _write(state: TrainingState, dst: Any, model: Any = None, optimizer: Any = None, *,
           strict: bool | None = None, **options: Any) -> str:
    # --no-strict: a state that lacks some of the model's variables (a Dropout layer's seed
    # generator after an import without a model) is written with what it has.
    _no_options(options)
    return export_tf_checkpoint(state, dst, model, optimizer, strict=True if strict is None else strict)


FORMATS = (FileFormat(
    name="tf-checkpoint", framework="keras",
    description="tf.train.Checkpoint(model=, optimizer=) files (a prefix, or a "
                "tf.train.CheckpointManager directory)",
    detect=_detect, read=_read, write=_write, needs_model=True),)
