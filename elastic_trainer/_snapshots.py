"""Host snapshots: a copy of the train state in host memory, to restore from when no slice survives."""

from __future__ import annotations

import jax
from jaxtyping import PyTree


class HostSnapshots:
    """Every ``period`` steps, copy the state to host memory without waiting for it.

    The copy starts at the snapshot step and runs during the next step; only
    then does the snapshot count (a copy still in flight is not used).

    :param period: steps between snapshots (0: never).
    """

    def __init__(self, period: int):
        self.period = period
        self.latest: tuple[int, PyTree] | None = None
        """The newest complete snapshot: (step, host arrays), or ``None``."""
        self._in_flight: tuple[int, PyTree] | None = None  # (step, device arrays being copied)

    def take(self, step: int, arrays: PyTree) -> None:
        """After step ``step``: complete the copy in flight, and start one if ``step`` is a snapshot step."""
        if self._in_flight is not None:
            in_flight_step, in_flight = self._in_flight
            self.latest, self._in_flight = (in_flight_step, jax.device_get(in_flight)), None
        if self.period and step % self.period == 0:
            for leaf in jax.tree.leaves(arrays):
                leaf.copy_to_host_async()
            self._in_flight = (step, arrays)
