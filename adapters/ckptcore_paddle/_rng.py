"""Paddle's global generators as plain values.

``state.rng["paddle"]`` sits next to ckptcore's ``"python"`` and ``"numpy"`` (the global legacy
numpy state is what ``paddle.io.DataLoader(shuffle=True)`` draws its order from): a list with one
``{"device": int, "seed": int, "offset": int, "engine": str}`` per generator of the current place,
as ``paddle.get_rng_state()`` returns them.  ``engine`` is the ASCII text of the CPU
``std::mt19937_64`` state (the decimal words ``GeneratorState.__getstate__`` gives, which
``__setstate__`` reads back exactly); seeds are unsigned 64-bit ints.
"""

from __future__ import annotations

from typing import Any, Mapping

import paddle

from ckptcore.errors import SchemaError


def capture_framework_rng() -> dict[str, Any]:
    """``{"paddle": [...]}``: every generator of the current place."""
    states = []
    for gs in paddle.get_rng_state():
        device, seed, offset, engine = gs.__getstate__()
        states.append({"device": int(device), "seed": int(seed), "offset": int(offset),
                       "engine": bytes(engine).decode("ascii")})
    return {"paddle": states}


def restore_framework_rng(rng: Mapping[str, Any]) -> None:
    """Put back ``rng["paddle"]`` (other entries are the core's); nothing changes if it is malformed.

    Raises:
        SchemaError: an entry is not a generator state, or their number is not the current place's.
    """
    if rng.get("paddle") is None:
        return
    states = _generator_states(rng["paddle"])
    if len(states) != len(paddle.get_rng_state()):
        raise SchemaError(f"rng['paddle'] holds {len(states)} generator states but the current "
                          f"place has {len(paddle.get_rng_state())}; restore on the same kind of device")
    paddle.set_rng_state(states)


def _generator_states(entries: Any) -> list[Any]:
    cls = paddle.base.core.GeneratorState
    out = []
    if not isinstance(entries, (list, tuple)):
        raise SchemaError("rng['paddle'] must be a list of generator states")
    for i, e in enumerate(entries):
        try:
            engine = list(str(e["engine"]).encode("ascii"))
            gs = cls.__new__(cls)
            gs.__setstate__((int(e["device"]), int(e["seed"]), int(e["offset"]), engine))
        except (KeyError, TypeError, ValueError, UnicodeEncodeError) as err:
            raise SchemaError(f"rng['paddle'][{i}] is not a Paddle generator state ({err})") from err
        out.append(gs)
    return out
