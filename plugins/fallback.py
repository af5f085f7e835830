"""The ``fallback`` strategy: a chain of strategies, each taking over when the one before gives up."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import elastic_trainer as et
import elastic_trainer.plugin as etp


class Fallback(etp.AbstractStrategy):
    """Try each strategy's plan in turn: when the slices a plan needs are not
    healthy once its wait is over, the next strategy's plan is carried out
    instead of stopping (for example pause_resume for 30 s, then scale_down).

    :param strategies: the chain, first choice first (each an :class:`~elastic_trainer.plugin.AbstractStrategy`).

    Every strategy of the chain plans at the moment of the failure, so each
    counts it in its own retry budget then: each member stops the run after
    its ``max_retries`` failures in a row with fewer than its
    ``retry_reset_steps`` steps of progress between them (not after
    ``max_retries`` failures of the whole run, as MaxText's
    ``elastic_max_retries``). The chain also answers the strategy's optional
    hooks (``et_run_start``, ``et_likely_layouts``, ``et_propose_resize``,
    ``et_step_end``) for its members, first member first.
    """

    def __init__(self, strategies: Sequence[etp.AbstractStrategy]):
        if len(strategies) < 2:
            raise et.ConfigError("strategy.strategies must name at least two strategies to fall back between.")
        if others := [s for s in strategies if not isinstance(s, etp.AbstractStrategy)]:
            raise et.ConfigError(
                f"strategy.strategies: {type(others[0]).__name__} is not an elastic_trainer.plugin.AbstractStrategy; "
                "a fallback chain takes strategies derived from it (docs/plugins.md, \"Two kinds of plugin\")."
            )
        if modal := [s for s in strategies if hasattr(s, "et_training_mode")]:
            raise et.ConfigError(
                f"strategy.strategies: {modal[0].name} chooses how every step trains (et_training_mode) and cannot "
                "be one strategy of a fallback chain; select it alone."
            )
        self.strategies = list(strategies)
        self.name = "->".join(s.name for s in self.strategies)
        restarting = [s for s in self.strategies if etp.restarts_process(s)]
        if restarting:  # elastic_trainer.plugin.RestartingStrategy, as its first restarting member declares
            self.restarts_process, self.max_restarts = True, restarting[0].max_restarts

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView, state: etp.TrainState, mode: etp.AbstractTrainingMode) -> None:
        """Let every member check the run (``scale_down``: its batch and ``min_slice_count``)."""
        for strategy in self.strategies:
            strategy.et_run_start(trainer=trainer, state=state, mode=mode)

    @et.hookimpl
    def et_choose_recovery(self, trainer: etp.RunView, failure: etp.Failure) -> etp.RecoveryPlan:
        """The first member's plan, each plan falling back to the next member's."""
        plans = [s.et_choose_recovery(trainer=trainer, failure=failure) for s in self.strategies]
        for index, plan in enumerate(plans):
            if not isinstance(plan, etp.RecoveryPlan):
                raise et.PluginError(f"strategy {self.strategies[index]!r} in the fallback chain returned {plan!r}, "
                                     "not an elastic_trainer.plugin.RecoveryPlan.")
        chained = plans[-1]
        for plan in reversed(plans[:-1]):
            chained = dataclasses.replace(plan, otherwise=chained)
        return chained

    @et.hookimpl
    def et_likely_layouts(self, trainer: etp.TrainerView) -> list[list[int]]:
        """Every layout a member expects."""
        return [layout for s in self.strategies for layout in s.et_likely_layouts(trainer=trainer)]

    @et.hookimpl
    def et_step_end(self, trainer: etp.TrainerView, step: int, metrics: dict) -> None:
        """Tell every member the step ended (``scale_down``: how long a dropped straggler has been out)."""
        for strategy in self.strategies:
            strategy.et_step_end(trainer=trainer, step=step, metrics=metrics)

    @et.hookimpl
    def et_propose_resize(self, trainer: etp.TrainerView, healthy_slices: list[int]) -> list[int] | None:
        """The first resize a member proposes."""
        for strategy in self.strategies:
            proposal = strategy.et_propose_resize(trainer=trainer, healthy_slices=healthy_slices)
            if proposal is not None:
                return proposal
        return None
