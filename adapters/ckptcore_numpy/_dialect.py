"""The NumPy reference adapter's migration dialect: neutral by construction.

The reference adapter stores ``OptimizerState(kind=..., step=..., hyperparams=..., slots={param:
{slot: array}})`` with the neutral slot names of :mod:`ckptcore.migrate.dialect`, so this dialect
mostly checks and passes values through:

=========  ==========================================  ===========================================
kind       hyperparams                                 slots per parameter
=========  ==========================================  ===========================================
``sgd``    ``learning_rate``, ``momentum`` (0: none),  ``momentum`` when momentum > 0: the buffer
           ``nesterov``                                b ← μb + g, w ← w − lr·b (gradient form)
``adam``   ``learning_rate``, ``beta1``, ``beta2``,    ``m``, ``v`` (uncorrected moments), and
           ``epsilon``, ``amsgrad``, ``weight_decay``  ``vmax`` with ``amsgrad``
           (decoupled), ``epsilon_mode``
=========  ==========================================  ===========================================

``epsilon_mode`` is ``"corrected"`` (the textbook update m̂/(√v̂+ε), the default) or
``"uncorrected"`` (m/(√v+ε) with the correction folded into the step size).  ``step`` counts
updates.  The reference adapter has no learning-rate schedules (asking for one is a
:class:`~ckptcore.errors.MigrationError`, and a source schedule continues here only as a
constant rate with ``approximate=True``), no generators of its own beyond the portable NumPy
and Python states, and no gradient accumulation inside its optimizer.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ckptcore.migrate.dialect import BaseDialect, Neutral, number, slots_by_table
from ckptcore.state import OptimizerState, ScheduleState

__all__ = ["DIALECT", "NumpyDialect"]

_EPS_MODES = ("corrected", "uncorrected")


class NumpyDialect(BaseDialect):
    name = "numpy"  # every convention is BaseDialect's default

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        hp, kind = opt.hyperparams or {}, opt.kind
        out = Neutral(family=kind, framework=self.name, kind=kind, lr=number(hp.get("learning_rate")),
                      step=int(opt.step))
        if kind == "sgd":
            out.family = "momentum"
            out.hp = {"momentum": number(hp.get("momentum"), 0.0) or 0.0,
                      "nesterov": bool(hp.get("nesterov", False)), "momentum_form": "gradient"}
        elif kind == "adam":
            mode = hp.get("epsilon_mode", "corrected")
            if mode not in _EPS_MODES:
                out.unsupported.append(f"numpy adam: epsilon_mode must be one of {_EPS_MODES}, got {mode!r}")
            out.hp = {"beta1": number(hp.get("beta1"), 0.9), "beta2": number(hp.get("beta2"), 0.999),
                      "epsilon": number(hp.get("epsilon"), 1e-8), "eps_mode": mode,
                      "amsgrad": bool(hp.get("amsgrad", False))}
        else:
            out.unsupported.append(f"the numpy reference optimizer {kind!r} cannot be migrated "
                                   "(supported: sgd, adam)")
        out.hp["decoupled_wd"] = number(hp.get("weight_decay"), 0.0) or 0.0
        out.hp["coupled_wd"] = 0.0
        return out

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        if n.family == "momentum":
            return "sgd", {"learning_rate": n.lr, "momentum": n.hp.get("momentum", 0.0),
                           "nesterov": bool(n.hp.get("nesterov", False))}
        if n.family == "adam":
            return "adam", {"learning_rate": n.lr, "beta1": n.hp.get("beta1"), "beta2": n.hp.get("beta2"),
                            "epsilon": n.hp.get("epsilon"), "amsgrad": bool(n.hp.get("amsgrad", False)),
                            "weight_decay": n.hp.get("decoupled_wd", 0.0),
                            "epsilon_mode": n.hp.get("eps_mode", "corrected")}
        # An unsupported family: reported by compare() as a family mismatch against "momentum".
        return "sgd", {"learning_rate": n.lr}

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        if n.family == "adam":
            table = {"m": "m", "v": "v", **({"vmax": "vmax"} if n.hp.get("amsgrad") else {})}
        elif n.family == "momentum" and n.hp.get("momentum"):
            table = {"momentum": "momentum"}
        else:
            table = {}
        return slots_by_table(table, slots, like)


DIALECT = NumpyDialect()
