"""A barrier over a group of JAX processes that can be given up: how the survivors' checkpoint saves end."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Collection

import jax

from .._private_apis import coordination_client


class SaveGivenUp(RuntimeError):
    """A save that :meth:`Checkpointer.save_over` gave up: the processes it waited for may be dead."""


class _HideGivenUpSaves(logging.Filter):
    """Drops Orbax's error reports (with tracebacks) of saves given up on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SaveGivenUp))


def hide_given_up_saves() -> None:
    """Keep Orbax's logger (absl's) from reporting given-up saves as errors; once per process."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _HideGivenUpSaves) for f in logger.filters):
        logger.addFilter(_HideGivenUpSaves())


class GroupBarrier:
    """A barrier over a group of processes for Orbax (``AsyncOptions.barrier_sync_fn``) that can be given up.

    Orbax ends every asynchronous save with barriers in JAX's coordination
    service. With ``jax_enable_recoverability`` that service does not fail a
    barrier when a process in it dies: the others wait out the timeout
    (measured with jax 0.10.2: still waiting after 14 minutes; Orbax's
    timeout for a commit is 20). This barrier meets in the service's
    key-value store instead, and :meth:`abort` makes every wait on it, now
    or later, raise at once.

    :param processes: the processes that meet.
    :param name: a name no other group of the job uses.
    """

    poll_s = 0.01

    def __init__(self, processes: Collection[int], *, name: str):
        self.processes = frozenset(processes)
        self.name = name
        self._uses: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._aborted = threading.Event()

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        """Wait until every process of the group has called this with ``key`` as often as this one has."""
        client = coordination_client()
        with self._lock:
            self._uses[key] += 1
            use = self._uses[key]
        here = f"elastic_trainer/barrier/{self.name}/{key.replace('/', '|')}"
        client.key_value_set(f"{here}/{use}/{jax.process_index()}", "")
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.processes <= self._arrived(client, f"{here}/{use}/"):
            if self._aborted.is_set():
                raise SaveGivenUp(f"checkpoint barrier {key!r} given up: the processes saving together changed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint barrier {key!r}: processes {sorted(self.processes)} did not all come")
            self._aborted.wait(self.poll_s)
        if use > 1:  # every process is past the use before, so its keys are read no more
            client.key_value_delete(f"{here}/{use - 1}/{jax.process_index()}")

    @staticmethod
    def _arrived(client, directory: str) -> set[int]:
        return {int(name.rsplit("/", 1)[1]) for name, _ in client.key_value_dir_get(directory)}

    def abort(self) -> None:
        """Make every wait, now or later, raise."""
        self._aborted.set()
