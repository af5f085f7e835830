"""Failure injection on the multi-controller runtime, for real: a slice's processes are killed, hung or slowed."""

from __future__ import annotations

import os
import signal
import time

import jax

from .._failures import ConfigError
from ._coordinator import KEY_PREFIX
from ._rejoin import note_return


def say_down(client) -> None:
    """Note when this process goes down (failure injection, or its slice was lost), for the others' records."""
    client.key_value_set(f"{KEY_PREFIX}down/{jax.process_index()}", repr(time.time()))


class ProcessFailureInjection:
    """The failure injection of :class:`MultiprocessCluster`: every process calls each method, and only the
    processes of the slice named act, so the others see what hardware would show them.

    Mixed into the cluster, whose ``slices``, ``processes_per_slice``,
    ``spared_slices``, ``processes_of``, ``_client`` and ``_own_times`` it uses.
    """

    def fail_slice(self, index: int, *, down_for_s: float) -> None:
        """Lose slice ``index``: its processes SIGKILL themselves (every process calls this; the others go on).

        After ``down_for_s`` the local launcher starts a replacement of each
        (:func:`note_return`), which the live processes take back in when the
        strategy scales up (docs/multiprocess.md, "Rejoin").
        """
        self._check_index(index)
        if jax.process_index() in self.processes_of(index):
            say_down(self._client())
            note_return(self._client(), down_for_s)
            os.kill(os.getpid(), signal.SIGKILL)

    def fail_process(self, index: int, position: int, *, down_for_s: float = 1e9) -> None:
        """Kill one process of slice ``index``, the one at ``position`` in it; the others of the slice then
        leave the job (a slice goes down whole) and the rest go on. After ``down_for_s`` the whole slice comes
        back, as :meth:`fail_slice`'s does."""
        self._check_index(index)
        if not 0 <= position < self.processes_per_slice:
            raise ConfigError(f"slice {index} has processes at positions 0 to {self.processes_per_slice - 1}, "
                              f"not {position}; cluster.processes_per_slice is {self.processes_per_slice}.")
        if jax.process_index() == self.processes_of(index)[position]:
            say_down(self._client())
            note_return(self._client(), down_for_s)
            os.kill(os.getpid(), signal.SIGKILL)

    def slow_slice(self, index: int, *, factor: float, for_s: float) -> None:
        """Slow slice ``index`` down: for ``for_s`` seconds its processes take ``factor`` times as long over each
        step (the rest of it slept once the step is done, before its end's barrier)."""
        self._check_index(index)
        if jax.process_index() in self.processes_of(index):
            self._own_times.slow_down(factor, for_s)

    def hang_slice(self, index: int, *, down_for_s: float) -> None:
        """Hang slice ``index``: its processes sleep ``down_for_s`` before their next step's collectives."""
        self._check_index(index)
        if jax.process_index() in self.processes_of(index):
            say_down(self._client())
            time.sleep(down_for_s)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.slices:
            raise ConfigError(f"slice {index} does not exist; the cluster has slices 0 to {self.slices - 1}.")
        if index in self.spared_slices:
            raise ConfigError(
                f"slice {index} holds process 0, which hosts JAX's coordination service with "
                "cluster.coordinator=process0: losing it ends every process (JAX's own limit), so failure injection "
                "spares it; choose another slice, or set cluster.coordinator=separate."
            )
