"""Metrics sinks: which scalars a run reports, and when; a sink only writes them (TensorBoard, JSON lines, ...)."""

from __future__ import annotations

import abc
import time
from pathlib import Path

import jax

import elastic_trainer as et
import elastic_trainer.plugin as etp


class AbstractMetricsSink(abc.ABC):
    """A plugin that reports the run's scalars to a sink.

    Every step: ``train/loss`` (and ``train/<name>`` for each aux scalar of a
    loss with ``has_aux``), ``train/samples_per_s`` and ``train/slices`` (the
    slices in use). At the end: ``run/goodput``, each badput category
    (``badput/<category>_s``), and for each failure, at its step,
    ``failures/recovery_s``, ``failures/lost_steps`` and, on a cluster with
    spares, ``failures/spares_taken`` and ``failures/spares_left`` (and at the
    end ``run/spares_in_use`` and ``run/spares_left``). A sink implements
    :meth:`open`, :meth:`write` and :meth:`close`: a new sink is one small
    class (see :class:`TensorBoard`).

    :param every: write the per-step scalars every this many steps.
    """

    def __init__(self, every: int = 1):
        if every < 1:
            raise et.ConfigError(f"logger.every must be at least 1, got {every}.")
        self.every = every
        self._step_began = 0.0

    @abc.abstractmethod
    def open(self, run_dir: Path | None) -> None:
        """Start writing, into ``run_dir`` when the run has one."""

    @abc.abstractmethod
    def write(self, name: str, value: float, step: int) -> None:
        """Record scalar ``name`` at ``step``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and stop writing."""

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView) -> None:
        """Open the sink."""
        self.open(trainer.run_dir)

    @et.hookimpl
    def et_step_start(self) -> None:
        """Note when the step began."""
        self._step_began = time.time()

    @et.hookimpl
    def et_step_end(self, trainer: etp.TrainerView, step: int, metrics: dict) -> None:
        """Write the step's loss and aux scalars, throughput and slices in use."""
        if step % self.every == 0:
            seconds = max(time.time() - self._step_began, 1e-9)
            for name, value in jax.device_get(metrics).items():  # one transfer
                self.write(f"train/{name}", float(value), step)
            self.write("train/samples_per_s", trainer.global_batch_size / seconds, step)
            self.write("train/slices", len(trainer.slices), step)

    @et.hookimpl
    def et_run_end(self, report: et.RunReport) -> None:
        """Write the run's goodput, badput and failures; close the sink."""
        end = report.steps_completed
        self.write("run/goodput", report.goodput, end)
        for category, seconds in report.badput_s.to_json().items():
            self.write(f"badput/{category}_s", seconds, end)
        for failure in report.failures:
            if failure.recovery_s is not None:  # None: the run ended before it recovered
                self.write("failures/recovery_s", failure.recovery_s, failure.step)
            self.write("failures/lost_steps", failure.lost_steps, failure.step)
            if failure.spares_left is not None:  # a cluster with spares
                self.write("failures/spares_taken", len(failure.spares_taken), failure.step)
                self.write("failures/spares_left", failure.spares_left, failure.step)
        if report.spares:
            self.write("run/spares_in_use", len(report.spares.in_use), end)
            self.write("run/spares_left", report.spares.left, end)
        self.close()


class TensorBoard(AbstractMetricsSink):
    """The run's scalars as a TensorBoard event file in ``<run_dir>/tensorboard`` (through tensorboardX,
    as MaxText writes its metrics); ``+logger=tensorboard`` on the command line.

    :param every: write the per-step scalars every this many steps.
    :param log_dir: where the event file goes; ``<run_dir>/tensorboard`` by default.
    """

    def __init__(self, every: int = 1, log_dir: str | None = None):
        super().__init__(every)
        if log_dir is not None and Path(log_dir).is_file():
            raise et.ConfigError(f"logger.log_dir {log_dir} is a file, not a directory; point it at a directory.")
        self.log_dir = log_dir
        self._writer = None

    def open(self, run_dir: Path | None) -> None:
        """Create the event file."""
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise et.ConfigError(
                "logger=tensorboard needs tensorboardX; install it with pip install 'elastic-trainer[tensorboard]'."
            ) from error
        if self.log_dir is None and run_dir is None:
            raise et.ConfigError("logger=tensorboard needs a run directory or logger.log_dir to write into.")
        self._writer = SummaryWriter(logdir=str(self.log_dir or Path(run_dir) / "tensorboard"))

    def write(self, name: str, value: float, step: int) -> None:
        """Add one scalar."""
        self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        """Flush the event file and close it."""
        self._writer.close()
