"""Discovery of a model's named arrays and moving bytes between them and a state."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._framework import Model

__all__ = ["named_tensors", "to_numpy", "assign"]


def named_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's arrays by name, in the model's order."""
    if not isinstance(model, Model):
        raise TypeError(f"the numpy adapter needs a ckptcore_numpy.Model, got "
                        f"{type(model).__module__}.{type(model).__qualname__}")
    return dict(model.params)


def to_numpy(t: np.ndarray, copy: bool = True) -> np.ndarray:
    """``t`` as a state array: a copy, or with ``copy=False`` the live array itself (a view that
    changes as training goes on)."""
    return t.copy() if copy else t


def assign(target: np.ndarray, value: np.ndarray) -> None:
    """Write ``value`` into ``target`` in place, so views of the live array see the restore too."""
    np.copyto(target, value, casting="no")
