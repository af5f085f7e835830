"""Where a recovery takes the train state from: each source a small class, tried in one order (:data:`POLICY`).

A surviving replica is the state of the failed step's start, on devices
that live: nothing is lost and nothing is read. Then the host snapshot (the
state of the last snapshot step, in host memory), then the newest readable
checkpoint. The snapshot goes before a checkpoint even when the checkpoint
is newer: it is read from host memory, it never fails for a storage reason,
and it is at most ``trainer.snapshot_period - 1`` steps old, where reading a
checkpoint costs a storage read that may find it unreadable and fall back
further. When slices return (a rejoin, ``_take_back.py``), every process of
the grown job takes the state from a live peer instead: the peer's replica,
sent over the collectives (:class:`Peer`, asked for with a ``donor``).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import jax
from jaxtyping import PyTree

from ._failures import TrainingStopped
from .clusters import SyncCall
from .clusters.multicontroller._rejoin import compile_from_peers
from ._mesh import replicated
from ._records import Layout, RestoredFrom
from .checkpoints._run_checkpoints import NoReadableCheckpoint

if TYPE_CHECKING:
    from ._recovery import TrainingContext

@dataclasses.dataclass(frozen=True)
class RestoreRequest:
    """What a recovery asks a source for: the state of ``step``'s start, on ``new``.

    :param arrays: the state's arrays as they are after the failure (what lived on lost slices is gone).
    :param old: the layout the state was on.
    :param survivors: the slices of ``old`` that still hold the whole state (none when every one was lost, or the
        failed step had taken the state from every slice).
    :param new: the layout to restore onto.
    :param step: the step the failure interrupted.
    :param since: the slices' incarnations the restore must not outlive.
    :param consumed: the failed step had taken the state from every slice (it is donated).
    :param donor: for a rejoin: the position in ``new`` of the live slice whose state every slice gets; ``None``
        for a recovery.
    :param returning: for a rejoin: the positions in ``new`` of the slices taken back, which alone take the donor's
        part of a state held per slice (a semi-synchronous mode's rows).
    """

    arrays: PyTree
    old: Layout
    survivors: Sequence[int]
    new: Layout
    step: int
    since: tuple[int, ...]
    consumed: bool = False
    donor: int | None = None
    returning: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored state: its arrays on the new layout, their source, the step they hold, and the slices of the
    state it came from whose training it carries (:meth:`AbstractTrainingMode.rows_onto`; ``None``: a rejoin's,
    which loses nothing)."""

    arrays: PyTree
    source: RestoredFrom
    step: int
    carried: tuple[int, ...] | None = None


class RestoreSource(abc.ABC):
    """One place the state can come back from."""

    name: ClassVar[RestoredFrom]

    @abc.abstractmethod
    def available(self, ctx: TrainingContext, request: RestoreRequest) -> bool:
        """Whether this source holds a state to restore."""

    @abc.abstractmethod
    def restore(self, ctx: TrainingContext, request: RestoreRequest) -> Restored:
        """The state, on ``request.new``."""


class _InMemorySource(RestoreSource):
    """A state this process holds (on surviving devices or in host memory), put on the new layout between
    ``et_before_restore`` and ``et_after_restore``."""

    measured_as: ClassVar[str]

    def restore(self, ctx: TrainingContext, request: RestoreRequest) -> Restored:
        step = self._step(ctx, request)
        ctx.hooks.et_before_restore(trainer=ctx.view, step=step, source=self.name)
        with ctx.clock.measure(self.measured_as):
            held, carried = self._arrays(ctx, request)
            arrays = jax.device_put(held, request.new.shardings)
            jax.block_until_ready(arrays)
            ctx.cluster.synchronize(SyncCall.MEMORY_RESTORE, request.new.slices, since=request.since)
        ctx.hooks.et_after_restore(trainer=ctx.view, step=step, source=self.name,
                                   state=ctx.train_state(arrays))
        return Restored(arrays, self.name, step, carried)

    @abc.abstractmethod
    def _step(self, ctx: TrainingContext, request: RestoreRequest) -> int:
        """The step the held state is of."""

    @abc.abstractmethod
    def _arrays(self, ctx: TrainingContext, request: RestoreRequest) -> tuple[PyTree, tuple[int, ...]]:
        """The held state for ``request.new``'s slices, and the slices whose training it carries."""


class Replica(_InMemorySource):
    """The copy on the surviving slices: the state of the failed step's start, nothing lost."""

    name, measured_as = "replica", "remesh"

    def available(self, ctx: TrainingContext, request: RestoreRequest) -> bool:
        return bool(request.survivors)

    def _step(self, ctx: TrainingContext, request: RestoreRequest) -> int:
        return request.step

    def _arrays(self, ctx: TrainingContext, request: RestoreRequest) -> tuple[PyTree, tuple[int, ...]]:
        positions = [request.old.slices.index(s) for s in request.survivors]
        return ctx.mode.move(request.arrays, request.old.mesh, positions, request.new.shardings), tuple(
            request.survivors)


class Snapshot(_InMemorySource):
    """The host snapshot: the state of the last snapshot step, in host memory."""

    name, measured_as = "snapshot", "checkpoint_restore"

    def available(self, ctx: TrainingContext, request: RestoreRequest) -> bool:
        return ctx.snapshots.latest is not None

    def _step(self, ctx: TrainingContext, request: RestoreRequest) -> int:
        return ctx.snapshots.latest.step

    def _arrays(self, ctx: TrainingContext, request: RestoreRequest) -> tuple[PyTree, tuple[int, ...]]:
        snapshot = ctx.snapshots.latest
        return ctx.mode.rows_onto(snapshot.arrays, snapshot.slices, request.new.slices)


class Checkpoint(RestoreSource):
    """The newest readable checkpoint (unreadable ones skipped, with a warning)."""

    name = "checkpoint"

    def available(self, ctx: TrainingContext, request: RestoreRequest) -> bool:
        return ctx.checkpoints is not None and ctx.checkpoints.checkpointer.latest_step() is not None

    def restore(self, ctx: TrainingContext, request: RestoreRequest) -> Restored:
        with ctx.clock.measure("checkpoint_restore"):
            try:
                arrays, step, carried = checkpoint_onto(ctx, request.new, since=request.since)
            except NoReadableCheckpoint as none:
                raise TrainingStopped(f"{_nothing_survived(request)} and no checkpoint is readable"
                                      f"{none.unreadable}.") from None
        return Restored(arrays, self.name, step, carried)


def checkpoint_onto(ctx: TrainingContext, layout: Layout, *, since: tuple[int, ...]
                    ) -> tuple[PyTree, int, tuple[int, ...]]:
    """The newest readable checkpoint on ``layout``: its arrays, its step, and the slices it was saved on whose
    training the state carries there.

    Read onto ``layout``'s shardings when the mode's state has the same
    shapes for the slices it was saved on as for ``layout``'s (always, for a
    mode whose every slice holds all of it); else read whole onto every
    device, and the mode makes it ``layout``'s (:meth:`AbstractTrainingMode.rows_onto`).
    """
    wanted = ctx.mode.abstract(ctx.abstract, slices=len(layout.slices))

    def target(saved_on: Sequence[int]) -> PyTree:
        saved = ctx.mode.abstract(ctx.abstract, slices=len(saved_on))
        same = all(a.shape == b.shape for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(wanted), strict=True))
        shardings = layout.shardings if same else jax.tree.map(lambda _: replicated(layout.mesh), saved)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), saved, shardings)

    arrays, step, saved_on = ctx.checkpoints.restore_newest(target, slices=layout.slices, since=since)
    arrays, carried = ctx.mode.rows_onto(arrays, saved_on, layout.slices)
    return jax.device_put(arrays, layout.shardings), step, carried


class Peer(RestoreSource):
    """A live slice's state, sent over the collectives to the slices that return (a rejoin): every slice of
    ``request.new`` gets the shards of the slice at position ``request.donor`` (the others' hold zeros, or a
    replacement's fresh state), but for each slice's own part of the state (a row per slice), which only the
    returning slices take. Every process of the grown job restores from it alike, in the same order: the
    program is compiled first and run only once the processes have agreed on who lives (a replacement gets here
    after compiling its whole step, long after the live processes: at 16 processes on 2 cores, more than the 30 s
    gloo gives a peer to join a collective on a new backend); then checkpoints regroup over them. No restore hook
    fires: no failure is recovered from."""

    name = "peer"

    def available(self, ctx: TrainingContext, request: RestoreRequest) -> bool:
        return request.donor is not None

    def restore(self, ctx: TrainingContext, request: RestoreRequest) -> Restored:
        slices = request.new.slices
        with ctx.clock.measure("remesh"):
            spread = compile_from_peers(request.arrays, request.new.shardings, request.donor, request.returning)
            ctx.cluster.synchronize(SyncCall.STATE_SHARING, slices, since=ctx.cluster.incarnations())
            arrays = spread(request.arrays)
            jax.block_until_ready(arrays)
            ctx.cluster.synchronize(SyncCall.STATE_SHARED, slices, since=ctx.cluster.incarnations())
        if ctx.checkpoints is not None:
            ctx.checkpoints.regroup(slices=slices, since=ctx.cluster.incarnations())
        return Restored(arrays, self.name, request.step)


POLICY: tuple[RestoreSource, ...] = (Peer(), Replica(), Snapshot(), Checkpoint())
"""The sources a recovery tries, first choice first."""


def restore_from_best(ctx: TrainingContext, request: RestoreRequest) -> Restored:
    """The state on ``request.new`` from the first source of :data:`POLICY` that holds one;
    :class:`TrainingStopped` when none does."""
    for source in POLICY:
        if source.available(ctx, request):
            return source.restore(ctx, request)
    raise TrainingStopped(f"{_nothing_survived(request)} and there is no snapshot or checkpoint to restore from; "
                          "keep trainer.snapshot_period above 0 or enable checkpoints.")


def _nothing_survived(request: RestoreRequest) -> str:
    """Why no slice holds the state, in words."""
    return ("the failed step had taken the state from every slice (a step donates it)" if request.consumed
            else "every slice was lost")
