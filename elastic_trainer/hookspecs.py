"""Hook specifications: every point where a plugin can observe or steer training.

Hooks are called with keyword arguments only, so a plugin implements just the
parameters it needs and new parameters never break old plugins. In one run they
fire in this order::

    et_run_start
    et_training_mode                  (once: what each layout's step compiles to)
    et_make_mesh                      (once, for the initial mesh)
    et_likely_layouts -> et_make_mesh (for each layout to compile ahead)
    et_before_restore, et_after_restore         (when resuming)
    for every step:
        et_step_start
        et_before_update              (the step runs; before its update takes the state)
        et_before_boundary            (where the training mode's boundary work is due: DiLoCo's outer step)
        et_step_end
        et_before_checkpoint_save, et_after_checkpoint_save    (on a step that is saved)
        et_slice_health -> et_propose_resize -> (on a resize) et_make_mesh
        when the step raises:
            et_classify_failure -> et_slice_health -> et_recovery_start -> et_choose_recovery
            -> et_slice_health (while waiting) -> et_make_mesh
            -> et_before_restore -> et_after_restore
    et_run_end
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Sequence

    import jax
    from jax.sharding import Mesh

    from ._failures import Failure, RecoveryPlan
    from ._run_report import RunReport
    from ._state import TrainState
    from ._training_mode import AbstractTrainingMode
    from ._protocols import RunView, TrainerView

PROJECT_NAME = "elastic_trainer"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks a function of this module as a hook's specification (pluggy's ``HookspecMarker``)."""
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's method as a hook implementation: ``@et.hookimpl`` (or ``@et.hookimpl(tryfirst=True)``,
``(trylast=True)``, ``(wrapper=True)``), on a method named after the hook it implements."""


# -------------------------------------------------------------------------
# Run lifecycle
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def et_training_mode(trainer: TrainerView) -> AbstractTrainingMode | None:
    """Called once, before :func:`et_run_start`, to choose how each layout's step is compiled and run.

    :param trainer: the trainer about to run; ``trainer.cluster`` is the cluster.

    Return an :class:`~elastic_trainer.plugin.AbstractTrainingMode`, or ``None`` to
    let the next plugin decide. ``firstresult``: with no answer the step is
    synchronous data parallel (:class:`~elastic_trainer.plugin.SynchronousMode`, its
    gradients and update split on a multi-controller cluster). Any other
    answer is a plugin error.
    """


@hookspec
def et_run_start(trainer: TrainerView, state: TrainState, mode: AbstractTrainingMode) -> None:
    """Called once, after the initial train state exists and before the first step.

    :param trainer: the trainer about to run; read ``trainer.steps``,
        ``trainer.cluster`` and ``trainer.run_dir`` from it.
    :param state: the initial train state, not yet on the mesh (a resumed run
        restores its checkpoint later, see :func:`et_after_restore`).
    :param mode: the run's training mode (:func:`et_training_mode`'s answer, or
        :class:`~elastic_trainer.plugin.SynchronousMode`): for example, whether and
        after which steps its boundary work runs (``mode.boundary_due``).

    Return value is ignored.
    """


@hookspec
def et_step_start(trainer: RunView, step: int) -> None:
    """Called before each train step starts.

    :param trainer: the running trainer; ``trainer.slices`` are the slices in use.
    :param step: the number of steps completed so far (0-based index of this step).

    Return value is ignored. Failure injection uses it to lose a slice during
    the step that follows.
    """


@hookspec
def et_before_boundary(trainer: RunView, step: int) -> None:
    """Called after a step whose training mode has boundary work due (``diloco``'s outer step: the slices' one
    collective), once that work's program is dispatched and running; never in the default, synchronous mode.

    :param trainer: the running trainer.
    :param step: the number of steps completed before the step it follows (as for ``et_step_start``).

    Return value is ignored. Failure injection uses it to lose a slice during
    the outer step: the slice is dropped and the work runs again over the others.
    """


@hookspec
def et_before_update(trainer: RunView, step: int) -> None:
    """Called during each train step, before its update takes the state (docs/architecture.md, "The step"): on
    a single controller the step is one program, dispatched and running when this is called; on
    ``cluster=multiprocess`` its gradients are computed on every slice, and the update is next.

    :param trainer: the running trainer.
    :param step: the number of steps completed before this one (as for ``et_step_start``).

    Return value is ignored. Failure injection uses it to lose a slice while
    the step runs: on a single controller the step has taken the state (it is
    donated) and no slice holds it any more; on ``cluster=multiprocess`` the
    processes that live hold the state after the step.
    """


@hookspec
def et_step_end(trainer: RunView, step: int, metrics: dict[str, jax.Array]) -> None:
    """Called after each train step has completed on every slice in use (or, on ``cluster=multiprocess`` when a
    failure interrupted its update, on the processes that live; recovery follows).

    :param trainer: the running trainer.
    :param step: the number of steps completed, counting this one (1-based).
    :param metrics: the step's metrics as device arrays: ``loss``, and the
        scalars of a loss with ``has_aux`` by their names.
        Reading one (``float(metrics["loss"])``) copies it to the host, so
        read them only as often as you need them.

    Return value is ignored. Called on the training thread: keep it cheap.
    """


@hookspec
def et_run_end(trainer: TrainerView, report: RunReport) -> None:
    """Called once when training ends, normally or because it was stopped.

    :param trainer: the trainer that ran.
    :param report: the run report (:class:`~elastic_trainer.RunReport`, what
        ``report.json`` holds), frozen. A plugin adds keys of its own with
        ``report.extra[name] = value`` (call it ``tryfirst`` to have them
        in ``report.json``, which the built-in reporter writes).

    Return value is ignored.
    """


# -------------------------------------------------------------------------
# Failures and recovery
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def et_classify_failure(error: BaseException, step: int, phase: str) -> Failure | None:
    """Called when a step, a save, a restore or a recovery raises, to decide whether the failure is elastic.

    :param error: the exception raised.
    :param step: the number of steps completed before the failed one.
    :param phase: what was running: ``"train_step"``, ``"update"`` (a split step's update),
        ``"boundary"`` (a training mode's work after the step: ``diloco``'s outer step),
        ``"checkpoint_save"``, ``"checkpoint_restore"`` or ``"recovery"`` (a failure while recovering).

    Return a :class:`~elastic_trainer.plugin.Failure` (``elastic=True`` when a strategy
    may recover from it, with the lost slices if known), or ``None`` to let the
    next plugin decide. ``firstresult``: the first non-``None`` answer wins; the
    built-in classifier runs last and calls anything it does not recognise fatal.
    """


@hookspec(firstresult=True)
def et_slice_health(trainer: RunView) -> list[int] | None:
    """Called to learn which slices are healthy: after a failure, while waiting, and at step boundaries.

    :param trainer: the running trainer; ``trainer.cluster`` is the cluster.

    Return the indices of the healthy slices, or ``None`` to let the next
    plugin answer. ``firstresult``: the built-in checker runs last and asks
    the cluster (``trainer.cluster.healthy_slices()``).
    """


@hookspec(firstresult=True)
def et_propose_resize(trainer: TrainerView, healthy_slices: list[int]) -> list[int] | None:
    """Called at each step boundary, to offer a change of the slices in use.

    :param trainer: the running trainer; ``trainer.slices`` are the slices in use.
    :param healthy_slices: the slices healthy now.

    Return the slices to continue on (a resize happens at once, the state
    moving from the slices in use), or ``None`` to keep the current ones.
    ``firstresult``. Strategies that scale back up implement it.
    """


@hookspec
def et_likely_layouts(trainer: TrainerView) -> list[list[int]]:
    """Called after the first compile, and again after the first step on each new layout (a recovery's, a
    resize's), to learn which slice sets may come next.

    :param trainer: the trainer; ``trainer.slices`` are the slices in use.

    Return lists of slice indices. The trainer compiles a step for each on a
    background thread (with the full global batch), so that a recovery onto
    one of them does not wait for a compile; compiles queued for an earlier
    layout that have not started are dropped. All plugins' answers are used.
    """


@hookspec
def et_recovery_start(trainer: RunView, failure: Failure) -> None:
    """Called when an elastic failure enters recovery, before the strategy chooses what to do about it.

    :param trainer: the running trainer.
    :param failure: the classified failure.

    Observers only: failure injection strikes here for its ``recovery``
    phase (a second failure while the first is recovered from).
    """


@hookspec(firstresult=True)
def et_choose_recovery(trainer: RunView, failure: Failure) -> RecoveryPlan | None:
    """Called after an elastic failure, to pick what to do about it: the strategy.

    :param trainer: the running trainer.
    :param failure: the classified failure.

    Return a :class:`~elastic_trainer.plugin.RecoveryPlan`, or ``None`` when this
    plugin does not handle the failure. ``firstresult``: the selected strategy
    answers. With no answer the run stops the traditional way and says how to
    select a strategy.
    """


@hookspec(firstresult=True)
def et_make_mesh(trainer: RunView, slice_devices: Sequence[Sequence[jax.Device]]) -> Mesh | None:
    """Called to build the mesh: once at start, and again after every resize.

    :param trainer: the trainer.
    :param slice_devices: the devices of each live slice, one sequence per slice.

    Return a :class:`jax.sharding.Mesh` with axes ``("slice", "device")``, or
    ``None`` to let the next plugin decide. ``firstresult``: the built-in plugin
    runs last and lays the live slices out in order.
    """


# -------------------------------------------------------------------------
# Checkpoints
# -------------------------------------------------------------------------


@hookspec
def et_before_checkpoint_save(trainer: TrainerView, step: int) -> None:
    """Called just before a checkpoint of ``step`` is handed to Orbax.

    :param trainer: the running trainer.
    :param step: the step being saved (steps completed).

    Return value is ignored.
    """


@hookspec
def et_after_checkpoint_save(trainer: TrainerView, step: int, directory: str) -> None:
    """Called once the step loop may go on after a save of ``step``.

    The save may still be committing in the background (Orbax async saves);
    it becomes restorable only when Orbax finalizes it.

    :param trainer: the running trainer.
    :param step: the step saved.
    :param directory: the checkpoint manager's root directory.

    Return value is ignored.
    """


@hookspec
def et_before_restore(trainer: TrainerView, step: int, source: str) -> None:
    """Called before train state is restored.

    :param trainer: the running trainer.
    :param step: the step that will be restored.
    :param source: where it comes from: ``"replica"``, ``"snapshot"`` or
        ``"checkpoint"``.

    Return value is ignored.
    """


@hookspec
def et_after_restore(trainer: TrainerView, step: int, source: str, state: TrainState) -> None:
    """Called after train state was restored, before training continues.

    :param trainer: the running trainer.
    :param step: the step restored.
    :param source: where it came from (see :func:`et_before_restore`).
    :param state: the restored state, on the current mesh. The next step
        consumes its device buffers (docs/architecture.md, "The step"): read or
        copy what you need here (``np.array(jax.device_get(...))``: on CPU
        ``device_get`` gives a view of the buffer); a reference kept for later
        raises "Array has been deleted".

    Return value is ignored.
    """
