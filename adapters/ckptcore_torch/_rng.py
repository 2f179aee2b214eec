"""PyTorch's global generators as plain values.

``state.rng["torch"]`` sits next to ckptcore's ``"python"`` and ``"numpy"``: the CPU generator's
state, ``torch.get_rng_state()``, as a ``uint8`` array (its Mersenne Twister words, seed and
offset as torch lays them out; what Dropout and ``torch.rand`` draw from).  With CUDA,
``state.rng["cuda"]`` is a list of one such array per device (``torch.cuda.get_rng_state(i)``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ckptcore.errors import SchemaError


def capture_framework_rng() -> dict[str, Any]:
    """``{"torch": uint8[...]}`` and, when CUDA is available, ``"cuda": [uint8[...] per device]``."""
    out: dict[str, Any] = {"torch": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_available():
        out["cuda"] = [torch.cuda.get_rng_state(i).numpy().copy() for i in range(torch.cuda.device_count())]
    return out


def _state(value: Any, where: str, like: torch.Tensor) -> torch.Tensor:
    arr = np.asarray(value)
    if arr.dtype != np.uint8 or arr.shape != tuple(like.shape):
        raise SchemaError(f"rng[{where}] is {arr.dtype}{list(arr.shape)}, not the uint8{list(like.shape)} "
                          "generator state this PyTorch keeps")
    return torch.from_numpy(arr.copy())


def restore_framework_rng(rng: Mapping[str, Any]) -> None:
    """Put back ``rng["torch"]`` and ``rng["cuda"]`` (other entries are the core's); every entry is
    checked before any generator is set.

    Raises:
        SchemaError: an entry is not a generator state of this PyTorch.
    """
    cpu = rng.get("torch")
    todo = []
    if cpu is not None:
        todo.append((torch.set_rng_state, _state(cpu, "'torch'", torch.get_rng_state())))
    cuda = rng.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if not isinstance(cuda, (list, tuple)):
            raise SchemaError("rng['cuda'] must be a list of generator states, one per device")
        count = torch.cuda.device_count()
        if len(cuda) != count:
            raise SchemaError(f"rng['cuda'] holds {len(cuda)} device states but this process sees "
                              f"{count} CUDA devices; restore on as many devices (or pass rng=False)")
        for i, value in enumerate(cuda):
            state = _state(value, f"'cuda'][{i}", torch.cuda.get_rng_state(i))
            todo.append((lambda s, i=i: torch.cuda.set_rng_state(s, i), state))
    for setter, state in todo:
        setter(state)
