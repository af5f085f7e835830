"""Failure injection: lose slices on a schedule, or at random (simulated slices, or real processes killed)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping

import numpy as np

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.clusters import AbstractInjectableCluster, AbstractProcessInjectableCluster

FIRED_FILE = "chaos_fired.json"
PHASES = ("train_step", "update", "boundary", "checkpoint_save", "checkpoint_restore", "recovery")
"""When a scheduled failure strikes, with ``at_step`` steps completed: as the
next train step starts (``train_step``: before it is launched), while that
step runs (``update``: before its update, once the step has taken the state on
a single controller, once its gradients are computed on ``cluster=multiprocess``),
while the training mode's boundary work after that step runs (``boundary``:
``diloco``'s outer step; a run without boundary work there refuses it),
during the save of step ``at_step``, a restore of the checkpoint of step
``at_step``, or while recovering from the failure at step ``at_step`` (a
second failure)."""


@dataclasses.dataclass(frozen=True)
class ScheduledFailure:
    """One slice lost at one step.

    :param at_step: the step (steps completed before it) during which it strikes.
    :param slice: the slice lost.
    :param phase: one of :data:`PHASES`.
    :param down_for_s: how long the slice stays down.
    :param hang: hang the slice instead: the step does not fail but never
        finishes while the slice is down (the watchdog must catch it).
    :param process: on ``cluster=multiprocess``, kill only the slice's
        process at this position (0 to ``processes_per_slice - 1``); the
        slice's other processes then leave the job. ``None``: all of them.
    :param slow: slow the slice down instead, by this factor (above 1): for
        ``down_for_s`` seconds its steps take that many times as long; it
        stays up (a straggler).
    """

    at_step: int
    slice: int
    phase: str = "train_step"
    down_for_s: float = 1e9
    hang: bool = False
    process: int | None = None
    slow: float | None = None

    def __post_init__(self):
        if self.at_step < 0 or self.slice < 0 or self.down_for_s < 0:
            raise et.ConfigError(f"chaos failure {self}: at_step, slice and down_for_s must not be negative.")
        if self.phase not in PHASES:
            raise et.ConfigError(f"chaos failure phase must be one of {PHASES}, got {self.phase!r}.")
        if self.process is not None and (self.process < 0 or self.hang):
            raise et.ConfigError(f"chaos failure {self}: process must not be negative, and a hang takes the whole "
                                 "slice (leave process unset).")
        if self.slow is not None and (self.slow <= 1 or self.hang or self.process is not None
                                      or self.phase != "train_step"):
            raise et.ConfigError(f"chaos failure {self}: slow must be above 1, and a slow slice is neither hung nor "
                                 "lost in part, from a train step on (leave hang, process and phase unset).")


def check_chaos_settings(
    *, mean_steps_between_failures: float, random_down_for_s: float, seed: int, steps_per_failure: int
) -> None:
    """Raise :class:`et.ConfigError` with one sentence for any bad ``chaos.*`` value; ``Chaos`` and its schema call it."""
    if min(mean_steps_between_failures, random_down_for_s, steps_per_failure) < 0:
        raise et.ConfigError(
            "chaos.mean_steps_between_failures, chaos.steps_per_failure and chaos.random_down_for_s "
            "must not be negative."
        )
    if seed < 0:  # numpy seeds must not be negative
        raise et.ConfigError(f"chaos.seed must be at least 0, got {seed}.")


class Chaos:
    """Loses slices the way hardware does, through the cluster (``cluster.fail_slice``).

    On ``cluster=simulated`` the slice's devices fail; on
    ``cluster=multiprocess`` every process of the slice is killed with
    SIGKILL (a hang puts it to sleep before the step's collectives). An
    entry with ``slow`` slows the slice down instead (``cluster.slow_slice``).

    :param failures: scheduled failures (mappings or :class:`ScheduledFailure`).
    :param mean_steps_between_failures: random mode: each step loses one of
        the slices in use with probability ``1 / mean`` (0: off).
    :param steps_per_failure: periodic mode: exactly one of the slices in use
        is lost in every window of this many steps (steps 0 to N-1, N to
        2N-1, ...), at a seeded random step of the window (0: off).
    :param random_down_for_s: how long a slice lost in random or periodic mode stays down.
    :param seed: seeds random and periodic modes; the same seed loses the same slices at the same steps.

    Scheduled failures strike once per run: a run in the same directory (a
    resumed run, a restarted worker) reads which already struck from
    ``chaos_fired.json`` there.
    """

    name = "chaos"

    def __init__(
        self,
        failures: Iterable[Mapping | ScheduledFailure] = (),
        mean_steps_between_failures: float = 0.0,
        random_down_for_s: float = 1e9,
        seed: int = 0,
        steps_per_failure: int = 0,
    ):
        self.failures = [f if isinstance(f, ScheduledFailure) else ScheduledFailure(**f) for f in failures]
        check_chaos_settings(mean_steps_between_failures=mean_steps_between_failures,
                             random_down_for_s=random_down_for_s, seed=seed, steps_per_failure=steps_per_failure)
        self.mean_steps_between_failures = mean_steps_between_failures
        self.steps_per_failure = steps_per_failure
        self.random_down_for_s = random_down_for_s
        self.seed = seed
        self._fired: set[int] = set()  # scheduled failures that struck
        self._random_steps: set[int] = set()  # steps a random failure struck (a retried step is spared)

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView, mode: etp.AbstractTrainingMode) -> None:
        """Check that the cluster can lose slices and has the ones scheduled, at steps the run reaches, in phases
        the run has there."""
        if not isinstance(trainer.cluster, AbstractInjectableCluster):
            raise et.ConfigError(
                f"chaos needs a cluster that can lose slices (cluster=simulated or cluster=multiprocess), "
                f"not {trainer.cluster.kind}."
            )
        if trainer.run_dir is not None and (trainer.run_dir / FIRED_FILE).exists():  # a resumed or restarted run
            fired = json.loads((trainer.run_dir / FIRED_FILE).read_text())
            self._fired, self._random_steps = set(fired["scheduled"]), set(fired["random_steps"])
        slices = len(trainer.cluster.slice_devices())
        for failure in self.failures:
            if failure.slice >= slices:
                raise et.ConfigError(f"chaos failure at step {failure.at_step} names slice {failure.slice}, "
                                     f"but the cluster has slices 0 to {slices - 1}.")
            if failure.process is not None and not isinstance(trainer.cluster, AbstractProcessInjectableCluster):
                raise et.ConfigError(f"chaos failure at step {failure.at_step} names process {failure.process} "
                                     f"of its slice, but only cluster=multiprocess has processes; leave it unset.")
            last = trainer.steps if failure.phase.startswith("checkpoint") else trainer.steps - 1  # step N is saved
            if failure.at_step > last:
                raise et.ConfigError(f"chaos failure at step {failure.at_step} ({failure.phase}) would never strike: "
                                     f"with trainer.steps={trainer.steps} the last {failure.phase} is at step {last}; "
                                     "schedule it earlier or raise trainer.steps.")
            if failure.phase == "boundary" and not mode.boundary_due(failure.at_step + 1, steps=trainer.steps):
                raise et.ConfigError(f"chaos failure at step {failure.at_step} (boundary) would never strike: the "
                                     f"{mode.name} training mode has no boundary work after step "
                                     f"{failure.at_step + 1}; "
                                     "schedule it at a step whose next step ends with one (diloco: every "
                                     "strategy.inner_steps steps) or pick another phase.")

    @et.hookimpl
    def et_step_start(self, trainer: etp.RunView, step: int) -> None:
        """Lose the slices scheduled for this step, and in random or periodic mode maybe one more."""
        self._strike(trainer, step, "train_step")
        if step in self._random_steps:
            return  # a step retried after its failure is spared
        if self.mean_steps_between_failures:
            rng = np.random.default_rng([self.seed, step])
            if rng.random() < 1 / self.mean_steps_between_failures:
                self._strike_random_slice(trainer, step, rng)
        if self.steps_per_failure:
            window = step // self.steps_per_failure
            rng = np.random.default_rng([self.seed, window, self.steps_per_failure])
            if step == window * self.steps_per_failure + rng.integers(self.steps_per_failure):
                self._strike_random_slice(trainer, step, rng)

    @et.hookimpl
    def et_before_update(self, trainer: etp.RunView, step: int) -> None:
        """Lose the slices scheduled to fail while the step after ``step`` runs, before its update."""
        self._strike(trainer, step, "update")

    @et.hookimpl
    def et_before_boundary(self, trainer: etp.RunView, step: int) -> None:
        """Lose the slices scheduled to fail during the mode's boundary work after the step after ``step``."""
        self._strike(trainer, step, "boundary")

    @et.hookimpl
    def et_before_checkpoint_save(self, trainer: etp.TrainerView, step: int) -> None:
        """Lose the slices scheduled to fail while step ``step`` is saved."""
        self._strike(trainer, step, "checkpoint_save")

    @et.hookimpl
    def et_before_restore(self, trainer: etp.TrainerView, step: int, source: str) -> None:
        """Lose the slices scheduled to fail while the checkpoint of step ``step`` is restored."""
        if source == "checkpoint":
            self._strike(trainer, step, "checkpoint_restore")

    @et.hookimpl
    def et_recovery_start(self, trainer: etp.RunView, failure: etp.Failure) -> None:
        """Lose the slices scheduled to fail while recovering from this failure."""
        self._strike(trainer, failure.step, "recovery")

    def _strike(self, trainer: etp.RunView, step: int, phase: str) -> None:
        for index, failure in enumerate(self.failures):
            if index not in self._fired and failure.at_step == step and failure.phase == phase:
                self._fired.add(index)
                self._remember(trainer)
                if failure.process is not None:
                    trainer.cluster.fail_process(failure.slice, failure.process, down_for_s=failure.down_for_s)
                    continue
                if failure.slow is not None:
                    trainer.cluster.slow_slice(failure.slice, factor=failure.slow, for_s=failure.down_for_s)
                    continue
                lose = trainer.cluster.hang_slice if failure.hang else trainer.cluster.fail_slice
                lose(failure.slice, down_for_s=failure.down_for_s)

    def _strike_random_slice(self, trainer: etp.RunView, step: int, rng: np.random.Generator) -> None:
        if step not in self._random_steps:
            self._random_steps.add(step)
            self._remember(trainer)
            candidates = [s for s in trainer.slices if s not in trainer.cluster.protected_slices]
            if candidates:
                trainer.cluster.fail_slice(int(rng.choice(candidates)), down_for_s=self.random_down_for_s)

    def _remember(self, trainer: etp.RunView) -> None:
        """Write down what struck, so that a restarted worker does not strike again."""
        if trainer.run_dir is not None:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            fired = {"scheduled": sorted(self._fired), "random_steps": sorted(self._random_steps)}
            (trainer.run_dir / FIRED_FILE).write_text(json.dumps(fired))
