"""Carrying out a strategy's plan: waiting for slices, and falling back along a chain."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ._failures import RecoveryPlan, TrainingStopped

HEALTH_POLL_S = 0.05
"""How often slice health is asked while waiting for slices."""


def wait_for_slices(hook: Any, trainer: Any, timeout_s: float) -> list[int]:
    """Poll the ``et_slice_health`` hook until every slice of ``trainer.cluster`` is healthy or ``timeout_s`` passed."""
    total = len(trainer.cluster.slice_devices())
    deadline = time.monotonic() + timeout_s
    healthy = hook.et_slice_health(trainer=trainer)
    while len(healthy) < total and time.monotonic() < deadline:
        time.sleep(min(HEALTH_POLL_S, max(0.0, deadline - time.monotonic())))
        healthy = hook.et_slice_health(trainer=trainer)
    return sorted(healthy)


def carry_out_waits(
    plan: RecoveryPlan,
    record: dict[str, Any],
    *,
    wait: Callable[[float], list[int]],
    restart: Callable[[], None],
    error: Exception,
) -> tuple[RecoveryPlan, list[int]]:
    """Wait as ``plan`` says; when too few slices are back, fall back to ``plan.otherwise`` or stop.

    :param record: the failure's report entry; gets ``action``, ``waiting_s``
        and, after a fallback, ``fell_back_from``.
    :param wait: waits up to the given seconds for every slice; returns the healthy ones.
    :param restart: called for a plan that restarts the process; it must raise.
    :param error: the failure, chained to a :class:`TrainingStopped`.
    :returns: the plan carried out and the healthy slices.
    """
    record["waiting_s"] = 0.0
    while True:
        record["action"] = plan.action
        if plan.restart_process:
            restart()
        begin = time.time()
        healthy = wait(plan.wait_for_all_s)
        record["waiting_s"] += time.time() - begin
        if len(healthy) >= plan.min_slices:
            return plan, healthy
        if plan.otherwise is None:
            raise TrainingStopped(
                f"{plan.action}: {len(healthy)} slice(s) healthy after waiting {record['waiting_s']:.0f} s, "
                f"fewer than the {plan.min_slices} the strategy needs; the last checkpoint is intact."
            ) from error
        record.setdefault("fell_back_from", []).append(plan.action)
        plan = plan.otherwise
