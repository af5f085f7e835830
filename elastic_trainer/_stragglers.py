"""Stragglers: slices alive but slower than the others, found from each slice's own time in a step.

The cluster measures the time (:meth:`AbstractTimedCluster.slice_step_seconds`);
every process sees the same times, so every process finds the same
stragglers at the same step, and a strategy acting on them
(``scale_down`` with ``strategy.drop_stragglers=true``) makes the same
decision everywhere.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._failures import ConfigError, check_at_least
from ._json_records import JsonRecord
from .clusters import vital_slices

if TYPE_CHECKING:
    from ._protocols import TrainerView


@dataclasses.dataclass(frozen=True)
class StragglerRule:
    """When a slice is a straggler: slower than ``factor`` x the median of the other slices in use, ``steps``
    steps in a row; it has recovered once it has not been for ``steps`` steps in a row.

    :param factor: how much slower than the others' median (``trainer.straggler_factor``).
    :param steps: for how many steps in a row (``trainer.straggler_steps``).
    """

    factor: float = 2.0
    steps: int = 5

    def __post_init__(self):
        if not self.factor > 1:
            raise ConfigError(f"trainer.straggler_factor must be above 1, got {self.factor}.")
        check_at_least("trainer.straggler_steps", self.steps, 1)


@dataclasses.dataclass(frozen=True)
class StragglerRecord(JsonRecord):
    """One slice found to be a straggler, as ``report["stragglers"]`` lists it.

    :param slice: the slice.
    :param slow_since_step: the first of the slow steps that made it one (steps counted as completed).
    :param detected_at_step: the step at whose end it was found.
    :param detected_at: when (``time.time()``).
    :param ratio: the median, over those steps, of its time over the other slices' median time.
    :param recovered_at_step: the step at whose end it had not been slow for ``steps`` steps in a row (``None``: not yet).
    :param recovered_at: when (``time.time()``).
    """

    slice: int
    slow_since_step: int
    detected_at_step: int
    detected_at: float
    ratio: float
    recovered_at_step: int | None = None
    recovered_at: float | None = None


class StragglerWatch:
    """Applies a :class:`StragglerRule` to each step's per-slice times.

    :param rule: when a slice is a straggler.

    A step in which a slice was not measured (it was not in use) breaks its
    run of slow or fast steps. A straggler a strategy dropped is one until it
    is back in use; there it is on trial, not one of :attr:`current`: it has
    recovered once it has not been slow for ``rule.steps`` steps in a row,
    and is one again once it has been slow that long.
    """

    def __init__(self, rule: StragglerRule):
        self.rule = rule
        self.records: list[StragglerRecord] = []
        self._runs: dict[int, list[float]] = {}  # slice -> its ratios in the current run of slow (or fast) steps
        self._open: dict[int, int] = {}  # straggler slice -> the index of its record
        self._on_trial: dict[int, int] = {}  # straggler back in use -> the index of its record
        self._measured: set[int] = set()  # the slices of the latest step observed

    @property
    def current(self) -> frozenset[int]:
        """The slices that are stragglers now (found, not recovered)."""
        return frozenset(self._open)

    def observe(self, step: int, seconds: Mapping[int, float]) -> None:
        """Take the per-slice times of the step that ended with ``step`` steps completed; fewer than two: nothing.
        A step with none measured (on ``cluster=multiprocess``, a semi-synchronous mode's inner steps end with no
        agreement) says nothing and changes nothing."""
        if not seconds:
            return
        for slice_ in set(self._open) & (set(seconds) - self._measured):  # a dropped straggler is back
            self._on_trial[slice_] = self._open.pop(slice_)
        self._measured = set(seconds)
        if len(seconds) < 2:
            self._runs.clear()
            return
        self._runs = {s: run for s, run in self._runs.items() if s in seconds}
        for slice_, took in seconds.items():
            others = statistics.median(t for s, t in seconds.items() if s != slice_)
            ratio = took / others if others > 0 else 1.0
            slow = ratio > self.rule.factor
            run = self._runs.setdefault(slice_, [])
            if run and (run[-1] > self.rule.factor) != slow:
                run.clear()  # the run of slow (or fast) steps ends
            run.append(ratio)
            if len(run) >= self.rule.steps:
                self._judge(slice_, step, slow, run)

    def _judge(self, slice_: int, step: int, slow: bool, run: list[float]) -> None:
        """``slice_`` has been slow (or not) for the rule's steps in a row, up to ``step``: open or close its record."""
        if slow and slice_ in self._on_trial:
            self._open[slice_] = self._on_trial.pop(slice_)
        elif slow and slice_ not in self._open:
            self._open[slice_] = len(self.records)
            self.records.append(StragglerRecord(
                slice=slice_, slow_since_step=step - len(run) + 1, detected_at_step=step, detected_at=time.time(),
                ratio=statistics.median(run),
            ))
        elif not slow and (slice_ in self._open or slice_ in self._on_trial):
            index = self._open.pop(slice_, None)
            index = self._on_trial.pop(slice_) if index is None else index
            self.records[index] = dataclasses.replace(self.records[index], recovered_at_step=step,
                                                      recovered_at=time.time())

    def to_json(self) -> list[dict[str, Any]]:
        """The report's ``stragglers``."""
        return [record.to_json() for record in self.records]


class StragglerDrops:
    """A strategy's resizes at a step boundary when it drops stragglers (``scale_down``'s and ``diloco``'s
    ``drop_stragglers``): which to drop, and when to take each back, after ``drop_for_steps`` steps out the first
    time and twice as long each time it is dropped again.

    :param enabled: drop stragglers at all (``strategy.drop_stragglers``).
    :param drop_for_steps: how many steps a dropped straggler stays out the first time
        (``strategy.drop_for_steps``).
    """

    def __init__(self, *, enabled: bool, drop_for_steps: int):
        check_at_least("strategy.drop_for_steps", drop_for_steps, 1)
        self.enabled, self.drop_for_steps = enabled, drop_for_steps
        self._out_until: dict[int, int] = {}  # dropped straggler -> the step it may come back at
        self._drops: dict[int, int] = {}  # slice -> how often it was dropped

    def propose(self, trainer: TrainerView, healthy_slices: list[int], *, step: int, min_slices: int,
                scale_up: bool) -> list[int] | None:
        """The slices to go on with once ``step`` steps are completed (``et_propose_resize``'s answer): those in
        use less the stragglers to drop; else, with ``scale_up``, every healthy slice not out any more when they
        are more than those in use; ``None``: no change."""
        stragglers = self._to_drop(trainer, min_slices=min_slices)
        if stragglers:
            for s in stragglers:
                self._drops[s] = self._drops.get(s, 0) + 1
                self._out_until[s] = step + self.drop_for_steps * 2 ** (self._drops[s] - 1)
            return [s for s in trainer.slices if s not in stragglers]
        back = [s for s in healthy_slices if self._out_until.get(s, 0) <= step]
        return back if scale_up and len(back) > len(trainer.slices) else None

    def _to_drop(self, trainer: TrainerView, *, min_slices: int) -> list[int]:
        """The stragglers in use to drop now (``trainer.stragglers``): none unless enabled, never one whose loss
        would end the job (``cluster.protected_slices``), and none if fewer than ``min_slices`` would be left."""
        if not self.enabled:
            return []
        vital = vital_slices(trainer.cluster)
        drop = sorted(s for s in trainer.stragglers if s in trainer.slices and s not in vital)
        return drop if len(trainer.slices) - len(drop) >= min_slices else []
