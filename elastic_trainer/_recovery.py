"""Recovery from a failure, as one path of functions (docs/architecture.md follows it).

:func:`survive` is where the trainer's loop hands a failure over:
:func:`classify` it (``et_classify_failure``, the slices lost),
:func:`choose_plan` (the strategy, ``et_choose_recovery``), :func:`carry_out`
its waits and fallbacks, mesh the slices that are left, :func:`restore` the
state (the restore policy's best source); the trainer then forgets the steps
the state no longer holds. ``et.elastic_retry`` uses
the same :func:`classify`, :func:`choose_plan`, :func:`carry_out` and
:func:`finish_recovery` around a loop the user keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import jax
from jaxtyping import PyTree

from .clusters import (
    AbstractInjectableCluster, AbstractRejoinCluster, has_spares, mesh_slice_count, returning_slices,
)
from ._failures import (
    ConfigError, Failure, PluginError, RecoveryPlan, RestartRequested, SliceLostError, TrainingStopped,
)
from ._layouts import Layouts, with_spares, without
from ._mesh import keep_slices
from ._plugins import answering
from ._records import FailureRecord, Layout, LoopState, PendingRecovery, RestoredFrom, RunContext, StepHistory
from ._restore_sources import RestoreRequest, restore_from_best
from .checkpoints._run_checkpoints import RunCheckpoints
from ._snapshots import HostSnapshots
from ._step_cache import StepCache
from ._stragglers import StragglerWatch
from ._step_runner import StepRunner
from ._take_back import take_back
from ._training_mode import AbstractTrainingMode
from ._state import TrainState

HEALTH_POLL_S = 0.05
"""How often slice health is asked while waiting for slices."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingContext(RunContext):
    """What the trainer's recovery works with besides: layouts, checkpoints, snapshots and the committed steps.

    :param layouts: makes the layout the run goes on with.
    :param stragglers: finds the slices slower than the others.
    :param checkpoints: the run's checkpoints, or ``None``.
    :param snapshots: the host snapshots.
    :param history: the committed steps (rolled back with the state).
    :param abstract: the training mode's state as shapes and dtypes (a checkpoint restore's target).
    :param static: the train state's non-array part.
    :param train_state: the train state (its non-array part included) in the training mode's state's arrays.
    :param mode: the training mode.
    :param step_cache: the compiled steps.
    :param runner: runs a step.
    """

    layouts: Layouts
    stragglers: StragglerWatch
    checkpoints: RunCheckpoints | None
    snapshots: HostSnapshots
    history: StepHistory
    abstract: PyTree
    static: PyTree
    train_state: Callable[[PyTree], TrainState]
    mode: AbstractTrainingMode
    step_cache: StepCache
    runner: StepRunner


# ---------------------------------------------------------------------- shared with elastic_retry


def lost_slices(ctx: RunContext, slices: Sequence[int], reported: Sequence[int], since: tuple[int, ...]) -> tuple[int, ...]:
    """Slices of ``slices`` whose data is gone: reported lost, unhealthy, or failed since ``since``."""
    healthy = set(ctx.hooks.et_slice_health(trainer=ctx.view))
    incarnations = ctx.cluster.incarnations()
    return tuple(s for s in slices if s in reported or s not in healthy or incarnations[s] != since[s])


def classify(
    ctx: RunContext, error: Exception, *, step: int, phase: str, slices: Sequence[int], since: tuple[int, ...],
    detection: bool = True,
) -> tuple[Failure, int]:
    """Classify ``error`` (``et_classify_failure``), find the slices lost, and record the failure.

    Returns the failure (its ``slices`` those lost) and its index in ``ctx.failures``. The time it takes is
    booked as ``detection`` unless the training went on meanwhile (not ``detection``: a dropped replica's).
    """
    lost_error = error if isinstance(error, SliceLostError) else None
    failed_at = (lost_error and lost_error.occurred_at) or time.time()  # a process death is stamped when it died
    with ctx.clock.measure("detection") if detection else contextlib.nullcontext():
        failure: Failure = ctx.hooks.et_classify_failure(error=error, step=step, phase=phase)
        lost = lost_slices(ctx, slices, failure.slices, since)
    record = FailureRecord(
        step=step, phase=failure.phase, slices=lost, kind=failure.kind, slices_before=len(slices),
        failed_at=failed_at, detection_s=time.time() - failed_at,
        processes=lost_error and lost_error.processes,  # on cluster=multiprocess, the processes that went with them
    )
    return dataclasses.replace(failure, slices=lost), ctx.failures.add(record)


def choose_plan(ctx: RunContext, failure: Failure) -> RecoveryPlan | None:
    """The strategy's plan for an elastic ``failure`` (``et_choose_recovery``, after ``et_recovery_start``), or
    ``None`` when none answers."""
    ctx.hooks.et_recovery_start(trainer=ctx.view, failure=failure)
    plan = ctx.hooks.et_choose_recovery(trainer=ctx.view, failure=failure)
    if plan is not None and not isinstance(plan, RecoveryPlan):
        raise PluginError(
            f"{answering(ctx.plugin_manager, 'et_choose_recovery')} returned {plan!r} from et_choose_recovery; "
            "a strategy must return an elastic_trainer.plugin.RecoveryPlan, or None to leave the decision to the "
            "next plugin."
        )
    return plan


def carry_out(
    ctx: RunContext, plan: RecoveryPlan, index: int, *, error: Exception, restart: Callable[[], NoReturn]
) -> tuple[RecoveryPlan, list[int]]:
    """Wait as ``plan`` says; when too few slices are back, fall back to ``plan.otherwise`` or stop.

    The plan waits up to ``wait_for_all_s`` for every slice, then, with fewer
    than ``min_slices`` healthy, up to ``wait_for_min_s`` for that many. A
    plan that restarts the process calls ``restart`` (which raises). So does
    a plan that would wait for lost slices on a cluster where they cannot come
    back (``cluster.lost_slices_rejoin`` is false: the multi-process runtime
    of this JAX): the whole job is re-formed instead, and the failure is
    marked ``regrouped``. The failure record ``index`` gets the ``action``,
    ``waiting_s`` and, after a fallback, ``fell_back_from``.

    :returns: the plan carried out and the healthy slices.
    """
    total = mesh_slice_count(ctx.cluster)  # every slice a mesh holds; a spare stands for a lost one
    waited, fell_back_from = 0.0, ()
    while True:
        ctx.failures.amend(index, action=plan.action, waiting_s=waited)
        if plan.restart_process:
            restart()
        if _waits_in_vain(ctx, plan, total):
            ctx.failures.amend(index, regrouped=True)
            restart()
        begin = time.time()
        healthy = wait_for_slices(ctx, plan.wait_for_all_s, until=total)
        if len(healthy) < plan.min_slices:
            healthy = wait_for_slices(ctx, plan.wait_for_min_s, until=plan.min_slices)
        waited += time.time() - begin
        ctx.failures.amend(index, waiting_s=waited)
        if len(healthy) >= plan.min_slices:
            return plan, healthy
        if plan.otherwise is None:
            raise TrainingStopped(
                f"{plan.action}: {len(healthy)} slice(s) healthy after waiting {waited:.0f} s, "
                f"fewer than the {plan.min_slices} the strategy needs; the last checkpoint is intact."
            ) from error
        fell_back_from += (plan.action,)
        ctx.failures.amend(index, fell_back_from=fell_back_from)
        plan = plan.otherwise


def _waits_in_vain(ctx: RunContext, plan: RecoveryPlan, total: int) -> bool:
    """Whether ``plan`` would wait for lost slices that do not come back within its wait (those back and waiting
    to be taken in, spares among them, count as healthy)."""
    healthy = [*ctx.cluster.healthy_slices(), *returning_slices(ctx.cluster)]
    waits = plan.wait_for_all_s and len(healthy) < total or plan.wait_for_min_s and len(healthy) < plan.min_slices
    lost = [s for s in range(len(ctx.cluster.slice_devices())) if s not in healthy]
    rejoins = isinstance(ctx.cluster, AbstractRejoinCluster)  # elsewhere a lost slice may come back any time
    return bool(waits) and rejoins and not ctx.cluster.lost_slices_return(
        lost, within_s=max(plan.wait_for_all_s, plan.wait_for_min_s))


def wait_for_slices(ctx: RunContext, timeout_s: float, *, until: int) -> list[int]:
    """Poll ``et_slice_health`` until at least ``until`` slices are healthy or ``timeout_s`` passed; the healthy
    slices, with those returning (:func:`~elastic_trainer.clusters.returning_slices`: taken back in once
    recovered)."""
    with ctx.clock.measure("waiting_for_slices"):
        deadline = time.monotonic() + timeout_s
        healthy = [*ctx.hooks.et_slice_health(trainer=ctx.view), *returning_slices(ctx.cluster)]
        while len(healthy) < until and time.monotonic() < deadline:
            time.sleep(min(HEALTH_POLL_S, max(0.0, deadline - time.monotonic())))
            if isinstance(ctx.cluster, AbstractRejoinCluster):
                ctx.cluster.await_returns()
            healthy = [*ctx.hooks.et_slice_health(trainer=ctx.view), *returning_slices(ctx.cluster)]
    return sorted(set(healthy))


@contextlib.contextmanager
def ends_run_if_stopped(ctx: RunContext, index: int) -> Iterator[None]:
    """Mark failure ``index`` as the one that ended the run when :class:`TrainingStopped` is raised inside
    (a strategy gave up, too few slices, nothing to restore); a restart goes on in a new worker."""
    try:
        yield
    except RestartRequested:
        raise
    except TrainingStopped:
        ctx.failures.amend(index, ended_run=True)
        raise


def finish_recovery(ctx: RunContext, pending: PendingRecovery | None) -> None:
    """After the first productive step since a failure: its recovery time is known."""
    if pending is not None:
        ctx.failures.amend(pending.failure, recovery_s=time.time() - pending.failed_at)


# ---------------------------------------------------------------------- the trainer's recovery


def survive(ctx: TrainingContext, error: Exception, state: LoopState, *, phase: str) -> LoopState:
    """Recover from ``error`` raised in ``phase`` of the loop at ``state``; a failure while recovering starts over.

    Returns the state to go on from: whole, on the new layout, at the step
    restored (the trainer forgets the steps after it).
    """
    if isinstance(error, PluginError):
        raise error  # a plugin's bug, not the hardware's
    while True:
        try:
            recovered = recover(ctx, error, state, phase=phase)
            break
        except (TrainingStopped, PluginError):
            raise
        except Exception as again:  # noqa: BLE001 - classified like any other failure
            error, phase = again, "recovery"
    del error  # a failed attempt's traceback holds this frame: kept, it would hold the failed arrays in a cycle
    return recovered


def recover(ctx: TrainingContext, error: Exception, state: LoopState, *, phase: str) -> LoopState:
    """Classify the failure, let the strategy plan, carry the plan out, re-mesh and restore."""
    failure, index = classify(ctx, error, step=state.step, phase=phase, slices=state.layout.slices,
                              since=state.incarnations)
    with ends_run_if_stopped(ctx, index):
        return _recover_from(ctx, failure, index, error, state)


def _recover_from(ctx: TrainingContext, failure: Failure, index: int, error: Exception, state: LoopState) -> LoopState:
    """Everything after classifying failure ``index``: the plan, its waits, the new layout and the restore."""
    step, old = state.step, state.layout
    if ctx.checkpoints is not None:  # before anything waits for a save that lost processes were part of
        ctx.checkpoints.regroup(slices=old.slices, since=state.incarnations)
    if not failure.elastic:
        raise TrainingStopped(f"step {step + 1} failed with a fatal error: {error}") from error
    plan = choose_plan(ctx, failure)
    if plan is None:
        raise TrainingStopped(
            f"step {step + 1} failed ({failure.kind}) and no strategy is selected, so training stops "
            "the traditional way; select one with +strategy=NAME to keep training through failures."
        ) from error
    plan, healthy = carry_out(ctx, plan, index, error=error, restart=lambda: restart(ctx, index, state, error=error))
    chosen = with_spares(healthy, in_use=old.slices, limit=ctx.layouts.limit)  # spares past it stay out
    returning = [s for s in chosen if s in returning_slices(ctx.cluster)]  # taken back in once recovered
    healthy = list(without(chosen, returning))
    lost = lost_slices(ctx, old.slices, failure.slices, state.incarnations)  # more may have failed meanwhile
    gone = gone_slices(state, lost)
    arrays = state.arrays
    if isinstance(ctx.cluster, AbstractInjectableCluster):
        arrays = ctx.cluster.surviving(arrays, gone)  # what lived on lost slices is gone (where simulated)
    ctx.failures.amend(index, slices=lost)
    survivors = [s for s in old.slices if s not in gone] if state.whole else []
    begin = time.time()
    try:
        new = ctx.layouts.make(healthy, plan=plan)
    except ConfigError as bad_layout:
        raise TrainingStopped(f"{plan.action}: {bad_layout}") from error
    remesh_s = time.time() - begin - new.compile_s
    begin = time.time()
    arrays, source, restored_step, carried = restore(ctx, arrays, old, survivors, new, step=step,
                                                     consumed=state.consumed)
    record = ctx.failures.amend(
        index, compile_s=new.compile_s, compile_cached=new.compile_cached, remesh_s=remesh_s,
        restore_s=time.time() - begin, restored_from=source, lost_steps=step - restored_step,
        slices_after=len(new.slices), samples_skipped=skip_what_no_state_holds(ctx, carried, restored_step) or None,
    )
    ctx.layouts.record_resize(step, old, new, reason="failure", seconds=remesh_s + record.compile_s + record.restore_s)
    train = ctx.train_state(arrays)
    recovered = LoopState(
        arrays, new, step=int(train.step), position=int(train.data_position),
        incarnations=ctx.cluster.incarnations(), pending=PendingRecovery(index, record.failed_at),
        save_due=state.save_due and failure.phase == "update" and restored_step == step,  # committed, not saved yet
    )
    if returning:  # replacements of lost slices came back while the plan waited, or spares wait to be taken in
        recovered = take_back(ctx, recovered, chosen, returning)
        ctx.failures.amend(index, slices_after=len(recovered.layout.slices))
    if has_spares(ctx.cluster):  # which spares took the lost slices' places
        in_use = recovered.layout.slices
        ctx.failures.amend(index, spares_taken=tuple(s for s in in_use if s not in old.slices),
                           spares_left=len(ctx.layouts.spares(in_use)))
    return recovered


def gone_slices(state: LoopState, lost: Sequence[int]) -> tuple[int, ...]:
    """The slices of ``state``'s layout that hold nothing of it once ``lost`` are lost: those, or every one when
    the failed step had taken the state (``state.consumed``)."""
    return state.layout.slices if state.consumed else tuple(s for s in state.layout.slices if s in lost)


def restore(
    ctx: TrainingContext, arrays: PyTree, old: Layout, survivors: Sequence[int], new: Layout, *, step: int,
    consumed: bool = False,
) -> tuple[PyTree, RestoredFrom, int, tuple[int, ...] | None]:
    """The state on ``new``, from the first source of the restore policy that holds one (``_restore_sources.py``:
    a surviving replica, else the host snapshot, else the newest readable checkpoint; ``consumed``: the failed
    step had taken the state from every slice).

    Returns the arrays, where they came from, the step they hold, and the slices whose training they carry.
    """
    request = RestoreRequest(arrays, old, survivors, new, step=step, since=ctx.cluster.incarnations(),
                             consumed=consumed)  # the restore must not outlive a slice it writes to
    restored = restore_from_best(ctx, request)
    return restored.arrays, restored.source, restored.step, restored.carried


def skip_what_no_state_holds(ctx: TrainingContext, carried: Sequence[int] | None, step: int) -> int:
    """After a restore of step ``step`` that carries the training of the slices ``carried``: the other slices'
    samples since their last sync (:meth:`AbstractTrainingMode.unsynced_from`), before ``step``, are skipped, and
    their time is wasted progress. Nothing in a mode whose every slice holds the whole state. Returns the samples
    skipped."""
    if carried is None:
        return 0
    since = ctx.mode.unsynced_from(step)
    trained = {s for t, slices in ctx.history.slices.items() if since <= t < step for s in slices}
    return skip_training_of(ctx, sorted(trained - set(carried)), since=since, until=step, at=step - 1)


def skip_training_of(ctx: TrainingContext, slices: Sequence[int], *, since: int, until: int,
                     at: int) -> int:
    """The training of ``slices`` in the committed steps from ``since`` to ``until`` (excluded) is gone as of step
    ``at`` (:meth:`StepHistory.drop_slice`): their samples are skipped and their share of the steps' time is
    wasted progress. Returns the samples skipped."""
    skipped = 0
    for lost in slices:
        samples, seconds = ctx.history.drop_slice(lost, since=since, until=until, at=at)
        ctx.clock.reclassify_productive(seconds)
        skipped += samples
    return skipped


def restart(ctx: TrainingContext, index: int, state: LoopState, *, error: Exception) -> NoReturn:
    """Give up this process: the next worker restores the last complete checkpoint (:class:`RestartRequested`)."""
    record = ctx.failures[index]
    if ctx.checkpoints is None:
        raise TrainingStopped(f"{record.action}: a restart needs checkpoints; enable checkpoint.enabled.")
    with ctx.clock.measure("checkpoint_save"):
        if record.regrouped:
            lost = lost_slices(ctx, state.layout.slices, record.slices, state.incarnations)
            save_what_survives(ctx, state, lost=gone_slices(state, lost))
        ctx.checkpoints.checkpointer.wait()
    restored = ctx.checkpoints.checkpointer.latest_step() or 0
    ctx.failures.amend(index, restored_from="checkpoint" if restored else "none", lost_steps=state.step - restored)
    raise RestartRequested(
        f"step {state.step + 1} lost slice(s) {list(record.slices)}; restarting the worker from step {restored}.",
        resume_step=restored,
    ) from error


def save_what_survives(ctx: TrainingContext, state: LoopState, *, lost: Sequence[int]) -> None:
    """Before the group is re-formed, save the survivors' whole state of ``state.step`` as a checkpoint (committed
    on return), so that the new group goes on from the step the failure interrupted: no step is lost.

    Every surviving slice holds a full copy, so the state is re-assembled
    from their shards alone, on a mesh of them (the lost processes' shards
    are not read). Nothing is saved when no slice survived or the state is
    not whole yet (a resume's restore); a step saved already stands.
    """
    old = state.layout
    kept = [position for position, s in enumerate(old.slices) if s not in lost]
    if not kept or not state.whole:
        return
    arrays = keep_slices(state.arrays, old.mesh, kept)
    layout = dataclasses.replace(old, slices=tuple(old.slices[p] for p in kept),
                                 mesh=jax.tree.leaves(arrays)[0].sharding.mesh)  # the survivors' mesh
    survivors = dataclasses.replace(state, arrays=arrays, layout=layout, incarnations=ctx.cluster.incarnations())
    ctx.checkpoints.save(survivors, step_times_s=list(ctx.history.seconds.values()), failures=len(ctx.failures))
