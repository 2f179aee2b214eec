"""The framework this adapter adapts: named float arrays and two optimizers, in plain NumPy.

Real adapters import these roles from their framework (a Keras ``Model`` and ``Adam``, a Paddle
``Layer`` and ``Momentum``); the reference adapter has no framework to import, so it brings the
smallest one that has what a checkpoint must carry: parameters updated in place, optimizers with
per-parameter slots and an iteration counter.  Everything is float arithmetic on the parameters'
own dtype, so a run resumed from a checkpoint repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Model", "SGD", "Adam", "Optimizer"]


class Model:
    """Named float arrays: ``Model({"dense/kernel": w, "dense/bias": b})``.

    ``params`` maps each name to the model's own array (a copy of what was passed).  Names are
    ``<layer>/<role>``; a layer whose ``kernel`` is 2-D is a dense layer (see ``_params.py``).

    Example:
        >>> import numpy as np
        >>> m = Model({"dense/kernel": np.zeros((2, 3), np.float32)})
        >>> m.params["dense/kernel"].shape
        (2, 3)
    """

    def __init__(self, params: Mapping[str, Any]):
        if not isinstance(params, Mapping):
            raise TypeError(f"Model takes a mapping of names to float arrays, got {type(params).__name__}")
        self.params: dict[str, np.ndarray] = {}
        for name, value in params.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
            arr = np.array(value, copy=True)
            if arr.dtype.kind != "f":
                raise TypeError(f"parameter {name!r} must be a float array, got {arr.dtype}")
            self.params[name] = arr

    def __repr__(self) -> str:
        return f"Model({', '.join(f'{k}: {v.dtype}{list(v.shape)}' for k, v in self.params.items())})"


class Optimizer:
    """Per-parameter ``slots`` (created on the first step), an ``iterations`` counter and
    ``hyperparams``; :meth:`step` updates a model's arrays in place."""

    kind = "optimizer"
    slot_names: tuple[str, ...] = ()

    def __init__(self, **hyperparams: float):
        for key, value in hyperparams.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise ValueError(f"{type(self).__name__}: {key} must be a finite number, got {value!r}")
        self.hyperparams = {k: float(v) for k, v in hyperparams.items()}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self.iterations = 0

    def step(self, model: Model, grads: Mapping[str, np.ndarray]) -> None:
        """Apply one update of ``grads`` (``{name: array}``, a subset of ``model.params``)."""
        if not isinstance(model, Model):
            raise TypeError(f"step() needs a ckptcore_numpy.Model, got {type(model).__name__}")
        unknown = sorted(set(grads) - set(model.params))
        if unknown:
            raise ValueError(f"gradients for parameters the model does not have: {unknown}")
        self.iterations += 1
        for name, g in grads.items():
            p = model.params[name]
            slots = self.slots.setdefault(name, {s: np.zeros_like(p) for s in self.slot_names})
            self._update(p, np.asarray(g, dtype=p.dtype), slots)

    def _update(self, p: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def _h(self, key: str, dtype: np.dtype) -> Any:
        return dtype.type(self.hyperparams[key])

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v}" for k, v in self.hyperparams.items())
        return f"{type(self).__name__}({hp})"


class SGD(Optimizer):
    """Stochastic gradient descent with (heavy-ball) momentum: ``v = mu*v + g; p -= lr*v``.

    Without momentum (``momentum=0``) it keeps no slot.
    """

    kind = "sgd"

    def __init__(self, lr: float, momentum: float = 0.0):
        super().__init__(learning_rate=lr, momentum=momentum)
        if not 0.0 <= self.hyperparams["momentum"] < 1.0:
            raise ValueError(f"SGD: momentum must be in [0, 1), got {momentum!r}")
        self.slot_names = ("momentum",) if self.hyperparams["momentum"] else ()

    def _update(self, p, g, slots):
        lr = self._h("learning_rate", p.dtype)
        if "momentum" in slots:
            v = slots["momentum"]
            v *= self._h("momentum", p.dtype)
            v += g
            g = v
        p -= lr * g


class Adam(Optimizer):
    """Adam with bias correction: slots ``m`` and ``v``."""

    kind = "adam"
    slot_names = ("m", "v")

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-7):
        super().__init__(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=epsilon)

    def _update(self, p, g, slots):
        t = p.dtype.type
        b1, b2 = self._h("beta1", p.dtype), self._h("beta2", p.dtype)
        m, v = slots["m"], slots["v"]
        m *= b1
        m += (t(1) - b1) * g
        v *= b2
        v += (t(1) - b2) * g * g
        k = self.iterations
        lr = self._h("learning_rate", p.dtype) * np.sqrt(t(1) - b2 ** k) / (t(1) - b1 ** k)
        p -= lr * m / (np.sqrt(v) + self._h("epsilon", p.dtype))
