"""The projection checked against what was measured: each run replayed through its own failure schedule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .._failures import ConfigError
from ._costs import StrategyCosts, restart_cost
from ._model import SINGLE_CONTROLLER
from ._runs import SWAPPING, MeasuredRun
from ._simulate import SWAP_THEN_SCALE_DOWN, Scenario, ScheduledFailure, replay

REPLAYED_PHASES = ("train_step", "checkpoint_save")


@dataclass(frozen=True)
class Validation:
    """One run's measured goodput beside the one the simulation predicts for it."""

    run: str
    strategy: str
    schedule: str
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        """Predicted minus measured."""
        return self.predicted - self.measured


def validate(runs: list[MeasuredRun], costs: dict[str, StrategyCosts]) -> list[Validation]:
    """Replay every run: its own step time, start and end, its strategy's per-event costs (the medians
    over all the runs given), its checkpoint period and its failure schedule, on one controller. A run that
    swapped spares in is replayed as ``swap_then_scale_down``, each recovery of its strategy's a swap."""
    restart = restart_cost(costs)
    validations = []
    for run in runs:
        if run.strategy in SWAPPING:
            own = dataclasses.replace(costs[run.strategy].for_run(run), strategy=SWAP_THEN_SCALE_DOWN)
            scenario = Scenario(SWAP_THEN_SCALE_DOWN, run.slices, own, restart, SINGLE_CONTROLLER, period=run.period,
                                spares=run.spares, swap=own.recovery)
        else:
            scenario = Scenario(run.strategy, run.slices, costs[run.strategy].for_run(run), restart,
                                SINGLE_CONTROLLER, period=run.period)
        outcome = replay(scenario, run.steps, schedule(run))
        validations.append(Validation(run.name, run.strategy, run.schedule, run.goodput, outcome.goodput))
    return validations


def schedule(run: MeasuredRun) -> list[ScheduledFailure]:
    """The run's failures as a schedule to replay; :class:`ConfigError` for one that cannot be."""
    replayed = []
    for failure in run.failures:
        if failure.phase not in REPLAYED_PHASES:
            raise ConfigError(f"run {run.name} lost a slice in phase {failure.phase!r}; the validation replays "
                              f"failures in {' and '.join(REPLAYED_PHASES)} only.")
        if failure.down_for_s is None:
            raise ConfigError(f"run {run.name} has no chaos config (.hydra/config.yaml), so how long its slices "
                              f"stayed down is unknown.")
        replayed.append(ScheduledFailure(failure.step, failure.phase, failure.slices, failure.down_for_s))
    return replayed
