"""What feeds what in a Flax NNX model, from the program JAX traces for one forward pass.

Migration pairs layers of two frameworks as nodes of two graphs (``ckptcore.migrate.match``), so
each layer's ParamInfo records ``attrs["inputs"]`` (the weight-owning layers whose outputs reach
it) and ``attrs["order"]`` (its run position).  NNX has no forward hooks, but a forward pass can be
traced abstractly (``jax.make_jaxpr``: shapes only, nothing computed) with the model's variables as
explicit inputs; following the data flow through the traced equations then shows, for each
equation that reads a layer's variable, which layers produced its other operands.  Values derived
from one layer's variables alone (a reshaped bias, ``rsqrt(var + eps)``) stay that layer's.

The model runs in eval mode on a small zero input shaped for each parameter-owning layer in turn
(a ``Linear``'s features, as a vector or a short sequence; a ``Conv``'s channels at a few spatial
sizes; token ids for an ``Embed``) until one traces; when none does, no structure is recorded
(the ``ckptcore`` logger says so) and migration pairs layers by order alone.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from ._tensors import path_name

__all__ = ["structure"]

_log = logging.getLogger("ckptcore")
_SUB_JAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_MAX_PROBES = 32


def structure(model: Any, layer_of: Mapping[str, str], probe_from: list[Any]
              ) -> dict[str, tuple[int, list[str]]] | None:
    """``layer -> (run position, feeding layers)`` for every layer in ``layer_of`` (leaf name ->
    layer), or None when no probe input runs ``model`` or some layer never ran.  The probes are
    shaped for the modules of ``probe_from``, in that order."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    owners = []
    for path, _ in flat:
        name = path_name(path)
        owners.append(layer_of.get(name[:-len("/value")] if name.endswith("/value") else name))
    layers = set(layer_of.values())

    def forward(leaves: list[Any], x: Any) -> Any:
        m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
        m.eval()
        return m(x)

    for probe in _probes(probe_from)[:_MAX_PROBES]:
        try:
            closed = jax.make_jaxpr(forward)([leaf for _, leaf in flat], probe)
        except Exception as e:  # noqa: BLE001 - a probe that does not fit the model: try the next
            _log.debug("ckptcore: structure probe %s failed on %s: %s", probe.shape,
                       type(model).__name__, e)
            continue
        found: dict[str, tuple[int, set[str]]] = {}
        jaxpr = closed.jaxpr
        n = len(flat)
        _flow(jaxpr, {v: frozenset() for v in jaxpr.invars[n:]},
              {v: o for v, o in zip(jaxpr.invars[:n], owners) if o is not None}, found)
        if set(found) >= layers:
            return {layer: (found[layer][0], sorted(found[layer][1])) for layer in layers}
        _log.debug("ckptcore: layers %s did not run on probe %s", sorted(layers - set(found)),
                   probe.shape)
        return None   # some layers never ran: a partial structure would mislead
    _log.info("ckptcore: no probe input runs %s; its layer structure is recorded as unknown",
              type(model).__name__)
    return None


def _probes(modules: list[Any]) -> list[Any]:
    """Zero inputs worth a trace: the input each layer would take if it came first."""
    out: list[tuple[tuple[int, ...], Any]] = []
    for mod in modules:
        cls = {c.__name__ for c in type(mod).__mro__}
        features = getattr(mod, "in_features", None)
        if "Embed" in cls:
            shapes, dtype = [(2, 6)], jnp.int32
        elif not isinstance(features, int):
            continue
        elif cls & {"Conv", "ConvTranspose"}:
            rank = len(getattr(mod, "kernel_size", (3, 3)))
            shapes, dtype = [(2, *([s] * rank), features) for s in (16, 28, 32, 8)], jnp.float32
        elif "Linear" in cls:
            shapes, dtype = [(2, 6, features), (2, features)], jnp.float32
        else:
            continue
        out.extend((s, dtype) for s in shapes if (s, dtype) not in out)
    return [jax.ShapeDtypeStruct(s, d) for s, d in out]


def _flow(jaxpr: Any, src: dict[Any, frozenset], own: dict[Any, str],
          found: dict[str, tuple[int, set[str]]]) -> None:
    """Propagate, through ``jaxpr``'s equations, which layers' outputs each value carries
    (``src``) and which values are a layer's variables or derived from them alone (``own``)."""
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if _var(v) and (v in src or v in own)]
        sub = next((eqn.params[k] for k in _SUB_JAXPRS if k in eqn.params), None)
        inner = getattr(sub, "jaxpr", sub)
        if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            pairs = [(iv, v) for iv, v in zip(inner.invars, eqn.invars) if _var(v)]
            sub_src = {iv: src[v] for iv, v in pairs if v in src}
            sub_own = {iv: own[v] for iv, v in pairs if v in own}
            _flow(inner, sub_src, sub_own, found)
            for ov, iv in zip(eqn.outvars, inner.outvars):
                if iv in sub_own:
                    own[ov] = sub_own[iv]
                else:
                    src[ov] = sub_src.get(iv, frozenset())
            continue
        owners = {own[v] for v in ins if v in own}
        data = frozenset().union(*(src[v] for v in ins if v in src))
        has_data = any(v in src for v in ins)
        if len(owners) == 1 and not has_data:   # the layer's own variables, transformed
            for ov in eqn.outvars:
                own[ov] = next(iter(owners))
            _seen(found, next(iter(owners)), frozenset())
            continue
        for layer in owners:
            _seen(found, layer, data - {layer})
        out = frozenset(owners) if owners else data
        for ov in eqn.outvars:
            src[ov] = out


def _var(v: Any) -> bool:
    return type(v).__name__ != "Literal"   # a constant operand carries no layer's output


def _seen(found: dict[str, tuple[int, set[str]]], layer: str, feeders: frozenset) -> None:
    if layer not in found:
        found[layer] = (len(found), set())
    found[layer][1].update(feeders)
