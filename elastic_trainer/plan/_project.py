"""Projections: each strategy's goodput on a cluster of any size, simulated over many long jobs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .._failures import ConfigError, check_at_least
from ._closed_form import choose_period, lost_steps_per_day, restart_goodput
from ._costs import RecoveryCost, StrategyCosts, bare_loop_costs, restart_cost
from ._model import LLAMA3_DAYS, MEASURED_OVERHEAD_RATIO, FailureModel, Runtime
from ._simulate import BARE_LOOP, SWAP_THEN_SCALE_DOWN, Failure, Scenario, failure_trace, simulate

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
    :param spares: spare slices besides ``slices``.
    :param per_chip_goodput: productive chip-time over the time of every chip, spares included: the progress times
        ``slices / (slices + spares)`` (a step on fewer slices takes as much chip-time as on all).
    :param swaps_per_day: failures a day that a spare took the place of.
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
    spares: int
    per_chip_goodput: float
    swaps_per_day: float

    @property
    def provisioned_throughput(self) -> float:
        """The throughput per provisioned chip: times ``slices / (slices + spares)``."""
        return self.throughput * self.slices / (self.slices + self.spares)


def scenarios(costs: dict[str, StrategyCosts], slices: int, model: FailureModel, runtime: Runtime, *,
              overhead_ratio: float = MEASURED_OVERHEAD_RATIO, spares: int | None = None,
              swap: RecoveryCost | None = None) -> list[Scenario]:
    """One scenario per measured strategy on ``slices`` slices, and one of the user's own loop restarting from
    checkpoints (:func:`bare_loop_costs`), each with its Young/Daly period; with ``spares``, one more of
    :func:`spare_scenario`."""
    check_at_least("the number of slices", slices, 1)
    restart = restart_cost(costs)
    chosen = []
    for strategy, own in {**costs, BARE_LOOP: bare_loop_costs(costs, overhead_ratio)}.items():
        speed = 1.0 if strategy == BARE_LOOP else overhead_ratio
        scenario = Scenario(strategy, slices, own, restart, runtime, period=1, speed=speed)
        chosen.append(dataclasses.replace(scenario, period=choose_period(scenario, model).steps))
    if spares is not None:
        chosen.append(spare_scenario(costs, slices, model, runtime, spares, swap, overhead_ratio=overhead_ratio))
    return chosen


def spare_scenario(costs: dict[str, StrategyCosts], slices: int, model: FailureModel, runtime: Runtime, spares: int,
                   swap: RecoveryCost | None, *, overhead_ratio: float = MEASURED_OVERHEAD_RATIO) -> Scenario:
    """``swap_then_scale_down`` with ``spares`` spare slices: ``scale_down``'s measured costs, a swap's
    measured cost while a spare is free, and ``scale_down``'s Young/Daly period (the same roll-backs)."""
    if "scale_down" not in costs:
        raise ConfigError("with no spare free a swap_then_scale_down job scales down, and no run given measured "
                          "scale_down.")
    own = dataclasses.replace(costs["scale_down"], strategy=SWAP_THEN_SCALE_DOWN)
    scenario = Scenario(SWAP_THEN_SCALE_DOWN, slices, own, restart_cost(costs), runtime, period=1, speed=overhead_ratio,
                        spares=spares, swap=swap)
    return dataclasses.replace(scenario, period=choose_period(scenario, model).steps)


def spare_counts(slices: int, model: FailureModel, *, tail: float = 1e-3) -> range:
    """The spare counts worth trying: 0 up to the number of slices down at once that is exceeded only ``tail`` of
    the time (Poisson, of mean the failures per second times the mean repair), at least 1."""
    mean = model.failures_per_day(slices) / 86400 * model.repair_s
    count, term = 0, math.exp(-mean)
    below = term
    while 1 - below >= tail:
        count += 1
        term *= mean / count
        below += term
    return range(max(1, count) + 1)


def project(chosen: list[Scenario], model: FailureModel, horizon: Horizon) -> list[Projection]:
    """Simulate every scenario through the same failures: jobs of ``horizon.days`` until enough have failed."""
    slices = chosen[0].slices
    drawn = slices + max(scenario.spares for scenario in chosen)
    horizon_s = horizon.days * 86400
    rng = np.random.default_rng([horizon.seed, slices])
    outcomes: list[list] = [[] for _ in chosen]
    failures = jobs = 0
    while jobs < horizon.max_jobs and (failures < horizon.min_failures or not jobs):
        trace = failure_trace(model, drawn, controller=chosen[0].runtime.controller_fails, horizon_s=horizon_s, rng=rng)
        for scenario, done in zip(chosen, outcomes):
            done.append(simulate(scenario, _own_failures(trace, drawn, scenario.slices + scenario.spares), horizon_s))
        failures, jobs = failures + len(trace), jobs + 1
    projections = []
    for scenario, done in zip(chosen, outcomes):
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
            spares=scenario.spares,
            per_chip_goodput=progress * slices / (slices + scenario.spares),
            swaps_per_day=sum(o.swaps for o in done) / wall_s * 86400,
        ))
    return projections


def _own_failures(trace: list[Failure], drawn: int, owned: int) -> list[Failure]:
    """The failures, of ``drawn`` slices and the controller (numbered ``drawn``), of a job's ``owned`` slices and its
    controller (numbered ``owned``)."""
    if owned == drawn:
        return trace
    return [f if f.slice < owned else dataclasses.replace(f, slice=owned) for f in trace
            if f.slice < owned or f.slice == drawn]


def recommend(projections: list[Projection]) -> Projection:
    """The strategy (or the bare loop) that gets the most steps done per provisioned chip (then the higher goodput)."""
    return max(projections, key=lambda p: (round(p.provisioned_throughput, 4), p.goodput))


def recommend_spares(projections: list[Projection]) -> Projection:
    """The spare count with the most goodput per provisioned chip (within 1e-5, the fewest spares)."""
    return max(projections, key=lambda p: (round(p.per_chip_goodput, 5), -p.spares))


def scaling(costs: dict[str, StrategyCosts], model: FailureModel, runtime: Runtime, horizon: Horizon,
            slice_counts: tuple[int, ...] = SLICE_COUNTS, *,
            overhead_ratio: float = MEASURED_OVERHEAD_RATIO) -> dict[int, list[Projection]]:
    """Every strategy projected at every slice count."""
    return {n: project(scenarios(costs, n, model, runtime, overhead_ratio=overhead_ratio), model, horizon)
            for n in slice_counts}


def spare_scaling(costs: dict[str, StrategyCosts], swap: RecoveryCost, model: FailureModel, runtime: Runtime,
                  horizon: Horizon, slice_counts: tuple[int, ...] = SLICE_COUNTS, *,
                  overhead_ratio: float = MEASURED_OVERHEAD_RATIO) -> dict[int, list[Projection]]:
    """``swap_then_scale_down`` projected at every slice count with every count of :func:`spare_counts`, all
    through the same failures of the slices in use."""
    return {n: project([spare_scenario(costs, n, model, runtime, k, swap, overhead_ratio=overhead_ratio)
                        for k in spare_counts(n, model)], model, horizon) for n in slice_counts}
