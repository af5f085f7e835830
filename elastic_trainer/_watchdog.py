"""The watchdog: a step that hangs becomes an elastic failure instead of a hung job."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ._failures import StepTimeoutError


class Watchdog:
    """Runs the wait for a step on a helper thread and gives up on it after ``timeout_s``.

    A wait that times out is left behind on its (daemon) thread, so a stuck
    device never blocks the job or its exit. ``timeout_s=0`` waits on the
    calling thread, without a limit.

    :param timeout_s: the longest a step may take.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def wait(self, wait_for_step: Callable[[], None]) -> None:
        """Call ``wait_for_step``; raise :class:`StepTimeoutError` if it takes longer than ``timeout_s``."""
        if not self.timeout_s:
            wait_for_step()
            return
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                wait_for_step()
                outcome.append(None)
            except BaseException as error:  # handed to the calling thread
                outcome.append(error)

        thread = threading.Thread(target=run, name="et-step-wait", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not outcome:
            raise StepTimeoutError(
                f"DEADLINE_EXCEEDED: the step did not finish within {self.timeout_s:g} s (trainer.step_timeout_s)",
                slices=(),
            )
        error = outcome.pop()
        if error is not None:
            try:
                raise error
            finally:  # the error's traceback holds this frame: a reference from it back would be a cycle, and the
                del error  # step's arrays in the frames would wait for the cyclic collector (RSS grew by 1 GB)
