"""The reference adapter: plain NumPy models, the smallest framework ckptcore supports.

It proves that a framework is one package: a :class:`Model` of named float arrays, optimizers
:class:`SGD` and :class:`Adam` with per-parameter slots, ``capture``/``restore`` through the core's
:class:`~ckptcore.adapter.RestorePlan`, and the ``ckpt demo`` model.  The registry finds
:data:`ADAPTER` through the ``ckptcore.adapters`` entry point (``numpy = "ckptcore_numpy:ADAPTER"``).

Modules (the shared adapter map, where it applies): ``_framework`` (the framework itself: Model,
SGD, Adam; real adapters import these from their framework), ``_capture`` (capture/restore),
``_tensors`` (discovery, moving bytes), ``_params`` (ParamInfo), ``_optimizer`` (slots and
counters), ``_rng`` (global and named generators), ``_demo`` (``ckpt demo``), ``_dialect``
(migration).  There is no training-loop callback, input pipeline or native file format: NumPy
has none, so :attr:`NumpyAdapter.formats` is empty (an ``.npz`` of ``state.model`` is all an
export could be, and ckptcore's own format already stores the same arrays, checksummed).

Example:
    >>> import numpy as np, ckptcore_numpy as cn
    >>> model = cn.Model({"dense/kernel": np.ones((2, 1), np.float32)})
    >>> opt = cn.SGD(0.5, momentum=0.9)
    >>> opt.step(model, {"dense/kernel": np.ones((2, 1), np.float32)})
    >>> state = cn.capture(model, opt)
    >>> state.framework, state.optimizer.slots["dense/kernel"]["momentum"].ravel().tolist()
    ('numpy', [1.0, 1.0])
    >>> fresh, fresh_opt = cn.Model({"dense/kernel": np.zeros((2, 1), np.float32)}), cn.SGD(0.5, 0.9)
    >>> cn.restore(state, fresh, fresh_opt).ok
    True
    >>> fresh.params["dense/kernel"].ravel().tolist(), fresh_opt.iterations
    ([0.5, 0.5], 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptcore.adapter import FileFormat, PackageAdapter
from ckptcore.state import RestoreReport, TrainingState

from ._capture import capture, restore
from ._framework import SGD, Adam, Model, Optimizer

__all__ = ["ADAPTER", "Model", "SGD", "Adam", "Optimizer", "capture", "restore"]

_KEYWORDS = ("model", "optimizer", "cursor", "generators")


def _known(objects: Mapping[str, Any], verb: str) -> None:
    unknown = sorted(set(objects) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"the numpy adapter cannot {verb} {unknown}: it takes "
                        f"{', '.join(_KEYWORDS)}")


class NumpyAdapter(PackageAdapter):
    """The registry's view of this package (the :class:`ckptcore.adapter.Adapter` contract)."""

    name = "numpy"
    capture_views = True  # capture(copy=False) returns the live arrays

    def handles(self, obj: object) -> bool:
        return isinstance(obj, Model)

    def capture(self, *, model: Any, optimizer: Any = None, cursor: Any = None, rng: bool = True,
                copy: bool = True, **objects: Any) -> TrainingState:
        _known(objects, "capture")
        return capture(model, optimizer, cursor=cursor, rng=rng, copy=copy, **objects)

    def restore(self, state: TrainingState, *, model: Any, optimizer: Any = None, cursor: Any = None,
                strict: bool = True, rng: bool = True, **objects: Any) -> RestoreReport:
        _known(objects, "restore")
        return restore(state, model, optimizer, cursor=cursor, strict=strict, rng=rng, **objects)

    @property
    def formats(self) -> tuple[FileFormat, ...]:
        return ()  # no native file format: ckptcore's own stores the same arrays, with checksums


ADAPTER = NumpyAdapter()
