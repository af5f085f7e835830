"""Child processes that never outlive their parent: each in a process group of its own, killed on the way out."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

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


class Terminated(BaseException):
    """The process got SIGTERM; raised so that ``finally`` blocks kill the children first."""


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` inside the block (Ctrl-C is already ``KeyboardInterrupt``).

    Only the main thread can install the handler; elsewhere the block runs unchanged.
    """
    def raise_terminated(signum, frame):
        raise Terminated(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ProcessGroup:
    """Child processes, each started in a session and process group of its own.

    :meth:`kill` sends SIGKILL to every group, so whatever a child started
    dies with it; use the group as a context manager to kill on any exit,
    including an exception, Ctrl-C or (with :func:`terminate_on_sigterm`) SIGTERM.
    A child that calls :func:`die_with_parent` also dies when its parent is
    killed outright (SIGKILL), when no ``finally`` runs.
    """

    def __init__(self):
        self.processes: list[subprocess.Popen] = []
        self.exited_at: dict[int, float] = {}  # index -> time.time() its exit was seen

    def start(self, command: Sequence[str], *, env: Mapping[str, str], stdout: IO | None = None) -> subprocess.Popen:
        """Start ``command`` with environment ``env`` in a new process group; its output to ``stdout`` if given."""
        env = {**env, PARENT_ENV: str(os.getpid())}
        process = subprocess.Popen(list(command), env=env, stdout=stdout, start_new_session=True)
        self.processes.append(process)
        return process

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
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()
