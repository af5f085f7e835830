"""What the core knows about a failure, and the errors it raises itself."""

from __future__ import annotations

import dataclasses

import jax


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
    """A ``DATA_LOSS`` error, as Pathways raises it when slices die; ``slices`` names them."""

    def __init__(self, message: str, *, slices: tuple[int, ...] | list[int]):
        super().__init__(message)
        self.slices = tuple(slices)


class StepTimeoutError(SliceLostError):
    """A step ran past ``trainer.step_timeout_s``: treated like a lost slice, found by health checks."""


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What a strategy decided to do about a failure; the trainer carries it out.

    :param action: the name the report gives this recovery (``"scale_down"``, ...).
    :param wait_for_all_s: wait up to this long for every slice to be healthy
        before going on (0: go on at once with the healthy ones).
    :param min_slices: stop training if fewer slices than this are healthy
        after the wait.
    :param keep_global_batch: keep the global batch (and so the sample order),
        growing the per-device batch; otherwise keep the per-device batch and
        shrink the global one.
    :param lr_scaling: with a shrunk global batch, scale the learning rate by
        the batch ratio (``"linear"``), its square root (``"sqrt"``) or not
        at all (``"none"``).
    :param restart_process: end this worker so the supervisor starts a fresh
        one that restores the last checkpoint (a full restart).
    :param otherwise: the plan to carry out instead of stopping when fewer
        than ``min_slices`` are healthy after the wait (a fallback chain).
    """

    action: str
    wait_for_all_s: float = 0.0
    min_slices: int = 1
    keep_global_batch: bool = True
    lr_scaling: str = "linear"
    restart_process: bool = False
    otherwise: RecoveryPlan | None = None


class RetryBudget:
    """How many recoveries a strategy may make before it gives up (MaxText's ``elastic_max_retries``).

    :param strategy: the strategy's name, for the message.
    :param max_retries: recoveries allowed.
    """

    def __init__(self, strategy: str, max_retries: int):
        check_at_least("strategy.max_retries", max_retries, 0)
        self.strategy = strategy
        self.max_retries = max_retries
        self.used = 0

    def spend(self) -> None:
        """Count one recovery; raise :class:`TrainingStopped` when the budget is spent."""
        self.used += 1
        if self.used > self.max_retries:
            raise TrainingStopped(
                f"{self.strategy} gave up after {self.max_retries} recoveries (strategy.max_retries)."
            )


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


def check_at_least(name: str, value: int | float, minimum: int | float) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value >= minimum``."""
    if not value >= minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}.")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (unreadable); an older one is used instead."""


class PluginError(RuntimeError):
    """A plugin failed to load or broke its hook's contract; the message names it."""


class TrainingStopped(RuntimeError):
    """Training stopped before its last step; ``report`` holds the run report."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class RestartRequested(TrainingStopped):
    """The strategy wants a fresh worker process that restores the last checkpoint.

    :param resume_step: the step of that checkpoint (0: none yet, the next worker starts afresh).
    """

    def __init__(self, message: str, *, resume_step: int):
        super().__init__(message)
        self.resume_step = resume_step
