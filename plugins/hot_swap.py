"""The ``hot_swap`` strategy: a spare slice takes a lost one's place at once, at the same slice count."""

from __future__ import annotations

import warnings

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.clusters import has_spares


class HotSwap(etp.AbstractStrategy):
    """Go on at once with a spare in each lost slice's place (``cluster.spare_slices``): the same slice count,
    global batch and per-device batch, the state from a surviving replica, no step lost.

    With no spare left the plan needs more slices than are healthy, so
    alone it stops the run; in a fallback chain the next strategy takes over
    (``+strategy=swap_then_scale_down``: swap while spares last, then scale
    down). A lost slice that comes back is a spare again.

    :param max_retries: stop after this many failures in a row without
        progress (see ``retry_reset_steps``).
    :param retry_reset_steps: a failure at least this many steps past the
        previous one starts the count of ``max_retries`` again (0: never).
    :param compile_ahead: compile the step for every "slice i replaced by a
        spare" layout in the background after start and after each swap, so
        a swap need not wait for a compile.
    """

    name = "hot_swap"

    def __init__(self, max_retries: int = 10, retry_reset_steps: int = etp.RetryBudget.DEFAULT_RESET_STEPS,
                 compile_ahead: bool = True):
        self.retries = etp.RetryBudget(self.name, max_retries, retry_reset_steps)
        self.compile_ahead = compile_ahead

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView, state: etp.TrainState, mode: etp.AbstractTrainingMode) -> None:
        """Warn once when the cluster has no spare to swap in."""
        if not has_spares(trainer.cluster):
            warnings.warn(f"hot_swap on a cluster without spares ({trainer.cluster.kind}) swaps in nothing: alone it "
                          "stops at the first failure; set cluster.spare_slices, or choose another strategy.",
                          et.SpareWarning, stacklevel=2)

    @et.hookimpl
    def et_choose_recovery(self, trainer: etp.RunView, failure: etp.Failure) -> etp.RecoveryPlan:
        """Go on at once with as many slices as were in use, spares standing in for the lost ones."""
        self.retries.spend(failure.step)
        return etp.RecoveryPlan(action="hot_swap", min_slices=len(trainer.slices))

    @et.hookimpl
    def et_likely_layouts(self, trainer: etp.TrainerView) -> list[list[int]]:
        """Every layout with one slice lost, which the trainer fills with a spare: where the next failure takes
        the run."""
        if not self.compile_ahead:
            return []
        return etp.one_slice_lost(trainer.slices)
