"""``torch.optim.Adam``/``AdamW`` with Keras' epsilon placement, so that runs migrate exactly.

Keras updates ``w -= lr·√(1-β2ᵗ)/(1-β1ᵗ) · m/(√v + ε)``: ε is added to the uncorrected √v.
torch's Adam computes ``lr/(1-β1ᵗ) · m/(√v/√(1-β2ᵗ) + ε)``, the same as adding ``ε·√(1-β2ᵗ)``
to √v.  These subclasses hand torch's kernel ``ε/√(1-β2ᵗ)`` for each step, which gives Keras'
update; their state keys are Adam's, and their param groups carry ``eps_mode="uncorrected"`` so
that migration (``ckptcore_torch._dialect``) knows which convention a checkpoint was trained with.
The same counterpart as ``ckptcore_paddle.keras_adam``.

Example:
    >>> opt = KerasAdam(net.parameters(), lr=1e-3)          # eps=1e-7, as Keras  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["KerasAdam", "KerasAdamW"]


class _KerasEpsilon:
    """Mixin: each step runs with the group's ε rescaled for Keras' placement, then puts it back."""

    def _mark(self) -> None:
        self.defaults["eps_mode"] = "uncorrected"
        for group in self.param_groups:
            group.setdefault("eps_mode", "uncorrected")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        self.param_groups[-1].setdefault("eps_mode", "uncorrected")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        saved = []
        for group in self.param_groups:
            steps = [float(self.state[p]["step"]) for p in group["params"] if "step" in self.state.get(p, {})]
            t = (max(steps) if steps else 0.0) + 1.0   # the update about to be applied
            beta2 = float(group["betas"][1])
            saved.append(group["eps"])
            group["eps"] = float(group["eps"]) / math.sqrt(1.0 - beta2 ** t)
        try:
            return super().step(closure)  # type: ignore[misc]
        finally:
            for group, eps in zip(self.param_groups, saved):
                group["eps"] = eps


class KerasAdam(_KerasEpsilon, torch.optim.Adam):
    """``torch.optim.Adam`` adding ε as Keras does (default ``eps=1e-7``, Keras' default)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, **kwargs)
        self._mark()


class KerasAdamW(_KerasEpsilon, torch.optim.AdamW):
    """``torch.optim.AdamW`` adding ε as Keras does (defaults ``eps=1e-7``, ``weight_decay=0.004``,
    Keras' defaults); its weight decay is decoupled, as Keras'."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-7, weight_decay: float = 0.004, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
        self._mark()
