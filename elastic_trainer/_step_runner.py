"""Running one train step to completion: its gradients, then its update, with the cluster checked and a watchdog
on each wait."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from .clusters import AbstractCluster
from ._compiled_step import CompiledStep
from ._data import AbstractDataset
from ._failures import SliceLostError, StepTimeoutError, UpdateInterrupted
from ._mesh import batch_sharding
from ._records import Layout
from ._watchdog import Watchdog


class _Made(NamedTuple):
    """The state the last step made: as the loop holds it, its leaves, and each update group's part of them."""

    arrays: PyTree
    leaves: list[jax.Array]
    parts: list[list[jax.Array]]


class StepRunner:
    """Runs a layout's compiled step on a batch of samples and waits for it.

    :param cluster: checked after the gradients and at the end of the step (a slice lost meanwhile raises).
    :param data: where the samples come from.
    :param watchdog: ends a wait that hangs.
    :param sample: a batch of one sample (an array or a pytree of them), for the batch's structure and shapes.
    :param hooks: the plugins' hooks (``et_before_update``), with ``view`` as their ``trainer``.
    :param structure: the structure of the state's arrays.
    """

    def __init__(self, cluster: AbstractCluster, data: AbstractDataset, watchdog: Watchdog, sample: PyTree, *,
                 hooks: Any, view: object, structure: Any):
        self._cluster = cluster
        self._data = data
        self._watchdog = watchdog
        self._leaves, self._structure = jax.tree.flatten(sample)
        self._hooks = hooks
        self._view = view
        self._state_structure = structure
        self._last: _Made | None = None

    def run(self, layout: Layout, arrays: PyTree, ids: np.ndarray, *, step: int, since: tuple[int, ...]
            ) -> tuple[PyTree, dict]:
        """Run step ``step`` on ``layout`` over samples ``ids``, to completion; the new arrays and the metrics.

        First the gradients, over every slice: a failure there raises as it
        is, and ``arrays`` stay whole (nothing was donated). Then the update,
        one program per group of slices, ``arrays`` donated to it (they are
        deleted: a stale reference raises rather than reads freed memory): a
        failure there raises :class:`UpdateInterrupted`, with the state after
        the step, whole on the groups without a lost slice.

        The step is waited for before the next one starts: one step in flight
        at a time. XLA:CPU deadlocks when several multi-device steps with
        collectives run at once (measured with 8 devices on 2 cores), and a
        failure must surface at the step it belongs to. ``since`` is the
        cluster's incarnations as of ``arrays``.
        """
        program: CompiledStep = layout.compiled
        leaves = self._leaves_of(arrays)
        gradients, loss = program.gradients(leaves, self._batch(layout, ids))
        self._cluster.step_dispatched()
        parts = self._last.parts if self._last is not None and self._last.leaves is leaves else program.cut(leaves)
        gradient_parts = program.cut(gradients, gradients=True)  # while the gradients are computed
        self._wait(layout, since, gradients, lambda: self._cluster.check_gradients(layout.slices, since=since))
        self._hooks.et_before_update(trainer=self._view, step=step)
        groups = self._cluster.update_groups(layout.slices)
        metrics = {"loss": loss}
        outcomes = program.update(parts, gradient_parts, lr_scale=layout.lr_scale, batch_size=layout.batch_size)
        for leaf in leaves:
            leaf.delete()  # its buffers were donated (or, where an update did not run, are given up)
        failed = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failed is not None:
            raise UpdateInterrupted(failed, arrays=None, metrics=metrics, groups=groups) from failed
        new_leaves = program.join(outcomes)
        new_arrays = self._state_structure.unflatten(new_leaves)
        self._last = _Made(new_arrays, new_leaves, outcomes)
        try:
            self._wait(layout, since, new_leaves, lambda: self._cluster.check_step(layout.slices, since=since))
        except Exception as error:
            raise UpdateInterrupted(error, arrays=new_arrays, metrics=metrics, groups=groups) from error
        return new_arrays, metrics

    def _leaves_of(self, arrays: PyTree) -> list[jax.Array]:
        """``arrays``' leaves; those of the last step's state without flattening it again."""
        if self._last is not None and self._last.arrays is arrays:
            return self._last.leaves
        self._last = None  # another state: the last step's is no more
        return self._state_structure.flatten_up_to(arrays)

    def _wait(self, layout: Layout, since: tuple[int, ...], pending: list[jax.Array], check: Callable[[], None]
              ) -> None:
        """Wait for ``pending`` under the watchdog, then ``check`` the cluster; a failure is explained first."""

        def wait() -> None:
            jax.block_until_ready(pending)
            check()

        try:
            self._watchdog.wait(wait)
        except Exception as error:
            if isinstance(error, StepTimeoutError) or not isinstance(error, SliceLostError):
                self._cluster.explain_failure(error, layout.slices, since=since, pending=pending)
            raise

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
