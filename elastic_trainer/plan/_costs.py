"""Per-event costs of each strategy: the medians of what its runs measured."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from .._failures import ConfigError
from ._runs import MeasuredFailure, MeasuredRun


@dataclass(frozen=True)
class RecoveryCost:
    """The parts of one recovery that are neither waiting for slices nor lost steps (seconds).

    :param restart_s: a new worker's process start (``startup_s``; full restarts only).
    :param other_s: the rest: leaving the failed step, the old worker's exit, the report.
    """

    detection_s: float = 0.0
    remesh_s: float = 0.0
    compile_s: float = 0.0
    restore_s: float = 0.0
    restart_s: float = 0.0
    other_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Every part together."""
        return sum(dataclasses.astuple(self))


@dataclass(frozen=True)
class StrategyCosts:
    """What one strategy's events cost (seconds), as its runs measured them.

    :param step_s: productive time per step on the measured cluster.
    :param gap_s: the time between two steps (input, hooks).
    :param save_s: the time one checkpoint save blocks the step loop.
    :param start_s: from a job's start to its first step.
    :param end_s: from a job's last step or save to its end.
    :param layout_compile_s: compiling (or loading from the cache) the step for one layout.
    :param recovery: the parts of a recovery, or ``None`` when no run of it failed.
    :param scale_up_s: moving back onto returned slices.
    """

    strategy: str
    step_s: float
    gap_s: float
    save_s: float
    start_s: float
    end_s: float
    layout_compile_s: float
    recovery: RecoveryCost | None
    scale_up_s: float
    runs: int
    failures: int

    def for_run(self, run: MeasuredRun) -> StrategyCosts:
        """These costs with ``run``'s own job-level measurements (its step time, gaps, start and end)."""
        return dataclasses.replace(self, step_s=run.step_s, gap_s=run.gap_s, start_s=run.start_s, end_s=run.end_s)


def strategy_costs(runs: list[MeasuredRun]) -> dict[str, StrategyCosts]:
    """Each strategy's costs, pooled over its runs: the median of every measured part."""
    costs = {}
    for strategy in sorted({run.strategy for run in runs}):
        own = [run for run in runs if run.strategy == strategy]
        failures = [f for run in own for f in run.failures if f.recovery_s > 0]
        costs[strategy] = StrategyCosts(
            strategy=strategy,
            step_s=_median(run.step_s for run in own),
            gap_s=_median(run.gap_s for run in own),
            save_s=_median(s for run in own for s in run.saves_s),
            start_s=_median(run.start_s for run in own),
            end_s=_median(run.end_s for run in own),
            layout_compile_s=_median(run.layout_compile_s for run in own),
            recovery=_recovery(failures) if failures else None,
            scale_up_s=_median(s for run in own for s in run.scale_ups_s),
            runs=len(own),
            failures=len(failures),
        )
    return costs


def cost_names() -> tuple[str, ...]:
    """The costs a what-if may set: every number of :class:`StrategyCosts` and of :class:`RecoveryCost`, and the
    trainer's speed against a bare loop (``overhead_ratio``, set apart: :func:`bare_loop_costs`)."""
    own = [f.name for f in dataclasses.fields(StrategyCosts) if f.name.endswith("_s")]
    return (*own, *(f.name for f in dataclasses.fields(RecoveryCost)), "overhead_ratio")


def with_costs(costs: dict[str, StrategyCosts], settings: dict[str, float]) -> dict[str, StrategyCosts]:
    """Every strategy's costs with ``settings`` (``{"layout_compile_s": 120.0}``, say) in place of the measured."""
    for name, seconds in settings.items():
        if name not in cost_names() or name == "overhead_ratio":
            raise ConfigError(f"there is no cost {name!r}; choose one of: {', '.join(cost_names())}.")
        if not seconds >= 0:
            raise ConfigError(f"the cost {name} must be a number of seconds, at least 0, got {seconds}.")
    recovery_parts = {f.name for f in dataclasses.fields(RecoveryCost)}
    own = {name: s for name, s in settings.items() if name not in recovery_parts}
    parts = {name: s for name, s in settings.items() if name in recovery_parts}
    return {
        strategy: dataclasses.replace(c, **own, recovery=dataclasses.replace(c.recovery or RecoveryCost(), **parts)
                                      if parts else c.recovery)
        for strategy, c in costs.items()
    }


def bare_loop_costs(costs: dict[str, StrategyCosts], overhead_ratio: float) -> StrategyCosts:
    """The user's own loop (``bare_loop``): the measured job and restart costs of ``full_restart`` (else of the
    first strategy measured), its step and the gap after it those of the trainer times ``overhead_ratio`` (the
    trainer's steps/s over the loop's, ``benchmarks/overhead.py``), its every failure a restart."""
    if not costs:
        raise ConfigError("the projection needs at least one run.")
    if not 0 < overhead_ratio <= 1:
        raise ConfigError(f"the cost overhead_ratio must be above 0 and at most 1 (the trainer's steps/s over a "
                          f"bare loop's), got {overhead_ratio}.")
    base = costs.get("full_restart") or next(iter(costs.values()))
    return dataclasses.replace(base, strategy="bare_loop", step_s=base.step_s * overhead_ratio,
                               gap_s=base.gap_s * overhead_ratio, recovery=restart_cost(costs), runs=0, failures=0)


def restart_cost(costs: dict[str, StrategyCosts]) -> RecoveryCost:
    """What restarting the job's processes costs: full_restart's measured recovery, else a job's start."""
    restarted = costs.get("full_restart")
    if restarted is not None and restarted.recovery is not None:
        return restarted.recovery
    if not costs:
        raise ConfigError("the projection needs at least one run.")
    return RecoveryCost(restart_s=max(c.start_s for c in costs.values()))


SWAP_ACTION = "hot_swap"
"""The ``action`` of a failure that a spare took the place of (``report.json``)."""


def swap_cost(runs: list[MeasuredRun], settings: dict[str, float] | None = None) -> RecoveryCost:
    """What a swap costs: the medians over the runs' failures that a spare took the place of, with the recovery
    parts of ``settings`` (what-ifs, as :func:`with_costs` takes them) in place of the measured."""
    swaps = [f for run in runs for f in run.failures if f.action == SWAP_ACTION and f.recovery_s > 0]
    if not swaps:
        raise ConfigError(f"no failure of the {len(runs)} spare runs given was a {SWAP_ACTION}, so a swap's cost is "
                          "unmeasured: run python -m elastic_trainer +benchmark=spares, or pass runs that swapped.")
    parts = {f.name for f in dataclasses.fields(RecoveryCost)}
    return dataclasses.replace(_recovery(swaps), **{name: s for name, s in (settings or {}).items() if name in parts})


def _recovery(failures: list[MeasuredFailure]) -> RecoveryCost:
    return RecoveryCost(
        detection_s=_median(f.detection_s for f in failures),
        remesh_s=_median(f.remesh_s for f in failures),
        compile_s=_median(f.compile_s for f in failures),
        restore_s=_median(f.restore_s for f in failures),
        restart_s=_median(f.startup_s for f in failures),
        other_s=_median(f.other_s for f in failures),
    )


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0
