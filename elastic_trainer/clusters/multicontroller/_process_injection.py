"""Failure injection on the multi-controller runtime, for real: a slice's processes are killed, hung or slowed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import final

import jax

from ..._failures import ConfigError
from ._membership import Membership
from . import _keys as keys
from ._rejoin import note_lost, note_return, say_down


@final
class ProcessInjection:
    """The failure injection of :class:`MultiprocessCluster`: every process calls each method, and only the
    processes of the slice named act, so the others see what hardware would show them.

    :param membership: who is in the job (the slices' processes, this process's step times).
    :param client: returns the coordination service's client.
    :param protected_slices: slices that must not be lost (the coordination service's host).
    """

    def __init__(self, membership: Membership, *, client: Callable, protected_slices: tuple[int, ...]):
        self._membership = membership
        self._client = client
        self._protected_slices = protected_slices

    def fail_slice(self, index: int, *, down_for_s: float) -> None:
        """Lose slice ``index``: its processes SIGKILL themselves (every process calls this; the others go on).

        After ``down_for_s`` the local launcher starts a replacement of each
        (:func:`note_return`), which the live processes take back in when the
        strategy scales up (docs/multiprocess.md, "Rejoin"). A slice out of
        the job (a spare, or a lost slice back and waiting) takes part in no
        step: the lowest live process kills its waiting processes instead.
        """
        self._check_index(index)
        processes = self._membership.processes_of(index)
        if not self._membership.live & set(processes):
            if jax.process_index() == min(self._membership.live):
                self._kill_waiting(processes, down_for_s)
        elif jax.process_index() in processes:
            self._go_down(down_for_s)

    def fail_process(self, index: int, position: int, *, down_for_s: float = 1e9) -> None:
        """Kill one process of slice ``index``, the one at ``position`` in it; the others of the slice then
        leave the job (a slice goes down whole) and the rest go on. After ``down_for_s`` the whole slice comes
        back, as :meth:`fail_slice`'s does."""
        self._check_index(index)
        per_slice = self._membership.processes_per_slice
        if not 0 <= position < per_slice:
            raise ConfigError(f"slice {index} has processes at positions 0 to {per_slice - 1}, "
                              f"not {position}; cluster.processes_per_slice is {per_slice}.")
        if jax.process_index() == self._membership.processes_of(index)[position]:
            self._go_down(down_for_s)

    def slow_slice(self, index: int, *, factor: float, for_s: float) -> None:
        """Slow slice ``index`` down: for ``for_s`` seconds its processes take ``factor`` times as long over each
        step (the rest of it slept once the step is done, before its end's barrier)."""
        self._check_index(index)
        if jax.process_index() in self._membership.processes_of(index):
            self._membership.own_times.slow_down(factor, for_s)

    def hang_slice(self, index: int, *, down_for_s: float) -> None:
        """Hang slice ``index``: its processes sleep ``down_for_s`` before their next step's collectives."""
        self._check_index(index)
        if jax.process_index() in self._membership.processes_of(index):
            say_down(self._client())
            time.sleep(down_for_s)

    def _go_down(self, down_for_s: float) -> None:
        """SIGKILL this process, having said when it went down and when it comes back."""
        say_down(self._client())
        note_return(self._client(), down_for_s)
        os.kill(os.getpid(), signal.SIGKILL)

    def _kill_waiting(self, processes: range, down_for_s: float) -> None:
        """SIGKILL ``processes``, which wait to be taken in (the OS pids they asked to join with), as their
        hardware would go; they come back after ``down_for_s``, as a killed live process does."""
        client = self._client()
        for process in processes:
            os_pid = keys.noted(client, keys.join(process))
            noted = keys.noted_pid(client, process)
            if os_pid is None or noted is None or not noted.here:
                raise ConfigError(f"process {process} does not wait to be taken in on this host, so failure "
                                  "injection cannot kill it; choose a slice of the mesh.")
            note_return(client, down_for_s, process=process)
            os.kill(int(os_pid), signal.SIGKILL)
        note_lost(processes)

    def _check_index(self, index: int) -> None:
        slices = self._membership.slices
        if not 0 <= index < slices:
            raise ConfigError(f"slice {index} does not exist; the cluster has slices 0 to {slices - 1}.")
        if index in self._protected_slices:
            raise ConfigError(
                f"slice {index} holds process 0, which hosts JAX's coordination service with "
                "cluster.coordinator=process0: losing it ends every process (JAX's own limit), so failure injection "
                "spares it; choose another slice, or set cluster.coordinator=separate."
            )
