"""Training modes: how a layout's step is compiled, and so what one step of the loop does on the devices.

The loop, the failure flow and the restore sources are the same in every mode
(docs/architecture.md); a mode decides only the programs a layout runs. The
synchronous mode is the default: one all-reduce of the gradients across slices
per step, then the donated update (:mod:`._compiled_step`). A plugin provides
another through ``et_training_mode`` (docs/plugins.md, "A training mode").
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from jax.sharding import Mesh
from jaxtyping import PyTree

from ._compiled_step import CompiledStep, DeviceScalars, FusedStep, SplitStep
from ._mesh import WithinSlice, move_replica
from ._state import TrainState
from ._step import StepFunctions, compile_gradients, compile_step, compile_update


class AbstractTrainingMode(abc.ABC):
    """What one step of the loop does: the state the run keeps (:meth:`init`) and the programs each layout
    runs on it (:meth:`compile`).

    A mode is asked once per layout (on the step cache's background thread
    when a layout is compiled ahead, so :meth:`compile` must not touch the
    running state). The loop runs what it returns through
    :meth:`CompiledStep.run` and commits the leaves it gives back.
    """

    name: ClassVar[str]
    """The mode's name, for messages and the checkpoints' metadata."""
    min_slices: int = 1
    """The fewest slices a step of this mode goes on with when it drops others (:meth:`StepMonitor.dropped`);
    with fewer left, the step fails as a whole and the failure flow takes over."""

    def init(self, arrays: TrainState) -> PyTree:
        """The mode's state, made once from the train state's arrays (the model's, the optimizer's, the step,
        the key and the data position): by default the train state itself.

        A mode that keeps more (an average of the parameters, outer
        parameters) returns a pytree of arrays that holds them; the run keeps
        it, whole, on every slice, and its snapshots, checkpoints, replicas
        and rejoins carry it. Its :meth:`compile` gets its shapes, and its
        compiled step its flat leaves.
        """
        return arrays

    def train_state(self, arrays: PyTree) -> TrainState:
        """The train state's arrays within the mode's state: what ``et_after_restore``, the report and
        :class:`~elastic_trainer.FitResult` see, and where the loop reads the step and data position."""
        return arrays

    def abstract(self, abstract: PyTree, *, slices: int) -> PyTree:
        """The mode's state as shapes for a layout of ``slices`` slices, from ``abstract`` (its shapes at the
        run's start): where a checkpoint is restored onto. The same by default; a mode whose slices each keep a
        part of their own (a row per slice) changes the rows."""
        return abstract

    def move(self, arrays: PyTree, mesh: Mesh, positions: Sequence[int], shardings: PyTree) -> PyTree:
        """The state held on the slices at ``positions`` of ``mesh`` onto ``shardings`` (another layout's), read
        from those slices alone: a replica restore, a resize, a dropped replica. By default every slice holds a
        full copy, so the kept slices' shards make it up and a new slice gets a copy (:func:`move_replica`)."""
        return move_replica(arrays, mesh, positions, shardings)

    def rows_onto(self, arrays: PyTree, from_slices: Sequence[int], to_slices: Sequence[int]
                  ) -> tuple[PyTree, tuple[int, ...]]:
        """The state held for ``from_slices`` (host arrays, or arrays on no layout: a snapshot, a checkpoint read)
        as the state for ``to_slices``, and the slices of ``from_slices`` whose training it carries (the others'
        samples since their last sync are skipped). By default every slice holds all of it: the same state, and
        every slice's."""
        return arrays, tuple(from_slices)

    def batch_size(self, global_batch_size: int, *, slices: int, limit: int) -> int | None:
        """The samples one step takes on a layout of ``slices`` of the cluster's ``limit`` slices; ``None``
        (the default): ``global_batch_size``, or what a recovery plan's batch policy makes of it."""
        return None

    def boundary_due(self, step: int, *, steps: int) -> bool:
        """Whether the compiled step's :meth:`~CompiledStep.boundary` runs once ``step`` steps of the run's
        ``steps`` are completed (a semi-synchronous mode's outer step); never by default."""
        return False

    def unsynced_from(self, step: int) -> int:
        """The first step whose progress a slice dropped during step ``step`` takes with it: its samples from
        there on are skipped (the report's ``samples``). Only a mode that drops slices
        (:meth:`StepMonitor.dropped`) is asked."""
        return step

    def forget_compiled(self) -> None:
        """The backend is restarting (a rejoin on ``cluster=multiprocess``): let go of the programs the mode keeps
        beyond a layout's compiled step (they run on the old backend's devices). Nothing by default."""

    @abc.abstractmethod
    def compile(self, functions: StepFunctions, abstract: PyTree, batch: PyTree, mesh: Mesh, *,
                within_slice: WithinSlice) -> tuple[CompiledStep, PyTree]:
        """The compiled step for ``mesh`` and the state's shardings on it.

        :param functions: the step's pure functions over the train state's flat leaves (:class:`StepFunctions`).
        :param abstract: the mode's state (:meth:`init`) as shapes and dtypes.
        :param batch: a ``jax.ShapeDtypeStruct`` per leaf of the global batch, sharded over the mesh.
        :param mesh: the layout's mesh, axes ``("slice", "device")``.
        :param within_slice: the state's layout within a slice (``trainer.within_slice``).
        """


@dataclasses.dataclass(frozen=True)
class SynchronousMode(AbstractTrainingMode):
    """Data parallel and synchronous: every step all-reduces the gradients across every slice, then updates.

    :param split: compile each step as its gradients and then its update (a
        :class:`SplitStep`, what a runtime whose processes each run their own
        part needs: ``cluster=multiprocess``); else one donating program (a
        :class:`FusedStep`, what a hand-written loop jits).
    """

    name: ClassVar[str] = "synchronous"
    split: bool = False

    def compile(self, functions: StepFunctions, abstract: PyTree, batch: PyTree, mesh: Mesh, *,
                within_slice: WithinSlice) -> tuple[CompiledStep, PyTree]:
        if self.split:
            gradients, shardings = compile_gradients(functions, abstract, batch, mesh, within_slice=within_slice)
            update = compile_update(functions, abstract, mesh, within_slice=within_slice)
            return SplitStep(gradients, update, DeviceScalars(mesh)), shardings
        program, shardings = compile_step(functions, abstract, batch, mesh, within_slice=within_slice)
        return FusedStep(program, DeviceScalars(mesh)), shardings
