"""Layouts: slices meshed through the ``et_make_mesh`` hook, the global batch on them, and a compiled step."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from .clusters import has_spares, mesh_slice_count, release as release_slices, returning_slices, vital_slices
from ._failures import ConfigError, PluginError, RecoveryPlan
from ._mesh import DEVICE_AXIS, SLICE_AXIS
from ._records import Layout, LoopState, ResizeRecord, RunContext
from ._step_cache import StepCache


def make_mesh(hooks: Any, view: object, slice_devices: Sequence[Sequence[jax.Device]]) -> Mesh:
    """The mesh plugins make for ``slice_devices`` (``et_make_mesh``); a :class:`PluginError` if it is not one."""
    mesh = hooks.et_make_mesh(trainer=view, slice_devices=slice_devices)
    if not isinstance(mesh, Mesh) or mesh.axis_names != (SLICE_AXIS, DEVICE_AXIS):
        raise PluginError(
            f"et_make_mesh returned {mesh!r}; a plugin must return a jax.sharding.Mesh "
            f"with axes ({SLICE_AXIS!r}, {DEVICE_AXIS!r})."
        )
    return mesh


def with_spares(candidates: Sequence[int], *, in_use: Sequence[int], limit: int) -> tuple[int, ...]:
    """At most ``limit`` of ``candidates``, the slices a mesh takes from them: those of ``in_use`` first, then the
    others (spares, a lost slice back among them), lowest first; sorted."""
    ordered = sorted(set(candidates), key=lambda s: (s not in in_use, s))
    return tuple(sorted(ordered[:limit]))


def without(slices: Sequence[int], returning: Sequence[int]) -> tuple[int, ...]:
    """``slices`` less those ``returning``: the layout a recovery makes first. A returning slice is taken in on a
    new backend afterwards (``take_back``), where nothing compiled on the old one is kept."""
    return tuple(s for s in slices if s not in returning)


class Layouts:
    """Makes the layouts a run trains on, and compiles likely next ones ahead.

    :param run: the cluster the slices come from, the plugins' hooks, and the clock that books meshing as
        start-up (first layout) or re-mesh, and compiling as compile.
    :param steps: the compiled steps, by layout.
    :param global_batch_size: samples per step on the full cluster.
    :param release: ``release(dropped, kept)`` lets the slices ``dropped`` go at a step boundary, the run
        going on with ``kept`` (the run's checkpoints do it: their saves go on over what is left); by default
        :func:`~elastic_trainer.clusters.release`.
    :param take_back: ``take_back(state, slices, returning)`` goes on with ``slices`` at a step boundary, taking
        in ``returning`` ones (``_take_back.take_back``); the state on the new layout.
    """

    def __init__(
        self, run: RunContext, *, steps: StepCache, global_batch_size: int,
        release: Callable[[Sequence[int], Sequence[int]], None] | None = None,
        take_back: Callable[[LoopState, tuple[int, ...], list[int]], LoopState] | None = None,
    ):
        self._cluster, self._hooks, self._view, self._clock = run.cluster, run.hooks, run.view, run.clock
        self._steps = steps
        self._global_batch_size = global_batch_size
        self._release = release or (lambda dropped, kept: release_slices(run.cluster, dropped))
        self._take_back = take_back
        self.resizes: list[ResizeRecord] = []
        """Every change of the slices in use, as the report lists them."""
        self._likely_from: tuple[int, ...] | None = None  # the layout whose likely next ones were queued last

    @property
    def limit(self) -> int:
        """The most slices a layout holds: the cluster's, less its spares
        (:func:`~elastic_trainer.clusters.mesh_slice_count`)."""
        return mesh_slice_count(self._cluster)

    def spares(self, in_use: Sequence[int]) -> list[int]:
        """The spares now: healthy slices out of ``in_use``, and those waiting to be taken in on a runtime that must
        take them in (:func:`~elastic_trainer.clusters.returning_slices`); none asked for on a cluster without
        spares."""
        if not has_spares(self._cluster):
            return []
        healthy = [*self._hooks.et_slice_health(trainer=self._view), *returning_slices(self._cluster)]
        return sorted(s for s in set(healthy) if s not in in_use)

    def make(self, slices: Sequence[int], *, plan: RecoveryPlan | None = None, at_start: bool = False) -> Layout:
        """Mesh ``slices`` and get a step compiled for them, with ``plan``'s batch policy; the meshing is booked
        as start-up for the run's first layout (``at_start``), as re-mesh for any other."""
        slices = tuple(sorted(slices))
        all_devices = self._cluster.slice_devices()
        with self._clock.measure("startup" if at_start else "remesh"):
            mesh = make_mesh(self._hooks, self._view, [all_devices[i] for i in slices])
        batch_size, lr_scale = self._batch_for(mesh, slices, plan)
        with self._clock.measure("compile"):
            compiled, shardings, compile_info = self._steps.get(mesh, batch_size, slices)
        return Layout(slices, mesh, batch_size, lr_scale, compiled, shardings, **compile_info)

    def compile_likely(self, layout: Layout) -> None:
        """Queue background compiles for the layouts plugins expect next from ``layout`` (``et_likely_layouts``),
        likeliest first; once per layout in use: at start, and after the first step on each new one.

        Likeliest first: the layouts that drop the fewest of ``layout``'s
        slices, and among those the ones that drop the slices that failed most
        often in this run (hardware that failed once is the likeliest to fail
        again); the plugins' order breaks ties. Compiles asked for ahead of an
        earlier layout that have not started yet are dropped (a layout with a
        lost slice in it is not where the next failure goes). The step cache
        compiles one at a time in this order and only while it has room
        (``trainer.max_cached_layouts``), so at N slices at most that many of
        the N "one slice fewer" layouts are compiled ahead: a bounded cost at
        any N (docs/architecture.md, "Compiles"). None lacks a slice whose
        loss ends the job (:func:`vital_slices`): it is never trained,
        and JAX caches no program that process 0 is not in. A spare fills each lost
        slice's place (:func:`with_spares`). Where a new backend takes the
        spare in (a returning slice), the survivors' layout is compiled first
        (:func:`without`: the recovery's), then the one with the spare, which
        reaches the new backend through JAX's persistent compilation cache.
        """
        if layout.slices == self._likely_from:
            return
        self._likely_from = layout.slices
        all_devices, failures = self._cluster.slice_devices(), self._cluster.incarnations()
        spares, returning = self.spares(layout.slices), returning_slices(self._cluster)
        chosen = [with_spares([*slices, *spares], in_use=slices, limit=self.limit)
                  for layouts in self._hooks.et_likely_layouts(trainer=self._view) for slices in layouts]
        vital = set(vital_slices(self._cluster))
        likely = dict.fromkeys(variant for slices in chosen for variant in (without(slices, returning), slices)
                               if vital <= set(variant))  # else never trained
        self._steps.drop_queued(keep=list(likely))

        def likeliest_first(slices: tuple[int, ...]) -> tuple[int, int]:
            dropped = [s for s in layout.slices if s not in slices]
            return len(dropped), -sum(failures[s] for s in dropped)

        for slices in sorted(likely, key=likeliest_first):
            mesh = make_mesh(self._hooks, self._view, [all_devices[i] for i in slices])
            local = any(device.process_index == jax.process_index() for device in mesh.devices.flat)
            by_mode = self._steps.mode.batch_size(self._global_batch_size, slices=len(slices), limit=self.limit)
            batch_size = layout.batch_size if by_mode is None else by_mode
            if mesh.size and batch_size % mesh.size == 0 and local:  # a mesh without us is not ours to run
                self._steps.compile_ahead(mesh, batch_size, slices)

    def maybe_resize(self, state: LoopState) -> LoopState:
        """Ask plugins whether to change slices at this step boundary (``et_propose_resize``); move the state if so.

        Slices taken away are released first (``release``); the state moves
        from the slices kept (each holds a full copy). Slices returning to a
        runtime that must take them in (:meth:`AbstractRejoinCluster.returning_slices`)
        are offered as healthy, and taken back in with ``take_back`` when the
        plugins want them (until then they wait).
        """
        layout = state.layout
        healthy = self._hooks.et_slice_health(trainer=self._view)
        returning = [s for s in returning_slices(self._cluster) if s not in healthy]
        target = self._hooks.et_propose_resize(trainer=self._view, healthy_slices=sorted({*healthy, *returning}))
        target = layout.slices if target is None else with_spares(target, in_use=layout.slices, limit=self.limit)
        if set(returning) & set(target):
            return self._take_back(state, target, returning)
        if target == layout.slices:
            return dataclasses.replace(state, at_boundary=False)
        begin = time.time()
        dropped = [s for s in layout.slices if s not in target]
        if dropped:
            self._release(dropped, [s for s in layout.slices if s not in dropped])
        new = self.make(target)
        with self._clock.measure("remesh"):
            kept = [position for position, s in enumerate(layout.slices) if s not in dropped]
            arrays = self._steps.mode.move(state.arrays, layout.mesh, kept, new.shardings)
            jax.block_until_ready(arrays)
        reason = "dropped" if dropped else "scale_up"
        self.record_resize(state.step, layout, new, reason=reason, seconds=time.time() - begin)
        return dataclasses.replace(state, arrays=arrays, layout=new, at_boundary=False)

    def record_resize(
        self, step: int, old: Layout, new: Layout, *, reason: str, seconds: float, state_from_peer: tuple[int, ...] = ()
    ) -> None:
        """Add a resize record when ``new`` uses other slices than ``old``."""
        if old.slices != new.slices:
            self.resizes.append(ResizeRecord(
                step=step, at=time.time(), reason=reason, slices_before=len(old.slices), slices=new.slices,
                seconds=seconds, compile_s=new.compile_s, compile_cached=new.compile_cached,
                state_from_peer=state_from_peer,
            ))

    def _batch_for(self, mesh: Mesh, slices: tuple[int, ...], plan: RecoveryPlan | None) -> tuple[int, float]:
        """The global batch and learning-rate scale on ``mesh`` under ``plan``'s batch policy."""
        batch_size, lr_scale = self._global_batch_size, 1.0
        by_mode = self._steps.mode.batch_size(batch_size, slices=len(slices), limit=self.limit)
        if by_mode is not None:
            batch_size = by_mode
        elif plan is not None and not plan.keep_global_batch:
            full_devices = self.limit * mesh.shape[DEVICE_AXIS]
            batch_size = self._global_batch_size * mesh.size // full_devices
            ratio = batch_size / self._global_batch_size
            lr_scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[plan.lr_scaling]
        if batch_size < 1 or batch_size % mesh.size:
            raise ConfigError(
                f"trainer.global_batch_size ({batch_size}) must be divisible by the {mesh.size} devices of "
                f"slices {list(slices)}, and by every device count the run may scale to."
            )
        return batch_size, lr_scale
