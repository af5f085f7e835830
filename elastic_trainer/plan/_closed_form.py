"""The closed forms: the checkpoint period by Young/Daly, and the goodput it gives a job that rolls back.

Young (1974) and Daly (2006): with a save that costs ``C`` and failures that
roll the job back every ``M`` seconds on average, the period that loses the
least is about ``sqrt(2 C M)``. Between two failures the job then runs ``M``
seconds on average, of which it saves ``C / (tau + C)`` and loses the work
since the last checkpoint, ``(tau + C) / 2`` on average, and then restarts for
``R`` seconds: it keeps ``tau / (tau + C) x (M - (tau + C) / 2) / (M + R)`` of
its time for steps. Unlike the simulation, this counts no failure during a
restart (a slice lost while the job waits for another).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoints._young_daly import YoungDalyPeriod
from ._model import FailureModel
from ._simulate import Scenario


@dataclass(frozen=True)
class Period:
    """A chosen checkpoint period: ``steps`` apart, ``interval_s`` of steps, against ``mtbf_s`` between roll-backs."""

    steps: int
    interval_s: float
    mtbf_s: float


def rollback_mtbf_s(scenario: Scenario, model: FailureModel) -> float:
    """Mean seconds between the failures that roll the scenario's job back: every failure of a slice or
    of the controller when it restarts on each, else only the coordinator's (the controller, or process 0)."""
    if scenario.restarts_on_every_failure:
        return 1 / ((scenario.slices + int(scenario.runtime.controller_fails)) * model.slice_rate_per_s)
    return 1 / model.slice_rate_per_s


def lost_steps_per_day(scenario: Scenario, model: FailureModel) -> float:
    """Expected steps rolled back a day: each roll-back to a checkpoint loses half a period on average, and on
    one controller each failure of an elastic strategy's slice (while a step runs) half a snapshot period."""
    lost = 86400 / rollback_mtbf_s(scenario, model) * scenario.period / 2
    if not scenario.restarts_on_every_failure and scenario.runtime.step_takes_state:
        lost += model.failures_per_day(scenario.slices) * scenario.snapshot_period / 2
    return lost


def choose_period(scenario: Scenario, model: FailureModel) -> Period:
    """The Young/Daly period for ``scenario`` (its own ``period`` is ignored), by the rule ``checkpoint.period=auto`` uses."""
    costs = scenario.costs
    mtbf_s = rollback_mtbf_s(scenario, model)
    rule = YoungDalyPeriod(mtbf_s=mtbf_s)
    steps = rule.choose(save_cost_s=scenario.save_s, step_times_s=[costs.step_s + costs.gap_s], elapsed_s=0.0,
                        failures=0)
    return Period(steps=steps, interval_s=rule.choice["interval_s"], mtbf_s=mtbf_s)


def restart_goodput(scenario: Scenario, model: FailureModel) -> float:
    """The closed-form goodput of a scenario that restarts every process on every failure (see the module)."""
    costs, runtime, cost = scenario.costs, scenario.runtime, scenario.restart
    mtbf_s = rollback_mtbf_s(scenario, model)
    starting_s = scenario.detection_s(cost) + cost.other_s + cost.restart_s + runtime.barrier_s(scenario.slices)
    restart_s = starting_s + model.expected_wait_s(starting_s) + cost.compile_s + cost.restore_s
    step_wall_s = costs.step_s + costs.gap_s
    tau, save = scenario.period * step_wall_s, scenario.save_s
    return costs.step_s / step_wall_s * tau / (tau + save) * (mtbf_s - (tau + save) / 2) / (mtbf_s + restart_s)
