"""Built-in progress display: step, loss (and a ``has_aux`` loss's scalars) and throughput while training runs."""

from __future__ import annotations

import time

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import elastic_trainer as et
import elastic_trainer.plugin as etp


class ProgressPlugin:
    """A rich progress bar on a terminal; plain periodic lines otherwise.

    The loss, and the aux scalars of a loss with ``has_aux``, are read from
    the device (in one transfer) at most every ``refresh_s`` seconds on a
    terminal, and ``lines`` times per run otherwise, so that showing them does
    not stall the asynchronous step loop.
    """

    def __init__(self, console: Console | None = None, *, refresh_s: float = 0.5, lines: int = 10):
        self.console = console or Console()
        self.refresh_s = refresh_s
        self.lines = lines
        self._progress: Progress | None = None

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView) -> None:
        """Open the bar (or plan the lines) for ``trainer.steps`` steps."""
        self._total = trainer.steps
        self._batch = trainer.global_batch_size
        self._every = max(1, trainer.steps // self.lines)
        self._last: tuple[int, float] | None = None
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}{task.fields[aux]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=self._total, loss="-", aux="", rate="-")
            self._progress.start()

    @et.hookimpl
    def et_step_end(self, step: int, metrics: dict) -> None:
        """Advance the bar; read the loss and throughput when it is time to show them."""
        now = time.perf_counter()
        if self._last is None:
            self._last = (step, now)
        due = step == self._total or (
            now - self._last[1] >= self.refresh_s if self._progress else step % self._every == 0
        )
        if not due:
            if self._progress:
                self._progress.update(self._task, completed=step)
            return
        values = jax.device_get(metrics)
        loss = float(values["loss"])
        aux = "".join(f"  {name} {float(value):.4f}" for name, value in values.items() if name != "loss")
        now = time.perf_counter()
        last_step, last_time = self._last
        rate = (step - last_step) * self._batch / (now - last_time) if step > last_step else float("nan")
        self._last = (step, now)
        if self._progress:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", aux=aux, rate=f"{rate:,.0f}")
        else:
            self.console.print(f"step {step}/{self._total}  loss {loss:.4f}{aux}  {rate:,.0f} samples/s",
                               highlight=False)

    @et.hookimpl
    def et_run_end(self) -> None:
        """Close the bar."""
        if self._progress:
            self._progress.stop()
            self._progress = None
