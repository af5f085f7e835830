"""What the core knows about a failure, and the errors it raises itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import jax

if TYPE_CHECKING:
    from ._run_report import RunReport


@dataclasses.dataclass(frozen=True)
class Failure:
    """A step's exception, classified.

    :param error: the exception raised.
    :param step: steps completed before the failed one.
    :param phase: what was running (``"train_step"``, ...).
    :param elastic: whether a strategy may recover from it; fatal otherwise.
    :param kind: a short name for the report (``"slice_lost"``, ``"fatal"``, ...).
    :param slices: indices of the slices lost, when known.
    """

    error: BaseException
    step: int
    phase: str
    elastic: bool
    kind: str
    slices: tuple[int, ...] = ()


class SliceLostError(jax.errors.JaxRuntimeError):
    """A ``DATA_LOSS`` error, as Pathways raises it when slices die.

    :param slices: the slices lost.
    :param processes: on a multi-process cluster, the processes that went with them (dead or leaving).
    :param occurred_at: when the first of them died (``time.time()``), when known; else when it was found.
    """

    def __init__(self, message: str, *, slices: Sequence[int], processes: Sequence[int] | None = None,
                 occurred_at: float | None = None):
        super().__init__(message)
        self.slices = tuple(slices)
        self.processes = None if processes is None else tuple(processes)
        self.occurred_at = occurred_at


class StepTimeoutError(SliceLostError):
    """A step ran past ``trainer.step_timeout_s``: treated like a lost slice, found by health checks."""


class StepInterrupted(Exception):
    """A failure after a step's program took the state (it is donated), raised by the compiled step.

    ``leaves`` is ``None`` when no slice holds a whole state any more (the
    fused step failed, or an update could not start); else the state after
    the step, whole on the processes that live (the update of a split step
    failed elsewhere: each process ran its own part).

    :param error: what the failure raised (classified like any other).
    :param leaves: the state's leaves after the step, or ``None``.
    :param metrics: the step's metrics (``loss``, and a ``has_aux`` loss's scalars), when the step is done (with
        ``leaves``).
    :param phase: where in the step it failed, when not in its programs (``"boundary"``: a mode's work after it).
    """

    def __init__(self, error: BaseException, *, leaves: list | None, metrics: dict | None,
                 phase: str | None = None):
        super().__init__(str(error))
        self.error, self.leaves, self.metrics, self.phase = error, leaves, metrics, phase


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What a strategy decided to do about a failure; the trainer carries it out.

    :param action: the name the report gives this recovery (``"scale_down"``, ...).
    :param wait_for_all_s: wait up to this long for every slice to be healthy
        before going on (0: go on at once with the healthy ones).
    :param min_slices: stop training if fewer slices than this are healthy
        after the waits.
    :param wait_for_min_s: when fewer than ``min_slices`` are healthy (after
        ``wait_for_all_s``), wait up to this long more for ``min_slices`` of
        them, then go on with every healthy one (0: stop, or fall back, at once).
    :param keep_global_batch: keep the global batch (and so the sample order),
        growing the per-device batch; otherwise keep the per-device batch and
        shrink the global one.
    :param lr_scaling: with a shrunk global batch, scale the learning rate by
        the batch ratio (``"linear"``), its square root (``"sqrt"``) or not
        at all (``"none"``).
    :param restart_process: end this worker so the supervisor starts a fresh
        one that restores the last checkpoint (a full restart).
    :param otherwise: the plan to carry out instead of stopping when fewer
        than ``min_slices`` are healthy after the waits (a fallback chain).
    """

    action: str
    wait_for_all_s: float = 0.0
    min_slices: int = 1
    wait_for_min_s: float = 0.0
    keep_global_batch: bool = True
    lr_scaling: str = "linear"
    restart_process: bool = False
    otherwise: RecoveryPlan | None = None


class RetryBudget:
    """How many failures in a row without progress a strategy recovers from before it gives up.

    Failures count while fewer than ``retry_reset_steps`` steps separate each
    from the one before (measured from the step where the previous failure
    struck, so that a run rolled back to a checkpoint and failing again
    before it gets past that step makes no progress); a failure at least
    ``retry_reset_steps`` steps after the previous one starts the count
    again at one. More than ``max_retries`` failures in a row stop the run.
    MaxText's ``elastic_max_retries`` counts every retry of the run instead,
    so a long, healthy run with failures far apart eventually exhausts it;
    ``retry_reset_steps=0`` gives that behaviour here.

    :param strategy: the strategy's name, for the message.
    :param max_retries: failures in a row without progress recovered from.
    :param retry_reset_steps: steps of progress that start the count again (0: never, every failure counts).
    """

    DEFAULT_RESET_STEPS: ClassVar[int] = 10
    """The strategies' default ``retry_reset_steps``.

    A crash loop makes no progress between failures: a step that fails each
    time it runs (0 steps), a slice lost again while the run recovers from it
    (0), a slice that flaps every step or two. A healthy cluster at scale
    fails hundreds of steps apart; even the issue's soak, a failure in every
    window of 15 steps (``chaos.steps_per_failure=15``, some only 1 step
    apart), never has more than two gaps under 10 steps in a row. 10 tells
    the two apart, and a run that truly loops still stops, within about
    ``10 * max_retries`` steps.
    """

    def __init__(self, strategy: str, max_retries: int, retry_reset_steps: int = DEFAULT_RESET_STEPS):
        check_at_least("strategy.max_retries", max_retries, 0)
        check_at_least("strategy.retry_reset_steps", retry_reset_steps, 0)
        self.strategy = strategy
        self.max_retries = max_retries
        self.retry_reset_steps = retry_reset_steps
        self.used = 0
        """Failures counted since the count last started again."""
        self._last_step: int | None = None  # where the previous failure struck

    def spend(self, step: int | None = None) -> None:
        """Count the failure at ``step`` (:attr:`Failure.step`); raise :class:`TrainingStopped` past the budget.

        Without ``step``, the failure counts as one without progress.
        """
        if (self.retry_reset_steps and step is not None and self._last_step is not None
                and step - self._last_step >= self.retry_reset_steps):
            self.used = 0
        self._last_step = step
        self.used += 1
        if self.used > self.max_retries:
            without_progress = (f" with fewer than {self.retry_reset_steps} steps of progress between failures"
                                if self.retry_reset_steps else "")
            settings = "strategy.max_retries" + (", strategy.retry_reset_steps" if self.retry_reset_steps else "")
            raise TrainingStopped(
                f"{self.strategy} gave up after {self.max_retries} recoveries{without_progress} ({settings})."
            )


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


def check_at_least(name: str, value: int | float, minimum: int | float) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value >= minimum``."""
    if not value >= minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}.")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (unreadable); an older one is used instead."""


class SpareWarning(UserWarning):
    """Spare slices and the strategy do not go together: spares the strategy never takes in, or a strategy
    that swaps with no spare to swap in."""


class AcceleratorUnusedWarning(UserWarning):
    """This host has GPUs or TPUs that JAX would use, but the chosen cluster trains on CPU devices; the message
    names the option that uses them, or says that none does yet."""


class SyncMismatchError(RuntimeError):
    """Live processes made different synchronization calls under one agreement's number; the message names both.
    A bug (in a plugin or the framework), never the hardware's: the run stops."""


class PluginError(RuntimeError):
    """A plugin failed to load or broke its hook's contract; the message names it."""


class TrainingStopped(RuntimeError):
    """Training stopped before its last step; ``report`` holds the run report (a :class:`RunReport`)."""

    def __init__(self, message: str, report: RunReport | None = None):
        super().__init__(message)
        self.report = report


class RestartRequested(TrainingStopped):
    """The strategy wants a fresh worker process that restores the last checkpoint.

    :param resume_step: the step of that checkpoint (0: none yet, the next worker starts afresh).
    """

    def __init__(self, message: str, *, resume_step: int):
        super().__init__(message)
        self.resume_step = resume_step
