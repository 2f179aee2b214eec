"""Cross-framework migration of a whole training state (Keras 3 <-> Paddle), in numpy alone.

``convert_state(state, template)`` turns a state captured in one framework into the other's
layout, taking the target's structure from ``template`` (the target adapter's capture of the live
target objects).  ``ckptcore.convert`` and ``ckptcore.load_state`` build the template for you.

Modules, in the order data flows through them:

* :mod:`.match`: which source layer is which target layer (from the adapters' ParamInfo);
* :mod:`.layouts`: weight layouts (transposes, gate orders, the Flatten row permutation), applied
  to weights and their optimizer slots alike;
* :mod:`.optimizers`: slot meanings, step counters, hyperparameters, Adam's epsilon convention;
* :mod:`.schedules`: which learning-rate schedules continue each other, at which step;
* :mod:`.rng`: Python/numpy RNG carried, framework RNGs reseeded deterministically;
* :mod:`.convert`: the orchestration.

Nothing here imports a framework.  See docs/MIGRATION.md for what is exact and what is not.
"""

from __future__ import annotations

from .convert import FRAMEWORKS, MigrationWarning, convert_state

__all__ = ["convert_state", "MigrationWarning", "FRAMEWORKS"]
