"""The failure model and the runtime model of a projection, with their cited defaults.

Every default is a published or measured number (docs/projection.md cites each):

- :data:`LLAMA3_FAILURES_PER_CHIP_HOUR`: Llama 3 405B's pre-training saw 419
  unexpected interruptions in a 54-day window on 16,384 H100 GPUs (Dubey et
  al., "The Llama 3 Herd of Models", 2024, section 3.3.4): one per GPU every
  5.8 years.
- :data:`LLAMA3_CHIPS_PER_SLICE`: its servers hold 8 GPUs each (same paper, section 3.3.1).
- :data:`LLAMA3_DAYS`: the length of that window, as the length of a simulated job.
- :data:`REPAIR_S`: 5 minutes until a lost slice (or a spare in its place) is
  back: MaxText's ``elastic_timeout_seconds`` default, the time its elastic
  mode waits for one.
- :data:`MULTI_CONTROLLER`: detection and barrier costs measured on
  ``cluster=multiprocess`` (docs/multiprocess.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._failures import ConfigError

LLAMA3_FAILURES_PER_CHIP_HOUR = 419 / (54 * 24 * 16384)
LLAMA3_CHIPS_PER_SLICE = 8
LLAMA3_DAYS = 54.0
REPAIR_S = 300.0
REPAIR_DISTRIBUTIONS = ("exponential", "fixed")


@dataclass(frozen=True)
class FailureModel:
    """How often slices fail and how long a lost one stays down.

    :param failures_per_chip_hour: each chip's failure rate; a slice fails when any of its chips does.
    :param chips_per_slice: chips in one slice.
    :param repair_s: the mean time a lost slice stays down.
    :param repair: ``"exponential"`` (memoryless repairs of mean ``repair_s``) or ``"fixed"``.
    """

    failures_per_chip_hour: float = LLAMA3_FAILURES_PER_CHIP_HOUR
    chips_per_slice: int = LLAMA3_CHIPS_PER_SLICE
    repair_s: float = REPAIR_S
    repair: str = "exponential"

    def __post_init__(self):
        if not self.failures_per_chip_hour > 0:
            raise ConfigError(f"the failure rate must be a positive number per chip-hour, got {self.failures_per_chip_hour}.")
        if not (isinstance(self.chips_per_slice, int) and self.chips_per_slice >= 1):
            raise ConfigError(f"chips per slice must be a whole number of at least 1, got {self.chips_per_slice}.")
        if not self.repair_s >= 0:
            raise ConfigError(f"the repair time must be a number of seconds, at least 0, got {self.repair_s}.")
        if self.repair not in REPAIR_DISTRIBUTIONS:
            raise ConfigError(f"the repair distribution must be one of {', '.join(REPAIR_DISTRIBUTIONS)}, got {self.repair!r}.")

    @property
    def slice_rate_per_s(self) -> float:
        """Failures per second of one slice."""
        return self.failures_per_chip_hour * self.chips_per_slice / 3600

    def failures_per_day(self, slices: int) -> float:
        """Expected slice failures per day in a job of ``slices`` slices."""
        return slices * self.slice_rate_per_s * 86400

    def repair_times(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` draws of the time a lost slice stays down."""
        if self.repair == "fixed":
            return np.full(size, self.repair_s)
        return rng.exponential(self.repair_s, size)

    def expected_wait_s(self, overlap_s: float) -> float:
        """The expected time a repair lasts beyond ``overlap_s`` (``E[max(0, repair - overlap_s)]``)."""
        if self.repair == "fixed":
            return max(0.0, self.repair_s - overlap_s)
        return self.repair_s * float(np.exp(-overlap_s / self.repair_s)) if self.repair_s else 0.0


MEASURED_OVERHEAD_RATIO = 1.0
"""The trainer's steps/s over a bare donating loop's on the default job (``benchmarks/overhead.py``,
docs/architecture.md "The step"), at most 1: the trainer runs the same program, so a median above 1 is the
machine's noise. A bare loop restarting from its checkpoints (the projection's ``bare_loop`` row) steps this
much faster."""

MEASURED_SAVE_BARRIER_S = ((1, 0.02), (2, 0.05), (3, 0.125))
"""(processes, seconds) a save of a two-array state blocked on ``cluster=multiprocess``: almost all of it
the processes' synchronization (docs/multiprocess.md, "Checkpoints after a lost process"; middles of the ranges)."""
MEASURED_DETECTION_S = 5.1
"""A killed process detected by the survivors (collective timeout 4 s, heartbeat 3 s; docs/multiprocess.md)."""


def barrier_s_per_process(measured: tuple[tuple[int, float], ...] = MEASURED_SAVE_BARRIER_S) -> float:
    """Least squares through the origin of the measured barrier times against the process count."""
    processes, seconds = (np.array(column, dtype=float) for column in zip(*measured))
    return float(np.linalg.lstsq(processes[:, None], seconds, rcond=None)[0][0])


@dataclass(frozen=True)
class Runtime:
    """Where the job runs, and what that changes for every strategy.

    :param name: ``"single"`` (one controller that sees every device: Pathways, the simulated cluster) or
        ``"multi"`` (JAX's multi-controller runtime, one process per slice).
    :param detection_s: the time to detect a lost slice, or ``None`` for the measured one.
    :param barrier_s_per_process: the cost of one barrier over the processes, per process; paid at every
        save, at every recovery's agreement on who lives and at every start of the processes.
    :param rejoin: a returned slice can rejoin a running job (``scale_down`` scales up).
    :param regroups: a strategy that waits for lost slices re-forms the whole group (a full restart).
    :param controller_fails: the controller (on the multi-controller runtime, the process hosting JAX's
        coordination service, ``cluster.coordinator=separate``) is a host of its own, failing at a slice's
        rate; with ``False`` the coordinator is slice 0 (``cluster.coordinator=process0``).
    :param step_takes_state: a step is one program with the state donated to it, so a slice lost while a
        step runs leaves no slice the state: it comes back from the host snapshot (a single controller;
        on the multi-controller runtime the processes that live keep it: docs/architecture.md, "The step").
    """

    name: str
    detection_s: float | None
    barrier_s_per_process: float
    rejoin: bool
    regroups: bool
    controller_fails: bool
    step_takes_state: bool

    def barrier_s(self, slices: int) -> float:
        """One barrier over ``slices`` processes."""
        return self.barrier_s_per_process * slices


SINGLE_CONTROLLER = Runtime("single", detection_s=None, barrier_s_per_process=0.0, rejoin=True, regroups=False,
                            controller_fails=True, step_takes_state=True)
MULTI_CONTROLLER = Runtime("multi", detection_s=MEASURED_DETECTION_S, barrier_s_per_process=barrier_s_per_process(),
                           rejoin=False, regroups=True, controller_fails=True, step_takes_state=False)
RUNTIMES = {runtime.name: runtime for runtime in (SINGLE_CONTROLLER, MULTI_CONTROLLER)}
