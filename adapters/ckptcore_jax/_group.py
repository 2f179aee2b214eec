"""``process_group()``: the processes of a JAX job as a ``ckptcore.ProcessGroup``.

A single process (``jax.process_count() == 1``, however many devices it drives) is a group of
one.  A multi-process job (``jax.distributed.initialize``) needs the group protocol over JAX's
coordination service (its key-value store and barriers): not built yet (issue 26, point 2).
"""

from __future__ import annotations

from typing import Any

__all__ = ["process_group"]


def process_group() -> Any:
    import jax

    from ckptcore import SingleProcessGroup
    from ckptcore_jax import NotYetImplementedError

    if jax.process_count() == 1:
        return SingleProcessGroup()
    raise NotYetImplementedError(
        f"ckptcore_jax.process_group() for a job of {jax.process_count()} processes is not "
        "implemented yet (issue 26, point 2); save each process's state to its own URL meanwhile")
