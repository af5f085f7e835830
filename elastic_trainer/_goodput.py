"""Where the wall time went: productive training versus each kind of badput."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

BADPUT_CATEGORIES = (
    "startup",
    "compile",
    "checkpoint_save",
    "checkpoint_restore",
    "detection",
    "waiting_for_slices",
    "remesh",
    "wasted_progress",
    "other",
)
"""Badput categories of ``report.json``, aligned with ml-goodput-measurement."""


class GoodputClock:
    """Measures spans of wall time by category, from ``started_at`` on.

    :param started_at: when the clock starts, in ``time.time()`` seconds: the
        process start for the CLI, now (the call to ``fit``) by default. The
        time from ``started_at`` until the clock is made counts as startup.
    """

    def __init__(self, started_at: float | None = None):
        now = time.time()
        self.started_at = now if started_at is None else started_at
        self.ended_at: float | None = None
        self.productive_s = 0.0
        self.badput_s = dict.fromkeys(BADPUT_CATEGORIES, 0.0)
        self.badput_s["startup"] = now - self.started_at

    @contextlib.contextmanager
    def measure(self, category: str, *, on_error: str | None = None) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``category`` (or ``"productive"``).

        :param on_error: the category that gets the time instead when the
            block raises (a failed step's time is not productive).
        """
        for name in (category, on_error or category):
            if name != "productive" and name not in self.badput_s:
                raise ValueError(f"unknown goodput category {name!r}")
        begin = time.time()
        try:
            yield
        except BaseException:
            self._add(on_error or category, time.time() - begin)
            raise
        self._add(category, time.time() - begin)

    def _add(self, category: str, seconds: float) -> None:
        if category == "productive":
            self.productive_s += seconds
        else:
            self.badput_s[category] += seconds

    def reclassify_productive(self, seconds: float) -> None:
        """Move ``seconds`` of productive time to ``wasted_progress`` (steps rolled back)."""
        self.productive_s -= seconds
        self.badput_s["wasted_progress"] += seconds

    def stop(self) -> None:
        """Mark the end of training; time after it is not counted."""
        self.ended_at = time.time()

    def summary(self) -> dict:
        """``wall_s``, ``productive_s``, ``goodput`` and ``badput_s``; unmeasured time is ``other``."""
        end = time.time() if self.ended_at is None else self.ended_at
        wall = end - self.started_at
        badput = dict(self.badput_s)
        badput["other"] += max(0.0, wall - self.productive_s - sum(badput.values()))
        return {
            "wall_s": wall,
            "productive_s": self.productive_s,
            "goodput": self.productive_s / wall if wall > 0 else 0.0,
            "badput_s": badput,
        }
