"""The ``pause_resume`` strategy: wait for the lost slices to return, then go on with all of them."""

from __future__ import annotations

import elastic_trainer as et


class PauseResume(et.AbstractStrategy):
    """Pause until every slice is healthy again, then resume on the full mesh.

    :param timeout_s: how long to wait for the slices (MaxText's
        ``elastic_timeout_seconds``); the run stops when they are not back by then.
    :param max_retries: stop after this many failures in a row without
        progress (see ``retry_reset_steps``). MaxText's ``elastic_max_retries``
        counts every failure of the run instead.
    :param retry_reset_steps: a failure at least this many steps past the
        previous one starts the count of ``max_retries`` again (0: never, as
        MaxText counts).
    """

    name = "pause_resume"

    def __init__(self, timeout_s: float = 300.0, max_retries: int = 10,
                 retry_reset_steps: int = et.RetryBudget.DEFAULT_RESET_STEPS):
        if timeout_s < 0:
            raise et.ConfigError(f"strategy.timeout_s must be at least 0, got {timeout_s}.")
        self.timeout_s = timeout_s
        self.retries = et.RetryBudget(self.name, max_retries, retry_reset_steps)

    @et.hookimpl
    def et_choose_recovery(self, trainer: et.RunView, failure: et.Failure) -> et.RecoveryPlan:
        """Wait up to ``timeout_s`` for every slice, and need all of them back (or spares in their place)."""
        self.retries.spend(failure.step)
        return et.RecoveryPlan(
            action="pause_resume",
            wait_for_all_s=self.timeout_s,
            min_slices=et.mesh_slice_count(trainer.cluster),
        )
