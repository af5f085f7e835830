"""The ``pause_resume`` strategy: wait for the lost slices to return, then go on with all of them."""

from __future__ import annotations

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.clusters import mesh_slice_count


class PauseResume(etp.AbstractStrategy):
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
                 retry_reset_steps: int = etp.RetryBudget.DEFAULT_RESET_STEPS):
        if timeout_s < 0:
            raise et.ConfigError(f"strategy.timeout_s must be at least 0, got {timeout_s}.")
        self.timeout_s = timeout_s
        self.retries = etp.RetryBudget(self.name, max_retries, retry_reset_steps)

    @et.hookimpl
    def et_choose_recovery(self, trainer: etp.RunView, failure: etp.Failure) -> etp.RecoveryPlan:
        """Wait up to ``timeout_s`` for every slice, and need all of them back (or spares in their place)."""
        self.retries.spend(failure.step)
        return etp.RecoveryPlan(
            action="pause_resume",
            wait_for_all_s=self.timeout_s,
            min_slices=mesh_slice_count(trainer.cluster),
        )
