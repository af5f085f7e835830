"""Host snapshots: a copy of the train state in host memory, to restore from when no slice holds it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

DEFAULT_SNAPSHOT_PERIOD = 10
"""Steps between host snapshots unless told otherwise (``trainer.snapshot_period``): a slice lost while a step
runs loses at most this many steps less one, for a copy of the state to host memory every this many steps
(docs/architecture.md, "The step")."""


class Snapshot(NamedTuple):
    """The state after step ``step``, as host arrays: its leaves, the structure that makes them a state, and the
    slices it was taken on (whose parts it holds, for a training mode whose slices each keep one)."""

    step: int
    leaves: list[np.ndarray]
    structure: Any
    slices: tuple[int, ...]

    @property
    def arrays(self) -> PyTree:
        """The state's arrays (host arrays)."""
        return self.structure.unflatten(self.leaves)


def host_copy(array: jax.Array) -> np.ndarray:
    """``array`` copied to host memory of its own: a replicated array from one device; on a runtime of several
    processes, an array split over them (a semi-synchronous mode's rows, a row per slice) with this process's
    shards in place and zeros elsewhere, which the memory does not hold until written (``np.zeros``).

    On CPU ``np.asarray`` gives a view of the device buffer, which must not
    be kept: the next step, donated that buffer, would then allocate a new one
    instead of reusing it, and the copy would not be one.
    """
    if not array.sharding.is_fully_replicated and not array.is_fully_addressable:
        host = np.zeros(array.shape, array.dtype)
        for shard in array.addressable_shards:
            host[shard.index] = np.asarray(shard.data)
        return host
    host = np.asarray(array.addressable_data(0) if array.sharding.is_fully_replicated else array)
    return host if host.flags.owndata else host.copy()


class HostSnapshots:
    """Every ``period`` steps, copy the state to host memory.

    The copy is complete when :meth:`take` returns: the next step consumes
    the state's device buffers (they are donated to it).

    :param period: steps between snapshots (0: never).
    :param structure: the structure of the state's arrays.
    """

    def __init__(self, period: int, structure: Any):
        self.period = period
        self._structure = structure
        self.latest: Snapshot | None = None
        """The newest snapshot, or ``None``."""

    def take(self, step: int, leaves: list[jax.Array], *, slices: tuple[int, ...]) -> None:
        """After step ``step``: copy the state's ``leaves`` (on ``slices``) to host memory if ``step`` is a
        snapshot step."""
        if self.period and step % self.period == 0:
            self.latest = Snapshot(step, [host_copy(leaf) for leaf in leaves], self._structure, slices)
