"""The ``step_counter`` observer: how many steps ran, and how many of them were done again after a restore."""

from __future__ import annotations

import logging

import elastic_trainer as et

logger = logging.getLogger(__name__)

REPORT_KEY = "step_counter"


class StepCounter:
    """Counts step ends and restores, and adds them to the run report under ``step_counter``.

    ``redone`` counts the steps that ended, were rolled back by a restore, and
    so ran again: the work a failure cost, in steps.
    """

    @et.hookimpl
    def et_run_start(self) -> None:
        """Start counting afresh (one process may run several jobs, as a multirun does)."""
        self.step_ends = 0
        self.last_step = 0
        self.restores: list[dict] = []

    @et.hookimpl
    def et_step_end(self, step: int) -> None:
        """Count the step; cheap, as this runs on the training thread."""
        self.step_ends += 1
        self.last_step = step

    @et.hookimpl
    def et_after_restore(self, step: int, source: str) -> None:
        """Note where the state came from and how many ended steps it rolled back."""
        self.restores.append({"step": step, "source": source, "redone": max(0, self.last_step - step)})
        self.last_step = step

    @et.hookimpl(tryfirst=True)
    def et_run_end(self, report: et.RunReport) -> None:
        """Add the counts to the report before the built-in reporter writes it, and log them."""
        redone = sum(restore["redone"] for restore in self.restores)
        report.extra[REPORT_KEY] = {"step_ends": self.step_ends, "redone": redone, "restores": self.restores}
        logger.info(
            "step_counter: %d step ends, %d restores, %d steps redone.", self.step_ends, len(self.restores), redone
        )


step_counter = StepCounter()
"""The instance the entry point names; elastic_trainer registers it as ``step_counter``."""
