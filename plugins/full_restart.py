"""The ``full_restart`` strategy: the traditional baseline, a new process from the last checkpoint."""

from __future__ import annotations

import warnings

import elastic_trainer as et


class FullRestart(et.AbstractStrategy):
    """End the worker on a lost slice; the supervisor starts a fresh one that restores the last checkpoint.

    :param max_restarts: stop after this many restarts.
    """

    name = "full_restart"
    restarts_process = True  # the command line runs workers under a supervisor for this strategy

    def __init__(self, max_restarts: int = 10):
        if max_restarts < 0:
            raise et.ConfigError(f"strategy.max_restarts must be at least 0, got {max_restarts}.")
        self.max_restarts = max_restarts

    @et.hookimpl
    def et_run_start(self, trainer: et.TrainerView, state: et.TrainState, mode: et.AbstractTrainingMode) -> None:
        """Warn once when the cluster keeps spares: a fresh worker starts on the first slices again, so a spare
        never takes a lost slice's place."""
        if et.has_spares(trainer.cluster):
            warnings.warn("full_restart never takes a spare slice in (a fresh worker starts on the first slices "
                          "again); choose +strategy=hot_swap, scale_down or pause_resume to use cluster.spare_slices.",
                          et.SpareWarning, stacklevel=2)

    @et.hookimpl
    def et_choose_recovery(self, trainer: et.RunView, failure: et.Failure) -> et.RecoveryPlan:
        """Always restart the whole worker process."""
        return et.RecoveryPlan(action="full_restart", restart_process=True)
