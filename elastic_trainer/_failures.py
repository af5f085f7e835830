"""What the core knows about a failure, and the errors it raises itself."""

from __future__ import annotations

import dataclasses


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


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


def check_at_least(name: str, value: int | float, minimum: int | float) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value >= minimum``."""
    if not value >= minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}.")


class PluginError(RuntimeError):
    """A plugin failed to load or broke its hook's contract; the message names it."""


class TrainingStopped(RuntimeError):
    """Training stopped before its last step; ``report`` holds the run report."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report
