"""Framework-neutral :class:`~ckptcore.state.ParamInfo` for each parameter of a Paddle layer tree.

Layers are recognised by class name, so this module needs no Paddle import.  Kinds and roles are
the shared vocabulary of :mod:`ckptcore.vocab`, so migration can match a Paddle model with another
framework's by order, kind and shape.  Layouts name the axes of Paddle's arrays: ``io`` for Linear,
``oik`` / ``oihw`` / ``oidhw`` for convolutions (a depthwise one is a grouped ``oihw``:
``(in*M, 1, h, w)``), ``iok`` / ``iohw`` for transposed ones, ``o`` for biases, ``vd`` for
embeddings.  Recurrent weights are ``(gates*hidden, in)`` (``attrs["axes"] == "oi"``) and their
layout is the gate order: ``ifco`` for LSTM, ``rzc`` for GRU.

A layer family the vocabulary has no word for keeps its class name in snake case as its kind, so two
Paddle models still match each other.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role, plain

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
# Layers that keep a feature map's channel count: a Linear after them still reads that map.
# Paddle's InstanceNorm layers: a family the shared vocabulary has no word for (see the docstring).
_NORMS = (Kind.BATCH_NORM, Kind.LAYER_NORM, Kind.GROUP_NORM, Kind.INSTANCE_NORM)
_PASS_THROUGH = {"MaxPool2D", "AvgPool2D", "AdaptiveAvgPool2D", "AdaptiveMaxPool2D", "ReLU", "ReLU6",
                 "LeakyReLU", "Sigmoid", "Tanh", "GELU", "Swish", "Silu", "Hardswish", "ELU",
                 "Dropout", "Dropout2D", "Flatten", "Identity"}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def describe_params(model: Any, canonical: Iterable[str]) -> dict[str, ParamInfo]:
    """ParamInfo for every name in ``canonical`` (structured names), walking ``model`` in layer order.

    ``index`` counts only layers that own at least one described parameter.
    """
    wanted = set(canonical)
    out: dict[str, ParamInfo] = {}
    index = 0
    spatial: tuple[int, str] | None = None  # (channels, data_format) of the last 2-D feature map
    for path, layer in model.named_sublayers(include_self=True):
        cls = type(layer).__name__
        own = [n for n, _ in layer.named_parameters(include_sublayers=False)]
        own += [n for n, _ in layer.named_buffers(include_sublayers=False)
                if n not in getattr(layer, "_non_persistable_buffer_names_set", ())]
        names = [(n, f"{path}.{n}" if path else n) for n in own]
        names = [(n, full) for n, full in names if full in wanted]
        if names:
            kind, layout, attrs = _layer_facts(layer, cls, spatial)
            for short, full in names:
                out[full] = _param(index, path, kind, layout, attrs, short, layer)
            index += 1
        spatial = _next_spatial(layer, cls, spatial)
    return out


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
    if cls in ("Conv2D", "Conv2DTranspose"):
        return int(layer._out_channels), str(layer._data_format)
    if cls in _BATCH_NORM or cls in _PASS_THROUGH or cls.startswith("InstanceNorm") or cls == "GroupNorm":
        return spatial
    if cls in ("Sequential", "LayerList", "LayerDict") or not list(layer.named_parameters(include_sublayers=False)):
        # containers and parameter-free layers (the model itself, custom blocks) don't change what we know
        return spatial
    return None
