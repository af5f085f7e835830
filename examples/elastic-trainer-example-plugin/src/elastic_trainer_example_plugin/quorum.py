"""The ``quorum`` strategy: scale down at once, but only while a quorum of the slices lives."""

from __future__ import annotations

import logging
import math

import elastic_trainer as et
import elastic_trainer.plugin as etp

logger = logging.getLogger(__name__)


class Quorum(etp.AbstractStrategy):
    """Go on with the healthy slices while at least ``quorum`` of the cluster's slices live.

    Unlike ``scale_down`` with a fixed ``min_slice_count``, the floor follows
    the cluster's size: ``quorum=0.5`` keeps a 4-slice job going on 2 slices
    and a 64-slice job on 32. Every decision is logged.

    :param quorum: the fraction of the cluster's slices that must be healthy
        to go on, in (0, 1]; the run goes on with at least
        ``ceil(quorum * slices)`` slices.
    :param max_retries: stop after this many recoveries.
    """

    name = "quorum"

    def __init__(self, quorum: float = 0.5, max_retries: int = 10):
        if not 0 < quorum <= 1:
            raise et.ConfigError(f"strategy.quorum must be above 0 and at most 1, got {quorum}.")
        self.quorum = quorum
        self.retries = etp.RetryBudget(self.name, max_retries)

    def min_slices(self, total: int) -> int:
        """The fewest slices of ``total`` that make a quorum."""
        return math.ceil(self.quorum * total)

    @et.hookimpl
    def et_choose_recovery(self, trainer: et.Trainer, failure: etp.Failure) -> etp.RecoveryPlan:
        """Plan to go on at once with the healthy slices, needing a quorum of them."""
        self.retries.spend(failure.step)
        total = len(trainer.cluster.slice_devices())
        needed = self.min_slices(total)
        healthy = trainer.hook.et_slice_health(trainer=trainer)
        decision = f"going on with {len(healthy)}" if len(healthy) >= needed else "stopping"
        logger.info(
            "quorum: step %d lost slice(s) %s; %d of %d slices healthy, quorum %d: %s.",
            failure.step + 1, list(failure.slices), len(healthy), total, needed, decision,
        )
        return etp.RecoveryPlan(action=self.name, min_slices=needed)
