"""The ``fallback`` strategy: a chain of strategies, each taking over when the one before gives up."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import elastic_trainer as et


class Fallback:
    """Try each strategy's plan in turn: when the slices a plan needs are not
    healthy once its wait is over, the next strategy's plan is carried out
    instead of stopping (for example pause_resume for 30 s, then scale_down).

    :param strategies: the chain, first choice first (strategy plugins).

    Every strategy of the chain plans at the moment of the failure, so each
    counts it in its own retry budget then: each member stops the run after
    its ``max_retries`` failures in a row with fewer than its
    ``retry_reset_steps`` steps of progress between them (not after
    ``max_retries`` failures of the whole run, as MaxText's
    ``elastic_max_retries``). The chain also answers the hooks its members
    implement besides ``et_choose_recovery`` (``et_likely_layouts``,
    ``et_propose_resize``), first member first.
    """

    def __init__(self, strategies: Sequence[object]):
        if len(strategies) < 2:
            raise et.ConfigError("strategy.strategies must name at least two strategies to fall back between.")
        self.strategies = list(strategies)
        self.name = "->".join(getattr(s, "name", type(s).__name__) for s in self.strategies)
        restarting = [s for s in self.strategies if et.restarts_process(s)]
        if restarting:  # et.RestartingStrategy, as its first restarting member declares
            self.restarts_process, self.max_restarts = True, restarting[0].max_restarts

    @et.hookimpl
    def et_run_start(self, trainer: et.TrainerView) -> None:
        """Let every member check the run (``scale_down``: its batch and ``min_slice_count``)."""
        for strategy in self.strategies:
            if hasattr(strategy, "et_run_start"):
                _call(strategy.et_run_start, trainer=trainer)

    @et.hookimpl
    def et_choose_recovery(self, trainer: et.Trainer, failure: et.Failure) -> et.RecoveryPlan:
        """The first member's plan, each plan falling back to the next member's."""
        plans = [_call(s.et_choose_recovery, trainer=trainer, failure=failure) for s in self.strategies]
        for index, plan in enumerate(plans):
            if not isinstance(plan, et.RecoveryPlan):
                raise et.PluginError(f"strategy {self.strategies[index]!r} in the fallback chain returned {plan!r}, "
                                     "not an et.RecoveryPlan.")
        chained = plans[-1]
        for plan in reversed(plans[:-1]):
            chained = dataclasses.replace(plan, otherwise=chained)
        return chained

    @et.hookimpl
    def et_likely_layouts(self, trainer: et.Trainer) -> list[list[int]]:
        """Every layout a member expects."""
        return [layout for s in self.strategies if hasattr(s, "et_likely_layouts")
                for layout in _call(s.et_likely_layouts, trainer=trainer) or []]

    @et.hookimpl
    def et_propose_resize(self, trainer: et.Trainer, healthy_slices: list[int]) -> list[int] | None:
        """The first resize a member proposes."""
        for strategy in self.strategies:
            if hasattr(strategy, "et_propose_resize"):
                proposal = _call(strategy.et_propose_resize, trainer=trainer, healthy_slices=healthy_slices)
                if proposal is not None:
                    return proposal
        return None


def _call(hook_method: Callable, **kwargs: Any) -> Any:
    """Call a member's hook implementation the way pluggy does: with only the arguments it names."""
    accepted = inspect.signature(hook_method).parameters
    return hook_method(**{name: value for name, value in kwargs.items() if name in accepted})
