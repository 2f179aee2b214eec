"""Framework-neutral :class:`~ckptcore.state.ParamInfo` for each parameter of a Paddle layer tree.

Layers are recognised by class name, so this module needs no Paddle import.  Kinds and roles are
the shared vocabulary of :mod:`ckptcore.vocab`, so migration can match a Paddle model with another
framework's by order, kind and shape.  Layouts name the axes of Paddle's arrays: ``io`` for Linear,
``oik`` / ``oihw`` / ``oidhw`` for convolutions (a depthwise one is a grouped ``oihw``:
``(in*M, 1, h, w)``), ``iok`` / ``iohw`` for transposed ones, ``o`` for biases, ``vd`` for
embeddings.  Recurrent weights are ``(gates*hidden, in)`` (``attrs["axes"] == "oi"``) and their
layout is the gate order: ``ifco`` for LSTM, ``rzc`` for GRU.  A ``MultiHeadAttention`` is one
layer, as the torch and Keras adapters describe theirs: its ``q_proj``/``k_proj``/``v_proj``/
``out_proj`` Linear sublayers belong to it, with roles ``query_kernel``/``query_bias``, ``key_*``,
``value_*`` and ``output_kernel``/``output_bias`` (layout ``io``, ``[in, heads*head_dim]`` flattened
head-major, and ``o``), ``attrs["projection"]`` ``query``/``key``/``value``/``attention_output``, and
``embed_dim``, ``num_heads``, ``head_dim``, ``kdim``, ``vdim`` from the layer.

A layer family the vocabulary has no word for keeps its class name in snake case as its kind, so two
Paddle models still match each other.

Structure (what feeds what): a dygraph layer has no static graph, so it is traced.  The model runs
once, in eval mode, on a small zero input shaped for its first parameter-owning layer (a
``Linear``'s ``in_features``, a convolution's channels at a few spatial sizes); forward hooks note
the order layers run and which parameter-owning layers' outputs reach each one through the autograd
graph (``Tensor.grad_fn``), whatever functional ops (``+``, ``concat``, ``F.relu``) lie between.
Each parameter's ``attrs["order"]`` and ``attrs["inputs"]`` hold that; when no probe input runs the
model, neither is recorded and migration treats the structure as unknown.
"""

from __future__ import annotations

import logging
import math
import re
import weakref
from typing import Any, Iterable, Mapping

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role, plain

_log = logging.getLogger("ckptcore")

_CONV = {"Conv1D": (Kind.CONV1D, "oik"), "Conv2D": (Kind.CONV2D, "oihw"), "Conv3D": (Kind.CONV3D, "oidhw"),
         "Conv1DTranspose": (Kind.CONV1D_TRANSPOSE, "iok"), "Conv2DTranspose": (Kind.CONV2D_TRANSPOSE, "iohw"),
         "Conv3DTranspose": (Kind.CONV3D_TRANSPOSE, "iodhw")}
_BATCH_NORM = {"BatchNorm", "BatchNorm1D", "BatchNorm2D", "BatchNorm3D", "SyncBatchNorm"}
_NORM_ROLES = {"weight": Role.GAMMA, "scale": Role.GAMMA, "bias": Role.BETA,
               "_mean": Role.MOVING_MEAN, "_variance": Role.MOVING_VARIANCE}
_RNN = {"LSTM": (Kind.LSTM, "ifco"), "GRU": (Kind.GRU, "rzc"), "SimpleRNN": (Kind.SIMPLE_RNN, None),
        "LSTMCell": (Kind.LSTM, "ifco"), "GRUCell": (Kind.GRU, "rzc"), "SimpleRNNCell": (Kind.SIMPLE_RNN, None)}
_RNN_ROLES = {"weight_ih": Role.KERNEL, "weight_hh": Role.RECURRENT_KERNEL,
              "bias_ih": Role.BIAS, "bias_hh": Role.RECURRENT_BIAS}
_RNN_NAME = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh)(?:_l(\d+))?(_reverse)?$")
# MultiHeadAttention's Linear sublayers, as the projections of the one attention layer:
# sublayer -> (role prefix, attrs["projection"]).  Their weights are [in, out] ("io").
_MHA_PROJ = {"q_proj": ("query", "query"), "k_proj": ("key", "key"), "v_proj": ("value", "value"),
             "out_proj": ("output", "attention_output")}
# Layers that keep a feature map's channel count: a Linear after them still reads that map.
# Paddle's InstanceNorm layers: a family the shared vocabulary has no word for (see the docstring).
_NORMS = (Kind.BATCH_NORM, Kind.LAYER_NORM, Kind.GROUP_NORM, Kind.INSTANCE_NORM)
_PASS_THROUGH = {"MaxPool2D", "AvgPool2D", "AdaptiveAvgPool2D", "AdaptiveMaxPool2D", "ReLU", "ReLU6",
                 "LeakyReLU", "Sigmoid", "Tanh", "GELU", "Swish", "Silu", "Hardswish", "ELU",
                 "Dropout", "Dropout2D", "Flatten", "Identity"}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def describe_params(model: Any, canonical: Iterable[str] | Mapping[str, Any]) -> dict[str, ParamInfo]:
    """ParamInfo for every name in ``canonical`` (structured names), walking ``model`` in layer order.

    ``index`` counts only layers that own at least one described parameter.  Given the tensors
    themselves (``{name: tensor}``, as ``named_tensors`` returns them), the result is cached on
    ``model`` (see ``_cached``): a save of the same model describes it once, not once per save.
    The ParamInfo objects are shared between the results (they are frozen).
    """
    key = _cache_key(canonical)
    if key is not None:
        hit = _cached(model, key)
        if hit is not None:
            return dict(hit)
    wanted = set(canonical)
    out: dict[str, ParamInfo] = {}
    index = 0
    owners: dict[int, str] = {}   # id(layer) -> path, for the layers that own described parameters
    facts: list[tuple[Any, str, Any, tuple]] = []  # (layer ref, class, spatial, facts) per owner
    spatial: tuple[int, str] | None = None  # (channels, data_format) of the last 2-D feature map
    claimed: set[int] = set()   # sublayers described as part of another layer (attention projections)
    for path, layer in model.named_sublayers(include_self=True):
        if id(layer) in claimed:
            continue
        cls = type(layer).__name__
        own = _own_entries(layer)
        if cls == "MultiHeadAttention":
            for sub in _MHA_PROJ:
                part = getattr(layer, sub, None)
                if part is not None and hasattr(part, "named_parameters"):
                    claimed.add(id(part))
                    own += [f"{sub}.{n}" for n in _own_entries(part)]
        names = [(n, f"{path}.{n}" if path else n) for n in own]
        names = [(n, full) for n, full in names if full in wanted]
        if names:
            kind, layout, attrs = these = _layer_facts(layer, cls, spatial)
            owners[id(layer)] = path
            facts.append((layer, cls, spatial, these))
            for short, full in names:
                out[full] = _param(index, path, kind, layout, attrs, short, layer)
            index += 1
        spatial = _next_spatial(layer, cls, spatial)
    structure = _structure(model, owners)
    if structure is not None:
        for full, info in out.items():
            order, inputs = structure.get(info.layer, (-1, []))
            info.attrs["order"], info.attrs["inputs"] = order, list(inputs)
    if key is not None:
        _remember(model, key, facts, out)
    return out


def _own_entries(layer: Any) -> list[str]:
    own = [n for n, _ in layer.named_parameters(include_sublayers=False)]
    return own + [n for n, _ in layer.named_buffers(include_sublayers=False)
                  if n not in getattr(layer, "_non_persistable_buffer_names_set", ())]


# ----------------------------------------------------------------------------- the cache
#
# Describing a model walks every sublayer and builds a ParamInfo per tensor: about 2 ms for
# mobilenet_v2's 262 tensors, a fifth of a capture.  A ParamInfo depends on the tensor's name, its
# shape and dtype, and on its layer's facts (class, channels, kernel, epsilon...) and structure.
# So the result is reused while the names, the tensor objects with their shapes and dtypes, and
# every owning layer's facts (recomputed: cheap) are what they were; anything else (a parameter
# replaced, added, reshaped or re-typed, a layer replaced or reconfigured) describes the model
# afresh.  The structure probe has its own cache (``_structure``).
_DESCRIBED: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def _cache_key(canonical: Any) -> tuple | None:
    if not isinstance(canonical, Mapping):
        return None  # names alone say nothing about the tensors: describe afresh
    try:
        return tuple((name, id(t), tuple(t.shape), t.dtype) for name, t in canonical.items())
    except (AttributeError, TypeError):
        return None


def _cached(model: Any, key: tuple) -> dict[str, ParamInfo] | None:
    try:
        entry = _DESCRIBED.get(model)
    except TypeError:
        return None
    if entry is None or entry[0] != key:
        return None
    for ref, cls, spatial, facts in entry[1]:
        layer = ref()
        if layer is None or type(layer).__name__ != cls or _layer_facts(layer, cls, spatial) != facts:
            return None
    return entry[2]


def _remember(model: Any, key: tuple, facts: list[tuple[Any, str, Any, tuple]],
              out: dict[str, ParamInfo]) -> None:
    try:
        refs = [(weakref.ref(layer), cls, spatial, these) for layer, cls, spatial, these in facts]
        _DESCRIBED[model] = (key, refs, dict(out))
    except TypeError:  # a model or layer that cannot be weakly referenced: no caching
        pass


def _probe_inputs(model: Any, owners: dict[int, str]) -> list[Any]:
    """Zero-input shapes worth a forward pass: the input each parameter-owning layer would take if it
    came first (a model need not define its first layer first), in definition order, deduplicated."""
    out: list[Any] = []
    for _, layer in model.named_sublayers(include_self=True):
        if id(layer) not in owners:
            continue
        cls = type(layer).__name__
        if cls == "Linear":   # a feature vector, or a sequence of them
            shapes: list[Any] = [[2, int(layer.weight.shape[0])], [2, 5, int(layer.weight.shape[0])]]
        elif cls == "MultiHeadAttention":   # self-attention on a sequence
            shapes = [[2, 5, int(layer.embed_dim)]]
        elif cls in ("Conv1D", "Conv2D", "Conv3D"):
            c, last = int(layer._in_channels), str(layer._data_format).endswith("C")
            nd = {"Conv1D": 1, "Conv2D": 2, "Conv3D": 3}[cls]
            sizes = (32, 28, 64, 224) if nd == 2 else (32, 16, 64)
            shapes = [[2] + ([s] * nd + [c] if last else [c] + [s] * nd) for s in sizes]
        elif cls == "Embedding":
            shapes = [("int64", [2, 8])]
        else:
            shapes = []
        out.extend(x for x in shapes if x not in out)
        if len(out) >= 16:   # a bound on failed forward passes (each fails fast, at a shape check)
            break
    return out


def _structure(model: Any, owners: dict[int, str]) -> dict[str, tuple[int, list[str]]] | None:
    """``path -> (position in run order, paths of the parameter-owning layers feeding it)``, or None.

    Cached on the model per set of layers: the trace is one forward pass, saves are many."""
    key = tuple(sorted(owners.values()))
    cached = getattr(model, "__dict__", {}).get("_ckptcore_structure")
    if cached is not None and cached[0] == key:
        return cached[1]
    result = None
    for shape in _probe_inputs(model, owners):
        result = _trace(model, owners, shape)
        if result is not None:
            break
    if result is None:
        _log.info("ckptcore: no probe input runs %s; its layer structure is recorded as unknown "
                  "(migration then refuses ambiguous pairings)", type(model).__name__)
    try:
        model.__dict__["_ckptcore_structure"] = (key, result)
    except (AttributeError, TypeError):
        pass
    return result


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if hasattr(value, "grad_fn") else []


def _node_id(node: Any) -> int:
    ptr = getattr(node, "node_ptr", None)
    return int(ptr()) if callable(ptr) else id(node)


def _trace(model: Any, owners: dict[int, str], shape: Any) -> dict[str, tuple[int, list[str]]] | None:
    import paddle  # only called with a live Paddle layer

    produced: dict[int, str] = {}     # grad node of a layer's output -> that layer's path
    found: dict[str, tuple[int, list[str]]] = {}

    def feeders(tensors: list[Any]) -> list[str]:
        out: list[str] = []
        seen: set[int] = set()
        stack = [t.grad_fn for t in tensors if getattr(t, "grad_fn", None) is not None]
        while stack:
            node = stack.pop()
            nid = _node_id(node)
            if nid in seen:
                continue
            seen.add(nid)
            if nid in produced:
                if produced[nid] not in out:
                    out.append(produced[nid])
                continue
            stack.extend(n for n in (node.next_functions or ()) if n is not None)
        return sorted(out)

    def pre(layer: Any, inputs: Any) -> None:
        path = owners[id(layer)]
        if path not in found:
            found[path] = (len(found), feeders(_tensors(inputs)))
        else:   # a shared layer: every call's inputs
            found[path] = (found[path][0], sorted(set(found[path][1]) | set(feeders(_tensors(inputs)))))

    def post(layer: Any, inputs: Any, outputs: Any) -> None:
        for t in _tensors(outputs):
            if getattr(t, "grad_fn", None) is not None:
                produced.setdefault(_node_id(t.grad_fn), owners[id(layer)])

    layers = [(l, l.training) for _, l in model.named_sublayers(include_self=True)]
    hooks = []
    try:
        for layer, _ in layers:
            if id(layer) in owners:
                hooks.append(layer.register_forward_pre_hook(pre))
                hooks.append(layer.register_forward_post_hook(post))
        model.eval()
        dtype, dims = shape if isinstance(shape, tuple) else ("float32", shape)
        x = paddle.zeros(dims, dtype=dtype)
        if dtype == "float32":
            x.stop_gradient = False   # every op on the way gets a grad node, even with frozen weights
        with paddle.enable_grad():    # the caller may be inside paddle.no_grad()
            model(x)
    except Exception as e:  # noqa: BLE001 - a probe that does not fit the model: try the next
        _log.debug("ckptcore: structure probe %s failed on %s: %s", shape, type(model).__name__, e)
        return None
    finally:
        for h in hooks:
            h.remove()
        for layer, training in layers:
            layer.training = training
    if set(found) != set(owners.values()):
        return None   # some layers never ran on the probe: a partial structure would mislead
    return found


def _layer_facts(layer: Any, cls: str, spatial: tuple[int, str] | None) -> tuple[str, str | None, dict]:
    if cls == "Linear":
        in_f, out_f = (int(d) for d in layer.weight.shape)
        attrs: dict[str, Any] = {"in_features": in_f, "out_features": out_f}
        if spatial is not None:
            attrs.update(_flatten_facts(in_f, *spatial))
        return Kind.DENSE, "io", attrs
    if cls in _CONV:
        kind, layout = _CONV[cls]
        cin, cout, groups = int(layer._in_channels), int(layer._out_channels), int(layer._groups)
        attrs = {"in_channels": cin, "out_channels": cout, "groups": groups,
                 "kernel_size": [int(k) for k in layer._kernel_size], "data_format": layer._data_format}
        if kind == Kind.CONV2D and groups == cin and groups > 1 and cout % cin == 0:
            kind, attrs["depth_multiplier"] = Kind.DEPTHWISE_CONV2D, cout // cin
        return kind, layout, attrs
    if cls in _BATCH_NORM:
        return Kind.BATCH_NORM, None, {"momentum": float(layer._momentum), "epsilon": float(layer._epsilon),
                                    "data_format": getattr(layer, "_data_format", "NCHW")}
    if cls == "LayerNorm":
        return Kind.LAYER_NORM, None, {"epsilon": float(layer._epsilon),
                                    "normalized_shape": [int(d) for d in layer._normalized_shape]}
    if cls in ("GroupNorm", "InstanceNorm1D", "InstanceNorm2D", "InstanceNorm3D"):
        kind = Kind.INSTANCE_NORM if cls.startswith("InstanceNorm") else Kind.GROUP_NORM
        return kind, None, {"epsilon": float(layer._epsilon)}
    if cls == "Embedding":
        return Kind.EMBEDDING, None, {"num_embeddings": int(layer._num_embeddings),
                                   "embedding_dim": int(layer._embedding_dim),
                                   "padding_idx": None if layer._padding_idx is None else int(layer._padding_idx)}
    if cls in _RNN:
        kind, gates = _RNN[cls]
        attrs = {"axes": "oi", "gate_order": gates}
        for a in ("input_size", "hidden_size", "num_layers", "num_directions", "proj_size"):
            if isinstance(getattr(layer, a, None), int):
                attrs[a] = getattr(layer, a)
        return kind, gates, attrs
    if cls == "MultiHeadAttention":
        e, h = int(layer.embed_dim), int(layer.num_heads)
        return Kind.MULTI_HEAD_ATTENTION, None, {"embed_dim": e, "num_heads": h, "head_dim": int(layer.head_dim),
                                                 "kdim": int(layer.kdim), "vdim": int(layer.vdim)}
    return _snake(cls), None, {"class": cls}


def _param(index: int, path: str, kind: str, layout: str | None, attrs: dict, short: str,
           layer: Any) -> ParamInfo:
    attrs = plain(attrs)  # a fresh dict of plain values (layer attributes may be numpy scalars)
    if kind in _NORMS:
        return ParamInfo(index, path, kind, _NORM_ROLES.get(short, short), None, attrs)
    if kind == Kind.EMBEDDING:
        return ParamInfo(index, path, kind, Role.EMBEDDINGS if short == "weight" else short,
                         "vd" if short == "weight" else None, attrs)
    if kind in (Kind.LSTM, Kind.GRU, Kind.SIMPLE_RNN):
        m = _RNN_NAME.match(short)
        if m:
            attrs["layer_index"] = int(m.group(2) or 0)
            attrs["direction"] = "reverse" if m.group(3) else "forward"
            return ParamInfo(index, path, kind, _RNN_ROLES[m.group(1)], layout, attrs)
        return ParamInfo(index, path, kind, short, layout, attrs)
    if kind == Kind.MULTI_HEAD_ATTENTION:
        sub, _, what = short.partition(".")
        if sub in _MHA_PROJ and what in ("weight", "bias"):
            prefix, attrs["projection"] = _MHA_PROJ[sub]
            if what == "weight":
                return ParamInfo(index, path, kind, f"{prefix}_kernel", "io", attrs)
            return ParamInfo(index, path, kind, f"{prefix}_bias", "o", attrs)
        return ParamInfo(index, path, kind, short.lstrip("_"), None, attrs)
    if short == "weight":
        return ParamInfo(index, path, kind, Role.KERNEL, layout, attrs)
    if short == "bias":
        return ParamInfo(index, path, kind, Role.BIAS, "o", attrs)
    return ParamInfo(index, path, kind, short.lstrip("_"), None, attrs)


def _flatten_facts(in_features: int, channels: int, data_format: str) -> dict[str, Any]:
    """What a Linear right after a 2-D feature map (conv, pooling, flatten) reads, when it can be told.

    As in the Keras adapter, ``input_shape`` is the feature map in flattening order (``[C, H, W]``
    for NCHW) and ``input_order`` its channel position.  Only the channel count is known without
    running the model, so the map is recorded when ``in_features`` is ``channels * s * s`` for an
    integer ``s`` (square maps, the common case), and ``inferred`` says it was deduced.
    """
    if channels <= 0 or in_features % channels:
        return {}
    hw = in_features // channels
    side = math.isqrt(hw)
    order = "channels_last" if data_format.endswith("C") else "channels_first"
    facts: dict[str, Any] = {"input_order": order, "input_channels": channels, "inferred": True}
    if side * side == hw:
        facts["input_shape"] = [channels, side, side] if order == "channels_first" else [side, side, channels]
    return facts


def _next_spatial(layer: Any, cls: str, spatial: tuple[int, str] | None) -> tuple[int, str] | None:
    if cls == "MultiHeadAttention":   # its projections (claimed sublayers) are Linear layers
        return None
    if cls in ("Conv2D", "Conv2DTranspose"):
        return int(layer._out_channels), str(layer._data_format)
    if cls in _BATCH_NORM or cls in _PASS_THROUGH or cls.startswith("InstanceNorm") or cls == "GroupNorm":
        return spatial
    if cls in ("Sequential", "LayerList", "LayerDict") or not list(layer.named_parameters(include_sublayers=False)):
        # containers and parameter-free layers (the model itself, custom blocks) don't change what we know
        return spatial
    return None
