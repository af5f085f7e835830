"""``cluster=pathways``: the slices of a Pathways job on Cloud TPU, seen through ``pathwaysutils``."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ._base import AbstractSpareCluster, AbstractWholeArrayLossCluster
from .._extras import import_extra
from .._failures import ConfigError, Failure, SliceLostError, check_at_least
from ..hookspecs import hookimpl


def _pathwaysutils_elastic() -> Any:
    """``pathwaysutils``' elastic module, imported when first used: an optional extra."""
    return import_extra(
        "pathwaysutils.elastic.elastic", needed_by="cluster=pathways", package="pathwaysutils", extra="pathways"
    )


class PathwaysCluster(AbstractSpareCluster, AbstractWholeArrayLossCluster):
    """Slices as Pathways reports them: ``device.slice_index`` groups the
    devices, pathwaysutils' health checker says which slices are up (as in
    MaxText's elastic mode), and its classification of slice-down errors
    feeds the ``et_classify_failure`` hook (the trainer registers the cluster
    as a plugin).

    A lost slice takes every array on it with it, for good: as pathwaysutils'
    own model of a device loss (``pathwaysutils.test.mock_fault_injection``)
    has it, an array made before the loss stays unreadable after the slice is
    back. Each time the health checker finds a slice down that was up, the
    slice's :meth:`incarnations` count goes up, so nothing placed on it before
    is used again.

    :param health_checker: a ``pathwaysutils.elastic.elastic.SliceHealthChecker``
        subclass, or its import path (``"module:Class"``); ``None`` for
        pathwaysutils' default, which runs a tiny computation on every slice.
    :param spare_slices: how many of the job's slices (the last ones) stay out
        of the mesh as spares, each ready to take a lost slice's place
        (``+strategy=hot_swap``).
    :param slice_to_devices: the devices of each Pathways slice index; by
        default ``get_slice_to_devices(jax.devices())``.
    """

    kind = "pathways"

    def __init__(
        self, health_checker: type | str | None = None, spare_slices: int = 0,
        slice_to_devices: Mapping[int, Sequence[jax.Device]] | None = None,
    ):
        check_at_least("cluster.spare_slices", spare_slices, 0)
        self._elastic = _pathwaysutils_elastic()
        if isinstance(health_checker, str):
            health_checker = load_health_checker(health_checker)
        self.health_checker = health_checker or self._elastic.DefaultSliceHealthChecker
        self.spare_slices = spare_slices
        self._given_slices = slice_to_devices
        self._failures: dict[int, int] = {}  # by our slice index: how often the health checker found it gone
        self._down: set[int] = set()  # our slices the health checker found down last

    def configure_jax(self) -> None:
        """Let pathwaysutils set up JAX for Pathways (it does nothing unless ``JAX_PLATFORMS`` names ``proxy``)."""
        importlib.import_module("pathwaysutils").initialize()

    @property
    def slice_indices(self) -> list[int]:
        """Pathways' slice indices, in the order of our slices 0, 1, ..."""
        indices = sorted(self._slice_to_devices())
        if self.spare_slices >= len(indices):
            raise ConfigError(f"cluster.spare_slices ({self.spare_slices}) must be fewer than the job's "
                              f"{len(indices)} Pathways slices; lower it.")
        return indices

    def slice_devices(self) -> list[list[jax.Device]]:
        """The devices of every slice, in slice-index order."""
        mapping = self._slice_to_devices()
        return [list(mapping[index]) for index in self.slice_indices]

    def describe(self) -> dict:
        """``kind``, ``slices`` (in the mesh, spares left out), ``devices_per_slice`` and ``spare_slices``."""
        devices = self.slice_devices()
        return {"kind": self.kind, "slices": len(devices) - self.spare_slices,
                "devices_per_slice": len(devices[0]) if devices else 0, "spare_slices": self.spare_slices}

    def healthy_slices(self) -> list[int]:
        """The slices pathwaysutils' health checker finds active; one found down that was up counts as lost
        (:meth:`incarnations`)."""
        mapping = self._slice_to_devices()
        active = self._elastic.get_active_slice_indices(mapping, self.health_checker(mapping))
        healthy = [ours for ours, index in enumerate(self.slice_indices) if index in active]
        down = set(range(len(mapping))) - set(healthy)
        for ours in down - self._down:
            self._failures[ours] = self._failures.get(ours, 0) + 1
        self._down = down
        return healthy

    def incarnations(self) -> tuple[int, ...]:
        """How often the health checker found each slice gone, having been up: what was placed on a slice before
        its count changed is gone, even once the slice is back."""
        return tuple(self._failures.get(ours, 0) for ours in range(len(self.slice_indices)))

    @hookimpl(tryfirst=True)
    def et_classify_failure(self, error: BaseException, step: int, phase: str) -> Failure | None:
        """A slice-down error by pathwaysutils' rule (``DATA_LOSS``, and ``DEADLINE_EXCEEDED``,
        ``NOT_FOUND`` or ``INTERNAL`` from the runtime) is elastic; anything else is left to the built-in classifier."""
        if isinstance(error, Exception) and self._elastic.is_error_due_to_slice_down(error):
            return Failure(error=error, step=step, phase=phase, elastic=True, kind="slice_lost",
                           slices=error.slices if isinstance(error, SliceLostError) else ())
        return None

    def _slice_to_devices(self) -> Mapping[int, Sequence[jax.Device]]:
        if self._given_slices is None:
            devices = jax.devices()
            if not all(hasattr(device, "slice_index") for device in devices):
                raise ConfigError(
                    f"cluster=pathways needs devices with a slice index (TPU through Pathways, JAX_PLATFORMS=proxy), "
                    f"but JAX's devices are {devices[0].platform} devices; use cluster=simulated here."
                )
            self._given_slices = self._elastic.get_slice_to_devices(devices)
        return self._given_slices


def load_health_checker(spec: str) -> type:
    """The ``SliceHealthChecker`` subclass that ``spec`` (``'module:Class'``) names; :class:`ConfigError` if none."""
    module, _, name = spec.partition(":")
    if not (all(part.isidentifier() for part in module.split(".")) and name.isidentifier()):
        raise ConfigError(
            f"cluster.health_checker must be 'module:Class' (a subclass of pathwaysutils' SliceHealthChecker) "
            f"or null for pathwaysutils' default, got {spec!r}."
        )
    checker_base = _pathwaysutils_elastic().SliceHealthChecker  # pathwaysutils missing: how to install it
    try:
        checker = getattr(importlib.import_module(module), name)
    except Exception as error:  # noqa: BLE001 - whatever importing the user's module raises
        detail = (str(error).splitlines() or [""])[0].rstrip(".")
        raise ConfigError(
            f"cluster.health_checker {spec!r} cannot be loaded ({type(error).__name__}: "
            f"{detail}); name an importable 'module:Class', or null for pathwaysutils' default."
        ) from error
    if not (isinstance(checker, type) and issubclass(checker, checker_base)):
        raise ConfigError(
            f"cluster.health_checker {spec!r} is not a subclass of pathwaysutils' "
            f"SliceHealthChecker; name one, or null for pathwaysutils' default."
        )
    return checker
