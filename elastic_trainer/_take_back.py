"""Taking a returning slice back in on ``cluster=multiprocess``: the live processes and its replacement start a
new backend together, and the replacement gets the train state from a peer (docs/multiprocess.md, "Rejoin")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from jaxtyping import PyTree

from .clusters import AbstractRejoinCluster, Admission
from .clusters.multicontroller._rejoin import donor_of, from_host, to_host
from ._records import Layout, LoopState
from ._restore_sources import RestoreRequest, restore_from_best


def take_back(ctx, state: LoopState, slices: Sequence[int], returning: Sequence[int]) -> LoopState:
    """In a live process, at a step boundary: go on with ``slices``, some of them ``returning`` (their processes
    are replacements that asked to join). ``ctx`` is the trainer's :class:`~elastic_trainer._recovery.TrainingContext`.

    The saves under way commit first; the state (this process's shards)
    and the losses still on the devices go to host memory; the cluster
    restarts the backend with the replacements (:meth:`~elastic_trainer.clusters.AbstractRejoinCluster.take_in`),
    every compiled step forgotten once the compile under way has ended; then
    the layout of ``slices`` is made on the new backend and the state moves to
    it, the returning slices' part from a live slice's (:func:`share_state`).
    When the replacements do not come to be taken in, the state stays as it is.
    """
    begin, old = time.time(), state.layout
    if ctx.checkpoints is not None:
        stopped = ctx.checkpoints.finish_saving(None)
        if stopped is not None:
            raise stopped
    with ctx.clock.measure("remesh"):
        host = to_host(state.arrays)
        ctx.history.losses_to_host()  # the backend that holds them is restarted
        group = ctx.checkpoints.checkpointer.groups + 1 if ctx.checkpoints else 0
        assert isinstance(ctx.cluster, AbstractRejoinCluster)  # the only kind whose slices return
        joined = ctx.cluster.take_in(slices, step=state.step, position=state.position, checkpoint_group=group,
                                     before_restart=ctx.step_cache.restart)
    if not joined:  # the replacements did not come: the job goes on as it was
        return dataclasses.replace(state, at_boundary=False)
    new = ctx.layouts.make(slices)
    abstract = ctx.mode.abstract(ctx.abstract, slices=len(new.slices))
    arrays = share_state(ctx, from_host(host, abstract, new.shardings), new, donor=donor_of(new.slices, returning),
                         returning=returning, step=state.step)
    ctx.layouts.record_resize(state.step, old, new, reason="rejoined", seconds=time.time() - begin,
                              state_from_peer=joined)
    return dataclasses.replace(state, arrays=arrays, layout=new, incarnations=ctx.cluster.incarnations(),
                               at_boundary=False)


def join(ctx, arrays: PyTree, layout: Layout, admission: Admission) -> LoopState:
    """In a replacement, once its layout is made: the state the live processes hold (:func:`share_state`), at the
    step and data position they are at."""
    arrays = share_state(ctx, arrays, layout, donor=admission.donor, returning=admission.returning,
                         step=admission.step)
    return LoopState(arrays, layout, step=admission.step, position=admission.position,
                     incarnations=ctx.cluster.incarnations())


def share_state(ctx, arrays: PyTree, layout: Layout, *, donor: int, returning: Sequence[int], step: int) -> PyTree:
    """What every process of a grown job does alike, in the same order: the state on ``layout``, every slice's from
    the slice at position ``donor``, but each slice's own part, which only those of the ``returning`` slices in
    ``layout`` take (the others go on waiting to be wanted). The restore policy's
    :class:`~elastic_trainer._restore_sources.Peer`."""
    request = RestoreRequest(arrays, old=layout, survivors=(), new=layout, step=step,
                             since=ctx.cluster.incarnations(), donor=donor,
                             returning=tuple(layout.slices.index(s) for s in returning if s in layout.slices))
    return restore_from_best(ctx, request).arrays
