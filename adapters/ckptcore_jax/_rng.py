"""The RNG states of a JAX run: Python's and NumPy's global ones (``ckptcore.capture_rng``), and
a Flax NNX model's RNG streams (``nnx.Rngs``: an ``RngKey`` and an ``RngCount`` per stream) under
``state.rng["nnx"]`` by their graph paths (``drop/rngs/dropout/key``), keys as their uint32
``key_data`` with the implementation in ``state.rng["nnx_keys"]``.  JAX itself has no global RNG:
every other key is an array of the run's own (a model or optimizer leaf, or passed by the
caller)."""

from __future__ import annotations

from typing import Any

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.rng import capture_rng, restore_rng

from ._sharding import capture_leaf, plan_leaf
from ._tensors import Leaves

__all__ = ["capture_framework_rng", "restore_framework_rng", "plan_rng"]


def capture_framework_rng(streams: Leaves, copy: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = capture_rng()
    if streams.values:
        values, keys = {}, {}
        for name, leaf in streams.values.items():
            values[name], impl = capture_leaf(leaf, copy, name=qualified("rng", name))
            if impl:
                keys[name] = impl
        out["nnx"] = values
        out["nnx_keys"] = keys
    return out


def restore_framework_rng(rng: dict[str, Any]) -> None:
    restore_rng({k: v for k, v in rng.items() if k not in ("nnx", "nnx_keys")})


def plan_rng(plan: RestorePlan, rng: dict[str, Any], streams: Leaves) -> None:
    """Plan the model's RNG streams back from ``rng`` (names missing on either side reported
    as ``rng/<path>``); the global generators go with :func:`restore_framework_rng`."""
    saved = dict(rng.get("nnx") or {})
    keys = dict(rng.get("nnx_keys") or {})
    for name, live in streams.values.items():
        value = saved.get(name)
        if value is None:
            plan.missing(qualified("rng", name))
            continue
        plan_leaf(plan, qualified("rng", name), value, live, saved_impl=keys.get(name),
                  put=lambda new, n=name: streams.put(n, new))
    plan.unexpected_from(saved, streams.values, "rng")
    plan.then(streams.commit)
