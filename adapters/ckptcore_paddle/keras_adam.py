"""Paddle Adam and AdamW with Keras' epsilon convention, for exact cross-framework continuation.

Keras updates ``w -= lr·√(1-β2ᵗ)/(1-β1ᵗ) · m/(√v + ε)``; Paddle's kernel adds ``ε·√(1-β2ᵗ)``
instead of ``ε`` (docs/MIGRATION.md, "Framework facts migration relies on"), which drifts by up
to 1e-3 in a few steps wherever √v is near ε.  These optimizers pass Paddle's kernel ``ε/√(1-β2ᵗ)`` for each parameter's own step ``t``
(read from its ``beta2_pow_acc``, which holds β2ᵗ before update ``t``), so the update is Keras'
to float32 rounding.  Everything else (accumulators, state_dict keys, ``set_state_dict``) is
Paddle's own, and ckptcore records them as kinds ``kerasadam`` / ``kerasadamw``.

Example:
    >>> from ckptcore_paddle.keras_adam import KerasAdam                      # doctest: +SKIP
    >>> opt = KerasAdam(learning_rate=1e-3, epsilon=1e-7, parameters=net.parameters())  # doctest: +SKIP
    >>> ckptcore.load_state("s3://runs/keras/step-500", model=net, optimizer=opt)         # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any

import paddle

__all__ = ["KerasAdam", "KerasAdamW"]


class _KerasEpsilon:
    """Mixin: call Paddle's per-parameter Adam op with the epsilon that reproduces Keras' update."""

    def _append_optimize_op(self, block: Any, param_and_grad: Any) -> Any:
        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        if getattr(self, "_use_multi_tensor", False):
            raise ValueError("KerasAdam does not support use_multi_tensor=True")
        eps = self._epsilon
        if not isinstance(eps, (int, float)):
            raise TypeError("KerasAdam needs a float epsilon")
        pow2 = self._get_accumulator_master(self._beta2_pow_acc_str, param_and_grad[0])
        corr = 1.0 - float(pow2.item())
        self._epsilon = eps / math.sqrt(corr) if corr > 0 else eps
        try:
            return super()._append_optimize_op(block, param_and_grad)  # type: ignore[misc]
        finally:
            self._epsilon = eps


class KerasAdam(_KerasEpsilon, paddle.optimizer.Adam):
    """``paddle.optimizer.Adam`` with Keras' epsilon placement (Keras' default ``epsilon=1e-7``)."""

    def __init__(self, learning_rate: Any = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-7, **kwargs: Any):
        super().__init__(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon, **kwargs)


class KerasAdamW(_KerasEpsilon, paddle.optimizer.AdamW):
    """``paddle.optimizer.AdamW`` with Keras' epsilon placement (Keras' defaults ``epsilon=1e-7``,
    ``weight_decay=0.004``; Paddle's decoupled decay equals Keras')."""

    def __init__(self, learning_rate: Any = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float = 0.004, **kwargs: Any):
        super().__init__(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
                         weight_decay=weight_decay, **kwargs)
