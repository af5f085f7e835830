"""Child processes that never outlive their parent: each in a process group of its own, killed on the way out."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

from .._preemption import signal_handlers

POLL_S = 0.05
"""How often running children are polled."""

PARENT_ENV = "ELASTIC_TRAINER_PARENT_PID"
"""Set in a child's environment to the pid of the process that started it."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when the process that started it ends, even by SIGKILL.

    Does nothing elsewhere, or when this process was not started by a :class:`ProcessGroup`.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the parent ended before the request took effect
        os._exit(1)


STOP_GRACE_S = 25.0
"""After a stop signal, how long the children have to save and end before they are killed: under
Kubernetes' default ``terminationGracePeriodSeconds`` (30 s), after which the kubelet kills every process."""


class StopRequest:
    """The stop signal this process received (SIGTERM, Ctrl-C, a preemption signal), passed on to its children.

    While entered, a handler for each of ``signals`` notes the first one and
    sends every signal received to the children of the :class:`ProcessGroup`
    objects made with this request, which then save and end by themselves
    (``Trainer.fit`` stops at the next step boundary). :meth:`overdue` says
    when they have had ``grace_s`` to do so. Handlers are installed only from
    the main thread (Python allows no other).
    """

    def __init__(self, signals: Sequence[int], *, grace_s: float = STOP_GRACE_S):
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.signum: int | None = None
        self._received_at: float | None = None
        self.groups: list[ProcessGroup] = []  # the groups open now, whose children get the signals
        self._handlers = contextlib.ExitStack()

    def _pass_on(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum, self._received_at = signum, time.monotonic()
        for group in self.groups:
            group.send(signum)

    def overdue(self) -> bool:
        """Whether a stop signal came more than ``grace_s`` ago."""
        return self._received_at is not None and time.monotonic() - self._received_at > self.grace_s

    def __enter__(self) -> StopRequest:
        self._handlers.enter_context(signal_handlers(self.signals, self._pass_on))
        return self

    def __exit__(self, *exc_info) -> None:
        self._handlers.close()


class ProcessGroup:
    """Child processes, each started in a session and process group of its own.

    :meth:`kill` sends SIGKILL to every group, so whatever a child started
    dies with it; use the group as a context manager to kill on any exit,
    including an exception. With a :class:`StopRequest`, the stop signals
    this process receives are passed on to the children instead, for them
    to end by themselves. A child that calls :func:`die_with_parent` also
    dies when its parent is killed outright (SIGKILL), when no ``finally`` runs.

    :param stop: the request whose signals the children get.
    """

    def __init__(self, stop: StopRequest | None = None):
        self.processes: list[subprocess.Popen] = []
        self.exited_at: dict[int, float] = {}  # index -> time.time() its exit was seen
        self._stop = stop

    def start(self, command: Sequence[str], *, env: Mapping[str, str], stdout: IO | None = None) -> subprocess.Popen:
        """Start ``command`` with environment ``env`` in a new process group; its output to ``stdout`` if given."""
        env = {**env, PARENT_ENV: str(os.getpid())}
        process = subprocess.Popen(list(command), env=env, stdout=stdout, start_new_session=True)
        self.processes.append(process)
        if self._stop is not None and self._stop.signum is not None:  # it came as the child started
            self.send(self._stop.signum)
        return process

    def send(self, signum: int) -> None:
        """Send ``signum`` to every child's process group."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)

    def poll(self) -> list[int | None]:
        """Every child's exit status (negative: killed by that signal), ``None`` while it runs."""
        codes = [process.poll() for process in self.processes]
        for index, code in enumerate(codes):
            if code is not None:
                self.exited_at.setdefault(index, time.time())
        return codes

    def kill(self) -> None:
        """SIGKILL every child's process group and reap the children."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.wait()
        self.poll()

    def __enter__(self) -> ProcessGroup:
        if self._stop is not None:
            self._stop.groups.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._stop is not None:
            self._stop.groups.remove(self)
        self.kill()
