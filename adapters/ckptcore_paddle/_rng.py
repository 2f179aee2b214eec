"""Paddle's global generators as plain values.

``state.rng["paddle"]`` sits next to ckptcore's ``"python"`` and ``"numpy"`` (the global legacy
numpy state is what ``paddle.io.DataLoader(shuffle=True)`` draws its order from): a list with one
``{"device": int, "seed": int, "offset": int, "engine": str}`` per generator of the current place,
as ``paddle.get_rng_state()`` returns them.  ``engine`` is the ASCII text of the CPU
``std::mt19937_64`` state (FRAMEWORKS.md §5); seeds are unsigned 64-bit ints.
"""

from __future__ import annotations

from typing import Any

import paddle

from ckptcore.errors import SchemaError
from ckptcore.rng import capture_rng, restore_rng


def capture_all_rng() -> dict[str, Any]:
    out = capture_rng()
    states = []
    for gs in paddle.get_rng_state():
        device, seed, offset, engine = gs.__getstate__()
        states.append({"device": int(device), "seed": int(seed), "offset": int(offset),
                       "engine": bytes(engine).decode("ascii")})
    out["paddle"] = states
    return out


def restore_all_rng(rng: dict[str, Any]) -> None:
    """Validate and put back every generator in ``rng``; nothing changes if an entry is malformed."""
    paddle_states = None
    if rng.get("paddle") is not None:
        paddle_states = _generator_states(rng["paddle"])
        if len(paddle_states) != len(paddle.get_rng_state()):
            raise SchemaError(f"rng['paddle'] holds {len(paddle_states)} generator states but the current "
                              f"place has {len(paddle.get_rng_state())}; restore on the same kind of device")
    restore_rng({k: v for k, v in rng.items() if k in ("python", "numpy")})
    if paddle_states is not None:
        paddle.set_rng_state(paddle_states)


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
