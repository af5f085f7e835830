"""The simulated cluster: slices made of CPU devices in this process."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
from jaxtyping import PyTree

from .._failures import ConfigError, SliceLostError
from ..config._settings import check_simulated_settings
from ._accelerators import accelerator_platform, warn_if_accelerators_unused
from ._base import AbstractInjectableCluster, AbstractSpareCluster, AbstractTimedCluster, SyncCall


class SimulatedCluster(AbstractInjectableCluster, AbstractSpareCluster, AbstractTimedCluster):
    """Slices made of CPU devices in this process, standing in for accelerator slices.

    :param slices: number of slices (data parallel across them).
    :param devices_per_slice: CPU devices in each slice.
    :param spare_slices: slices more, kept out of the mesh as spares (the last ones).

    A slice fails with :meth:`fail_slice` (the chaos plugin calls it) the way
    a real one does: the next step on a mesh that includes it raises a
    ``DATA_LOSS`` error, its shards are destroyed (overwritten with NaN, or the
    largest integer), and health checks report it down until its down time
    has passed. A slice hung with :meth:`hang_slice` is down too, but a step
    that uses it does not finish until the slice is back: only the trainer's
    watchdog ends the wait. A slice slowed with :meth:`slow_slice` makes
    every step that uses it take ``factor`` times as long (the step's end
    waits for it, slept here), and is the one whose own step time
    (:meth:`slice_step_seconds`) is ``factor`` times the others'.
    """

    kind = "simulated"

    def __init__(self, slices: int = 4, devices_per_slice: int = 2, spare_slices: int = 0):
        check_simulated_settings(slices=slices, devices_per_slice=devices_per_slice, spare_slices=spare_slices)
        self.slices = slices
        self.devices_per_slice = devices_per_slice
        self.spare_slices = spare_slices
        self._down_until = [0.0] * self._all_slices
        self._failures = [0] * self._all_slices
        self._hung: set[int] = set()
        self._slow: dict[int, tuple[float, float]] = {}  # slice -> (factor, until when)
        self._dispatched_at: float | None = None
        self._step_seconds: dict[int, float] = {}

    @property
    def _all_slices(self) -> int:
        return self.slices + self.spare_slices

    @property
    def num_devices(self) -> int:
        """Devices in all slices together, the spares' included."""
        return self._all_slices * self.devices_per_slice

    def configure_jax(self) -> None:
        """Ask JAX for enough CPU devices (never fewer than were asked for already), or check that it already has
        them; warn where JAX would use GPUs or TPUs here (:class:`~elastic_trainer.AcceleratorUnusedWarning`)."""
        warn_if_accelerators_unused("simulated", accelerator_platform())
        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", max(self.num_devices, jax.config.jax_num_cpu_devices))
        except RuntimeError:
            pass  # the backend is already up; _cpu_devices checks it has enough
        self._cpu_devices()

    def _cpu_devices(self) -> Sequence[jax.Device]:
        devices = jax.devices("cpu")
        if len(devices) < self.num_devices:
            raise ConfigError(
                f"the simulated cluster needs {self.num_devices} CPU devices but JAX started with "
                f"{len(devices)}; create the cluster (or set jax_num_cpu_devices) before any JAX operation runs."
            )
        return devices

    def slice_devices(self) -> list[list[jax.Device]]:
        devices = self._cpu_devices()
        n = self.devices_per_slice
        return [list(devices[i * n : (i + 1) * n]) for i in range(self._all_slices)]

    def describe(self) -> dict:
        return {"kind": self.kind, "slices": self.slices, "devices_per_slice": self.devices_per_slice,
                "spare_slices": self.spare_slices}

    def fail_slice(self, index: int, *, down_for_s: float) -> None:
        """Lose slice ``index`` now; it comes back after ``down_for_s`` seconds."""
        self._check_index(index)
        self._down_until[index] = time.monotonic() + down_for_s
        self._failures[index] += 1

    def hang_slice(self, index: int, *, down_for_s: float) -> None:
        """Hang slice ``index`` now: a step using it does not finish until it comes back."""
        self.fail_slice(index, down_for_s=down_for_s)
        self._hung.add(index)

    def slow_slice(self, index: int, *, factor: float, for_s: float) -> None:
        """Slow slice ``index`` down: for ``for_s`` seconds a step that uses it takes ``factor`` times as long."""
        self._check_index(index)
        self._slow[index] = (factor, time.monotonic() + for_s)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self._all_slices:
            raise ConfigError(f"slice {index} does not exist; the cluster has slices 0 to {self._all_slices - 1}.")

    def healthy_slices(self) -> list[int]:
        now = time.monotonic()
        return [i for i, until in enumerate(self._down_until) if until <= now]

    def incarnations(self) -> tuple[int, ...]:
        return tuple(self._failures)

    def check_launch(self, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Refuse to launch a step on a slice lost since ``since`` (a hung one is not known to be lost: the step
        is launched and hangs)."""
        if tuple(self._failures) == since:  # nothing failed anywhere: the common case, one comparison
            return
        lost = [s for s in slices if self._failures[s] != since[s] and s not in self._hung]
        if lost:
            raise SliceLostError(f"DATA_LOSS: simulated slice(s) {lost} lost before the step was launched",
                                 slices=lost)

    def synchronize(self, call: SyncCall, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Wait for the hung slices of ``slices`` to come back, then raise ``DATA_LOSS`` for those lost since
        ``since``; each slice's own time in the step is known then."""
        if tuple(self._failures) != since:
            for index in self._hung & set(slices):  # a hung slice holds the step until it is back
                time.sleep(max(0.0, self._down_until[index] - time.monotonic()))
            lost = [s for s in slices if self._failures[s] != since[s]]
            if lost:
                self._dispatched_at = None
                raise SliceLostError(f"DATA_LOSS: simulated slice(s) {lost} lost during the step", slices=lost)
        self._step_seconds = self._time_slices(slices)

    def step_dispatched(self) -> None:
        self._dispatched_at = time.monotonic()

    def slice_step_seconds(self) -> dict[int, float]:
        return dict(self._step_seconds)

    def _time_slices(self, slices: Sequence[int]) -> dict[int, float]:
        """The own time of each of ``slices`` in the step dispatched last, once the slow ones are done too:
        the step's time so far, ``factor`` times that for a slow slice (the rest of its time is slept here)."""
        if self._dispatched_at is None:
            return {}  # no step since the last check (the processes meeting at start-up)
        took, now = time.monotonic() - self._dispatched_at, time.monotonic()
        self._dispatched_at = None
        factors = {s: factor for s, (factor, until) in self._slow.items() if s in slices and until > now}
        if factors:
            time.sleep((max(factors.values()) - 1) * took)
        return {s: took * factors.get(s, 1.0) for s in slices}

    def surviving(self, tree: PyTree, lost_slices: Sequence[int]) -> PyTree:
        all_slices = self.slice_devices()
        dead = {device for index in lost_slices for device in all_slices[index]}

        def destroy(array: jax.Array) -> jax.Array:
            if not isinstance(array, jax.Array) or array.is_deleted() or not dead & set(array.sharding.device_set):
                return array  # a deleted array was consumed by an update: nothing of it is left to read
            garbage = np.nan if np.issubdtype(array.dtype, np.inexact) else np.iinfo(array.dtype).max
            shards = [
                jax.device_put(np.full(shard.data.shape, garbage, array.dtype), shard.device)
                if shard.device in dead
                else shard.data
                for shard in array.addressable_shards
            ]
            return jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)

        return jax.tree.map(destroy, tree)
