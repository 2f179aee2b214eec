"""The adapter contract's types (``Adapter``, ``FileFormat``, ``DemoProgram``), below every module
that needs them: the registry checks adapters against ``Adapter``, and :mod:`ckptcore.adapter`
(the adapter SPI, which also offers conversion through the registry) re-exports all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from .state import RestoreReport, TrainingState


@runtime_checkable
class Adapter(Protocol):
    """What the registry expects of an adapter object (``ADAPTER`` in the adapter package).

    ``capture`` and ``restore`` take the framework objects as keywords: ``model`` always, then
    ``optimizer``, ``cursor`` (a :class:`~ckptcore.DataCursor` or anything with ``state_dict`` /
    ``load_state_dict``) and any framework-specific ones (``scheduler``, ``scaler``...).  An object
    passed that the adapter does not know is a ``TypeError``, never silently ignored.
    """

    name: str
    """The framework's short name, also ``TrainingState.framework`` of its captures."""

    capture_views: bool
    """Whether ``capture(copy=False)`` returns views of live buffers (a synchronous save may write
    them as they are; an asynchronous save copies them first)."""

    def handles(self, obj: object) -> bool:
        """Whether ``obj`` (a model) belongs to this framework.  Must not import the framework."""

    def capture(self, *, model: Any, optimizer: Any = None, cursor: Any = None, rng: bool = True,
                copy: bool = True, **objects: Any) -> TrainingState:
        """Snapshot the objects.  ``rng=False`` leaves ``state.rng`` empty; ``copy=False`` may
        return views of live buffers (see :attr:`capture_views`)."""

    def restore(self, state: TrainingState, *, model: Any, optimizer: Any = None, cursor: Any = None,
                strict: bool = True, rng: bool = True, **objects: Any) -> RestoreReport:
        """Put ``state`` back (through a :class:`RestorePlan`).  ``rng=False`` leaves every RNG
        as it is.  A state of another framework is converted first (``ckptcore.convert``)."""

    @property
    def dialect(self) -> Any:
        """The framework's migration dialect (see :mod:`ckptcore.migrate`): its optimizers,
        schedules, RNG and ``extra`` section in neutral terms."""

    @property
    def formats(self) -> Sequence[FileFormat]:
        """The framework's native checkpoint files that ``ckpt import``/``ckpt export`` handle."""

    def demo(self, *, seed: int, features: int, classes: int) -> DemoProgram:
        """A tiny model for ``ckpt demo``, built deterministically from ``seed``."""


@dataclass(frozen=True)
class FileFormat:
    """A framework's native checkpoint files, as the command line sees them.

    Attributes:
        name: The ``--to``/``--from`` choice, e.g. ``"tf-checkpoint"``, ``"pdparams"``.
        framework: The adapter's name.
        description: One line for ``--help``.
        detect: Whether a path given to ``ckpt import`` is of this format (no framework import).
        read: ``read(src, model=None, optimizer=None, **options) -> TrainingState``; ``model`` and
            ``optimizer`` come from ``--model MODULE:FACTORY`` when given.
        write: ``write(state, dst, model=None, optimizer=None, **options) -> str`` (what it wrote).
        needs_model: Whether ``write`` needs live objects (``--model``) to name or shape the files.
        options: Extra command-line options, ``{name: help}``, passed to ``read``/``write`` as
            keywords (``None`` when not given on the command line).
    """

    name: str
    framework: str
    description: str
    detect: Callable[[str], bool]
    read: Callable[..., TrainingState] | None = None
    write: Callable[..., Any] | None = None
    needs_model: bool = False
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.read is None and self.write is None:
            raise ValueError(f"file format {self.name!r} neither reads nor writes")


@dataclass(frozen=True)
class DemoProgram:
    """What ``ckpt demo`` trains: the objects it saves and restores, and one training step.

    ``objects`` go to ``CheckpointManager.save``/``restore`` as keywords (``model=...``, ...);
    ``train_step(x, y)`` trains one batch of float32 features and int64 labels.
    """

    description: str
    objects: Mapping[str, Any]
    train_step: Callable[[np.ndarray, np.ndarray], None]
