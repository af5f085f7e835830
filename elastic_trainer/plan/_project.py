"""Projections: each strategy's goodput on a cluster of any size, simulated over many long jobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .._failures import ConfigError, check_at_least
from ._closed_form import choose_period, lost_steps_per_day, restart_goodput
from ._costs import StrategyCosts, bare_loop_costs, restart_cost
from ._model import LLAMA3_DAYS, MEASURED_OVERHEAD_RATIO, FailureModel, Runtime
from ._simulate import BARE_LOOP, Scenario, failure_trace, simulate

SLICE_COUNTS = tuple(2**k for k in range(2, 13))
"""The slice counts of the scaling table and plot: 4 to 4,096."""


@dataclass(frozen=True)
class Horizon:
    """How much to simulate: jobs of ``days`` each, as many as it takes to see ``min_failures`` failures
    (at most ``max_jobs``), the failures drawn from ``seed``."""

    days: float = LLAMA3_DAYS
    min_failures: int = 400
    max_jobs: int = 2000
    seed: int = 0

    def __post_init__(self):
        if not self.days > 0:
            raise ConfigError(f"the job length must be a positive number of days, got {self.days}.")
        check_at_least("the number of failures to simulate", self.min_failures, 1)
        check_at_least("the number of jobs to simulate", self.max_jobs, 1)


@dataclass(frozen=True)
class Projection:
    """One strategy on one cluster, projected.

    :param goodput: productive time over wall time, as ``report.json`` defines it.
    :param progress: the steps done, timed as on every slice, over wall time.
    :param throughput: the progress times the scenario's speed against the bare loop: the steps done, timed as
        the bare loop's step on every slice, over wall time, what the job gets done against the user's
        alternative (the recommendation goes by this).
    :param failures_per_day: expected slice failures a day.
    :param lost_steps_per_day: steps rolled back a day, expected (roll-backs are too rare at scale for the
        simulation to count them well: elastic strategies roll back only when the coordinator is lost).
    :param closed_form: Young/Daly's first-order goodput, for a strategy that restarts on every failure.
    """

    strategy: str
    slices: int
    goodput: float
    progress: float
    throughput: float
    failures_per_day: float
    period_steps: int
    period_s: float
    lost_steps_per_day: float
    closed_form: float | None
    jobs: int
    failures: int


def scenarios(costs: dict[str, StrategyCosts], slices: int, model: FailureModel, runtime: Runtime, *,
              overhead_ratio: float = MEASURED_OVERHEAD_RATIO) -> list[Scenario]:
    """One scenario per measured strategy on ``slices`` slices, and one of the user's own loop restarting from
    checkpoints (:func:`bare_loop_costs`), each with its Young/Daly period."""
    check_at_least("the number of slices", slices, 1)
    restart = restart_cost(costs)
    chosen = []
    for strategy, own in {**costs, BARE_LOOP: bare_loop_costs(costs, overhead_ratio)}.items():
        speed = 1.0 if strategy == BARE_LOOP else overhead_ratio
        scenario = Scenario(strategy, slices, own, restart, runtime, period=1, speed=speed)
        chosen.append(dataclasses.replace(scenario, period=choose_period(scenario, model).steps))
    return chosen


def project(chosen: list[Scenario], model: FailureModel, horizon: Horizon) -> list[Projection]:
    """Simulate every scenario through the same failures: jobs of ``horizon.days`` until enough have failed."""
    slices = chosen[0].slices
    horizon_s = horizon.days * 86400
    rng = np.random.default_rng([horizon.seed, slices])
    outcomes: dict[str, list] = {scenario.strategy: [] for scenario in chosen}
    failures = jobs = 0
    while jobs < horizon.max_jobs and (failures < horizon.min_failures or not jobs):
        trace = failure_trace(model, slices, controller=chosen[0].runtime.controller_fails, horizon_s=horizon_s, rng=rng)
        for scenario in chosen:
            outcomes[scenario.strategy].append(simulate(scenario, trace, horizon_s))
        failures, jobs = failures + len(trace), jobs + 1
    projections = []
    for scenario in chosen:
        done = outcomes[scenario.strategy]
        wall_s = sum(o.wall_s for o in done)
        progress = sum(o.steps * o.full_step_s for o in done) / wall_s
        projections.append(Projection(
            strategy=scenario.strategy,
            slices=slices,
            goodput=sum(o.productive_s for o in done) / wall_s,
            progress=progress,
            throughput=progress * scenario.speed,
            failures_per_day=model.failures_per_day(slices),
            period_steps=scenario.period,
            period_s=scenario.period * (scenario.costs.step_s + scenario.costs.gap_s),
            lost_steps_per_day=lost_steps_per_day(scenario, model),
            closed_form=restart_goodput(scenario, model) if scenario.restarts_on_every_failure else None,
            jobs=jobs,
            failures=failures,
        ))
    return projections


def recommend(projections: list[Projection]) -> Projection:
    """The strategy (or the bare loop) that gets the most steps done (then the higher goodput)."""
    return max(projections, key=lambda p: (round(p.throughput, 4), p.goodput))


def scaling(costs: dict[str, StrategyCosts], model: FailureModel, runtime: Runtime, horizon: Horizon,
            slice_counts: tuple[int, ...] = SLICE_COUNTS, *,
            overhead_ratio: float = MEASURED_OVERHEAD_RATIO) -> dict[int, list[Projection]]:
    """Every strategy projected at every slice count."""
    return {n: project(scenarios(costs, n, model, runtime, overhead_ratio=overhead_ratio), model, horizon)
            for n in slice_counts}
