"""A :class:`~ckptcore.ParamInfo` for each of a model's arrays, in the shared vocabulary.

Names are ``<layer>/<role>``.  A layer whose ``kernel`` is 2-D is a dense layer (kernel laid out
``io``: inputs by outputs, as ``x @ kernel``); anything else is a custom parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role

from ._tensors import named_tensors

__all__ = ["describe_params"]

_DENSE_ROLES = {Role.KERNEL.value: "io", Role.BIAS.value: "o"}


def describe_params(model: Any, names: Iterable[str]) -> dict[str, ParamInfo]:
    tensors = named_tensors(model)
    layers: dict[str, list[str]] = {}
    for name in tensors:
        layer, _, role = name.rpartition("/")
        layers.setdefault(layer, []).append(role)
    out = {}
    for name in names:
        layer, _, role = name.rpartition("/")
        index = list(layers).index(layer)
        kernel = tensors.get(f"{layer}/{Role.KERNEL.value}" if layer else Role.KERNEL.value)
        dense = (kernel is not None and kernel.ndim == 2
                 and set(layers[layer]) <= set(_DENSE_ROLES) and role in _DENSE_ROLES)
        if dense:
            out[name] = ParamInfo(index=index, layer=layer, kind=Kind.DENSE, role=Role(role),
                                  layout=_DENSE_ROLES[role])
        else:
            out[name] = ParamInfo(index=index, layer=layer, kind=Kind.CUSTOM, role=role or name)
    return out
