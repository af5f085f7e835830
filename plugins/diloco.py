"""The ``diloco`` strategy: semi-synchronous training, in which a lost slice stalls no one.

Each slice trains a replica of its own on its share of every step's batch
for ``inner_steps`` steps, with no collective across slices; then the live
slices average their progress into one outer step (Nesterov momentum by
default, DiLoCo's). A slice lost during the inner steps is dropped with its
replica and the others go on without a pause; its samples since the last
outer step are counted as skipped. A slice lost during the outer step is
dropped and the step runs again over the others. A healthy slice is taken
back in at an outer step, with the outer parameters. On ``cluster=multiprocess``
the processes meet only at outer steps, where a process lost meanwhile is
found and its replica dropped. The training mode is in
``diloco_mode.py``; docs/plugins.md, "A mode whose slices each keep a part of their own".
"""

from __future__ import annotations

import optax

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.clusters import mesh_slice_count
from elastic_trainer_plugins.diloco_mode import DiLoCoMode


class DiLoCo(etp.AbstractStrategy):
    """DiLoCo (Douillard et al., 2023): inner steps on each slice's own replica, an outer step every
    ``inner_steps``.

    :param inner_steps: steps between outer steps (DiLoCo's H); the run's last step ends with one too.
    :param outer_lr: the outer optimizer's learning rate (DiLoCo: 0.7).
    :param outer_momentum: its momentum (DiLoCo: 0.9; 0: plain SGD).
    :param nesterov: Nesterov momentum (DiLoCo's).
    :param min_slice_count: the fewest slices to go on with: a step that would leave fewer fails as a whole,
        and the run waits up to ``timeout_s`` for that many before it restores the last snapshot or checkpoint.
    :param timeout_s: that wait (0: stop at once).
    :param scale_up: take healthy slices back in at the next outer step.
    :param compile_ahead: compile the outer step for every "one slice fewer" layout in the background (each
        slice's own program is compiled once, for every layout).
    :param max_retries: stop after this many failures in a row that took the failure flow (see
        ``retry_reset_steps``); a dropped replica is not one.
    :param retry_reset_steps: a failure at least this many steps past the previous one starts that count again.
    :param drop_stragglers: at an outer step, go on without the slices in use found to be stragglers
        (``trainer.straggler_factor`` times slower than the others for ``trainer.straggler_steps`` steps), as
        long as ``min_slice_count`` are left: the outer step has taken their progress in, so nothing is skipped,
        and the others stop waiting for them at every step. Each is taken back at an outer step after
        ``drop_for_steps`` steps (twice as long each time it is dropped again).
    :param drop_for_steps: how many steps a dropped straggler stays out the first time.
    """

    name = "diloco"

    def __init__(self, inner_steps: int = 10, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, min_slice_count: int = 1, timeout_s: float = 300.0, scale_up: bool = True,
                 compile_ahead: bool = True, max_retries: int = 10,
                 retry_reset_steps: int = etp.RetryBudget.DEFAULT_RESET_STEPS, drop_stragglers: bool = False,
                 drop_for_steps: int = 20):
        for name, value, low in (("inner_steps", inner_steps, 1), ("min_slice_count", min_slice_count, 1)):
            if value < low:
                raise et.ConfigError(f"strategy.{name} must be at least {low}, got {value}.")
        if outer_lr <= 0:
            raise et.ConfigError(f"strategy.outer_lr must be above 0, got {outer_lr}.")
        if not 0 <= outer_momentum < 1:
            raise et.ConfigError(f"strategy.outer_momentum must be at least 0 and below 1, got {outer_momentum}.")
        if timeout_s < 0:
            raise et.ConfigError(f"strategy.timeout_s must be at least 0, got {timeout_s}.")
        self.inner_steps, self.min_slice_count, self.timeout_s = inner_steps, min_slice_count, timeout_s
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.scale_up, self.compile_ahead = scale_up, compile_ahead
        self.retries = etp.RetryBudget(self.name, max_retries, retry_reset_steps)
        self.drops = etp.StragglerDrops(enabled=drop_stragglers, drop_for_steps=drop_for_steps)
        self._step = 0  # steps completed, as of the last step's end

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView, state: etp.TrainState, mode: etp.AbstractTrainingMode) -> None:
        """Refuse more slices asked for than the cluster has, and a global batch whose per-slice share does not
        divide over a slice's devices."""
        slices = mesh_slice_count(trainer.cluster)
        if self.min_slice_count > slices:
            raise et.ConfigError(
                f"strategy.min_slice_count ({self.min_slice_count}) is above the cluster's {slices} slices.")
        devices = len(trainer.cluster.slice_devices()[0])
        if trainer.global_batch_size % (slices * devices):
            raise et.ConfigError(
                f"trainer.global_batch_size ({trainer.global_batch_size}) must be divisible by the cluster's "
                f"{slices} slices x {devices} devices: each slice trains its own share, split over its devices.")

    @et.hookimpl
    def et_training_mode(self, trainer: etp.TrainerView) -> DiLoCoMode:
        """DiLoCo's mode: a replica per slice, and the outer step."""
        slices = mesh_slice_count(trainer.cluster)
        outer = optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=self.nesterov)
        return DiLoCoMode(inner_steps=self.inner_steps, outer_optimizer=outer, slices=slices, limit=slices,
                          steps=trainer.steps, min_slices=self.min_slice_count)

    @et.hookimpl
    def et_choose_recovery(self, trainer: etp.RunView, failure: etp.Failure) -> etp.RecoveryPlan:
        """A failure no replica drop absorbs (too few slices left, or outside a step): wait up to ``timeout_s``
        for ``min_slice_count`` healthy slices, then go on with every healthy one."""
        self.retries.spend(failure.step)
        return etp.RecoveryPlan(action="diloco", min_slices=self.min_slice_count, wait_for_min_s=self.timeout_s)

    @et.hookimpl
    def et_likely_layouts(self, trainer: etp.TrainerView) -> list[list[int]]:
        """Every layout with one slice fewer: where the next dropped replica takes the run."""
        return etp.one_slice_lost(trainer.slices, at_least=self.min_slice_count) if self.compile_ahead else []

    @et.hookimpl
    def et_step_end(self, trainer: etp.TrainerView, step: int, metrics: dict) -> None:
        """Note the steps completed: slices are dropped for being slow and taken back only at an outer step."""
        self._step = step

    @et.hookimpl
    def et_propose_resize(self, trainer: etp.TrainerView, healthy_slices: list[int]) -> list[int] | None:
        """At an outer step, drop the stragglers in use (``drop_stragglers``); else (``scale_up``) take back every
        healthy slice when more are healthy than in use, less the dropped stragglers whose time out is not over."""
        if self._step % self.inner_steps:
            return None
        return self.drops.propose(trainer, healthy_slices, step=self._step, min_slices=self.min_slice_count,
                                  scale_up=self.scale_up)
