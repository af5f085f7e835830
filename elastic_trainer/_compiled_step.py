"""A layout's compiled step, and how it runs: one donating program, or the gradients and then the update.

Which one a layout gets is the training mode's (:class:`~elastic_trainer.plugin.SynchronousMode`: a split step on an
:class:`AbstractMultiControllerCluster`, docs/architecture.md, "The step"). Both run the same way from outside: the
runner (a :class:`StepMonitor`) is told when the step is launched and
dispatched, and waits for it; a failure after the state was donated raises
:class:`StepInterrupted`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._failures import StepInterrupted
from ._mesh import replicated


class StepMonitor(Protocol):
    """What a compiled step calls while it runs (the :class:`~elastic_trainer._step_runner.StepRunner`).

    ``slices`` narrows a check to some of the layout's slices, for a step
    whose programs run on one slice each (a semi-synchronous mode's); by
    default a check covers every slice of the layout.
    """

    @property
    def step(self) -> int:
        """The step being run: how many steps were completed before it."""

    @property
    def slices(self) -> tuple[int, ...]:
        """The slices of the running step's layout, in the order of its mesh's slice axis."""

    @property
    def since(self) -> tuple[int, ...]:
        """The cluster's incarnations as of the state the step runs on: device data put before a slice's count
        changed is gone (:meth:`~elastic_trainer.clusters.AbstractCluster.incarnations`)."""

    def launching(self, slices: Sequence[int] | None = None) -> None:
        """Just before the step's first program is dispatched (on ``slices``): a slice known to be lost raises
        here, the state still whole."""

    def dispatched(self) -> None:
        """The step's first program is dispatched: what the host does while the devices work goes here."""

    def made(self, leaves: list[jax.Array]) -> None:
        """The program that makes the new state's ``leaves`` is dispatched (they are not ready yet)."""

    def before_update(self) -> None:
        """The step's update is about to consume the state (in a fused step: it runs, dispatched); in a
        boundary, its program runs, dispatched."""

    def wait(self, pending: list[jax.Array], *, end: bool, slices: Sequence[int] | None = None) -> None:
        """Wait for ``pending`` and check the cluster (``slices`` of it): after the gradients, or at the step's
        ``end``."""

    def dropped(self, slices: Sequence[int], error: Exception) -> None:
        """The step goes on without ``slices``, lost (``error`` says how), and without their part of the state:
        the new leaves it makes lie on the other slices alone. Only a mode whose slices each keep a part of
        their own (a replica) drops slices; the loop then goes on without them, with no recovery."""


class CompiledStep(Protocol):
    """A layout's compiled step, as a training mode makes it (:class:`~elastic_trainer.plugin.AbstractTrainingMode`)."""

    @property
    def executables(self) -> tuple[Any, ...]:
        """Every program one step runs (what ``benchmarks/memory.py`` accounts)."""

    def run(self, leaves: list[jax.Array], batch: PyTree, *, lr_scale: float, batch_size: int,
            monitor: StepMonitor) -> tuple[list[jax.Array], dict[str, jax.Array]]:
        """Run the step on the state's ``leaves`` and ``batch`` to its end, telling ``monitor`` as it goes; the
        new leaves and the step's metrics (``loss``, and a ``has_aux`` loss's scalars).

        ``lr_scale`` multiplies the updates (a shrunk global batch's
        learning-rate rescaling, 1 otherwise) and ``batch_size`` is the global
        batch's. A failure before the state was taken raises as it is (the
        leaves are whole); one after, :class:`StepInterrupted` with the new
        leaves where the processes that live hold them, else none.
        """

    def boundary(self, leaves: list[jax.Array], *, monitor: StepMonitor) -> list[jax.Array]:
        """The work between two steps that the mode says is due (:meth:`AbstractTrainingMode.boundary_due`: a
        semi-synchronous mode's outer step) on the committed state's ``leaves``; the new leaves. Only a mode
        whose ``boundary_due`` can be true needs it. It must not donate ``leaves``: a slice lost while it runs is
        dropped, and it runs again over the others."""
        raise NotImplementedError


class DeviceScalars:
    """``lr_scale`` and ``batch_size`` on a mesh's devices, put there once per value."""

    def __init__(self, mesh: Mesh):
        self._sharding = replicated(mesh)
        self._values: dict[tuple, tuple[jax.Array, jax.Array]] = {}
        self._since: tuple[int, ...] | None = None

    def get(self, lr_scale: float, batch_size: int, *, since: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """The two scalars on the mesh; put again once a slice failed after they were put (``since`` is the
        cluster's incarnations now): a lost slice takes every array on it with it, even once it is back."""
        if since != self._since:
            self._values, self._since = {}, since
        key = (lr_scale, batch_size)
        if key not in self._values:
            self._values[key] = tuple(  # not device_put: on several processes it checks that each put the same
                jax.make_array_from_callback((), self._sharding, lambda _, v=v: v)  # value, a collective: one
                for v in (np.float32(lr_scale), np.int32(batch_size)))  # peer slow to it ended 3-process runs here
        return self._values[key]


@dataclasses.dataclass(frozen=True)
class FusedStep:
    """The step as one program over the layout's mesh, the state donated (a hand-written loop's step).

    A failure while it runs loses the state on every slice: the program
    consumed it. The runner then raises :class:`StepInterrupted` without arrays,
    and the state comes back from the host snapshot or a checkpoint.

    :param program: the compiled step (:func:`~elastic_trainer._step.compile_step`).
    :param scalars: the step's scalar arguments on the mesh.
    """

    program: Any
    scalars: DeviceScalars

    @property
    def executables(self) -> tuple[Any, ...]:
        """Every program one step runs (what ``benchmarks/memory.py`` accounts)."""
        return (self.program,)

    def run(self, leaves: list[jax.Array], batch: PyTree, *, lr_scale: float, batch_size: int,
            monitor: StepMonitor) -> tuple[list[jax.Array], dict[str, jax.Array]]:
        """Run the step on ``leaves`` (donated) and ``batch`` to its end; the new leaves and the metrics."""
        monitor.launching()
        try:
            lr = self.scalars.get(lr_scale, batch_size, since=monitor.since)[0]
            new_leaves, metrics = self.program(leaves, batch, lr)
        except Exception as error:  # noqa: BLE001 - it did not run: the donated state may be gone
            raise StepInterrupted(error, leaves=None, metrics=None) from error
        monitor.dispatched()
        monitor.made(new_leaves)
        monitor.before_update()
        try:
            monitor.wait([*new_leaves, *metrics.values()], end=True)
        except Exception as error:
            raise StepInterrupted(error, leaves=None, metrics=None) from error
        return new_leaves, metrics


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """The step as two programs over the layout's mesh: the gradients (nothing donated), then the update (the
    state donated, no collective).

    For a runtime where each process runs its own part of every program:
    a process lost during the gradients leaves every other the state before
    the step; one lost during the update, the state after it.

    :param gradients: the compiled gradients (:func:`~elastic_trainer._step.compile_gradients`).
    :param update: the compiled update (:func:`~elastic_trainer._step.compile_update`).
    :param scalars: the update's scalar arguments on the mesh.
    """

    gradients: Any
    update: Any
    scalars: DeviceScalars

    @property
    def executables(self) -> tuple[Any, ...]:
        """Every program one step runs (what ``benchmarks/memory.py`` accounts)."""
        return (self.gradients, self.update)

    def run(self, leaves: list[jax.Array], batch: PyTree, *, lr_scale: float, batch_size: int,
            monitor: StepMonitor) -> tuple[list[jax.Array], dict[str, jax.Array]]:
        """Run the step on ``leaves`` and ``batch`` to its end; the new leaves and the metrics. A failure before the
        update raises as it is (``leaves`` are whole); one during it, :class:`StepInterrupted` with the new leaves,
        whole on the processes that live."""
        monitor.launching()
        gradients, metrics = self.gradients(leaves, batch)
        monitor.dispatched()
        monitor.wait([*gradients, *metrics.values()], end=False)
        monitor.before_update()
        try:
            new_leaves = self.update(leaves, gradients, *self.scalars.get(lr_scale, batch_size, since=monitor.since))
        except Exception as error:  # noqa: BLE001 - it did not run: the donated state may be gone, here too
            raise StepInterrupted(error, leaves=None, metrics=metrics) from error
        monitor.made(new_leaves)
        try:
            monitor.wait(new_leaves, end=True)
        except Exception as error:
            raise StepInterrupted(error, leaves=new_leaves, metrics=metrics) from error
        return new_leaves, metrics
