"""Host snapshots: a copy of the train state in host memory, to restore from when no slice survives."""

from __future__ import annotations

import jax
from jaxtyping import PyTree


class HostSnapshots:
    """Every ``period`` steps, copy the state to host memory.

    The copy is complete when :meth:`take` returns: the next step's update
    consumes the state's device buffers (docs/architecture.md, "Donation").
    A replicated array is read from one device only.

    :param period: steps between snapshots (0: never).
    """

    def __init__(self, period: int):
        self.period = period
        self.latest: tuple[int, PyTree] | None = None
        """The newest snapshot: (step, host arrays), or ``None``."""

    def take(self, step: int, arrays: PyTree) -> None:
        """After step ``step``: copy ``arrays`` to host memory if ``step`` is a snapshot step."""
        if self.period and step % self.period == 0:
            self.latest = step, jax.device_get(arrays)
