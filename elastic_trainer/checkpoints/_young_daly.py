"""``checkpoint.period=auto``: the checkpoint period by the Young/Daly rule."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from orbax.checkpoint.checkpoint_managers import DecisionContext, PolicyCheckpointInfo, SaveDecisionPolicy

from .._failures import ConfigError


class YoungDalyPeriod:
    """Chooses how many steps apart checkpoints go, from what the run measured.

    Young (1974) and Daly (2006): the interval between checkpoints that loses
    the least time to saves plus recomputation after failures is about
    ``sqrt(2 x save_cost x MTBF)``. The save cost is the time the step loop
    really waited for each save so far (median); the step time is the median
    of the steps so far. The MTBF is ``mtbf_s`` when given; otherwise the
    rate observed in this run: run time divided by failures seen, or, before
    the first failure, the run time so far (a failure-free stretch is a lower
    bound on the MTBF, so the period grows while nothing fails).

    :param mtbf_s: expected seconds between failures, or ``None`` to use the rate observed.
    """

    def __init__(self, mtbf_s: float | None = None):
        check_mtbf(mtbf_s)
        self.mtbf_s = mtbf_s
        self.save_costs_s: list[float] = []
        self.choice: dict[str, Any] | None = None

    def choose(self, *, save_cost_s: float, step_times_s: list[float], elapsed_s: float, failures: int) -> int:
        """Record a save that blocked ``save_cost_s`` and return the steps until the next one."""
        self.save_costs_s.append(save_cost_s)
        cost = statistics.median(self.save_costs_s)
        step_time = statistics.median(step_times_s)
        if self.mtbf_s is not None:
            mtbf, source = self.mtbf_s, "from checkpoint.mtbf_s"
        elif failures:
            mtbf, source = elapsed_s / failures, f"observed: {failures} failure(s) in {elapsed_s:.0f} s"
        else:
            mtbf, source = elapsed_s, f"observed: no failure in {elapsed_s:.0f} s, a lower bound"
        interval = math.sqrt(2 * cost * mtbf)
        steps = max(1, round(interval / step_time))
        self.choice = {
            "period_steps": steps,
            "interval_s": interval,
            "save_cost_s": cost,
            "step_time_s": step_time,
            "mtbf_s": mtbf,
            "mtbf_source": source,
            "why": (
                f"Young/Daly: sqrt(2 x {cost:.3f} s save x {mtbf:.0f} s MTBF) = {interval:.2f} s"
                f" = {steps} step(s) of {step_time:.3f} s; MTBF {source}"
            ),
        }
        return steps


class YoungDalyPolicy(SaveDecisionPolicy):
    """Orbax's save decision for ``checkpoint.period=auto``: the first step is saved (to measure what a save
    costs), then each step once :attr:`period` chose after the last save has passed.

    :param mtbf_s: as for :class:`YoungDalyPeriod`.
    """

    def __init__(self, mtbf_s: float | None = None):
        self.period = YoungDalyPeriod(mtbf_s)
        self.next_step = 1

    def should_save(self, step: PolicyCheckpointInfo, previous_steps: Sequence[PolicyCheckpointInfo], *,
                    context: DecisionContext) -> bool:
        return step.step >= self.next_step

    def saved(self, step: int, *, save_cost_s: float, step_times_s: list[float], elapsed_s: float,
              failures: int) -> None:
        """Step ``step`` was saved at that cost: choose when the next save is due."""
        self.next_step = step + self.period.choose(save_cost_s=save_cost_s, step_times_s=step_times_s,
                                                   elapsed_s=elapsed_s, failures=failures)


def check_mtbf(mtbf_s: float | None) -> None:
    """Raise :class:`ConfigError` unless ``mtbf_s`` is ``None`` or a positive number of seconds."""
    if mtbf_s is not None and not mtbf_s > 0:
        raise ConfigError(f"checkpoint.mtbf_s must be a positive number of seconds or null, got {mtbf_s}.")
