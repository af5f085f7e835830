"""Every name the multi-controller runtime keeps in the coordination service's key-value store, in one place.

The training processes keep their notes under :data:`KEY_PREFIX`; what the
platform's collectives keep there (gloo's rendezvous) is the platform layer's
(``_platform.py``), and a checkpoint group's barriers are Orbax's
(``checkpoints/_group_barrier.py``).
"""

from __future__ import annotations

import socket
from typing import NamedTuple

KEY_PREFIX = "elastic_trainer/"
"""Where the training processes keep their notes in the coordination service's key-value store."""

JOIN = f"{KEY_PREFIX}join"
"""The directory of :func:`join` notes: replacements that ask to be taken in."""

ENDED = f"{KEY_PREFIX}ended"
"""Set by the lowest live process when the job ends: replacements still waiting to be taken in end too."""

LEAVE = f"{KEY_PREFIX}leave"
"""The barrier where the live processes leave the job together."""


def noted(client, key: str) -> str | None:
    """The value of ``key`` in the coordination service's key-value store, ``None`` if it is not there."""
    try:
        return client.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - the runtime raises a plain error for a missing key
        return None


def pid(process: int) -> str:
    """``"<host> <OS pid>"`` of the process that holds id ``process`` (a replacement finds its predecessor's)."""
    return f"{KEY_PREFIX}pid/{process}"


class NotedPid(NamedTuple):
    """What :func:`pid` holds: the host a process runs on and its OS pid there."""

    host: str
    os_pid: int

    @classmethod
    def parse(cls, text: str) -> NotedPid:
        """The note as :meth:`text` wrote it."""
        host, os_pid = text.split(" ")
        return cls(host, int(os_pid))

    @property
    def text(self) -> str:
        """``"<host> <OS pid>"``, as the key-value store keeps it."""
        return f"{self.host} {self.os_pid}"

    @property
    def here(self) -> bool:
        """Whether the process runs on this host (so this process can see it end, or kill it)."""
        return self.host == socket.gethostname()


def noted_pid(client, process: int) -> NotedPid | None:
    """The :func:`pid` note of ``process``, ``None`` if it noted none."""
    text = noted(client, pid(process))
    return None if text is None else NotedPid.parse(text)


def dispatched(process: int) -> str:
    """How many steps ``process`` has dispatched (a process that has not reached a failed step is stuck)."""
    return f"{KEY_PREFIX}dispatched/{process}"


MEETINGS_PER_BLOCK = 64
"""Meetings kept in one directory of the key-value store, deleted together (one call) once every process is past
them."""


def meetings(block: int) -> str:
    """The directory of the meetings before the dispatches of block ``block`` (:data:`MEETINGS_PER_BLOCK` of them)."""
    return f"{KEY_PREFIX}meet/{block}"


def meeting(attempt: int) -> str:
    """The directory of the meeting before every process's ``attempt``-th step dispatch (:func:`ready`,
    :func:`verdict`)."""
    return f"{meetings(attempt // MEETINGS_PER_BLOCK)}/{attempt}"


def ready(attempt: int, process: int | None = None) -> str:
    """Set by ``process`` once it is about to dispatch its ``attempt``-th step; the directory of them without
    ``process``."""
    return f"{meeting(attempt)}/ready" + ("" if process is None else f"/{process}")


def verdict(attempt: int) -> str:
    """How the meeting before the ``attempt``-th dispatch ended, written once by the first process to know:
    ``"go"`` (every live process came) or ``"agree"`` (one did not come in time: the live ones agree on who
    lives before any dispatches)."""
    return f"{meeting(attempt)}/verdict"


def stuck(process: int) -> str:
    """Set when ``process`` was killed because it was stuck before a step's collectives."""
    return f"{KEY_PREFIX}stuck/{process}"


def down(process: int) -> str:
    """When ``process`` went down (``time.time()``), noted by itself before it went (failure injection, leaving)."""
    return f"{KEY_PREFIX}down/{process}"


def returns(process: int) -> str:
    """When the replacement of ``process`` is due (``time.time()``), if it is to come back."""
    return f"{KEY_PREFIX}returns/{process}"


def left(process: int, incarnation: int) -> str:
    """Set by live ``process`` once it has noted whether it comes back with its slice, lost in the slice's
    ``incarnation``."""
    return f"{KEY_PREFIX}left/{process}/{incarnation}"


def join(process: int) -> str:
    """The OS pid of a replacement of ``process`` that asks to be taken in."""
    return f"{JOIN}/{process}"


def asks(agreement: int) -> str:
    """The replacements that asked to join as of ``agreement``, as the lowest live process saw them."""
    return f"{KEY_PREFIX}asks/{agreement}"


def admitted(process: int, os_pid: str) -> str:
    """How the live processes take in the replacement of ``process`` that runs as ``os_pid`` (an Admission)."""
    return f"{KEY_PREFIX}admitted/{process}/{os_pid}"


def rejoin_barrier(admission_round: int, name: str) -> str:
    """The barrier ``name`` (``met``, ``clean``) of the ``admission_round``-th admission."""
    return f"{KEY_PREFIX}rejoin{admission_round}/{name}"


def took(step: int, process: int | None = None) -> str:
    """Each process's own time in step ``step`` (its dispatch number); the directory of them without ``process``."""
    return f"{KEY_PREFIX}took/{step}/" + ("" if process is None else str(process))


def sync_slot(slot: int) -> str:
    """The directory of agreement slot ``slot``'s :func:`sync_call` notes, one per process."""
    return f"{KEY_PREFIX}sync/{slot}"


def sync_call(slot: int, process: int) -> str:
    """The synchronization call ``process`` made last in agreement slot ``slot`` (``"<number> <call>"``)."""
    return f"{sync_slot(slot)}/{process}"
