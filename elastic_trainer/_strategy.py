"""The base of a strategy plugin: the hook it must implement and the optional ones, with their defaults."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar


if TYPE_CHECKING:
    from ._failures import Failure, RecoveryPlan
    from ._protocols import RunView, TrainerView
    from ._state import TrainState
    from ._training_mode import AbstractTrainingMode

DEFAULT_MAX_RESTARTS = 10
"""How many new worker processes the command may start for a strategy's restarts when the strategy does not say
(its ``max_restarts``)."""


def one_slice_lost(slices: Sequence[int], *, at_least: int = 0) -> list[list[int]]:
    """Every layout of ``slices`` with one of them lost: where the next failure takes a run, for a strategy's
    ``et_likely_layouts`` (the trainer fills each lost place with a spare, where the cluster keeps one); none
    when that would leave fewer than ``at_least`` slices (a strategy's ``min_slice_count``)."""
    if len(slices) <= at_least:
        return []
    return [[s for s in slices if s != lost] for lost in slices]


class AbstractStrategy(abc.ABC):
    """A strategy plugin: it decides how the run recovers from each failure (:meth:`et_choose_recovery`).

    A subclass marks the hooks it implements with ``et.hookimpl``, as any
    plugin does, and takes every argument of each (the hooks' full
    signatures, as below). The optional hooks here do nothing and are not
    registered unless a subclass overrides them, so a strategy that composes
    others (``fallback``) calls each member's hooks directly, without asking
    which it has.
    """

    name: ClassVar[str]
    """The report's ``strategy``."""
    max_restarts: int = DEFAULT_MAX_RESTARTS
    """How many new worker processes the command may start when this strategy's plans restart the process."""

    @abc.abstractmethod
    def et_choose_recovery(self, trainer: RunView, failure: Failure) -> RecoveryPlan:
        """How to recover from ``failure`` (:func:`~elastic_trainer.hookspecs.et_choose_recovery`)."""

    def et_run_start(self, trainer: TrainerView, state: TrainState, mode: AbstractTrainingMode) -> None:
        """Check the run before its first step (:func:`~elastic_trainer.hookspecs.et_run_start`); by default,
        nothing to check."""

    def et_likely_layouts(self, trainer: TrainerView) -> list[list[int]]:
        """The layouts worth compiling ahead (:func:`~elastic_trainer.hookspecs.et_likely_layouts`); by
        default none."""
        return []

    def et_propose_resize(self, trainer: TrainerView, healthy_slices: list[int]) -> list[int] | None:
        """The slices to move to at this step boundary (:func:`~elastic_trainer.hookspecs.et_propose_resize`);
        by default no resize."""
        return None

    def et_step_end(self, trainer: TrainerView, step: int, metrics: dict[str, Any]) -> None:
        """Note a completed step (:func:`~elastic_trainer.hookspecs.et_step_end`: ``scale_down`` counts the steps
        a dropped straggler stays out); by default nothing."""
