"""Running one train step to completion: its batch (prepared while the step before ran), its program(s), the
cluster's checks, and a watchdog on each wait."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from .clusters import (AbstractCluster, AbstractInjectableCluster, AbstractMultiControllerCluster, AbstractTimedCluster,
                       SyncCall)
from ._data import AbstractDataset, sample_ids
from ._failures import SliceLostError, StepInterrupted, StepTimeoutError, SyncMismatchError
from ._mesh import batch_sharding
from ._records import Layout
from ._watchdog import Watchdog


class StepResult(NamedTuple):
    """A step run to its end: the new state and its leaves, the samples it was trained on, its metrics, the
    slices it went on without (:meth:`StepMonitor.dropped`: the new state lies on the others) with why, and each
    slice's own time where its slices ran programs of their own (else the cluster's
    :meth:`~AbstractTimedCluster.slice_step_seconds` tells)."""

    arrays: PyTree
    leaves: list[jax.Array]
    ids: np.ndarray
    metrics: dict[str, jax.Array]
    dropped: dict[int, Exception] = {}
    slice_seconds: dict[int, float] = {}


class _Batch(NamedTuple):
    """A step's samples on a layout's devices: for which layout and data position, or what reading them raised."""

    layout: Layout
    position: int
    ids: np.ndarray
    arrays: PyTree | None
    error: Exception | None


class StepRunner:
    """Runs a layout's compiled step on the batch at a data position, and waits for it.

    While a step runs, the runner reads the next step's batch onto the same
    layout, as a hand-written loop does; a batch read for a layout or
    position that is not the next step's (a failure changed them) is dropped.

    :param cluster: checked after each step's wait; told when a step is launched (an injectable cluster, which
        refuses a launch on a slice it lost) and dispatched (a timed one), and asked to explain a failed wait (a
        multi-controller one).
    :param data: where the samples come from.
    :param watchdog: ends a wait that hangs.
    :param sample: a batch of one sample (an array or a pytree of them), for the batch's structure and shapes.
    :param hooks: the plugins' hooks (``et_before_update``), with ``view`` as their ``trainer``.
    :param structure: the structure of the state's arrays.
    :param seed: the data order's seed.
    """

    def __init__(self, cluster: AbstractCluster, data: AbstractDataset, watchdog: Watchdog, sample: PyTree, *,
                 hooks: Any, view: object, structure: Any, seed: int):
        self._cluster = cluster
        self._injectable = cluster if isinstance(cluster, AbstractInjectableCluster) else None
        self._timed = cluster if isinstance(cluster, AbstractTimedCluster) else None
        self._multi_controller = cluster if isinstance(cluster, AbstractMultiControllerCluster) else None
        self._data = data
        self._watchdog = watchdog
        leaves, self._structure = jax.tree.flatten(sample)
        self._row_shapes = [np.shape(leaf)[1:] for leaf in leaves]
        self._hooks = hooks
        self._view = view
        self._state_structure = structure
        self._seed = seed
        self._last: tuple[PyTree, list[jax.Array]] | None = None  # the state the last step made, and its leaves
        self._batch: _Batch | None = None  # the running step's
        self._retired: tuple = ()  # what the step before the running one took: let go while this one runs
        self._next: _Batch | None = None
        self._running: tuple[Layout, tuple[int, ...], int, int | None] | None = None
        self._dropped: dict[int, Exception] = {}  # the running step's
        self._slice_seconds: dict[int, float] = {}  # the running step's slices' own times, where each waits apart
        self._in_boundary = False  # running a mode's boundary work, not a step

    def run(self, layout: Layout, arrays: PyTree, position: int, *, step: int, since: tuple[int, ...],
            prepare_next: bool) -> StepResult:
        """Run step ``step`` on ``layout`` over the batch at data ``position``, to completion.

        ``arrays`` are donated to the step (they are deleted: a stale reference
        raises rather than reads freed memory). A failure before the step took
        them raises as it is; one after, :class:`~elastic_trainer._failures.StepInterrupted`.
        ``since`` is the cluster's incarnations as of ``arrays``; with
        ``prepare_next``, the next step's batch is read while this one runs.

        The step is waited for before the next one starts: one step in flight
        at a time. XLA:CPU deadlocks when several multi-device steps with
        collectives run at once (measured with 8 devices on 2 cores), and a
        failure must surface at the step it belongs to.
        """
        batch = self._take_batch(layout, position)
        self._running = layout, since, step, position + layout.batch_size if prepare_next else None
        self._batch, self._dropped, self._slice_seconds = batch, {}, {}
        leaves, metrics = layout.compiled.run(self._leaves_of(arrays), batch.arrays, lr_scale=layout.lr_scale,
                                              batch_size=layout.batch_size, monitor=self)
        return StepResult(self._last[0], leaves, batch.ids, metrics, self._dropped, self._slice_seconds)

    def boundary(self, layout: Layout, done: StepResult, *, step: int, since: tuple[int, ...]) -> StepResult:
        """Run ``layout``'s boundary work (a mode's outer step) on ``done``'s state after step ``step``, to
        completion; ``done`` with the new state. ``since`` is as for :meth:`run`."""
        self._running, self._dropped, self._in_boundary = (layout, since, step, None), {}, True
        try:
            leaves = layout.compiled.boundary(self._leaves_of(done.arrays), monitor=self)
        finally:
            self._in_boundary = False
        return done._replace(arrays=self._state_of(leaves), leaves=leaves, dropped=self._dropped)

    def result_of(self, interrupted: StepInterrupted) -> StepResult:
        """What the running step made when its update failed elsewhere (a split step's): the state the live
        processes hold, on the samples it ran."""
        leaves = interrupted.leaves
        return StepResult(self._state_of(leaves), leaves, self._batch.ids, interrupted.metrics)

    def _state_of(self, leaves: list[jax.Array]) -> PyTree:
        """The state made of a step's new ``leaves``; the next step takes its leaves without flattening it."""
        arrays = self._state_structure.unflatten(leaves)
        self._last = arrays, leaves
        return arrays

    # ------------------------------------------------------------------ the monitor of a running step

    @property
    def step(self) -> int:
        """The step being run (how many were completed before it)."""
        return self._running[2]

    @property
    def slices(self) -> tuple[int, ...]:
        """The slices of the running step's layout, in the mesh's order."""
        return self._running[0].slices

    @property
    def since(self) -> tuple[int, ...]:
        """The cluster's incarnations as of the running step's state."""
        return self._running[1]

    def launching(self, slices: Sequence[int] | None = None) -> None:
        """Before the step's first dispatch (on ``slices``, by default the layout's): a slice known to be lost
        raises, the state still whole."""
        if self._injectable is not None:
            layout, since, _, _ = self._running
            self._injectable.check_launch(layout.slices if slices is None else slices, since=since)

    def dispatched(self) -> None:
        """The step (one slice's program of it) runs: tell the cluster, and read the next step's batch meanwhile,
        once."""
        if self._timed is not None:
            self._timed.step_dispatched()
        layout, _, _, next_position = self._running
        if next_position is not None and self._next is None:
            self._next = self._read_batch(layout, next_position)

    def made(self, leaves: list[jax.Array]) -> None:
        """The new state's leaves are dispatched: make its pytree while the devices work, and let go of what the
        step before took (its batch, and its state, donated: the arrays are deleted, but releasing an array
        costs about a microsecond per device, 1.5 ms a step for the small model's state on 64 devices, which a
        hand-written loop pays while its step runs too)."""
        self._retired = self._last, self._batch  # this step's state and batch: let go while the next one runs
        self._state_of(leaves)

    def before_update(self) -> None:
        """The step's update is about to consume the state (``et_before_update``), or a mode's boundary work
        runs (``et_before_boundary``)."""
        hook = self._hooks.et_before_boundary if self._in_boundary else self._hooks.et_before_update
        hook(trainer=self._view, step=self._running[2])

    def wait(self, pending: list[jax.Array], *, end: bool, slices: Sequence[int] | None = None) -> None:
        """Wait for ``pending`` under the watchdog, and at the step's ``end`` synchronize ``slices`` (by default
        the layout's; ``SyncCall.STEP_END``); a multi-controller cluster explains a failure that lost slices may
        explain first."""
        layout, since, _, _ = self._running

        def wait_and_check() -> None:
            jax.block_until_ready(pending)
            if end:
                self._cluster.synchronize(SyncCall.STEP_END, layout.slices if slices is None else slices, since=since)
                if slices is not None and self._timed is not None:  # a slice's own program: its own time
                    self._slice_seconds.update(self._timed.slice_step_seconds())

        try:
            self._watchdog.wait(wait_and_check)
        except Exception as error:
            hardware = isinstance(error, StepTimeoutError) or not isinstance(error, (SliceLostError, SyncMismatchError))
            if hardware and self._multi_controller is not None:
                self._multi_controller.explain_failure(error, layout.slices, since=since, pending=pending)
            raise

    def dropped(self, slices: Sequence[int], error: Exception) -> None:
        """The step goes on without ``slices`` (``error``): the loop drops them once it ends."""
        self._dropped.update(dict.fromkeys(slices, error))

    # ------------------------------------------------------------------ state and batches

    def _leaves_of(self, arrays: PyTree) -> list[jax.Array]:
        """``arrays``' leaves; those of the last step's state without flattening it again."""
        if self._last is not None and self._last[0] is arrays:
            return self._last[1]
        self._last = None  # another state: the last step's is no more
        return self._state_structure.flatten_up_to(arrays)

    def _take_batch(self, layout: Layout, position: int) -> _Batch:
        """The batch at ``position`` on ``layout``: the one read during the last step, or read now; what reading
        it raised is raised now, at the step it belongs to."""
        batch, self._next = self._next, None
        if batch is None or batch.layout is not layout or batch.position != position:
            batch = self._read_batch(layout, position)
        if batch.error is not None:
            raise batch.error
        return batch

    def _read_batch(self, layout: Layout, position: int) -> _Batch:
        """Read the samples at ``position`` onto ``layout``'s devices; an error is kept for the step that needs them."""
        ids = sample_ids(self._data.num_samples, seed=self._seed, start=position, count=layout.batch_size)
        try:
            return _Batch(layout, position, ids, self._place(layout, ids), None)
        except Exception as error:  # noqa: BLE001 - the dataset's (a user's) error, raised by the step that reads it
            return _Batch(layout, position, ids, None, error)

    def _place(self, layout: Layout, ids: np.ndarray) -> PyTree:
        """The samples ``ids`` split over ``layout``'s devices. One process reads them all and puts them there,
        as a hand-written loop does; with several, each reads only its own devices' rows, once per shard."""
        sharding = batch_sharding(layout.mesh)
        if jax.process_count() == 1:
            return jax.device_put(self._data.get_batch(ids), sharding)
        fetched: dict[tuple, list[np.ndarray]] = {}

        def rows(index: tuple[slice, ...]) -> list[np.ndarray]:
            key = index[0].indices(len(ids))
            if key not in fetched:
                fetched[key] = [np.asarray(leaf) for leaf in
                                self._structure.flatten_up_to(self._data.get_batch(ids[index[0]]))]
            return fetched[key]

        return self._structure.unflatten([
            jax.make_array_from_callback((len(ids), *shape), sharding, lambda index, i=i: rows(index)[i])
            for i, shape in enumerate(self._row_shapes)
        ])
