"""A step that went on without some slices: a semi-synchronous mode's slices each keep a replica of their own, and
one lost takes only its replica with it (docs/architecture.md, "Dropped replicas").

The others are not stopped: there is no detection wait, no strategy's plan
and no restore, only the failure's record, the layout of the slices left
(compiled ahead, like a recovery's) and the lost slice's samples since its
last synchronization counted as skipped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax

from ._failures import StepInterrupted, TrainingStopped
from ._records import LoopState
from ._recovery import TrainingContext, classify, ends_run_if_stopped, lost_slices, skip_training_of
from ._step_runner import StepResult


def drop_replicas(ctx: TrainingContext, state: LoopState, done: StepResult, error: Exception,
                  dropped: Sequence[int], *, phase: str) -> tuple[LoopState, StepResult]:
    """Go on without the slices ``dropped`` (or found lost: ``error`` may name none, a hang the watchdog ended)
    of ``state.layout`` after step ``state.step`` (lost in ``phase``): ``state`` on the layout of the others,
    with ``done``'s state moved onto it and the lost slices' incarnations brought up to date (the others' stay: a
    failure of theirs since is still found).

    ``done``'s state lies on the slices that hold it: the others' alone, or
    all of the layout's (a boundary that lost a slice: its inputs are whole).
    A failure that the plugins find fatal stops the run. When fewer slices
    than the mode goes on with (:attr:`AbstractTrainingMode.min_slices`) are
    left, or none is known lost, the step fails as a whole
    (:class:`StepInterrupted`: the failure flow takes over).
    """
    layout = state.layout
    gone = lost_slices(ctx, layout.slices, dropped, state.incarnations)
    survivors = tuple(s for s in layout.slices if s not in gone)
    if not gone or len(survivors) < max(1, ctx.mode.min_slices):  # the failure flow classifies and records it
        raise StepInterrupted(error, leaves=None, metrics=None, phase=phase)
    failure, index = classify(ctx, error, step=state.step, phase=phase, slices=layout.slices,
                              since=state.incarnations, detection=False)
    with ends_run_if_stopped(ctx, index):
        if not failure.elastic:
            raise TrainingStopped(f"step {state.step + 1} failed with a fatal error: {error}")
    if ctx.checkpoints is not None:  # on a runtime of several processes, the saves go on over the live ones
        ctx.checkpoints.regroup(slices=layout.slices, since=state.incarnations)
    begin = time.time()
    new = ctx.layouts.make(survivors)
    held_on = jax.tree.leaves(done.arrays)[0].sharding.mesh  # the mesh of the slices that hold the state
    rows = [tuple(row) for row in held_on.devices]
    positions = [rows.index(tuple(layout.mesh.devices[layout.slices.index(s)])) for s in survivors]
    arrays = ctx.mode.move(done.arrays, held_on, positions, new.shardings)
    skipped = skip_training_of(ctx, gone, since=ctx.mode.unsynced_from(state.step), until=state.step + 1,
                               at=state.step)
    ctx.failures.amend(index, slices=tuple(gone), action="drop_replica", slices_after=len(survivors),
                       restored_from="replica", lost_steps=0, recovery_s=0.0, samples_skipped=skipped,
                       compile_s=new.compile_s, compile_cached=new.compile_cached)
    ctx.layouts.record_resize(state.step, layout, new, reason="replica_dropped", seconds=time.time() - begin)
    now = ctx.cluster.incarnations()
    incarnations = tuple(now[s] if s in gone else count for s, count in enumerate(state.incarnations))
    return dataclasses.replace(state, layout=new, incarnations=incarnations), done._replace(
        arrays=arrays, leaves=jax.tree.leaves(arrays), dropped={})
