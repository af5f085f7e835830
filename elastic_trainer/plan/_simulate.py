"""A discrete-event simulation of one job: its steps, saves, failures, waits, recoveries and restarts.

Time moves from event to event (a failure, a slice back, the end of a
recovery); between two events the job trains at the rate of its layout and
saves every ``period`` steps, worked out in closed form, so a job of weeks
costs a few operations per failure, not per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._failures import ConfigError, check_at_least
from .._snapshots import DEFAULT_SNAPSHOT_PERIOD
from .._step_cache import DEFAULT_MAX_LAYOUTS
from ._costs import RecoveryCost, StrategyCosts
from ._model import FailureModel, Runtime

_EPSILON_S = 1e-7  # a scheduled failure comes this long before the end of its step or save
BARE_LOOP = "bare_loop"
"""The user's alternative: a hand-written donating loop, its step the bare loop's, that restarts every
process from its last checkpoint on every failure (a full restart without the trainer)."""
RESTARTING = ("full_restart", BARE_LOOP)
"""The strategies that restart every process on every failure, at their own measured cost."""
SWAP_THEN_SCALE_DOWN = "swap_then_scale_down"
"""Spares (``+strategy=swap_then_scale_down``): a spare takes a lost slice's place at a swap's measured cost; with
none free, ``scale_down`` at its own."""
SCALING_DOWN = ("scale_down", SWAP_THEN_SCALE_DOWN)
"""The strategies that go on with fewer slices, and back onto more when they are back."""


@dataclass(frozen=True)
class Scenario:
    """One job to simulate: a strategy on ``slices`` slices, what its events cost and how often it saves.

    :param restart: what restarting every process costs (a lost coordinator, or a group re-formed).
    :param period: steps between checkpoints.
    :param compile_ahead: ``scale_down`` compiles "one slice fewer" layouts in the background after
        each start of its processes, one at a time (``et_likely_layouts``), as many as the step
        cache has room for (``trainer.max_cached_layouts`` less the one in use); a layout needed
        before its compile started is compiled on the spot.
    :param snapshot_period: steps between host snapshots (``trainer.snapshot_period``; 0: none): where
        a slice lost while a step runs rolls an elastic strategy back to, when
        :attr:`Runtime.step_takes_state`.
    :param speed: its steps/s over the bare loop's on the same work (the trainer's ``overhead_ratio``; 1 for the
        bare loop itself), for :attr:`Projection.throughput`.
    :param spares: slices of the job out of the mesh, one of which takes a lost slice's place (``swap_then_scale_down``
        only); a lost slice, once repaired, is a spare.
    :param swap: what a swap costs, measured (:func:`swap_cost`); needed with spares.
    """

    strategy: str
    slices: int
    costs: StrategyCosts
    restart: RecoveryCost
    runtime: Runtime
    period: int
    compile_ahead: bool = True
    snapshot_period: int = DEFAULT_SNAPSHOT_PERIOD
    speed: float = 1.0
    spares: int = 0
    swap: RecoveryCost | None = None

    def __post_init__(self):
        check_at_least("the number of spare slices", self.spares, 0)
        if self.spares and (self.strategy != SWAP_THEN_SCALE_DOWN or self.swap is None):
            raise ConfigError(f"spares are modelled for {SWAP_THEN_SCALE_DOWN} with a measured swap cost only, "
                              f"not for {self.strategy}.")

    @property
    def save_s(self) -> float:
        """One save's blocking time, with the processes' barrier."""
        return self.costs.save_s + self.runtime.barrier_s(self.slices)

    @property
    def restarts_on_every_failure(self) -> bool:
        """Whether every lost slice restarts every process and rolls the job back to its last checkpoint."""
        return self.strategy in RESTARTING or (self.strategy == "pause_resume" and self.runtime.regroups)

    def detection_s(self, cost: RecoveryCost) -> float:
        """The time to detect a lost slice: the runtime's, or else the one measured with ``cost``."""
        return cost.detection_s if self.runtime.detection_s is None else self.runtime.detection_s


@dataclass(frozen=True)
class Failure:
    """Slice ``slice`` lost at ``time`` and back ``repair_s`` later; ``slice == slices`` is the controller."""

    time: float
    slice: int
    repair_s: float


@dataclass(frozen=True)
class ScheduledFailure:
    """A failure as a benchmark schedules it: as the step after ``step`` starts (``train_step``: before it is
    launched) or while step ``step`` is saved (``checkpoint_save``), the slices down for ``down_for_s`` from
    then."""

    step: int
    phase: str
    slices: tuple[int, ...]
    down_for_s: float


@dataclass(frozen=True)
class Outcome:
    """What a simulated job did (seconds and steps).

    :param full_step_s: a step's time on every slice, for :attr:`progress`.
    :param swaps: failures a spare took the place of.
    """

    wall_s: float
    productive_s: float
    steps: int
    full_step_s: float
    lost_steps: int
    saves: int
    swaps: int

    @property
    def goodput(self) -> float:
        """Productive time over wall time, as ``report.json`` defines it."""
        return self.productive_s / self.wall_s

    @property
    def progress(self) -> float:
        """The steps done, timed as on every slice, over wall time: goodput less any slower steps on fewer slices."""
        return self.steps * self.full_step_s / self.wall_s


def failure_trace(model: FailureModel, slices: int, *, controller: bool, horizon_s: float,
                  rng: np.random.Generator) -> list[Failure]:
    """Every failure of ``slices`` slices (and of a controller host) in ``horizon_s``, in time order:
    each fails after an exponential up time, stays down for a repair time, and fails again later."""
    count = slices + int(controller)
    mean_up_s = 1 / model.slice_rate_per_s
    next_failure = rng.exponential(mean_up_s, count)
    failures = []
    while (hit := np.flatnonzero(next_failure < horizon_s)).size:
        repairs = model.repair_times(rng, hit.size)
        failures += [Failure(float(t), int(s), float(r)) for t, s, r in zip(next_failure[hit], hit, repairs)]
        next_failure[hit] += repairs + rng.exponential(mean_up_s, hit.size)
    return sorted(failures, key=lambda f: f.time)


def simulate(scenario: Scenario, failures: list[Failure], horizon_s: float) -> Outcome:
    """The job run for ``horizon_s`` of wall time through ``failures``."""
    job = _Job(scenario)
    for failure in failures:
        job.run_until(failure.time)
        job.fail(failure.slice, failure.time + failure.repair_s)
    job.run_until(horizon_s)
    return job.outcome(horizon_s + scenario.costs.end_s)


def replay(scenario: Scenario, steps: int, schedule: list[ScheduledFailure]) -> Outcome:
    """A job of ``steps`` steps through a benchmark's failure schedule, ending with a save of its last step."""
    job = _Job(scenario)
    for failure in schedule:
        after_save = failure.phase == "checkpoint_save"
        job.run_to_step(failure.step if after_save else failure.step + 1, after_save=after_save, early_s=_EPSILON_S)
        lost_at = job.t - (job.save_s if after_save else job.step_wall_s)  # its step or save began then
        for lost in failure.slices:
            job.fail(lost, lost_at + failure.down_for_s, in_step=False)
    last_saved = steps % scenario.period == 0
    job.run_to_step(steps, after_save=last_saved)
    end = job.t + (0.0 if last_saved else job.save_s) + scenario.costs.end_s
    return job.outcome(end)


class _Job:
    """The state of one simulated job (private to the simulation: time only moves forward)."""

    def __init__(self, scenario: Scenario):
        self.sc = scenario
        self.n = scenario.slices
        self.total = self.n + scenario.spares  # the job's slices, spares included
        self.coordinator = self.total if scenario.runtime.controller_fails else 0
        self.down_until = np.zeros(self.total + 1)  # slice i is up once time reaches down_until[i]; [total]: the controller
        self.t = 0.0
        self.slice_at = np.arange(self.n)  # the slice at each position of the mesh (the last one, at a missing position)
        self.missing: frozenset[int] = frozenset()  # positions the job runs without
        self.position_of = np.arange(self.total)  # each slice's position in the mesh, -1 out of it
        self.position_of[self.n:] = -1
        self.base, self.done, self.saving, self.checkpoint = 0, 0.0, None, 0  # cycle start, steps in it, save under way
        self.productive = 0.0
        self.lost = self.saves = self.swaps = 0
        self.busy_until = scenario.costs.start_s
        self._new_processes(self.busy_until)

    # ---- rates

    @property
    def step_s(self) -> float:
        """A step's productive time on the slices in use: the same global batch over fewer devices is slower."""
        return self.sc.costs.step_s * self.n / (self.n - len(self.missing))

    @property
    def step_wall_s(self) -> float:
        """A step and the gap before the next."""
        return self.step_s + self.sc.costs.gap_s

    @property
    def save_s(self) -> float:
        """One save's blocking time."""
        return self.sc.save_s

    # ---- moving time

    def run_until(self, until: float) -> None:
        """Train (and recover, and scale up) until ``until``."""
        while (event := self._next_event()) is not None and event <= until:
            self._advance(event)
            self._scale_up()
        self._advance(until)

    def run_to_step(self, step: int, *, after_save: bool, early_s: float = 0.0) -> None:
        """Train until ``early_s`` before the end of step ``step`` (or of its save)."""
        while True:
            if self.busy_until > self.t:
                self.run_until(self.busy_until)
                continue
            target = self.t + self._time_to(step, after_save=after_save) - early_s
            event = self._next_event()
            if event is None or event > target:
                self._advance(target)
                return
            self.run_until(event)

    def _next_event(self) -> float | None:
        """The end of the recovery under way, or, with slices missing, when the first slice out of the mesh is back (to
        scale up)."""
        if self.busy_until > self.t:
            return self.busy_until
        if self.sc.strategy in SCALING_DOWN and self.sc.runtime.rejoin and self.missing:
            return max(self.t, float(self.down_until[: self.total][self.position_of < 0].min()))
        return None

    def _advance(self, until: float) -> None:
        if until <= self.t:
            return
        if self.busy_until > self.t:
            self.t = min(until, self.busy_until)
            if until <= self.t:
                return
        self._train(until - self.t)
        self.t = until

    def _train(self, seconds: float) -> None:
        """``seconds`` of steps, with a save after every ``period``-th step."""
        period, step_s, wall_s, save_s = self.sc.period, self.step_s, self.step_wall_s, self.save_s
        while seconds > 0:
            if self.saving is None:
                needed = (period - self.done) * wall_s
                if seconds < needed:
                    self.done += seconds / wall_s
                    self.productive += seconds * step_s / wall_s
                    return
                seconds -= needed
                self.productive += (period - self.done) * step_s
                self.done, self.saving = period, 0.0
            needed = save_s - self.saving
            if seconds < needed:
                self.saving += seconds
                return
            seconds -= needed
            cycle_s = period * wall_s + save_s
            cycles = 1 + int(seconds // cycle_s)  # this save, and every whole cycle after it
            seconds -= (cycles - 1) * cycle_s
            self.base += cycles * period
            self.checkpoint, self.done, self.saving = self.base, 0.0, None
            self.saves += cycles
            self.productive += (cycles - 1) * period * step_s

    def _time_to(self, step: int, *, after_save: bool) -> float:
        """Seconds from now to the end of step ``step`` (or of its save), saves on the way included."""
        period, save_s = self.sc.period, self.save_s
        seconds, position, boundary = 0.0, self.base + self.done, self.base + period
        if self.saving is not None:
            seconds, position, boundary = save_s - self.saving, boundary, boundary + period
        saves = 0 if step <= boundary else (step - boundary - 1) // period + 1
        if after_save and step >= boundary and (step - boundary) % period == 0:
            saves += 1
        return seconds + (step - position) * self.step_wall_s + saves * save_s

    # ---- failures

    def fail(self, lost: int, back_at: float, *, in_step: bool | None = None) -> None:
        """Slice ``lost`` goes down until ``back_at``; the strategy recovers if the job used it. ``in_step``: a step
        was running (by default: unless a save or a recovery was)."""
        self.down_until[lost] = max(self.down_until[lost], back_at)
        coordinator = lost == self.coordinator
        if not coordinator and (lost >= self.total or self.position_of[lost] < 0):
            return  # a slice the job does not use: a spare, or one down
        in_step = self.saving is None and self.busy_until <= self.t if in_step is None else in_step
        self._stop_step()
        if coordinator or self.sc.restarts_on_every_failure:
            self._restart(self.sc.costs.recovery if self.sc.strategy in RESTARTING else self.sc.restart)
            return
        if in_step and self.sc.runtime.step_takes_state:
            self._roll_back_to_snapshot()
        if self.sc.strategy == "pause_resume":
            self._pause()
        else:
            self._scale_down()

    def _stop_step(self) -> None:
        """The step under way is lost; a save under way is discarded."""
        if self.saving is not None:
            self.base, self.done, self.saving = self.base + self.sc.period, 0.0, None
            return
        whole = math.floor(self.done)
        self.productive -= (self.done - whole) * self.step_s
        self.done = whole

    def _roll_back_to_snapshot(self) -> None:
        """The step under way had taken the state: back to the newest host snapshot (or checkpoint)."""
        completed, period = self.base + int(self.done), self.sc.snapshot_period
        snapshot = max(self.checkpoint, completed - completed % period if period else 0)
        self.productive -= (completed - snapshot) * self.step_s
        self.lost += completed - snapshot
        self.base = min(self.base, snapshot)  # a snapshot before a discarded save's cycle starts the cycle there
        self.done = float(snapshot - self.base)

    def _roll_back(self) -> None:
        """Back to the last checkpoint: the steps since are lost."""
        lost = self.base + int(self.done) - self.checkpoint
        self.productive -= lost * self.step_s
        self.lost += lost
        self.base, self.done = self.checkpoint, 0.0

    def _restart(self, cost: RecoveryCost | None) -> None:
        """Every process starts again, once as many slices as the mesh holds are back, and restores the last
        checkpoint."""
        cost = cost or RecoveryCost()
        self._roll_back()
        first_up = np.argsort(self.down_until[: self.total], kind="stable")[: self.n]  # the n slices back first
        self._place(np.sort(first_up), frozenset())
        started = self.t + self.sc.detection_s(cost) + cost.other_s + cost.restart_s + self.sc.runtime.barrier_s(self.n)
        ready = max(started, float(self.down_until[self.slice_at].max()), float(self.down_until[self.coordinator]))
        self.busy_until = ready + cost.compile_s + (cost.restore_s if self.checkpoint else 0.0)
        self._new_processes(self.busy_until)

    def _pause(self) -> None:
        """Wait until every slice is back, then go on from a replica (or the checkpoint, if none lived)."""
        cost = self.sc.costs.recovery or RecoveryCost()
        slices_back = float(self.down_until[: self.n].max())
        if (self.down_until[: self.n] > self.t).all():
            self._roll_back()
        after_wait = max(self.t + self.sc.detection_s(cost), slices_back)
        self.busy_until = after_wait + cost.remesh_s + cost.compile_s + cost.restore_s + cost.other_s

    def _scale_down(self) -> None:
        """Go on at once on the live slices, spares in the lost ones' places while any are free (the lost stay out
        where they cannot rejoin)."""
        cost = self.sc.costs.recovery or RecoveryCost()
        down = frozenset(int(i) for i in np.flatnonzero(self.down_until[self.slice_at] > self.t))
        missing = down if self.sc.runtime.rejoin else self.missing | down
        swapped = self._swap_in(missing)
        missing -= swapped
        if len(missing) == self.n:
            self._restart(self.sc.restart)  # nothing left to go on with: the job is started again
            return
        if swapped and len(missing) <= len(self.missing):  # as many slices as before: a swap
            self.swaps += 1
            self._place(self.slice_at, missing)
            swap = self.sc.swap or RecoveryCost()
            self.busy_until = (self.t + self.sc.detection_s(swap) + self.sc.runtime.barrier_s(self.n) + swap.remesh_s
                               + swap.compile_s + swap.restore_s + swap.other_s)
            return
        self._place(self.slice_at, missing)
        meshed = self.t + self.sc.detection_s(cost) + self.sc.runtime.barrier_s(self.n) + cost.remesh_s
        compiled = meshed + cost.compile_s + self._compile_wait(missing, meshed)
        self.busy_until = compiled + cost.restore_s + cost.other_s

    def _scale_up(self) -> None:
        """Move back onto the missing slices that are back, at the step boundary now."""
        if self.busy_until > self.t or not (self.sc.strategy in SCALING_DOWN and self.sc.runtime.rejoin):
            return
        missing = frozenset(i for i in self.missing if self.down_until[self.slice_at[i]] > self.t)
        missing -= self._swap_in(missing)
        if missing == self.missing:
            return
        self._place(self.slice_at, missing)
        rejoin = self.sc.runtime.rejoin_s
        if rejoin is None:
            self.busy_until = self.t + self.sc.costs.scale_up_s + self._compile_wait(missing, self.t)
            return
        self.busy_until = self.t + rejoin.at(self.n)  # new backends: the new layout compiled within it, the rest lost
        self._new_processes(self.busy_until)
        self.compiled.add(missing)

    def _swap_in(self, positions: frozenset[int]) -> frozenset[int]:
        """Put a free spare (a slice up and at none of the other positions) at as many of ``positions`` as there
        are; those filled."""
        if not self.sc.spares:
            return frozenset()
        held = np.ones(self.n, dtype=bool)
        held[list(positions)] = False
        free = self.down_until[: self.total] <= self.t
        free[self.slice_at[held]] = False
        spares = np.flatnonzero(free)
        filled = sorted(positions)[: spares.size]
        self.slice_at[filled] = spares[: len(filled)]
        return frozenset(filled)

    def _place(self, slice_at: np.ndarray, missing: frozenset[int]) -> None:
        """The mesh: ``slice_at[p]`` at each position ``p`` but the ``missing``."""
        self.slice_at, self.missing = slice_at, missing
        live = np.ones(self.n, dtype=bool)
        live[list(missing)] = False
        self.position_of[:] = -1
        self.position_of[slice_at[live]] = np.flatnonzero(live)

    # ---- compiled layouts

    def _new_processes(self, at: float) -> None:
        """New processes: only the full layout is compiled; compile-ahead starts its queue at ``at``."""
        self.compiled = {frozenset()}
        compile_s = self.sc.costs.layout_compile_s
        ahead = self.sc.strategy in SCALING_DOWN and self.sc.compile_ahead and self.n > 1
        queued = min(self.n, DEFAULT_MAX_LAYOUTS - 1) if ahead else 0  # the step cache's room beside the full layout
        self.ahead = {frozenset((i,)): at + (i + 1) * compile_s for i in range(queued)}

    def _compile_wait(self, layout: frozenset[int], at: float) -> float:
        """Seconds from ``at`` until the step for ``layout`` is compiled, beyond a look-up."""
        if layout in self.compiled:
            return 0.0
        self.compiled.add(layout)
        ready, compile_s = self.ahead.get(layout), self.sc.costs.layout_compile_s
        return compile_s if ready is None else min(compile_s, max(0.0, ready - at))  # not started: compiled now

    def outcome(self, wall_s: float) -> Outcome:
        """What the job did by ``wall_s``."""
        return Outcome(
            wall_s=float(wall_s), productive_s=float(self.productive), steps=self.base + int(self.done),
            full_step_s=self.sc.costs.step_s, lost_steps=self.lost,
            saves=self.saves, swaps=self.swaps,
        )
