"""The ``full_restart`` strategy: the traditional baseline, a new process from the last checkpoint."""

from __future__ import annotations

import warnings

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.clusters import has_spares


class FullRestart(etp.AbstractStrategy):
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
    def et_run_start(self, trainer: etp.TrainerView, state: etp.TrainState, mode: etp.AbstractTrainingMode) -> None:
        """Warn once when the cluster keeps spares: a fresh worker starts on the first slices again, so a spare
        never takes a lost slice's place."""
        if has_spares(trainer.cluster):
            warnings.warn("full_restart never takes a spare slice in (a fresh worker starts on the first slices "
                          "again); choose +strategy=hot_swap, scale_down or pause_resume to use cluster.spare_slices.",
                          et.SpareWarning, stacklevel=2)

    @et.hookimpl
    def et_choose_recovery(self, trainer: etp.RunView, failure: etp.Failure) -> etp.RecoveryPlan:
        """Always restart the whole worker process."""
        return etp.RecoveryPlan(action="full_restart", restart_process=True)
