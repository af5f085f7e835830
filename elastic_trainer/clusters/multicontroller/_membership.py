"""Who is in a multi-controller job, as its live processes last agreed, and how they agree on it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, final

import jax
import psutil
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from ..._private_apis import own_process_id
from .._base import SyncCall
from . import _keys as keys
from ._call_order import CallOrder
from ._step_times import OwnStepTimes

if TYPE_CHECKING:
    from ._rejoin import Admission

STUCK_GRACE_S = 1.0
"""After its step failed, how long a process waits at least for every other live process to have reached that
step; one that has not (nor within the collective timeout of this process's dispatch) is dead or stuck before the
step's collectives."""


MEET_POLL_MS = 250
"""While a process waits for a late peer before a dispatch, how often it looks whether that peer died on this
host or the wait ran out."""


def devices_of(processes: Container[int]) -> list[jax.Device]:
    """The devices of ``processes``, in process order, then by id: the order slices and barriers list them in."""
    return sorted((d for d in jax.devices() if d.process_index in processes), key=lambda d: (d.process_index, d.id))

@final
class Membership:
    """Who is in the job: the live processes, each slice's failure count, the replacements that asked to join, and
    the counts of steps dispatched and of agreements, which every live process holds alike.

    :param num_processes: processes in the job, the spares' included.
    :param processes_per_slice: processes that make up one slice (consecutive ones).
    :param spare_slices: how many of the slices are spares at the start (the last ones): their processes are not
        live until taken in.
    :param client: returns the coordination service's client (``None`` before joining).
    :param on_lost: called with the processes found dead, in the lowest live process (their replacements may start).
    """

    def __init__(self, *, num_processes: int, processes_per_slice: int, client: Callable,
                 on_lost: Callable[[list[int]], None], spare_slices: int = 0):
        self.processes_per_slice = processes_per_slice
        self.slices = num_processes // processes_per_slice
        self.live: set[int] = set(range((self.slices - spare_slices) * processes_per_slice))
        """The processes alive at the last agreement."""
        self.failures: list[int] = [0] * self.slices
        """How often each slice has failed (its incarnation)."""
        self.lost_at: dict[int, float | None] = {}
        """Each dead process's time of going down, where it said so."""
        self.dispatched = 0
        """Steps this process has dispatched."""
        self.dispatched_at = time.monotonic()
        """When it dispatched the latest (``time.monotonic``)."""
        self.agreements = 0
        """Agreements on who lives so far; each numbers its synchronization call."""
        self.returning: frozenset[int] = frozenset()
        """Replacements that asked to join, as the live processes agreed."""
        self.own_times = OwnStepTimes(client, jax.process_index)
        """This process's own time in each step, and the others'."""
        self._client = client
        self._on_lost = on_lost
        self._call_order = CallOrder(client, jax.process_index)

    def processes_of(self, index: int) -> range:
        """The processes that make up slice ``index``."""
        return range(index * self.processes_per_slice, (index + 1) * self.processes_per_slice)

    def healthy_slices(self) -> list[int]:
        """Slices whose processes were all live when the processes last agreed."""
        return [s for s in range(self.slices) if set(self.processes_of(s)) <= self.live]

    def returning_slices(self) -> list[int]:
        """Slices whose every process is a replacement that asked to join."""
        return [s for s in range(self.slices) if set(self.processes_of(s)) <= self.returning]

    def go_on_from(self, admission: Admission) -> None:
        """In a replacement the live processes took in: hold what they hold."""
        self.live, self.failures = set(admission.processes), list(admission.incarnations)
        self.dispatched, self.agreements = admission.dispatched, admission.agreements

    def agree(self, call: SyncCall) -> None:
        """Wait for every live process here (``live_devices``' barrier), each having made the same ``call`` under
        the agreement's number (:class:`CallOrder`), and hear which replacements asked to join; note who died
        since last time."""
        devices = devices_of(self.live)
        self._offer_returns()
        self._call_order.note(self.agreements, call)
        try:
            with live_devices(devices):
                pass
            self._hear_returns()
            self._call_order.check(self.agreements, call, self.live)
        except ProcessFailureError as failure:  # a loss explains any difference in the calls
            dead = {device.process_index for device in failure.failed_devices} & self.live
            for process in sorted(dead):
                down_at = keys.noted(self._client(), keys.down(process))  # failure injection says when
                self.lost_at[process] = float(down_at) if down_at is not None else None
            self.lose(dead)

    def lose(self, processes: set[int]) -> None:
        """``processes`` are out of the job (dead, or leaving with their slice): their slices fail once more."""
        self.live -= processes
        if processes and own_process_id() == min(self.live):
            self._on_lost(sorted(processes))
        for s in {p // self.processes_per_slice for p in processes}:
            self.failures[s] += 1

    def _offer_returns(self) -> None:
        """Before the processes agree on who lives: the lowest live one notes which replacements asked to join."""
        self.agreements += 1
        if own_process_id() != min(self.live):
            return
        asking = {int(key.rsplit("/", 1)[1]): pid for key, pid in self._client().key_value_dir_get(keys.JOIN)}
        asking = sorted(p for p, os_pid in asking.items()
                        if p not in self.live and not dead_here(self._client(), p, os_pid))
        if asking:
            self._client().key_value_set(keys.asks(self.agreements), json.dumps(asking))

    def _hear_returns(self) -> None:
        """After the agreement: every live process reads which replacements asked (the same for all)."""
        asked = keys.noted(self._client(), keys.asks(self.agreements))
        self.returning = frozenset(json.loads(asked)) if asked is not None else frozenset()

    def step_dispatched(self) -> None:
        """Note in the key-value store that this process reached its latest step's collectives."""
        self.dispatched += 1
        self.dispatched_at = time.monotonic()
        self.own_times.dispatched()
        self._client().key_value_set(keys.dispatched(jax.process_index()), str(self.dispatched), allow_overwrite=True)

    def meet(self, *, stuck_after_s: float) -> bool:
        """Before this process dispatches its next step: wait until every other live process is about to dispatch
        it too; whether they all came.

        A step's collectives then start together, so a peer late to a step
        (a compilation cache that missed, a busy host) keeps the others
        waiting here, not in collectives that would give up after
        ``collective_timeout_s``. The processes need not be met for that in
        any other way: the one that finds every note there (the last to come)
        writes the verdict ``"go"``. One that waited ``stuck_after_s`` for a
        peer, or saw it die on this host, writes ``"agree"`` instead; only the
        first verdict is written, and every process follows it. With
        ``"agree"``, a peer still absent once ``stuck_after_s`` has passed since
        this process came is stuck: it is killed (:func:`_kill_if_stuck`), and the
        caller has the live processes agree on who lives before any dispatches.
        """
        attempt, me, client = self.dispatched + 1, jax.process_index(), self._client()
        if self.live == {me}:
            return True
        client.key_value_set(keys.ready(attempt, me), "1", allow_overwrite=True)
        block, first = divmod(attempt, keys.MEETINGS_PER_BLOCK)
        if me == min(self.live) and not first and block > 1:  # every process is past the block before the last:
            client.key_value_delete(keys.meetings(block - 2))  # each came to the last meeting, after them
        deadline, waited = time.monotonic() + stuck_after_s, False
        while (absent := self.live - _came(client, attempt)) and not (
                waited and (time.monotonic() > deadline or any(dead_here(client, p) for p in absent))):
            try:
                verdict = client.blocking_key_value_get(keys.verdict(attempt), MEET_POLL_MS)
                break
            except Exception:  # noqa: BLE001 - the runtime raises a plain error when the wait runs out
                waited = True
        else:
            verdict = _decide(client, attempt, "agree" if absent else "go")
        if verdict == "go":
            return True
        absent = {p for p in self.live - {me} if not dead_here(client, p)}
        while (absent := absent - _came(client, attempt)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for process in sorted(absent):
            _kill_if_stuck(client, process)
        return False

    def kill_stuck(self, *, collective_timeout_s: float) -> None:
        """Kill the live processes that never reached the failed step's collectives: they are stuck.

        Every process notes each step it dispatched (:meth:`step_dispatched`);
        one that has not noted this step within :data:`STUCK_GRACE_S` of our
        failure is dead or stuck, unless the collective timeout since our own
        dispatch has not run out yet: our step may have failed at once (a peer
        died), and a live peer only slow to reach the collectives (a loaded
        host) is given the time its collectives would give it. A stuck one on
        this host is killed; one on another host is left to the scheduler (the
        barrier that follows waits until it is gone).
        """
        client = self._client()
        behind = processes_behind(client, self.live - {jax.process_index()}, self.dispatched,
                                  not_before=self.dispatched_at + collective_timeout_s)
        for process in behind:
            _kill_if_stuck(client, process)


def processes_behind(client, processes: set[int], dispatched: int, *, not_before: float) -> list[int]:
    """Those of ``processes`` that have not noted step ``dispatched`` as dispatched within :data:`STUCK_GRACE_S`
    nor by ``not_before`` (``time.monotonic``), less those known dead already (on this host), which are not waited
    for."""
    deadline = max(time.monotonic() + STUCK_GRACE_S, not_before)
    behind = {p for p in processes if not dead_here(client, p)}
    while behind and time.monotonic() < deadline:
        behind -= {p for p in behind if int(keys.noted(client, keys.dispatched(p)) or 0) >= dispatched}
        time.sleep(0.05)
    return sorted(behind)


def _came(client, attempt: int) -> set[int]:
    """The processes that came to the meeting before their ``attempt``-th dispatch."""
    return {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(keys.ready(attempt))}


def _decide(client, attempt: int, verdict: str) -> str:
    """Write ``verdict`` as the meeting's before the ``attempt``-th dispatch unless one is written already; the
    one written."""
    try:
        client.key_value_set(keys.verdict(attempt), verdict)
        return verdict
    except Exception:  # noqa: BLE001 - written already (the runtime's ALREADY_EXISTS): that one stands
        return client.blocking_key_value_get(keys.verdict(attempt), 1000)


def dead_here(client, process: int, os_pid: str | None = None) -> bool:
    """Whether ``process`` ran on this host and has ended (a zombie its launcher has not reaped yet included).

    ``os_pid`` names the one that runs as ``process`` when it is not the one its ``pid`` note names: a spare or
    replacement that asked to join (a replacement's note is still its predecessor's, on the same host).
    """
    noted = keys.noted_pid(client, process)
    if noted is None or not noted.here:
        return False
    try:
        return psutil.Process(int(os_pid or noted.os_pid)).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _kill_if_stuck(client, process: int) -> None:
    """SIGKILL ``process`` if it lives on this host and is not dead already, and note that it was stuck."""
    noted = keys.NotedPid.parse(client.blocking_key_value_get(keys.pid(process), 1000))
    if not noted.here:
        print(f"elastic_trainer: process {process} on {noted.host} did not reach the step; waiting until it is "
              "known dead (a stuck process on another host must be killed by the scheduler)", file=sys.stderr)
        return
    if dead_here(client, process):
        return  # dead already, not stuck
    try:
        os.kill(noted.os_pid, signal.SIGKILL)
        client.key_value_set(keys.stuck(process), "killed", allow_overwrite=True)
    except ProcessLookupError:
        pass  # died meanwhile, not stuck
