"""Framework-neutral :class:`~ckptcore.ParamInfo` for every variable of a Keras model.

``kind`` names the layer family (``dense``, ``conv2d``, ``batch_norm``, ``lstm``...),
``role`` the variable's part in it (``kernel``, ``bias``, ``moving_mean``...), and
``layout`` its axis order (``io``, ``hwio``, ``hwoi``...) or, for recurrent
layers, the gate order (``ifco``, ``zrh``).  ``index`` is the ordinal of the
layer among the layers that own weights, in model order (depth first), so that
two frameworks' lists can be aligned; seed states and custom variables get -1.

Structure: for a functional or Sequential model, ``attrs["inputs"]`` lists the paths of the
weight-owning layers whose outputs reach this layer through parameter-free layers (read from the
graph: ``layer._inbound_nodes``, ``node.parent_nodes``), and ``attrs["order"]`` the layer's position
in a topological order of that graph.  A layer outside any graph (a subclassed model) leaves both
out, which migration reads as "structure unknown".
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role, plain

from ._tensors import layer_path, raw_owners, walk_layers

_KINDS = {
    "Dense": Kind.DENSE, "EinsumDense": Kind.EINSUM_DENSE, "Embedding": Kind.EMBEDDING,
    "Conv1D": Kind.CONV1D, "Conv2D": Kind.CONV2D, "Conv3D": Kind.CONV3D,
    "DepthwiseConv1D": Kind.DEPTHWISE_CONV1D, "DepthwiseConv2D": Kind.DEPTHWISE_CONV2D,
    "SeparableConv1D": Kind.SEPARABLE_CONV1D, "SeparableConv2D": Kind.SEPARABLE_CONV2D,
    "Conv1DTranspose": Kind.CONV1D_TRANSPOSE, "Conv2DTranspose": Kind.CONV2D_TRANSPOSE,
    "Conv3DTranspose": Kind.CONV3D_TRANSPOSE,
    "BatchNormalization": Kind.BATCH_NORM, "LayerNormalization": Kind.LAYER_NORM,
    "GroupNormalization": Kind.GROUP_NORM, "UnitNormalization": Kind.UNIT_NORM,
    "LSTM": Kind.LSTM, "GRU": Kind.GRU, "SimpleRNN": Kind.SIMPLE_RNN,
    "MultiHeadAttention": Kind.MULTI_HEAD_ATTENTION, "PReLU": Kind.PRELU,
}
# Keras' kernel layouts, one letter per axis (see ckptcore.vocab for the letters).
_CONV = {Kind.CONV1D: "kio", Kind.CONV2D: "hwio", Kind.CONV3D: "dhwio",
         Kind.CONV1D_TRANSPOSE: "koi", Kind.CONV2D_TRANSPOSE: "hwoi", Kind.CONV3D_TRANSPOSE: "dhwoi",
         Kind.DEPTHWISE_CONV1D: "kim", Kind.DEPTHWISE_CONV2D: "hwim"}
_SEPARABLE = (Kind.SEPARABLE_CONV1D, Kind.SEPARABLE_CONV2D)
# Keras' gate orders: LSTM i, f, c, o; GRU z, r, h.
_GATES = {Kind.LSTM: "ifco", Kind.GRU: "zrh", Kind.SIMPLE_RNN: None}
_NORMS = (Kind.BATCH_NORM, Kind.LAYER_NORM, Kind.GROUP_NORM)
_CONV_ATTRS = ("kernel_size", "strides", "padding", "dilation_rate", "data_format", "groups",
               "depth_multiplier", "output_padding")
_NORM_ATTRS = ("axis", "epsilon", "momentum", "center", "scale", "groups")
# Layers a flattened feature map passes through unchanged on its way from Flatten to Dense.
_PASSTHROUGH = {"Dropout", "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "GaussianNoise",
                "GaussianDropout", "AlphaDropout", "ActivityRegularization", "Identity", "Masking"}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _reporting_layer(owner: Any, ancestors: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
    """The layer a variable is described under: an RNN for its cell, an MHA for its projections."""
    attrs: dict[str, Any] = {}
    parent = ancestors[-1] if ancestors else None
    if parent is not None and getattr(parent, "cell", None) is owner:
        owner, ancestors, parent = parent, ancestors[:-1], ancestors[-2] if len(ancestors) > 1 else None
        if parent is not None and type(parent).__name__ == "Bidirectional":
            attrs["direction"] = "backward" if getattr(parent, "backward_layer", None) is owner \
                else "forward"
        for key in ("units", "reset_after", "go_backwards", "return_sequences"):
            if hasattr(owner, key):
                attrs[key] = plain(getattr(owner, key))
    elif parent is not None and type(parent).__name__ == "MultiHeadAttention":
        attrs["projection"] = owner.name
        for key in ("num_heads", "key_dim", "value_dim"):
            attrs[key] = plain(getattr(parent, f"_{key}", None))
        owner = parent
    return owner, attrs


def _describe(kind: str, role: str, layer: Any, attrs: dict[str, Any]) -> str | None:
    if kind in _CONV or kind in _SEPARABLE:
        for key in _CONV_ATTRS:
            if hasattr(layer, key):
                attrs[key] = plain(getattr(layer, key))
    elif kind in _NORMS:
        for key in _NORM_ATTRS:
            if hasattr(layer, key):
                attrs[key] = plain(getattr(layer, key))
    if role == Role.BIAS and kind not in _GATES and kind != Kind.MULTI_HEAD_ATTENTION:
        return "o"
    if kind == Kind.DENSE and role == Role.KERNEL:
        return "io"
    if kind in _CONV and role == Role.KERNEL:
        return _CONV[kind]
    if kind in _SEPARABLE:
        spatial = "k" if kind == Kind.SEPARABLE_CONV1D else "hw"
        return {Role.DEPTHWISE_KERNEL: spatial + "im", Role.POINTWISE_KERNEL: spatial + "io"}.get(role)
    if kind == Kind.EMBEDDING and role == Role.EMBEDDINGS:
        return "vd"
    if kind in _GATES:
        if role in (Role.KERNEL, Role.RECURRENT_KERNEL):
            attrs["axes"] = "io"
        return _GATES[kind]
    if kind == Kind.MULTI_HEAD_ATTENTION:
        out = attrs.get("projection") == "attention_output"
        return {(Role.KERNEL, False): "ehd", (Role.BIAS, False): "hd",
                (Role.KERNEL, True): "hde", (Role.BIAS, True): "e"}.get((role, out))
    return None


def _flatten_input(layer: Any) -> list[int] | None:
    """The feature-map shape a Dense layer reads through a Flatten, in flattening order."""
    nodes = getattr(layer, "_inbound_nodes", None)
    node = nodes[0] if nodes else None
    for _ in range(16):
        parents = node.parent_nodes if node is not None else []
        if len(parents) != 1:
            return None
        node = parents[0]
        name = type(node.operation).__name__
        if name == "Flatten":
            shape = list(node.input_tensors[0].shape[1:])
            if len(shape) < 2 or any(d is None for d in shape):
                return None
            if getattr(node.operation, "data_format", None) == "channels_first":
                shape = shape[1:] + shape[:1]  # Flatten moves channels last before reshaping
            return [int(d) for d in shape]
        if name not in _PASSTHROUGH:
            return None
    return None


# model -> (its variables, their names, their ParamInfo): see describe_params.  Weak on the model,
# so a model that goes away takes its entry with it.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def describe_params(model: Any, names: dict[int, str],
                    variables: Sequence[Any] | None = None) -> dict[str, ParamInfo]:
    """``ParamInfo`` for every variable named in ``names`` (``id(variable) -> name``).

    With ``variables`` (the objects whose ids ``names`` holds, in model order), the result is
    kept for the next call on the same model: a ParamInfo follows from a layer's class and
    configuration and from the graph, which do not change while the model keeps the same
    variables under the same names, and computing it walks every layer and the whole graph
    (about a third of a capture of a real model).  Any change of the variables (a model that
    built more layers, lost one, or replaced a variable) or of their names computes it afresh;
    the entry holds the variables themselves, so that ids are never reused while it lives.
    Every call returns new ParamInfo objects (the caller's state may be changed freely).
    """
    if variables is None:
        return _describe_params(model, names)
    key = tuple(names[id(v)] for v in variables)
    try:
        hit = _CACHE.get(model)
    except TypeError:  # an unhashable or not weakly referenceable model: nothing to keep
        return _describe_params(model, names)
    if hit is not None and hit[1] == key and len(hit[0]) == len(variables) \
            and all(a is b for a, b in zip(hit[0], variables)):
        return {name: _copy(info) for name, info in hit[2].items()}
    out = _describe_params(model, names)
    _CACHE[model] = (tuple(variables), key, {name: _copy(info) for name, info in out.items()})
    return out


def _copy(info: ParamInfo) -> ParamInfo:
    attrs = {k: list(v) if isinstance(v, list) else v for k, v in info.attrs.items()}
    return ParamInfo(index=info.index, layer=info.layer, kind=info.kind, role=info.role,
                     layout=info.layout, attrs=attrs)


def _describe_params(model: Any, names: dict[int, str]) -> dict[str, ParamInfo]:
    out: dict[str, ParamInfo] = {}
    index = -1
    raw = raw_owners(model)
    for layer, ancestors in walk_layers(model):
        own = [(v, False) for v in list(layer._trainable_variables) + list(layer._non_trainable_variables)]
        own += [(sg.state, True) for sg in getattr(layer, "_seed_generators", ())]
        own = [(v, seed) for v, seed in own if id(v) in names and names[id(v)] not in out]
        if not own:
            continue
        rep, attrs = _reporting_layer(layer, ancestors)
        kind = _KINDS.get(type(rep).__name__, _snake(type(rep).__name__))
        if any(not seed for _, seed in own):
            index += 1
        if kind == Kind.DENSE:
            shape = _flatten_input(rep)
            if shape is not None:
                attrs.update(input_shape=shape, input_order="channels_last")
        for var, seed in own:
            a = dict(attrs)
            if seed:
                out[names[id(var)]] = ParamInfo(index=-1, layer=layer_path(rep), kind=kind,
                                                role=Role.SEED_STATE, attrs=a)
                continue
            role = var.name
            if "projection" in a:
                role = f"{a['projection']}_{var.name}" if a["projection"] != "attention_output" \
                    else f"output_{var.name}"
            layout = _describe(kind, var.name, rep, a)
            out[names[id(var)]] = ParamInfo(index=index, layer=layer_path(rep), kind=kind,
                                            role=role, layout=layout, attrs=a)
    _add_structure(model, out)
    for vid, name in names.items():
        if name not in out and vid in raw:
            out[name] = ParamInfo(index=-1, layer=layer_path(raw[vid]), kind=Kind.CUSTOM,
                                  role=name[len(layer_path(raw[vid])) + 1:])
    return out


def _graph_op(layer: Any, ancestors: tuple[Any, ...]) -> Any | None:
    """The layer that appears in the functional graph for ``layer`` (itself, or a wrapper such as
    Bidirectional); None outside any graph."""
    for cand in (layer, *reversed(ancestors)):
        if getattr(cand, "_inbound_nodes", None):
            return cand
    return None


def _add_structure(model: Any, out: dict[str, ParamInfo]) -> None:
    reps: dict[str, Any] = {}        # reporting-layer path -> its graph op (None: not in a graph)
    for layer, ancestors in walk_layers(model):
        rep, _ = _reporting_layer(layer, ancestors)
        path = layer_path(rep)
        if path in reps or not any(i.layer == path and i.index >= 0 for i in out.values()):
            continue
        anc = ancestors if rep is layer else ancestors[:-1]
        reps[path] = _graph_op(rep, anc)
    if not reps or any(op is None for op in reps.values()):
        return   # a subclassed model (or part of one): the structure is unknown
    op_paths: dict[int, list[str]] = {}
    for path, op in reps.items():
        op_paths.setdefault(id(op), []).append(path)

    def feeders(op: Any) -> list[str]:
        found: set[str] = set()
        seen: set[int] = set()
        stack = [p for node in op._inbound_nodes for p in node.parent_nodes]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            paths = op_paths.get(id(node.operation))
            if paths is not None:
                found.update(paths)
                continue
            stack.extend(node.parent_nodes)
        return sorted(found)

    inputs = {path: feeders(op) for path, op in reps.items()}
    for path, op in reps.items():   # layers sharing one graph op (Bidirectional) run in sequence
        inputs[path] = sorted(set(inputs[path]) - {path})
    order: dict[str, int] = {}
    pending = dict(inputs)
    while pending:   # Kahn's algorithm, ties in model order
        ready = [p for p, ins in pending.items() if all(i in order or i not in pending for i in ins)]
        if not ready:   # a cycle cannot come out of a functional graph, but never loop forever
            return
        for p in ready:
            order[p] = len(order)
            del pending[p]
    for info in out.values():
        if info.index >= 0 and info.layer in inputs:
            info.attrs["inputs"], info.attrs["order"] = list(inputs[info.layer]), order[info.layer]
