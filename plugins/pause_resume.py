"""The ``pause_resume`` strategy: wait for the lost slices to return, then go on with all of them."""

from __future__ import annotations

import elastic_trainer as et


class PauseResume:
    """Pause until every slice is healthy again, then resume on the full mesh.

    :param timeout_s: how long to wait for the slices (MaxText's
        ``elastic_timeout_seconds``); the run stops when they are not back by then.
    :param max_retries: stop after this many recoveries (``elastic_max_retries``).
    """

    name = "pause_resume"

    def __init__(self, timeout_s: float = 300.0, max_retries: int = 10):
        if timeout_s < 0:
            raise et.ConfigError(f"strategy.timeout_s must be at least 0, got {timeout_s}.")
        self.timeout_s = timeout_s
        self.retries = et.RetryBudget(self.name, max_retries)

    @et.hookimpl
    def et_choose_recovery(self, trainer: et.Trainer, failure: et.Failure) -> et.RecoveryPlan:
        """Wait up to ``timeout_s`` for every slice, and need all of them back."""
        self.retries.spend()
        return et.RecoveryPlan(
            action="pause_resume",
            wait_for_all_s=self.timeout_s,
            min_slices=len(trainer.cluster.slice_devices()),
        )
