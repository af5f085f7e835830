"""The trainer: a flat step loop that calls hooks and never branches on a strategy.

What happens around the loop lives elsewhere: layouts in ``_layouts.py``,
checkpoints in ``checkpoints/_run_checkpoints.py``, host snapshots in ``_snapshots.py``,
and everything after a failure in ``_recovery.py`` (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import optax
import pluggy
from jax.sharding import Mesh
from jaxtyping import PyTree

from .checkpoints._checkpointer import Checkpointer
from .clusters import AbstractCluster, AbstractTimedCluster, SimulatedCluster, SyncCall, admission_of
from ._data import AbstractDataset
from ._failures import ConfigError, PluginError, RestartRequested, SliceLostError, StepInterrupted, TrainingStopped
from ._ledger import SampleLedger
from ._mesh import WithinSlice, put_on
from ._plugins import GuardedHooks, make_plugin_manager, registers_hooks, strategy_name
from ._preemption import Preempted, PreemptionWatch, stop_signals
from ._records import FailureLog, LoopState
from ._report import RunReport, run_report
from ._recovery import TrainingContext, finish_recovery, survive
from ._replica_drops import drop_replicas
from ._restore_sources import checkpoint_onto
from .checkpoints._run_checkpoints import NoReadableCheckpoint
from ._run_lock import hold_run_locks
from .config._settings import check_trainer_settings
from ._snapshots import DEFAULT_SNAPSHOT_PERIOD
from ._stragglers import StragglerRule
from ._state import TrainState
from ._step import LossFn
from ._step_cache import DEFAULT_MAX_LAYOUTS
from ._step_runner import StepResult
from ._run_start import start_run
from ._take_back import join
from ._watchdog import Watchdog


def _next_phase(state: LoopState) -> str:
    """What the loop does next: restore a checkpoint until the state is whole, save a step that is due, or train."""
    if not state.whole:
        return "checkpoint_restore"
    return "checkpoint_save" if state.save_due else "train_step"


def _let_the_save_in_flight_end(checkpointer: Checkpointer | None) -> None:
    """When an error ends ``fit`` before its end (a plugin's, a bad config's), let the save still committing end
    before the directory's lock goes: another run must not start on a checkpoint being written. One process
    alone: with several, its closing barrier waits for the others."""
    if checkpointer is not None and checkpointer.saving and jax.process_count() == 1:
        with contextlib.suppress(Exception):  # the error that ended the run is the one to raise
            checkpointer.wait()


def _preempted(checkpointer: Checkpointer | None, step: int, signum: int) -> Preempted:
    """What a stop signal ends the run with, once it stopped after step ``step``: where it goes on from."""
    name = signal.Signals(signum).name
    if checkpointer is None:
        return Preempted(f"stopped by {name} after step {step}, with no checkpoint (checkpoints are off).",
                         signum=signum)
    latest = checkpointer.latest_step()
    where = (f"saved as a checkpoint in {checkpointer.directory}" if latest == step else
             f"whose save failed, so a resume goes on from {f'step {latest}' if latest else 'the start'}")
    return Preempted(f"stopped by {name} after step {step}, {where}; continue with "
                     "checkpoint.resume=true.", signum=signum)


def _directory_locks(trainer: Trainer) -> contextlib.AbstractContextManager:
    """The locks of the checkpoint directory and the run directory, taken by process 0 (with a
    checkpointer, JAX has started: it knows which process this is)."""
    if trainer.checkpointer is None or jax.process_index() != 0:
        return contextlib.nullcontext()
    directories = [(trainer.checkpointer.directory, "the checkpoint directory")]
    return hold_run_locks(directories + ([(trainer.run_dir, "run_dir")] if trainer.run_dir else []), for_job=False)


def _commit(trainer: Trainer, state: LoopState, done: StepResult, *, interrupted: bool) -> LoopState:
    """Commit step ``state.step`` (its samples and loss are in the history already): the loop's state after it,
    on ``state``'s layout.

    After an ``interrupted`` update (a split step's, on a runtime whose
    processes each ran their own part) the state is whole on the live
    processes only: the per-step work that reads every slice (straggler
    times, compiling ahead, the host snapshot) waits for the recovery.
    """
    ctx, step, layout = trainer._ctx, state.step, state.layout
    finish_recovery(ctx, state.pending)
    ctx.history.note_first_step(ctx.clock)
    save_due = (ctx.checkpoints is not None
                and ctx.checkpoints.checkpointer.schedule.due(step + 1, last_step=trainer.steps))
    committed = LoopState(done.arrays, layout, step=step + 1, position=state.position + len(done.ids),
                          incarnations=state.incarnations, save_due=save_due, at_boundary=not save_due)
    trainer.hook.et_step_end(trainer=trainer, step=step + 1, metrics=done.metrics)
    if not interrupted:
        timed = isinstance(trainer.cluster, AbstractTimedCluster)
        ctx.stragglers.observe(step + 1, done.slice_seconds or (trainer.cluster.slice_step_seconds() if timed else {}))
        ctx.layouts.compile_likely(layout)  # once per layout: for a new one (a recovery's, a resize's), now
        ctx.snapshots.take(step + 1, done.leaves, slices=layout.slices)
    return committed


def _forget_from(ctx: TrainingContext, step: int) -> None:
    """Forget the steps from ``step`` on, which the state no longer holds: their samples, losses, and their time
    as goodput."""
    ctx.clock.reclassify_productive(ctx.history.roll_back(step))


def _recovered(ctx: TrainingContext, failed: LoopState, error: Exception, phase: str) -> LoopState:
    """Survive ``error`` raised in ``phase`` at ``failed``: the state to go on from, the history rolled back to it."""
    recovered = survive(ctx, error, failed, phase=phase)
    if not failed.whole:  # nothing was trained here yet (a resume): the run's samples count from the state restored
        ctx.history.resume_at(recovered.step, recovered.position)
    _forget_from(ctx, recovered.step)
    return recovered


class PhaseEnd(NamedTuple):
    """How a phase of the loop ended: the loop's state after it, and the failure that goes to recovery from that
    state (with the phase it failed in), if any."""

    state: LoopState
    failure: Exception | None = None
    phase: str = ""


def _recovery_start(state: LoopState, error: Exception, phase: str) -> PhaseEnd:
    """What recovery starts from when ``error`` ended ``phase`` at ``state``: a step that had taken the state
    from every slice (:class:`StepInterrupted`) left it to none."""
    if isinstance(error, StepInterrupted):
        return PhaseEnd(dataclasses.replace(state, consumed=True), error.error, error.phase or phase)
    return PhaseEnd(state, error, phase)


class FitResult(NamedTuple):
    """What :meth:`Trainer.fit` returns: the final train state and the run report."""

    state: TrainState
    report: RunReport


class Trainer:
    """Trains an Equinox model data-parallel over a cluster's slices.

    :param model: the ``eqx.Module`` to train.
    :param loss_fn: ``loss_fn(model, batch, *, key) -> scalar``, or ``-> (scalar, aux)`` with ``has_aux``.
    :param optimizer: an optax gradient transformation.
    :param data: the dataset; batches are drawn by :func:`sample_ids`.
    :param steps: train until this many steps are completed.
    :param global_batch_size: samples per step over all devices.
    :param cluster: where to run; 4 simulated slices of 2 CPU devices by default.
    :param seed: seeds the data order and the per-step keys.
    :param within_slice: ``"replicated"`` or ``"sharded"`` state within a slice.
    :param snapshot_period: copy the state to host memory every this many
        steps, to restore from when no slice survives (0: never).
    :param step_timeout_s: a step that takes longer is a failure (a hung
        slice), classified and recovered like a lost one (0: no limit).
    :param plugins: extra plugins, registered after the built-in ones.
    :param plugin_manager: use this manager instead of building one.
    :param strategy: the recovery strategy, a plugin implementing
        ``et_choose_recovery``; with none, a failure stops training.
    :param checkpointer: saves the state every ``checkpointer.schedule.period`` steps and
        at the end; no checkpoints if ``None``.
    :param resume: continue from the checkpointer's latest complete checkpoint
        (an error if there is none).
    :param run_dir: where plugins write files (``report.json``); none if ``None``.
    :param started_at: when the wall clock starts (``time.time()``); the call
        to :meth:`fit` if ``None``.
    :param max_cached_layouts: keep the compiled steps of at most this many
        layouts (least recently used out first; never the one in use), so that
        a long run through many resizes does not grow without bound.
    :param preemption_signal: a signal that stops training like SIGTERM and
        Ctrl-C do (``"SIGUSR1"``): at the next step boundary, with a checkpoint
        of the last committed step (:class:`~elastic_trainer.Preempted`).
    :param straggler_rule: when a slice slower than the others is a straggler (:attr:`stragglers`).
    :param has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` a dict of scalars (accuracy, perplexity, ...)
        computed over the batch like the loss (as ``jax.value_and_grad(..., has_aux=True)`` takes it); they
        reach the progress line, :class:`~elastic_trainer.RunReport`'s ``history`` and the metrics loggers.

    With a checkpointer, :meth:`fit` holds the lock of the checkpoint
    directory and of ``run_dir`` for the run's life (process 0 of several),
    unless the job that started this process holds them: another run on
    either is refused with :class:`~elastic_trainer.RunLockedError`.
    """

    def __init__(
        self,
        *,
        model: PyTree,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        data: AbstractDataset,
        steps: int,
        global_batch_size: int,
        cluster: AbstractCluster | None = None,
        seed: int = 0,
        within_slice: WithinSlice = "replicated",
        snapshot_period: int = DEFAULT_SNAPSHOT_PERIOD,
        step_timeout_s: float = 300.0,
        plugins: Iterable[object] = (),
        plugin_manager: pluggy.PluginManager | None = None,
        strategy: object | None = None,
        checkpointer: Checkpointer | None = None,
        resume: bool = False,
        run_dir: str | Path | None = None,
        started_at: float | None = None,
        preemption_signal: str | int | None = None,
        max_cached_layouts: int = DEFAULT_MAX_LAYOUTS,
        straggler_rule: StragglerRule = StragglerRule(),
        has_aux: bool = False,
    ):
        check_trainer_settings(steps=steps, global_batch_size=global_batch_size, snapshot_period=snapshot_period,
                               step_timeout_s=step_timeout_s, within_slice=within_slice,
                               max_cached_layouts=max_cached_layouts)
        if resume and checkpointer is None:
            raise ConfigError("resuming needs a checkpointer; pass checkpointer= (checkpoint.dir from the CLI).")
        self.cluster = SimulatedCluster() if cluster is None else cluster
        self.model, self.loss_fn, self.optimizer, self.data = model, loss_fn, optimizer, data
        self.has_aux = has_aux
        self.steps, self.global_batch_size, self.seed = steps, global_batch_size, seed
        self.within_slice, self.snapshot_period = within_slice, snapshot_period
        self.max_cached_layouts, self.straggler_rule = max_cached_layouts, straggler_rule
        self.checkpointer, self.resume = checkpointer, resume
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.started_at = started_at
        self.stop_signals = stop_signals(preemption_signal)
        self.plugin_manager = make_plugin_manager(plugins) if plugin_manager is None else plugin_manager
        self.strategy = strategy
        if strategy is not None:
            self.plugin_manager.register(strategy, name=f"strategy:{strategy_name(strategy)}")
        if registers_hooks(self.plugin_manager, cluster):  # a cluster may steer (pathways classifies its errors)
            self.plugin_manager.register(cluster, name=f"cluster:{cluster.kind}")
        self._hooks = GuardedHooks(self.plugin_manager)
        self._watchdog = Watchdog(step_timeout_s)
        self._failures = FailureLog()
        self._ctx: TrainingContext | None = None  # the run's collaborators, once fit starts
        self._state: LoopState | None = None  # the loop's state as hooks see it: its layout is the one in use

    @property
    def hook(self) -> GuardedHooks:
        """The plugin manager's hooks; call them with keyword arguments. An
        observer hook that raises stops training with a :class:`PluginError` naming the plugin."""
        return self._hooks

    @property
    def slices(self) -> tuple[int, ...]:
        """The slices of the layout in use (none before :meth:`fit`)."""
        return self._state.layout.slices if self._state else ()

    @property
    def mesh(self) -> Mesh | None:
        """The mesh of the layout in use (``None`` before :meth:`fit`)."""
        return self._state.layout.mesh if self._state else None

    @property
    def stragglers(self) -> frozenset[int]:
        """The slices found slower than the others and not recovered since (none before :meth:`fit`)."""
        return self._ctx.stragglers.current if self._ctx else frozenset()

    @property
    def ledger(self) -> SampleLedger | None:
        """The samples of the committed steps, once :meth:`fit` started."""
        return self._ctx.history.ledger if self._ctx else None

    @property
    def mode_state(self) -> PyTree | None:
        """The training mode's state (arrays only) as of the last committed step, once :meth:`fit` returned: the
        train state's arrays unless the mode keeps more (docs/plugins.md, "A mode with a state of its own")."""
        return self._state.arrays if self._state else None

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The failures so far, as the report lists them."""
        return self._failures.to_json()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> FitResult:
        """Train until ``steps`` steps are completed; returns the state and report.

        Raises :class:`TrainingStopped` (with the report attached) when a failure
        stops training before the last step, and :class:`Preempted` when a stop
        signal did (SIGTERM, Ctrl-C, ``preemption_signal``), once the last
        committed step is saved.
        """
        with _directory_locks(self), PreemptionWatch(self.stop_signals) as preemption:
            try:
                return self._fit(preemption)
            except BaseException:
                _let_the_save_in_flight_end(self.checkpointer)
                raise

    def _fit(self, preemption: PreemptionWatch) -> FitResult:
        state = self._start()
        phases = {"checkpoint_restore": self._resume, "train_step": self._train, "checkpoint_save": self._save}
        stopped: TrainingStopped | None = None
        forced_save = False
        try:
            while not state.whole or state.save_due or state.step < self.steps:
                self._state = state
                if state.at_boundary and preemption.stops_at(state.step):
                    if not self._save_before_stopping(state.step) or forced_save:
                        raise _preempted(self.checkpointer, state.step, preemption.signum)
                    state, forced_save = dataclasses.replace(state, save_due=True, at_boundary=False), True
                if state.at_boundary and state.step < self.steps:
                    state = self._state = self._ctx.layouts.maybe_resize(state)  # the hooks see the slices in use
                phase = _next_phase(state)
                try:
                    end = phases[phase](state)
                except (ConfigError, PluginError, TrainingStopped):
                    raise
                except Exception as error:  # noqa: BLE001 - the one place where a failure enters recovery
                    end = _recovery_start(state, error, phase)
                state = end.state
                if end.failure is not None:
                    state = _recovered(self._ctx, state, end.failure, end.phase)
        except TrainingStopped as stop:
            stopped = stop
            if isinstance(stop, RestartRequested):  # the state goes back to the last checkpoint
                _forget_from(self._ctx, stop.resume_step)
                state = dataclasses.replace(state, step=stop.resume_step, position=self.ledger.end_position())
        return _finish(self, state, stopped)

    def _save_before_stopping(self, step: int) -> bool:
        """Whether step ``step`` must be saved before a stop signal ends the run (it is not a committed
        checkpoint yet, once the saves under way have committed)."""
        if self.checkpointer is None:
            return False
        with self._ctx.clock.measure("checkpoint_save"):
            self._ctx.checkpoints.finish_saving(None)  # a failed save is listed; the signal stops the run anyway
        return step not in self.checkpointer.steps_newest_first()

    def _start(self) -> LoopState:
        """Start JAX, build the run's collaborators and the first layout; the loop's first state."""
        self._ctx, arrays = start_run(self, watchdog=self._watchdog, failures=self._failures)
        ctx, clock = self._ctx, self._ctx.clock
        incarnations, joined = self.cluster.incarnations(), admission_of(self.cluster)  # as of the state in hand
        layout = ctx.layouts.make(joined.slices if joined else range(ctx.layouts.limit), at_start=True)
        with clock.measure("startup"):
            arrays = put_on(arrays, layout.shardings)
        if joined:  # a replacement: the state comes from the live processes
            self._state = join(ctx, arrays, layout, joined)
            ctx.history.start_at(self._state.position)
        else:
            with clock.measure("startup"):
                self.cluster.synchronize(SyncCall.RUN_START, layout.slices, since=incarnations)  # all ready
                if not self.resume:  # the first snapshot: a step that fails before the first period ends starts over
                    ctx.snapshots.take(0, jax.tree.leaves(arrays), slices=layout.slices)
            resume_from = self.checkpointer.latest_step() if self.resume else None
            self._state = LoopState(arrays, layout, step=resume_from or 0, position=0, incarnations=incarnations,
                                    whole=not self.resume)
        with clock.measure("startup"):
            ctx.layouts.compile_likely(layout)
        return self._state

    def _train(self, state: LoopState) -> PhaseEnd:
        """Run step ``state.step`` and commit it: the state after it.

        When the update of a split step fails elsewhere, the step is committed
        all the same (the processes that live hold it), and the failure goes to
        recovery from there (phase ``update``). Slices the step went on without
        (a semi-synchronous mode's, each with a replica of its own) are dropped
        with no recovery (``_replica_drops.py``); then the mode's boundary work
        runs where it is due (its outer step), over the slices left.
        """
        ctx = self._ctx
        self.hook.et_step_start(trainer=self, step=state.step)
        began, failure = time.time(), None
        with ctx.clock.measure("productive", on_error="wasted_progress"):
            try:
                done = ctx.runner.run(state.layout, state.arrays, state.position, step=state.step,
                                      since=state.incarnations, prepare_next=state.step + 1 < self.steps)
            except StepInterrupted as interrupted:
                if interrupted.leaves is None:  # no slice holds the state: the step is lost
                    raise
                done = ctx.runner.result_of(interrupted)
                failure = interrupted.error
            ctx.history.commit(state.step, done.ids, done.metrics, slices=state.layout.slices)
        ctx.history.time_step(state.step, time.time() - began)
        try:
            if done.dropped:
                dropped = list(done.dropped)
                state, done = drop_replicas(ctx, state, done, done.dropped[dropped[0]], dropped, phase="train_step")
                self._state = state  # the slices in use, for the hooks from here on
            state, done = self._boundary(state, done)
            began = time.time()
            with ctx.clock.measure("productive", on_error="wasted_progress"):
                committed = _commit(self, state, done, interrupted=failure is not None)
        except BaseException:  # the step is not committed after all: its samples and its time are not the run's
            ctx.clock.reclassify_productive(ctx.history.roll_back(state.step))
            raise
        ctx.history.time_step(state.step, time.time() - began)  # the step's time: its run, boundary and commit
        return PhaseEnd(committed, failure, "update")

    def _boundary(self, state: LoopState, done: StepResult) -> tuple[LoopState, StepResult]:
        """Run the mode's boundary work after step ``state.step`` where it is due; a slice lost while it runs is
        dropped, and it runs again over the others (its inputs are whole: it does not donate them)."""
        ctx = self._ctx
        while ctx.mode.boundary_due(state.step + 1, steps=self.steps):
            began = time.time()
            try:
                with ctx.clock.measure("productive", on_error="wasted_progress"):
                    done = ctx.runner.boundary(state.layout, done, step=state.step, since=state.incarnations)
                ctx.history.time_step(state.step, time.time() - began)
                return state, done
            except SliceLostError as lost:
                state, done = drop_replicas(ctx, state, done, lost, lost.slices, phase="boundary")
                self._state = state
            except Exception as error:  # noqa: BLE001 - the step took the state before it: none is whole now
                raise StepInterrupted(error, leaves=None, metrics=None, phase="boundary") from error
        return state, done

    def _save(self, state: LoopState) -> PhaseEnd:
        """Save ``state`` as a checkpoint of its step (it is due)."""
        with self._ctx.clock.measure("checkpoint_save"):
            self._ctx.checkpoints.save(state, step_times_s=list(self._ctx.history.seconds.values()),
                                       failures=len(self._failures))
        return PhaseEnd(dataclasses.replace(state, save_due=False, at_boundary=True))

    def _resume(self, state: LoopState) -> PhaseEnd:
        """Restore the newest readable checkpoint; a slice lost meanwhile is recovered from like any failure."""
        ctx = self._ctx
        try:
            with ctx.clock.measure("checkpoint_restore"):
                arrays, step, _ = checkpoint_onto(ctx, state.layout, since=state.incarnations)
        except NoReadableCheckpoint as none:
            raise ConfigError(
                f"checkpoint.resume is set but {self.checkpointer.directory} holds no complete, readable checkpoint"
                f"{none.unreadable}; point checkpoint.dir at a run's checkpoints, or drop checkpoint.resume to "
                "start afresh."
            ) from None
        position = int(ctx.train_state(arrays).data_position)
        ctx.history.resume_at(step, position)
        return PhaseEnd(dataclasses.replace(state, arrays=arrays, step=step, position=position,
                                            whole=True))


def _finish(trainer: Trainer, state: LoopState, stopped: TrainingStopped | None) -> FitResult:
    """Wait for the last save, write the report (``et_run_end``); the result, or ``stopped`` raised."""
    ctx, trainer._state = trainer._ctx, state
    if ctx.checkpoints is not None:
        with ctx.clock.measure("checkpoint_save"):
            stopped = ctx.checkpoints.finish_saving(stopped)
    ctx.clock.stop()
    ctx.step_cache.close()
    report = run_report(trainer, ctx, state, stopped=None if stopped is None else str(stopped))
    trainer.hook.et_run_end(trainer=trainer, report=report)
    if stopped is not None:
        stopped.report = report
        raise stopped
    return FitResult(ctx.train_state(state.arrays), report)
