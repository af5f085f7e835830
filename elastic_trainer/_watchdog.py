"""The watchdog: a step that hangs becomes an elastic failure instead of a hung job."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

from ._failures import StepTimeoutError


class _Waiter:
    """A daemon thread that runs the waits it is handed, one at a time, and hands back how each ended; it ends once
    the waiter is let go of, so runs one after another in one process (a sweep, a notebook) leave no thread each."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.outcomes: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self.tasks, self.outcomes), name="et-step-wait", daemon=True).start()
        weakref.finalize(self, self.tasks.put, None)  # the thread holds the queues, not the waiter


def _serve(tasks: queue.SimpleQueue[Callable[[], None] | None], outcomes: queue.SimpleQueue[BaseException | None]
           ) -> None:
    """Run each wait from ``tasks`` and put how it ended on ``outcomes``, until ``None`` comes."""
    while (task := tasks.get()) is not None:
        try:
            task()
            outcomes.put(None)
        except BaseException as error:  # handed to the calling thread
            outcomes.put(error)
        del task


class Watchdog:
    """Runs the wait for a step on a helper thread and gives up on it after ``timeout_s``.

    The helper thread lives from wait to wait, so a step's wait costs two
    queue hand-offs, not a thread's start. A wait that times out is left
    behind on its (daemon) thread, which is not used again, so a stuck device
    never blocks the job or its exit. ``timeout_s=0`` waits on the calling
    thread, without a limit.

    Why a thread at all: a wait for a device (``block_until_ready``) cannot be
    interrupted from Python, and the training thread must go on to recover.

    :param timeout_s: the longest a step may take.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._waiter: _Waiter | None = None

    def wait(self, wait_for_step: Callable[[], None]) -> None:
        """Call ``wait_for_step``; raise :class:`StepTimeoutError` if it takes longer than ``timeout_s``."""
        if not self.timeout_s:
            wait_for_step()
            return
        if self._waiter is None:
            self._waiter = _Waiter()
        self._waiter.tasks.put(wait_for_step)
        try:
            error = self._waiter.outcomes.get(timeout=self.timeout_s)
        except queue.Empty:
            self._waiter = None  # stuck in that wait: the next one gets a thread of its own
            raise StepTimeoutError(
                f"DEADLINE_EXCEEDED: the step did not finish within {self.timeout_s:g} s (trainer.step_timeout_s)",
                slices=(),
            ) from None
        if error is not None:
            try:
                raise error
            finally:  # the error's traceback holds this frame: a reference from it back would be a cycle, and the
                del error  # step's arrays in the frames would wait for the cyclic collector (RSS grew by 1 GB)
