"""The ``scale_down`` strategy: go on at once with the slices that live; scale back up when they return."""

from __future__ import annotations

import math

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.clusters import mesh_slice_count

BATCH_POLICIES = ("keep_global", "keep_per_device")
LR_SCALINGS = ("linear", "sqrt", "none")


class ScaleDown(etp.AbstractStrategy):
    """Continue on the live slices as soon as a slice is lost.

    :param min_slice_count: the fewest slices to train on (MaxText's
        ``elastic_min_slice_count``); with fewer healthy, wait for them.
    :param timeout_s: how long to wait, when fewer than ``min_slice_count``
        slices are healthy, for that many to be (MaxText's
        ``elastic_timeout_seconds``); then go on with every healthy slice, or
        stop if there are still too few (0: stop at once).
    :param scale_up: move back onto returning slices at the next step boundary.
    :param batch_policy: ``keep_global`` keeps the global batch and sample
        order (each device takes more samples); ``keep_per_device`` keeps each
        device's batch, so the global batch shrinks with the slices.
    :param lr_scaling: with ``keep_per_device``, how the learning rate follows
        the global batch: ``linear``, ``sqrt`` or ``none``.
    :param max_retries: stop after this many failures in a row without
        progress (see ``retry_reset_steps``). MaxText's ``elastic_max_retries``
        counts every failure of the run instead.
    :param retry_reset_steps: a failure at least this many steps past the
        previous one starts the count of ``max_retries`` again (0: never, as
        MaxText counts).
    :param compile_ahead: compile the step for every "one slice fewer" layout
        in the background after start and after each change of the slices in
        use, so a recovery need not wait for a compile; off saves that work
        where compiles are cheap or cores few.
    :param drop_stragglers: at a step boundary, go on without the slices in
        use found to be stragglers (``trainer.straggler_factor`` times slower
        than the others for ``trainer.straggler_steps`` steps), as long as
        ``min_slice_count`` remain; with ``scale_up``, take one back after
        ``drop_for_steps`` steps (twice as long each time it is dropped
        again). On ``cluster=multiprocess`` a dropped slice's processes
        leave the job and do not come back.
    :param drop_for_steps: how many steps a dropped straggler stays out the first time.
    """

    name = "scale_down"

    def __init__(
        self,
        min_slice_count: int = 1,
        timeout_s: float = 300.0,
        scale_up: bool = True,
        batch_policy: str = "keep_global",
        lr_scaling: str = "linear",
        max_retries: int = 10,
        retry_reset_steps: int = etp.RetryBudget.DEFAULT_RESET_STEPS,
        compile_ahead: bool = True,
        drop_stragglers: bool = False,
        drop_for_steps: int = 20,
    ):
        if min_slice_count < 1:
            raise et.ConfigError(f"strategy.min_slice_count must be at least 1, got {min_slice_count}.")
        if timeout_s < 0:
            raise et.ConfigError(f"strategy.timeout_s must be at least 0, got {timeout_s}.")
        if batch_policy not in BATCH_POLICIES:
            raise et.ConfigError(f"strategy.batch_policy must be one of {BATCH_POLICIES}, got {batch_policy!r}.")
        if lr_scaling not in LR_SCALINGS:
            raise et.ConfigError(f"strategy.lr_scaling must be one of {LR_SCALINGS}, got {lr_scaling!r}.")
        self.min_slice_count = min_slice_count
        self.timeout_s = timeout_s
        self.scale_up = scale_up
        self.batch_policy = batch_policy
        self.lr_scaling = lr_scaling
        self.retries = etp.RetryBudget(self.name, max_retries, retry_reset_steps)
        self.compile_ahead = compile_ahead
        self.drops = etp.StragglerDrops(enabled=drop_stragglers, drop_for_steps=drop_for_steps)
        self._step = 0  # steps completed, as of the last step's end

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView, state: etp.TrainState, mode: etp.AbstractTrainingMode) -> None:
        """Check that the cluster has enough slices to ever satisfy ``min_slice_count``, and, under
        ``keep_global``, that the global batch divides over every device count the run may scale down to."""
        slices = mesh_slice_count(trainer.cluster)
        if self.min_slice_count > slices:
            raise et.ConfigError(
                f"strategy.min_slice_count ({self.min_slice_count}) is above the cluster's {slices} slices."
            )
        if self.batch_policy == "keep_global":  # keep_per_device shrinks the batch with the devices
            _check_batch_divides(trainer.global_batch_size, devices_per_slice=len(trainer.cluster.slice_devices()[0]),
                                slice_counts=range(self.min_slice_count, slices + 1))

    @et.hookimpl
    def et_choose_recovery(self, trainer: etp.RunView, failure: etp.Failure) -> etp.RecoveryPlan:
        """Continue now on whatever is healthy; with fewer than ``min_slice_count`` slices healthy,
        wait up to ``timeout_s`` for that many first."""
        self.retries.spend(failure.step)
        return etp.RecoveryPlan(
            action="scale_down",
            min_slices=self.min_slice_count,
            wait_for_min_s=self.timeout_s,
            keep_global_batch=self.batch_policy == "keep_global",
            lr_scaling=self.lr_scaling,
        )

    @et.hookimpl
    def et_likely_layouts(self, trainer: etp.TrainerView) -> list[list[int]]:
        """Every layout with one slice fewer: where the next failure will take the run."""
        return etp.one_slice_lost(trainer.slices, at_least=self.min_slice_count) if self.compile_ahead else []

    @et.hookimpl
    def et_step_end(self, trainer: etp.TrainerView, step: int, metrics: dict) -> None:
        """Note the steps completed, for how long a dropped straggler stays out."""
        self._step = step

    @et.hookimpl
    def et_propose_resize(self, trainer: etp.TrainerView, healthy_slices: list[int]) -> list[int] | None:
        """Drop the stragglers in use (``drop_stragglers``); else take back every healthy slice when more are
        healthy than in use, less the dropped stragglers whose time out is not over."""
        return self.drops.propose(trainer, healthy_slices, step=self._step, min_slices=self.min_slice_count,
                                  scale_up=self.scale_up)


def _check_batch_divides(batch_size: int, *, devices_per_slice: int, slice_counts: range) -> None:
    """Raise :class:`et.ConfigError` unless ``batch_size`` divides over the devices of each of ``slice_counts``."""
    device_counts = [count * devices_per_slice for count in slice_counts]
    for count, devices in reversed(list(zip(slice_counts, device_counts))):  # where failures go first
        if batch_size % devices:
            raise et.ConfigError(
                f"trainer.global_batch_size ({batch_size}) must be divisible by the {devices} devices of {count} "
                f"slices, and by every device count scale_down may scale to (strategy.min_slice_count="
                f"{slice_counts.start} to {slice_counts.stop - 1} slices); choose a multiple of "
                f"{math.lcm(*device_counts)}, raise strategy.min_slice_count or set "
                "strategy.batch_policy=keep_per_device."
            )
