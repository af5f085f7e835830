"""A run's checkpoints: saving with the cluster checked, discarding interrupted saves, regrouping, restoring."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from ._checkpointer import Checkpointer
from ._failed_writes import SaveEnded
from ._checksums import ChecksumMismatch
from ..clusters import AbstractMultiControllerCluster, SyncCall, release as release_slices
from .._failures import CheckpointWarning, ConfigError, SliceLostError, TrainingStopped
from .._records import LoopState, RunContext


def refuse_to_overwrite(checkpointer: Checkpointer) -> None:
    """Raise :class:`ConfigError` when the directory of a run that does not resume holds an earlier run's checkpoints."""
    latest = checkpointer.latest_step()
    if latest is not None:
        raise ConfigError(
            f"{checkpointer.directory} already holds checkpoints (newest: step {latest}); continue that "
            "run with checkpoint.resume=true, or choose another checkpoint.dir."
        )


def _first_line(error: BaseException) -> str:
    """``error`` in a few words: its type and the first line of its message (a runtime's runs over many)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


class NoReadableCheckpoint(Exception):
    """No checkpoint of the directory could be read; ``unreadable`` names those skipped, in words."""

    def __init__(self, skipped: list[tuple[int, str]]):
        super().__init__("no readable checkpoint")
        self.unreadable = f" (unreadable: {', '.join(f'step {s} ({why})' for s, why in skipped)})" if skipped else ""


class RunCheckpoints:
    """What a training run does with its :class:`Checkpointer`.

    A save that a lost slice interrupts is discarded, never committed; once
    processes are lost the live ones regroup to save without the dead; a
    restore (resume or recovery alike) takes the newest readable checkpoint
    of the same data order.

    A save that fails for I/O while every slice is fine is not a failure of
    the hardware: it is listed in :attr:`failed_saves`, named in one
    :class:`CheckpointWarning`, and training goes on (the earlier
    checkpoints are kept; the next save is tried at its period). The
    ``checkpointer.max_failed_saves``-th failed save in a row stops the run
    (:class:`TrainingStopped`).

    :param checkpointer: where the checkpoints go.
    :param run: the cluster (checked after each save: a slice lost meanwhile makes it void), the plugins'
        hooks, and the run's clock (its start dates the saves for ``period="auto"``).
    :param train_state: the train state (a :class:`~elastic_trainer.plugin.TrainState`) of a restored state's arrays,
        for ``et_after_restore``.
    :param data_order: what fixes the sample order (``seed``, ``num_samples``), checked on restore.
    :param run_metadata: more fields for each checkpoint's metadata.
    """

    def __init__(
        self, checkpointer: Checkpointer, run: RunContext, *, train_state: Callable[[PyTree], Any],
        data_order: dict[str, int], run_metadata: dict[str, Any],
    ):
        self.checkpointer = checkpointer
        self._cluster, self._hooks, self._view, self._clock = run.cluster, run.hooks, run.view, run.clock
        self._train_state = train_state
        self._data_order = data_order
        self._run_metadata = run_metadata
        self.failed_saves: list[SaveEnded] = []
        """The saves that failed for I/O, in the order their failures were found."""
        self._failed_in_a_row = 0

    def save(self, state: LoopState, *, step_times_s: list[float], failures: int) -> None:
        """Save ``state``; if a slice is lost meanwhile, the save is discarded and the failure raised.

        The save in flight before ends first, so that its failure is its own
        step's. Each process then does what it does alone, and the processes
        meet (the cluster's check) before the save's collectives start. Raises :class:`TrainingStopped`, without starting this save,
        when that failure is the ``max_failed_saves``-th in a row, and after
        it when this save fails at once and is.
        """
        began = time.time()
        step, slices = state.step, state.layout.slices
        metadata = {
            "step": step, "data_position": state.position, **self._data_order, **self._run_metadata,
            "slices": list(slices), "mesh": dict(state.layout.mesh.shape),
        }
        try:
            ended = [outcome for outcome in [self.checkpointer.wait()] if outcome is not None]
            if self._failures_in_a_row_after(ended) < self.checkpointer.max_failed_saves:
                self.checkpointer.prepare_save(state.arrays)
                self._cluster.synchronize(SyncCall.SAVE_START, slices, since=state.incarnations)  # all ready
                # last before Orbax: a failure injected here lands after the processes agreed on who lives, where
                # only the save's own barriers find it (bounded by cluster.barrier_timeout_s)
                self._hooks.et_before_checkpoint_save(trainer=self._view, step=step)
                ended += self.checkpointer.save(step, state.arrays, metadata)
        except Exception:
            try:
                self._cluster.synchronize(SyncCall.SAVE_END, slices, since=state.incarnations)  # a loss explains it
            finally:
                self.discard(step, slices=slices, since=state.incarnations)
            raise
        try:
            self._cluster.synchronize(SyncCall.SAVE_END, slices, since=state.incarnations)  # a loss voids the save
        except Exception:
            self.discard(step, slices=slices, since=state.incarnations)
            raise
        self._note(ended)
        if any(outcome.step == step and outcome.cause for outcome in ended):
            return  # this step's save failed at once: there is nothing of it to wait for
        self.checkpointer.schedule.saved(
            step, blocked_s=time.time() - began, step_times_s=step_times_s,
            elapsed_s=time.time() - self._clock.started_at, failures=failures,
        )
        self._hooks.et_after_checkpoint_save(trainer=self._view, step=step, directory=str(self.checkpointer.directory))

    def finish_saving(self, stopped: TrainingStopped | None) -> TrainingStopped | None:
        """At the end of the run: wait for the last save and note how it ended; ``stopped``, or the stop
        that a last failed save makes when it is the ``max_failed_saves``-th in a row."""
        outcome = self.checkpointer.wait()
        try:
            self._note([] if outcome is None else [outcome])
        except TrainingStopped as stop:
            return stopped or stop
        return stopped

    def _failures_in_a_row_after(self, ended: list[SaveEnded]) -> int:
        """How many saves in a row will have failed once the outcomes ``ended`` are counted (a commit ends a run)."""
        in_a_row = self._failed_in_a_row
        for outcome in ended:
            in_a_row = 0 if outcome.cause is None else in_a_row + 1
        return in_a_row

    def _note(self, ended: list[SaveEnded]) -> None:
        """Count the saves that ended: each failure is listed and warned about, and raises
        :class:`TrainingStopped` when it is the ``max_failed_saves``-th in a row."""
        limit = self.checkpointer.max_failed_saves
        for outcome in ended:
            self._failed_in_a_row = self._failures_in_a_row_after([outcome])
            if outcome.cause is None:
                continue
            self.failed_saves.append(outcome)
            if self._failed_in_a_row >= limit:
                newest = self.checkpointer.latest_step()
                raise TrainingStopped(
                    f"the checkpoint save of step {outcome.step} failed ({outcome.cause}), {self._failed_in_a_row} "
                    f"failed saves in a row (checkpoint.max_failed_saves={limit}); "
                    + ("no checkpoint was saved" if newest is None else f"the newest checkpoint, step {newest}, is intact")
                    + f"; free space in {self.checkpointer.directory} or fix its storage, then continue with "
                    "checkpoint.resume=true."
                )
            warnings.warn(
                f"the checkpoint save of step {outcome.step} failed ({outcome.cause}); training goes on, the next save "
                f"is tried at its period, and {limit} failed saves in a row stop the run (checkpoint.max_failed_saves).",
                CheckpointWarning,
                stacklevel=3,
            )

    def discard(self, step: int, *, slices: Sequence[int], since: tuple[int, ...]) -> None:
        """Make sure the save of ``step``, interrupted by a failure, never becomes a checkpoint."""
        self.regroup(slices=slices, since=since)
        self.checkpointer.discard(step)

    def release(self, dropped: Sequence[int], kept: Sequence[int]) -> None:
        """Let slices ``dropped`` go at a step boundary (:func:`~elastic_trainer.clusters.release`: their processes
        may leave the job), once the saves under way have committed; later saves go over the live processes of ``kept``."""
        stopped = self.finish_saving(None)  # a failed save is listed like any other
        if stopped is not None:
            raise stopped
        release_slices(self._cluster, dropped)
        self.regroup(slices=kept, since=self._cluster.incarnations())

    def regroup(self, *, slices: Sequence[int], since: tuple[int, ...]) -> None:
        """Once processes are lost, save over the live ones only (a multi-controller cluster's
        :meth:`~AbstractMultiControllerCluster.live_processes`).

        A cluster driven by one process never regroups, even when every slice is lost.
        A process that dies while the survivors form the group fails it (after
        the group's timeout); the processes then agree again on who lives, and
        that new loss is raised, to be recovered from like any other (the
        recovery regroups anew). Any other failure to form the group stands.
        """
        if not isinstance(self._cluster, AbstractMultiControllerCluster):
            return
        live = self._cluster.live_processes()
        try:
            self.checkpointer.save_over(live)
        except Exception as error:
            try:
                self._cluster.synchronize(SyncCall.CHECKPOINT_GROUP, slices, since=since)
            except SliceLostError as lost:
                if self._cluster.live_processes() < live:
                    raise lost from error
            raise

    def restore_newest(self, target: Callable[[list[int]], PyTree], *, slices: Sequence[int],
                       since: tuple[int, ...]) -> tuple[PyTree, int, list[int]]:
        """Restore the newest readable checkpoint onto ``target(its slices)``'s shapes and shardings: the arrays,
        their step and the slices they were saved on.

        Unreadable ones (truncated, corrupt) are skipped, and named in a
        warning once an older one was read; their files are left as they
        are. A read that fails because a slice was lost meanwhile is that
        failure, not damage: the cluster raises it. Raises :class:`NoReadableCheckpoint` when none is readable (the
        caller says what that means), :class:`ConfigError` for a checkpoint
        of another model or data order, and what the cluster raises when a
        slice of ``slices`` was lost meanwhile.
        """
        self._note([outcome for outcome in [self.checkpointer.wait()] if outcome is not None])  # Orbax lists a
        # save in flight among its steps before its folder is in place: reading it then finds no directory
        skipped = []
        for step in self.checkpointer.steps_newest_first():
            self._hooks.et_before_restore(trainer=self._view, step=step, source="checkpoint")
            try:
                saved_on = self.checkpointer.metadata(step)["slices"]
                arrays, metadata = self.checkpointer.restore(step, like=target(saved_on))
            except ConfigError:
                raise  # another model's checkpoint: the wrong directory or model, not damage
            except Exception as error:  # noqa: BLE001 - a truncated or corrupt checkpoint: try the one before
                self._cluster.synchronize(SyncCall.CHECKPOINT_RESTORE, slices, since=since)  # unless a loss explains it
                self.checkpointer.mark_unreadable(step)
                skipped.append((step, str(error) if isinstance(error, ChecksumMismatch) else _first_line(error)))
                continue
            self._check_same_data(step, metadata)
            jax.block_until_ready(arrays)
            for bad_step, why in skipped:
                warnings.warn(
                    f"the checkpoint of step {bad_step} in {self.checkpointer.directory} is unreadable "
                    f"({why}); skipping it for the one before.",
                    CheckpointWarning,
                    stacklevel=2,
                )
            self._cluster.synchronize(SyncCall.CHECKPOINT_RESTORE, slices, since=since)
            self._hooks.et_after_restore(
                trainer=self._view, step=step, source="checkpoint", state=self._train_state(arrays)
            )
            return arrays, step, saved_on
        raise NoReadableCheckpoint(skipped)

    def _check_same_data(self, step: int, metadata: dict[str, Any]) -> None:
        """Raise :class:`ConfigError` when the checkpoint was trained on another sample order than this run's."""
        for name, ours in self._data_order.items():
            theirs = metadata.get(name, ours)  # older checkpoints lack num_samples
            if theirs != ours:
                raise ConfigError(
                    f"the checkpoint of step {step} in {self.checkpointer.directory} was trained with {name}={theirs} "
                    f"and this run has {name}={ours}, which changes the order of the samples; resume with the same "
                    "seed and data, or choose another checkpoint.dir."
                )
