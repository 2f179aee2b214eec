"""A :class:`~ckptcore.ParamInfo` for each model leaf, in the shared vocabulary.

Names are ``<layer path>/<leaf>``.  Flax lays a ``Linear``/``Dense`` kernel out ``[in, out]``
(``io``, as ``x @ kernel``); a layer of a 2-D ``kernel`` and a ``bias`` is described as dense,
and a layer of ``scale``/``bias``/``mean``/``var`` (``nnx.BatchNorm``) as batch normalisation
(Flax's ``scale``/``bias``/``mean``/``var`` are the vocabulary's gamma/beta/moving mean and
variance).  Everything else is a custom parameter, until the JAX migration dialect (issue 26,
point 5) describes convolutions, attention and the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ckptcore.state import ParamInfo
from ckptcore.vocab import Kind, Role

__all__ = ["describe_params"]

_DENSE = {"kernel": (Role.KERNEL, "io"), "bias": (Role.BIAS, "o")}
_NORM = {"scale": Role.GAMMA, "bias": Role.BETA, "mean": Role.MOVING_MEAN, "var": Role.MOVING_VARIANCE}


def describe_params(leaves: Mapping[str, Any], names: Iterable[str]) -> dict[str, ParamInfo]:
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
