"""The run's timeline as typed records, one line of ``events.jsonl`` each (:meth:`Event.to_json`): what the
built-in event log writes, and what a plugin that records events of its own builds on.

Every line has ``event`` (its kind) and ``time`` (when it began, ``time.time()`` seconds, like the report's
``started_at``); a span also has ``end``. A run whose workers were restarted adds ``worker`` (which one) to the
lines of its steps, saves and restores.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._json_records import JsonRecord
from ._records import FailureRecord, ResizeRecord
from ._stragglers import StragglerRecord


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event(JsonRecord):
    """One event of the timeline."""

    event: ClassVar[str]
    """The kind of event: the line's ``event``."""
    time: float
    """When it happened or began (``time.time()``)."""

    def to_json(self) -> dict[str, Any]:
        """The line of ``events.jsonl``: ``event`` first, then the fields."""
        return {"event": self.event, **super().to_json()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Span(Event):
    """An event that lasted from ``time`` to ``end``."""

    end: float
    """When it ended (``time.time()``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepEvent(Span):
    """A completed step."""

    event: ClassVar[str] = "step"
    step: int
    """Steps completed, counting this one."""
    slices: tuple[int, ...]
    """The slices it ran on."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSaveEvent(Span):
    """The time the step loop blocked on saving a checkpoint."""

    event: ClassVar[str] = "checkpoint_save"
    step: int
    """The step saved."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreEvent(Span):
    """Restoring the state after a failure (or a resumed run's checkpoint)."""

    event: ClassVar[str] = "restore"
    step: int
    """The step restored."""
    source: str
    """Where the state came from: ``replica``, ``snapshot``, ``checkpoint`` or ``peer``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryEvent(Span):
    """From a failure until the end of the first productive step after it."""

    event: ClassVar[str] = "recovery"
    step: int
    """The step that failed."""
    action: str
    """What the strategy did."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointFailureEvent(Event):
    """A checkpoint save that failed for I/O, found at ``time``; training went on."""

    event: ClassVar[str] = "checkpoint_failure"
    step: int
    """The step whose save failed."""
    cause: str | None
    """The storage's error in words."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureEvent(Event):
    """A failure, raised at ``time``: the line holds the report's record of it (``failed_at`` is ``time``)."""

    event: ClassVar[str] = "failure"
    failure: FailureRecord
    """The failure as ``report.json``'s ``failures`` lists it."""

    def to_json(self) -> dict[str, Any]:
        """``event``, ``time``, then the failure's fields."""
        return {"event": self.event, "time": self.time, **self.failure.to_json()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResizeEvent(Event):
    """A change of the slices in use, made at ``time``: the line holds the report's record of it."""

    event: ClassVar[str] = "resize"
    resize: ResizeRecord
    """The resize as ``report.json``'s ``resizes`` lists it."""

    def to_json(self) -> dict[str, Any]:
        """``event``, ``time``, then the resize's fields."""
        return {"event": self.event, "time": self.time, **self.resize.to_json()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerEvent(Event):
    """A straggler, from when it was found (``time``) to when it recovered (``end``, if it did)."""

    event: ClassVar[str] = "straggler"
    straggler: StragglerRecord
    """The straggler as ``report.json``'s ``stragglers`` lists it."""

    def to_json(self) -> dict[str, Any]:
        """``event``, ``time``, the straggler's fields, and ``end`` once it recovered."""
        recovered = self.straggler.recovered_at
        return {"event": self.event, "time": self.time, **self.straggler.to_json(),
                **({"end": recovered} if recovered else {})}
