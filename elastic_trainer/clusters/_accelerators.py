"""No silent CPU on an accelerator host: a cluster that trains on CPU devices says so where JAX would use GPUs or TPUs.

The check starts no JAX backend: a backend started before a cluster configures
JAX would fix the platform (and the CPU device count) before the cluster chose
them. It looks for the devices as JAX itself does before it starts one, and for
the JAX plugin that drives them; once a backend runs, JAX's own answer is used.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import warnings

import jax

from .._failures import AcceleratorUnusedWarning
from .._private_apis import accelerator_hardware, backends_started

PLATFORM_NAMES = {"gpu": {"gpu", "cuda", "rocm"}, "tpu": {"tpu"}}
"""The names ``JAX_PLATFORMS`` may give each accelerator platform."""

HARDWARE = {"gpu": "GPUs", "tpu": "TPUs"}

CPU_CLUSTERS = {
    "simulated": "SimulatedCluster (cluster=simulated, the default) trains on simulated slices of CPU devices",
    "multiprocess": 'MultiprocessCluster(platform="cpu") (cluster.platform=cpu, the default) trains on CPU devices',
}
"""What each cluster that trains on CPU devices does, in the warning's words."""

ACCELERATOR_PATHS = {
    ("simulated", "gpu"): 'no cluster trains on GPUs yet (docs/clusters.md, "A GPU/NCCL platform layer")',
    ("simulated", "tpu"): "PathwaysCluster (cluster=pathways) trains on TPU slices through Pathways, "
                          "not yet tried on a TPU",
    ("multiprocess", "gpu"): "platform=None (cluster.platform=null) takes JAX's default platform, not yet tried on "
                             'GPUs: no GPU platform layer is written yet (docs/clusters.md, "A GPU/NCCL platform layer")',
    ("multiprocess", "tpu"): "PathwaysCluster (cluster=pathways) trains on TPU slices through Pathways, not yet tried "
                             "on a TPU (platform=None, cluster.platform=null, takes JAX's default platform, untried "
                             "on TPUs)",
}
"""For each cluster and accelerator, the option that uses the accelerator, or that none does yet."""


def accelerator_platform() -> str | None:
    """``"gpu"`` or ``"tpu"`` when JAX's default backend on this host is, or would be, one; ``None`` otherwise.

    A running backend answers itself. Before one runs: the devices are here,
    ``JAX_PLATFORMS`` (the user's choice) does not leave them out, and the JAX
    plugin that drives them is installed (else JAX falls back to CPU itself).
    """
    if backends_started():
        platform = jax.default_backend()
        return platform if platform in PLATFORM_NAMES else None
    platform = accelerator_hardware()
    if platform is None:
        return None
    requested = {name.strip().lower() for name in os.environ.get("JAX_PLATFORMS", "").split(",") if name.strip()}
    if requested and not requested & PLATFORM_NAMES[platform]:
        return None
    return platform if _plugin_installed(platform) else None


def _plugin_installed(platform: str) -> bool:
    """Whether the JAX plugin for ``platform`` is installed: a ``jax_plugins`` module or entry point for CUDA or
    ROCm (GPUs), ``libtpu`` (TPUs)."""
    if platform == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    names = {entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")}
    if importlib.util.find_spec("jax_plugins") is not None:
        names |= {module.name for module in pkgutil.iter_modules(importlib.import_module("jax_plugins").__path__)}
    return any("cuda" in name or "rocm" in name for name in names)


def warn_if_accelerators_unused(cluster: str, platform: str | None) -> None:
    """Warn (:class:`~elastic_trainer.AcceleratorUnusedWarning`) that ``cluster`` (``"simulated"`` or
    ``"multiprocess"``) trains on CPU devices although JAX's default ``platform`` here is an accelerator; nothing
    when ``platform`` is ``None``."""
    if platform is not None:
        warnings.warn(
            f"this host has {HARDWARE[platform]} that JAX would use, but {CPU_CLUSTERS[cluster]}; "
            f"{ACCELERATOR_PATHS[cluster, platform]}.", AcceleratorUnusedWarning, stacklevel=3,
        )
