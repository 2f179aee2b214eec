"""A :class:`~ckptcore.ParamInfo` for each model leaf, in the shared vocabulary.

Names are ``<layer path>/<leaf>``.  A Flax NNX model's layers are recognised by class (the
first ``flax.nnx`` name in the class's MRO, so a subclass of ``nnx.Linear`` is a dense layer).
Flax's layouts, as :mod:`ckptcore.vocab` names them:

* ``Linear``: kernel ``[in, out]`` (``io``, as ``x @ kernel``), bias ``o``;
* ``Conv``: kernel ``[kw, in, out]``/``[kh, kw, in, out]``/``[kd, kh, kw, in, out]`` (``kio``,
  ``hwio``, ``dhwio``); a depthwise one (``feature_group_count == in_features``) is a grouped
  ``hwio`` of shape ``(kh, kw, 1, in*M)``, output channel ``c*M + m``;
* ``ConvTranspose``: ``transpose_kernel=True`` keeps the kernel as the gradient of a convolution
  does, ``[kh, kw, out, in]`` (``hwoi``); the default (``False``) is ``[kh, kw, in, out]`` applied
  as a convolution of the dilated input, so it is spatially flipped: ``hwio`` with
  ``attrs["spatially_flipped"]``;
* ``BatchNorm``: ``scale``/``bias``/``mean``/``var`` are gamma/beta/moving mean/moving variance;
  Flax's ``momentum`` is already the neutral one (moving = moving·momentum + batch·(1-momentum)),
  the batch variance that updates ``var`` the biased one; ``LayerNorm``: ``scale``/``bias``;
* ``MultiHeadAttention``: one layer whose ``query``/``key``/``value`` kernels are ``[in, heads,
  head_dim]`` (``ehd``, biases ``hd``) and whose ``out`` kernel is ``[heads, head_dim, out]``
  (``hde``, bias ``e``): roles ``query_kernel`` ... ``output_bias``;
* ``Embed``: ``embedding`` ``[vocab, features]`` (``vd``).

Anything else is a custom parameter.  A model that is a bare pytree (not an NNX module) is
described from its leaves: a layer of a 2-D ``kernel`` and a ``bias`` as dense, one of
``scale``/``bias``/``mean``/``var`` as batch normalisation.  Structure (``attrs["inputs"]``,
``attrs["order"]``) comes from a traced forward pass (``_structure.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role

from ._structure import structure
from ._tensors import path_name

__all__ = ["describe_params"]

_DENSE = {"kernel": (Role.KERNEL, "io"), "bias": (Role.BIAS, "o")}
_NORM = {"scale": Role.GAMMA, "bias": Role.BETA, "mean": Role.MOVING_MEAN, "var": Role.MOVING_VARIANCE}
_CONV = {3: (Kind.CONV1D, "kio"), 4: (Kind.CONV2D, "hwio"), 5: (Kind.CONV3D, "dhwio")}
_CONV_T = {3: (Kind.CONV1D_TRANSPOSE, "koi", "kio"), 4: (Kind.CONV2D_TRANSPOSE, "hwoi", "hwio"),
           5: (Kind.CONV3D_TRANSPOSE, "dhwoi", "dhwio")}
_ATTENTION = {"query": ("query", "ehd", "hd"), "key": ("key", "ehd", "hd"), "value": ("value", "ehd", "hd"),
              "out": ("output", "hde", "e")}
_NNX = ("Linear", "Conv", "ConvTranspose", "BatchNorm", "LayerNorm", "MultiHeadAttention", "Embed")
# The structure depends on the model's graph (its modules and their static attributes) and the
# shapes of its leaves, not on their values: traced once per (graph, shapes), a few hundred kept.
_STRUCTURES: dict[tuple, Any] = {}
_KEEP = 256


def describe_params(leaves: Mapping[str, Any], names: Iterable[str], model: Any = None) -> dict[str, ParamInfo]:
    modules = _modules(model)
    if modules is None:
        return _from_leaves(leaves, names)
    described = {name: _describe(name, leaves, modules) for name in names}
    order = list(dict.fromkeys(i.layer for i in described.values()))
    layer_of = {n: i.layer for n, i in described.items() if i.kind != Kind.CUSTOM}
    found = _structure(model, leaves, layer_of, [modules[x] for x in order if x in modules and x in
                                                  set(layer_of.values())])
    out: dict[str, ParamInfo] = {}
    for name, info in described.items():
        attrs = dict(info.attrs)
        if found is not None and info.layer in found:
            attrs["order"], attrs["inputs"] = int(found[info.layer][0]), list(found[info.layer][1])
        out[name] = replace(info, index=order.index(info.layer), attrs=attrs)
    return out


def _modules(model: Any) -> dict[str, Any] | None:
    """Every NNX module of ``model`` by path, or None when ``model`` is no NNX module."""
    if not any(c.__name__ == "Module" and c.__module__.startswith("flax.nnx") for c in type(model).__mro__):
        return None
    from flax import nnx

    return {path_name(p): node for p, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}


def _family(module: Any) -> str | None:
    for c in type(module).__mro__:
        if c.__module__.startswith("flax.nnx") and c.__name__ in _NNX:
            return c.__name__
    return None


def _describe(name: str, leaves: Mapping[str, Any], modules: Mapping[str, Any]) -> ParamInfo:
    layer, _, leaf = name.rpartition("/")
    parent, _, proj = layer.rpartition("/")
    if proj in _ATTENTION and _family(modules.get(parent)) == "MultiHeadAttention":
        what, kernel_layout, bias_layout = _ATTENTION[proj]
        layout = kernel_layout if leaf == "kernel" else bias_layout
        return ParamInfo(0, parent, Kind.MULTI_HEAD_ATTENTION, f"{what}_{leaf}", layout,
                         {"num_heads": int(modules[parent].num_heads)})
    mod = modules.get(layer)
    family = _family(mod)
    shape = tuple(getattr(leaves.get(f"{layer}/kernel"), "shape", ()))
    custom = ParamInfo(0, layer, Kind.CUSTOM, leaf or name)
    if family == "Linear" and leaf in _DENSE:
        return ParamInfo(0, layer, Kind.DENSE, *_DENSE[leaf])
    if family == "Conv" and leaf in _DENSE and len(shape) in _CONV:
        kind, layout = _CONV[len(shape)]
        groups = int(getattr(mod, "feature_group_count", 1))
        if groups > 1:
            if len(shape) != 4 or groups != int(mod.in_features) or shape[-2] != 1:
                return ParamInfo(0, layer, "grouped_conv", leaf, None, {"feature_group_count": groups})
            kind = Kind.DEPTHWISE_CONV2D
        return ParamInfo(0, layer, kind, _DENSE[leaf][0], layout if leaf == "kernel" else "o")
    if family == "ConvTranspose" and leaf in _DENSE and len(shape) in _CONV_T:
        kind, transposed, plain_layout = _CONV_T[len(shape)]
        if leaf == "bias":
            return ParamInfo(0, layer, kind, Role.BIAS, "o")
        if getattr(mod, "transpose_kernel", False):
            return ParamInfo(0, layer, kind, Role.KERNEL, transposed)
        return ParamInfo(0, layer, kind, Role.KERNEL, plain_layout, {"spatially_flipped": True})
    if family == "BatchNorm" and leaf in _NORM:
        attrs = {"momentum": float(mod.momentum), "epsilon": float(mod.epsilon), "variance_update": "biased"}
        return ParamInfo(0, layer, Kind.BATCH_NORM, _NORM[leaf], None, attrs)
    if family == "LayerNorm" and leaf in ("scale", "bias"):
        return ParamInfo(0, layer, Kind.LAYER_NORM, _NORM[leaf], None, {"epsilon": float(mod.epsilon)})
    if family == "Embed" and leaf == "embedding":
        return ParamInfo(0, layer, Kind.EMBEDDING, Role.EMBEDDINGS, "vd")
    return custom


def _structure(model: Any, leaves: Mapping[str, Any], layer_of: dict[str, str],
               probe_from: list[Any]) -> dict[str, tuple[int, list[str]]] | None:
    from flax import nnx

    key: tuple | None = (nnx.graphdef(model), tuple((n, tuple(getattr(v, "shape", ()))) for n, v in leaves.items()))
    try:
        if key in _STRUCTURES:
            return _STRUCTURES[key]
    except TypeError:   # an unhashable static attribute: traced every time
        key = None
    found = structure(model, layer_of, probe_from) if layer_of else None
    if key is not None:
        if len(_STRUCTURES) >= _KEEP:
            _STRUCTURES.pop(next(iter(_STRUCTURES)))
        _STRUCTURES[key] = found
    return found


def _from_leaves(leaves: Mapping[str, Any], names: Iterable[str]) -> dict[str, ParamInfo]:
    layers: dict[str, set[str]] = {}
    for name in leaves:
        layer, _, leaf = name.rpartition("/")
        layers.setdefault(layer, set()).add(leaf)
    order = list(layers)
    out = {}
    for name in names:
        layer, _, leaf = name.rpartition("/")
        roles, index = layers.get(layer, set()), order.index(layer) if layer in layers else 0
        kernel = leaves.get(f"{layer}/kernel" if layer else "kernel")
        if roles <= set(_DENSE) and kernel is not None and len(getattr(kernel, "shape", ())) == 2:
            role, layout = _DENSE[leaf]
            out[name] = ParamInfo(index=index, layer=layer, kind=Kind.DENSE, role=role, layout=layout)
        elif roles == set(_NORM):
            out[name] = ParamInfo(index=index, layer=layer, kind=Kind.BATCH_NORM, role=_NORM[leaf])
        else:
            out[name] = ParamInfo(index=index, layer=layer, kind=Kind.CUSTOM, role=leaf or name)
    return out
