"""Which steps a run saves: Orbax's save decision policies (a fixed period, or the Young/Daly rule) and the last
step."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Literal

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import (AnySavePolicy, DecisionContext, FixedIntervalPolicy,
                                                  SpecificStepsPolicy)

from ._young_daly import YoungDalyPolicy


@dataclasses.dataclass(frozen=True)
class _StepInfo:
    """A step as Orbax's save decision policies see it (their ``PolicyCheckpointInfo``)."""

    step: int
    time: datetime.datetime
    metrics: dict[str, Any] | None = None


_DECISION_CONTEXT = DecisionContext(
    is_saving_in_progress=False, reached_preemption=False, multiprocessing_options=ocp.options.MultiprocessingOptions())
"""What the policies that decide the saves are told beside the step: the ones used here read none of it."""


class SaveSchedule:
    """The steps a :class:`~elastic_trainer.Checkpointer` saves, as Orbax's save decision policies choose them.

    A multiple of ``period``, and the run's last step. With ``period="auto"``
    the steps between saves follow the Young/Daly rule
    (:class:`YoungDalyPolicy`), re-chosen after every save from its measured
    cost (:meth:`saved`).

    :param period: save every this many steps, or ``"auto"``.
    :param mtbf_s: for ``period="auto"``: the expected seconds between failures, or ``None`` for the rate
        observed in the run.
    """

    def __init__(self, period: int | Literal["auto"], mtbf_s: float | None = None):
        self.period = period
        self.policy = YoungDalyPolicy(mtbf_s) if period == "auto" else FixedIntervalPolicy(period)
        """Which steps to save (an Orbax policy): every ``period`` steps, or by the Young/Daly rule."""

    def due(self, step: int, *, last_step: int | None = None) -> bool:
        """Whether to save step ``step``: Orbax's :attr:`policy`, or it is the run's ``last_step``."""
        policy = AnySavePolicy([self.policy, SpecificStepsPolicy(() if last_step is None else (last_step,))])
        return policy.should_save(_StepInfo(step, datetime.datetime.now(datetime.timezone.utc)), previous_steps=(),
                                  context=_DECISION_CONTEXT)

    def saved(self, step: int, *, blocked_s: float, step_times_s: list[float], elapsed_s: float, failures: int) -> None:
        """Note that saving ``step`` blocked the loop ``blocked_s``; with ``period="auto"``, plan the next save."""
        if isinstance(self.policy, YoungDalyPolicy):
            self.policy.saved(step, save_cost_s=blocked_s, step_times_s=step_times_s, elapsed_s=elapsed_s,
                              failures=failures)

    def describe(self) -> dict[str, Any]:
        """The period, for the report; an automatic one says what it chose and why."""
        return {"period": self.period,
                "auto": self.policy.period.choice if isinstance(self.policy, YoungDalyPolicy) else None}
