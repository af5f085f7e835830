"""Step times on the multi-controller runtime: the check of the collective timeout, and each process's own
time in a step, shared with the others for finding stragglers."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable

from . import _keys as keys

STEP_TIME_MARGIN = 4
"""A collective timeout under this many median step times may end a failure-free step (a peer only slow):
a collective waits for the part of a step a peer has not done yet (measured: 2 s and 0.25-0.3 s steps, 3
processes on 2 cores with another job running, no collective timed out in 300 steps)."""


class TimeoutCheck:
    """The time between a process's step dispatches, checked once against the collective timeout chosen for it.

    :param timeout_s: the collective timeout in force.
    :param steps: how many steps are timed before the check (the first, which compiles, is left out).
    """

    def __init__(self, timeout_s: int, steps: int = 20):
        self.timeout_s = timeout_s
        self.steps = steps
        self._dispatches: list[float] = []

    def dispatched(self) -> None:
        """Note a dispatch; after :attr:`steps` of them, warn if the median step needs a longer timeout."""
        if len(self._dispatches) > self.steps:
            return
        self._dispatches.append(time.monotonic())
        if len(self._dispatches) > self.steps:
            step_s = statistics.median(b - a for a, b in zip(self._dispatches[1:], self._dispatches[2:]))
            if STEP_TIME_MARGIN * step_s > self.timeout_s:
                warnings.warn(
                    f"a step takes {step_s:.2f} s, and the collective timeout chosen before it could be measured "
                    f"({self.timeout_s} s) is under {STEP_TIME_MARGIN} steps: a peer only slow may fail a step; set "
                    f"cluster.collective_timeout_s={math.ceil(STEP_TIME_MARGIN * step_s)} or more.",
                    stacklevel=3,
                )


class OwnStepTimes:
    """A process's own time in each step, and the others', through the coordination service's key-value store.

    :param client: the coordination service's client.
    :param process: this process's index.

    A process notes its time before the barrier that ends the step (where
    the processes agree on who lives), and reads everyone's after it: every
    process reads the same times.
    """

    def __init__(self, client: Callable, process: Callable[[], int]):
        self._client, self._process = client, process
        self._dispatched_at: float | None = None  # when the step under way was, until it is timed
        self._slow: tuple[float, float] | None = None  # (factor, until when), from failure injection

    def dispatched(self) -> None:
        """Note that a step was dispatched now."""
        self._dispatched_at = time.monotonic()

    def forget(self) -> None:
        """The step under way failed: it is not timed."""
        self._dispatched_at = None

    def slow_down(self, factor: float, for_s: float) -> None:
        """For ``for_s`` seconds, take ``factor`` times as long over each step (the rest slept before its end)."""
        self._slow = (factor, time.monotonic() + for_s)

    def note(self, step: int) -> bool:
        """Once step ``step`` (its dispatch number) is done here, note its time for the others (a slow process
        takes its longer time first); whether there was a step to time."""
        if self._dispatched_at is None:
            return False
        took, self._dispatched_at = time.monotonic() - self._dispatched_at, None
        if self._slow is not None and self._slow[1] > time.monotonic():
            time.sleep((self._slow[0] - 1) * took)
            took *= self._slow[0]
        client, me = self._client(), self._process()
        client.key_value_set(keys.took(step, me), repr(took))
        with contextlib.suppress(Exception):  # the previous step's entry, which every process has read by now
            client.key_value_delete(keys.took(step - 1, me))
        return True

    def read(self, step: int, slices: Iterable[tuple[int, range]]) -> dict[int, float]:
        """After the barrier: each of ``slices`` (index, processes) whose processes all noted step ``step``, with
        the time of its slowest process."""
        noted = self._client().key_value_dir_get(keys.took(step))
        by_process = {int(key.rsplit("/", 1)[1]): float(value) for key, value in noted}
        return {index: max(by_process[p] for p in processes) for index, processes in slices
                if all(p in by_process for p in processes)}
