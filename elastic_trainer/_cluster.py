"""Clusters: where the devices come from and how they group into slices."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import jax

from ._failures import ConfigError, check_at_least


class AbstractCluster(abc.ABC):
    """A set of devices grouped into slices of equal size."""

    kind: str

    @abc.abstractmethod
    def configure_jax(self) -> None:
        """Configure JAX for this cluster; call before JAX's backend starts."""

    @abc.abstractmethod
    def slice_devices(self) -> list[list[jax.Device]]:
        """The devices of every slice, slice by slice."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """The cluster as the report's ``cluster`` field."""


class SimulatedCluster(AbstractCluster):
    """Slices made of CPU devices in this process, standing in for accelerator slices.

    :param slices: number of slices (data parallel across them).
    :param devices_per_slice: CPU devices in each slice.
    """

    kind = "simulated"

    def __init__(self, slices: int = 4, devices_per_slice: int = 2):
        check_at_least("cluster.slices", slices, 1)
        check_at_least("cluster.devices_per_slice", devices_per_slice, 1)
        self.slices = slices
        self.devices_per_slice = devices_per_slice

    @property
    def num_devices(self) -> int:
        """Devices in all slices together."""
        return self.slices * self.devices_per_slice

    def configure_jax(self) -> None:
        """Ask JAX for enough CPU devices, or check that it already has them."""
        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", self.num_devices)
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
        return [list(devices[i * n : (i + 1) * n]) for i in range(self.slices)]

    def describe(self) -> dict:
        return {"kind": self.kind, "slices": self.slices, "devices_per_slice": self.devices_per_slice}
