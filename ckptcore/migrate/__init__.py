"""Migration of a whole training state between frameworks, in NumPy alone.

``convert_state(state, template)`` turns a state captured in one framework into another's layout,
taking the target's structure from ``template`` (the target adapter's capture of the live target
objects).  ``ckptcore.convert`` and ``ckptcore.load_state`` build the template for you.

Each framework speaks through its *dialect* (:mod:`.dialect`, supplied by its adapter as
``ADAPTER.dialect``), which translates its optimizers, schedules and random state to and from a
neutral form; the modules here only hold neutral algebra, in the order data flows through them:

* :mod:`.match`: which source layer is which target layer (from the adapters' ParamInfo);
* :mod:`.layouts`: weight layouts (transposes, gate orders, recurrent bias forms, the Flatten row
  permutation), applied to weights and their optimizer slots alike;
* :mod:`.optimizers`: comparing two neutral optimizers (hyperparameters, epsilon conventions);
* :mod:`.schedules`: canonical schedule formulas, which continue each other, at which step;
* :mod:`.rng`: Python/NumPy RNG carried, framework RNGs reseeded deterministically;
* :mod:`.convert`: the orchestration.

Nothing here imports a framework or names one.  See docs/MIGRATION.md for what is exact and what
is not.
"""

from __future__ import annotations

from ..errors import MigrationWarning
from .convert import convert_state, dialect_for
from .dialect import BaseDialect, Dialect, Neutral

__all__ = ["convert_state", "MigrationWarning", "Dialect", "BaseDialect", "Neutral", "dialect_for"]
