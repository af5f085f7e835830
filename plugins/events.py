"""Built-in event log: the run's timeline as ``events.jsonl`` beside ``report.json``."""

from __future__ import annotations

import json
import time
from typing import Any

import elastic_trainer as et
import elastic_trainer.plugin as etp

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Records steps, checkpoint saves and restores as they happen, and the
    failures, recoveries, resizes and stragglers of the report, as one JSON object per line
    ordered by time (``time.time()`` seconds, like the report's ``started_at``).

    Every event has ``event`` and ``time`` (its start); spans also have ``end``:

    - ``step``: a completed step (``step`` counts completed steps) and the ``slices`` it ran on;
    - ``checkpoint_save``: the time the step loop blocked on saving ``step``;
    - ``restore``: restoring ``step`` from ``source`` (replica, snapshot or checkpoint);
    - ``failure``: a failure as in ``report.json``'s ``failures``;
    - ``recovery``: from a failure until the end of the first productive step after it;
    - ``resize``: the mesh changed from ``slices_before`` to ``slices_after`` slices, for ``reason``.
    - ``checkpoint_failure``: the save of ``step`` failed for I/O (``cause``), found at ``time``; training went on.
    - ``straggler``: a straggler as in ``report.json``'s ``stragglers``, from when it was found (to when it recovered).
    """

    def __init__(self):
        self.events: list[dict[str, Any]] = []
        self._began: dict[str, float] = {}

    @et.hookimpl
    def et_run_start(self) -> None:
        """Start an empty timeline."""
        self.events, self._began = [], {}

    @et.hookimpl
    def et_step_start(self) -> None:
        """Note when the step began."""
        self._began["step"] = time.time()

    @et.hookimpl
    def et_step_end(self, trainer: etp.RunView, step: int) -> None:
        """Record the step's span and the slices it ran on."""
        self._span("step", step=step, slices=list(trainer.slices))

    @et.hookimpl
    def et_before_checkpoint_save(self) -> None:
        """Note when the save began."""
        self._began["checkpoint_save"] = time.time()

    @et.hookimpl
    def et_after_checkpoint_save(self, step: int) -> None:
        """Record the save's blocking span."""
        self._span("checkpoint_save", step=step)

    @et.hookimpl
    def et_before_restore(self) -> None:
        """Note when the restore began."""
        self._began["restore"] = time.time()

    @et.hookimpl
    def et_after_restore(self, step: int, source: str) -> None:
        """Record the restore's span and where the state came from."""
        self._span("restore", step=step, source=source)

    @et.hookimpl
    def et_run_end(self, trainer: etp.TrainerView, report: et.RunReport) -> None:
        """Add the report's failures, recoveries, resizes and failed checkpoint saves; write ``events.jsonl``
        to the run directory."""
        self.events += etp.report_events(report)
        self.events.sort(key=lambda event: event["time"])
        if trainer.run_dir is not None:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            with open(trainer.run_dir / EVENTS_FILE, "w") as file:
                file.writelines(json.dumps(event) + "\n" for event in self.events)

    def _span(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "time": self._began.pop(event, time.time()), "end": time.time(), **fields})
