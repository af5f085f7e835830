"""Built-in event log: the run's timeline as ``events.jsonl`` beside ``report.json``."""

from __future__ import annotations

import json
import time

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.events import CheckpointSaveEvent, Event, RestoreEvent, Span, StepEvent

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Records steps, checkpoint saves and restores as they happen, and the
    failures, recoveries, resizes, stragglers and failed checkpoint saves of the report
    (:mod:`elastic_trainer.events` has a record for each kind), as one JSON object per line
    ordered by time (``time.time()`` seconds, like the report's ``started_at``).
    """

    def __init__(self):
        self.events: list[Event] = []
        self._began: dict[str, float] = {}

    @et.hookimpl
    def et_run_start(self) -> None:
        """Start an empty timeline."""
        self.events, self._began = [], {}

    @et.hookimpl
    def et_step_start(self) -> None:
        """Note when the step began."""
        self._began[StepEvent.event] = time.time()

    @et.hookimpl
    def et_step_end(self, trainer: etp.RunView, step: int) -> None:
        """Record the step's span and the slices it ran on."""
        self._span(StepEvent, step=step, slices=tuple(trainer.slices))

    @et.hookimpl
    def et_before_checkpoint_save(self) -> None:
        """Note when the save began."""
        self._began[CheckpointSaveEvent.event] = time.time()

    @et.hookimpl
    def et_after_checkpoint_save(self, step: int) -> None:
        """Record the save's blocking span."""
        self._span(CheckpointSaveEvent, step=step)

    @et.hookimpl
    def et_before_restore(self) -> None:
        """Note when the restore began."""
        self._began[RestoreEvent.event] = time.time()

    @et.hookimpl
    def et_after_restore(self, step: int, source: str) -> None:
        """Record the restore's span and where the state came from."""
        self._span(RestoreEvent, step=step, source=source)

    @et.hookimpl
    def et_run_end(self, trainer: etp.TrainerView, report: et.RunReport) -> None:
        """Add the report's failures, recoveries, resizes and failed checkpoint saves; write ``events.jsonl``
        to the run directory."""
        self.events += etp.report_events(report)
        self.events.sort(key=lambda event: event.time)
        if trainer.run_dir is not None:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            with open(trainer.run_dir / EVENTS_FILE, "w") as file:
                file.writelines(json.dumps(event.to_json()) + "\n" for event in self.events)

    def _span(self, kind: type[Span], **fields: object) -> None:
        self.events.append(kind(time=self._began.pop(kind.event, time.time()), end=time.time(), **fields))
