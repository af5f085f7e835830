"""The platform layer of ``cluster=multiprocess``: what depends on the devices' collectives, apart from the
membership protocol (who lives, stuck processes, rejoin), which is the same on any platform.

A layer configures JAX's collectives before the backend starts, and, when a
replacement rejoins, deletes what the old backend's collectives left in the
coordination service before every process starts a new backend together.
:class:`CpuGloo` is the layer that runs here; a GPU/NCCL layer is a subclass
of :class:`PlatformLayer` named in :data:`PLATFORM_LAYERS` (docs/clusters.md).
"""

from __future__ import annotations

import abc
import os
from typing import ClassVar

import jax
import jax.extend.backend

from ..._private_apis import forget_live_devices


class PlatformLayer(abc.ABC):
    """How one platform's collectives are configured, and restarted when a replacement rejoins."""

    name: ClassVar[str | None]
    """``cluster.platform``'s value for this layer."""

    @abc.abstractmethod
    def configure(self, *, devices_per_process: int | None, collective_timeout_s: int) -> None:
        """Set JAX's options for this platform's collectives (each to give up after ``collective_timeout_s``),
        before any backend starts; ``devices_per_process`` devices each, or the platform's own when ``None``."""

    @abc.abstractmethod
    def forget_collectives(self, client) -> None:
        """Delete what the old backend's collectives left in the coordination service's key-value store (the
        lowest process of a rejoin calls it, while every other process waits)."""

    def restart_backend(self) -> None:
        """Drop this process's backend and start a new one, together with every other process of the job: the
        old one's communicators do not know the replacement. Arrays of the old backend are unusable after."""
        jax.clear_caches()
        jax.extend.backend.clear_backends()
        jax.devices()  # the new backend, started together
        forget_live_devices()  # what live_devices last saw are the old backend's devices


class CpuGloo(PlatformLayer):
    """CPU devices, with gloo's collectives between processes (what runs on this machine and in the tests).

    gloo's rendezvous keys are named after the devices only, and each process
    keeps its communicators for its CPU client's life (XLA's
    ``gloo_collectives.cc`` and ``cpu_cliques.cc``, jax 0.10.2), hence the
    keys deleted and the new backend at a rejoin.
    """

    name = "cpu"

    STALE_KEYS = ("cpu:global_topology/cpu", "cpu:gloo")
    """What the old CPU backend left that a new one must write again: its global topology (a key) and gloo's
    rendezvous (a directory). Each process's local topology is written with overwriting allowed."""

    def configure(self, *, devices_per_process: int | None, collective_timeout_s: int) -> None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        flag = f"--xla_cpu_collective_timeout_seconds={collective_timeout_s}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        if devices_per_process is not None:
            jax.config.update("jax_num_cpu_devices", devices_per_process)

    def forget_collectives(self, client) -> None:
        global_topology, rendezvous = self.STALE_KEYS
        client.key_value_delete(global_topology)
        for key, _ in client.key_value_dir_get_bytes(rendezvous):
            client.key_value_delete(key)


class JaxDefault(PlatformLayer):
    """JAX's default platform on a real cluster (``cluster.platform=null``), configured as JAX configures it.

    Not tried here (no accelerator): a rejoin on it deletes nothing, and
    whether its collectives take a replacement in is untested; a layer of
    its own says so (docs/clusters.md).
    """

    name = None

    def configure(self, *, devices_per_process: int | None, collective_timeout_s: int) -> None:
        pass

    def forget_collectives(self, client) -> None:
        pass


PLATFORM_LAYERS: dict[str | None, PlatformLayer] = {layer.name: layer for layer in (CpuGloo(), JaxDefault())}
"""Every platform layer, by ``cluster.platform``."""
