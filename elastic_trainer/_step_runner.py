"""Running one train step to completion, with the cluster checked and a watchdog on the wait."""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import PyTree

from .clusters import AbstractCluster
from ._data import AbstractDataset
from ._failures import SliceLostError, StepTimeoutError
from ._mesh import batch_sharding
from ._records import Layout
from ._watchdog import Watchdog


class StepRunner:
    """Runs a layout's compiled step on a batch of samples and waits for it.

    :param cluster: checked at the end of the step (a slice lost during it raises).
    :param data: where the samples come from.
    :param watchdog: ends a wait that hangs.
    :param sample: a batch of one sample (an array or a pytree of them), for the batch's structure and shapes.
    """

    def __init__(self, cluster: AbstractCluster, data: AbstractDataset, watchdog: Watchdog, sample: PyTree):
        self._cluster = cluster
        self._data = data
        self._watchdog = watchdog
        self._leaves, self._structure = jax.tree.flatten(sample)

    def run(self, layout: Layout, arrays: PyTree, ids: np.ndarray, *, since: tuple[int, ...]) -> tuple[PyTree, dict]:
        """Run one step on ``layout`` over samples ``ids``, to completion; the new arrays and the metrics.

        The step is waited for before the next one starts: one step in flight
        at a time. XLA:CPU deadlocks when several multi-device steps with
        collectives run at once (measured with 8 devices on 2 cores), and a
        failure must surface at the step it belongs to, so that the state
        before it is known to be whole. ``since`` is the cluster's
        incarnations as of ``arrays``.
        """
        batch = self._batch(layout, ids)
        new_arrays, metrics = layout.compiled(arrays, batch, np.float32(layout.lr_scale))
        self._cluster.step_dispatched()

        def wait_for_step() -> None:
            jax.block_until_ready(new_arrays)
            self._cluster.check_step(layout.slices, since=since)

        try:
            self._watchdog.wait(wait_for_step)
        except Exception as error:
            if isinstance(error, StepTimeoutError) or not isinstance(error, SliceLostError):
                self._cluster.explain_failure(error, layout.slices, since=since, pending=new_arrays)
            raise
        return new_arrays, metrics

    def _batch(self, layout: Layout, ids: np.ndarray) -> PyTree:
        """The samples ``ids`` split over ``layout``'s devices: each process reads only its own devices' rows,
        once per shard for all the batch's leaves."""
        sharding, fetched = batch_sharding(layout.mesh), {}

        def rows(index: tuple[slice, ...]) -> list[np.ndarray]:
            key = index[0].indices(len(ids))
            if key not in fetched:
                fetched[key] = [np.asarray(leaf) for leaf in self._structure.flatten_up_to(self._data.get_batch(ids[index[0]]))]
            return fetched[key]

        leaves = [
            jax.make_array_from_callback((len(ids), *leaf.shape[1:]), sharding, lambda index, i=i: rows(index)[i])
            for i, leaf in enumerate(self._leaves)
        ]
        return self._structure.unflatten(leaves)
