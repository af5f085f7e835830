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
- :data:`MULTI_CONTROLLER`: detection, barrier and rejoin costs measured on
  ``cluster=multiprocess`` from 2 to 16 processes (:data:`MEASURED_MULTIPROCESS`,
  docs/multiprocess.md, "From 2 to 16 processes").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
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


@dataclass(frozen=True)
class MeasuredProcesses:
    """What ``benchmarks/multiprocess_scale.py`` measured with ``processes`` processes of one CPU device each
    (seconds): a save's blocking time (almost all of it the processes' synchronization), the detection of a
    killed process, and taking its replacement back in (new backends, the compile, the state from a peer;
    ``None`` where that failed)."""

    processes: int
    save_s: float
    detection_s: float
    rejoin_s: float | None


MEASURED_MULTIPROCESS = (
    MeasuredProcesses(2, save_s=0.165, detection_s=2.28, rejoin_s=8.40),
    MeasuredProcesses(4, save_s=0.273, detection_s=10.12, rejoin_s=21.78),
    MeasuredProcesses(8, save_s=0.583, detection_s=10.15, rejoin_s=26.02),
    MeasuredProcesses(16, save_s=1.577, detection_s=20.24, rejoin_s=None),
)
"""``python benchmarks/multiprocess_scale.py``, 2026-12-03 (benchmarks/results/multiprocess_scale/results.json;
docs/multiprocess.md, "From 2 to 16 processes"): the tiny model, process 1 killed and back,
``cluster.collective_timeout_s=10``, every process on the same 2 CPU cores, shared with another job. With 16
processes taking the replacement back in failed (gloo's 30 s rendezvous), so the rejoin is fitted over 2 to 8."""


@dataclass(frozen=True)
class Linear:
    """A cost of ``fixed_s`` plus ``per_process_s`` for each process."""

    fixed_s: float
    per_process_s: float

    def at(self, processes: int) -> float:
        """The cost with ``processes`` processes."""
        return self.fixed_s + self.per_process_s * processes


def fit_linear(points: Sequence[tuple[int, float]], *, through_origin: bool = False) -> Linear:
    """Least squares of (processes, seconds) ``points`` by a line (``through_origin``: with no fixed part)."""
    processes, seconds = (np.array(column, dtype=float) for column in zip(*points))
    columns = [processes] if through_origin else [np.ones_like(processes), processes]
    solution = np.linalg.lstsq(np.stack(columns, axis=1), seconds, rcond=None)[0]
    return Linear(0.0, float(solution[0])) if through_origin else Linear(float(solution[0]), float(solution[1]))


def barrier_s_per_process(measured: Sequence[MeasuredProcesses] = MEASURED_MULTIPROCESS) -> float:
    """Least squares through the origin of the measured saves' blocking times against the process count."""
    return fit_linear([(m.processes, m.save_s) for m in measured], through_origin=True).per_process_s


def detection_s(measured: Sequence[MeasuredProcesses] = MEASURED_MULTIPROCESS) -> float:
    """The median measured detection: with 4 and 8 processes the survivors not connected to the dead process waited
    out the collective timeout, with 16 twice; with 2 the survivor's collective failed at once."""
    return statistics.median(m.detection_s for m in measured)


def rejoin_cost(measured: Sequence[MeasuredProcesses] = MEASURED_MULTIPROCESS) -> Linear:
    """Least squares of the measured rejoins by a line in the process count."""
    return fit_linear([(m.processes, m.rejoin_s) for m in measured if m.rejoin_s is not None])


@dataclass(frozen=True)
class Runtime:
    """Where the job runs, and what that changes for every strategy.

    :param name: ``"single"`` (one controller that sees every device: Pathways, the simulated cluster) or
        ``"multi"`` (JAX's multi-controller runtime, one process per slice).
    :param detection_s: the time to detect a lost slice, or ``None`` for the measured one.
    :param barrier_s_per_process: the cost of one barrier over the processes, per process; paid at every
        save, at every recovery's agreement on who lives and at every start of the processes.
    :param rejoin: a returned slice can rejoin a running job (``scale_down`` scales up).
    :param rejoin_s: what taking it back in costs, or ``None`` for the measured scale-up; on the multi-controller
        runtime every process then starts a new backend, and every compiled layout but the new one is forgotten.
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
    rejoin_s: Linear | None
    regroups: bool
    controller_fails: bool
    step_takes_state: bool

    def barrier_s(self, slices: int) -> float:
        """One barrier over ``slices`` processes."""
        return self.barrier_s_per_process * slices


SINGLE_CONTROLLER = Runtime("single", detection_s=None, barrier_s_per_process=0.0, rejoin=True, rejoin_s=None,
                            regroups=False, controller_fails=True, step_takes_state=True)
MULTI_CONTROLLER = Runtime("multi", detection_s=detection_s(), barrier_s_per_process=barrier_s_per_process(),
                           rejoin=True, rejoin_s=rejoin_cost(), regroups=True, controller_fails=True,
                           step_takes_state=False)
RUNTIMES = {runtime.name: runtime for runtime in (SINGLE_CONTROLLER, MULTI_CONTROLLER)}
