"""Checkpoints of the train state, stored by Orbax."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Literal

from etils import epath

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jaxtyping import PyTree

from .._private_apis import end_background_writes, end_save_writes
from ._failed_writes import FailedSaves, SaveEnded, log_closed_loop_noise, move_aside
from ._checksums import CHECKSUMS_KEY, checksums, compile_checksums, verify_checksums
from .._failures import ConfigError
from ._group_barrier import GroupBarrier, hide_given_up_saves
from ..clusters.multicontroller._rejoin import Admission
from ._save_schedule import SaveSchedule
from ._storage import checkpoint_path, is_object_store
from ._orbax_handler import state_handler
from ..config._settings import check_checkpoint_settings

FIRST_SAVE_TIMEOUT_S = 300
"""How long every process waits for the others to be ready for the job's first save (some may still be compiling)."""


def orbax_manager(
    directory: epath.Path, *, max_to_keep: int, async_save: bool, active_processes: set[int] | None,
    barrier: GroupBarrier | None,
) -> ocp.CheckpointManager:
    """An Orbax manager of ``directory`` whose saves synchronize ``active_processes`` (``None``: every process
    of the job, with Orbax's own barriers).

    ``barrier`` (with several processes) ends each asynchronous save instead of Orbax's own.
    """
    multiprocessing = ocp.options.MultiprocessingOptions()
    if active_processes is not None:
        multiprocessing = ocp.options.MultiprocessingOptions(
            primary_host=min(active_processes),
            active_processes=set(active_processes),
            barrier_sync_key_prefix=barrier.name if barrier is not None else None,
        )
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=active_processes is None,  # Orbax refuses to create it for a group; it exists by now
            multiprocessing_options=multiprocessing,
            async_options=None if barrier is None else ocp.options.AsyncOptions(barrier_sync_fn=barrier),
        ),
        item_handlers={
            "state": state_handler(multiprocessing),
            "metadata": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
        },
    )


class Checkpointer:
    """Saves and restores a train state's arrays, plus JSON metadata, with Orbax.

    Orbax's save decision policies choose the steps to save (:attr:`schedule`):
    a multiple of ``period`` (or by the Young/Daly rule), and the run's last.
    Saves are asynchronous by
    default: the step loop waits only while the arrays are copied off the
    devices, and Orbax commits the files in the background. A restore targets
    abstract arrays with the current shardings, so a checkpoint loads onto
    any mesh.

    Every save keeps each array's checksum (:mod:`._checksums`, computed on
    the devices) in the JSON metadata, and every restore verifies them: an
    array whose bits changed on disk raises :class:`ChecksumMismatch`.
    Checkpoints saved before checksums existed restore unverified.

    A save that fails for I/O (a full disk, EIO, lost permissions) does not
    raise: :meth:`save` and :meth:`wait` return how each save ended
    (:class:`SaveEnded`), an asynchronous failure attributed to the step
    whose save failed, and the failed step's temporary folder is removed.
    What to do about it (``max_failed_saves``) is the caller's.

    In a job of several JAX processes every save is written by all of them together. Once processes are lost,
    :meth:`save_over` makes the live ones a group of their own (an Orbax manager with ``active_processes``), so
    that saves go on without the dead; a save that a loss interrupts never commits.

    The directory must be a writable directory (it is created if missing), or a ``gs://BUCKET/PATH`` URL of a
    bucket that exists (Orbax writes there through tensorstore and etils' ``epath``), or the constructor raises
    :class:`ConfigError`. A checkpoint found unreadable is marked with :meth:`mark_unreadable`: it is no longer
    listed, and it is never deleted or overwritten (a save of its step first moves it aside, to
    ``<step>.unreadable``).

    :param directory: where the checkpoints go (one folder per step): a local directory or ``gs://BUCKET/PATH``.
    :param period: save every this many steps, or ``"auto"``.
    :param max_to_keep: keep at most this many checkpoints; older ones are deleted.
    :param async_save: commit in the background.
    :param mtbf_s: for ``period="auto"``: the expected seconds between
        failures, or ``None`` for the rate observed in the run.
    :param max_failed_saves: a run stops when this many saves in a row failed for I/O.
    :param admission: in a replacement process, how the job took it in (``cluster.admission``): it saves alone,
        in the job's next checkpoint group, until the trainer makes it one of the group again.
    :param processes: the processes that save together from the start, when not every process of the job (a job
        whose spare processes hold no part of the state): a group of their own, as after :meth:`save_over`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        period: int | Literal["auto"] = 100,
        max_to_keep: int = 3,
        async_save: bool = True,
        mtbf_s: float | None = None,
        max_failed_saves: int = 3,
        admission: Admission | None = None,
        processes: Collection[int] | None = None,
    ):
        check_checkpoint_settings(period=period, max_to_keep=max_to_keep, mtbf_s=mtbf_s,
                                  max_failed_saves=max_failed_saves)
        self.directory = checkpoint_path(directory)
        """Where the checkpoints go: an absolute local path, or a ``gs://`` URL (an ``etils.epath.Path``)."""
        _check_directory(self.directory)
        self.schedule = SaveSchedule(period, mtbf_s)
        """Which steps to save (:meth:`SaveSchedule.due`), re-planned after each save (:meth:`SaveSchedule.saved`)."""
        self._unreadable: set[int] = set()
        self._max_to_keep = max_to_keep
        self._async_save = async_save
        self.max_failed_saves = max_failed_saves
        self._in_flight: int | None = None  # the step whose asynchronous save may still be committing
        self._failed_saves = FailedSaves(self.directory)
        self.groups = admission.checkpoint_group - 1 if admission else 0  # a replacement saves alone at first
        """How many times the processes regrouped (each group's barriers are named after it)."""
        grouped = admission is not None or processes is not None
        self.processes = frozenset([jax.process_index()] if admission else processes or range(jax.process_count()))
        """The processes that save together: every process of the job (or ``processes``), until :meth:`save_over`."""
        self._barrier = self._group_barrier(self.processes)
        self.manager = self._manager(active_processes=set(self.processes) if grouped else None, barrier=self._barrier)
        if self._barrier is not None and not grouped:
            self._compile_orbax_barrier()
        log_closed_loop_noise()

    def _compile_orbax_barrier(self) -> None:
        """Compile, and pass once, the collective that Orbax's barriers over every process are (JAX's
        ``sync_global_devices``, an all-gather), with every process ready first.

        Compiled at the first save instead, it would start in one process
        while another still compiles it (on a busy machine, after more than
        ``cluster.collective_timeout_s``) and fail the save with every process
        alive.
        """
        self._barrier(key="orbax-barrier", timeout_ms=FIRST_SAVE_TIMEOUT_S * 1000)
        multihost_utils.sync_global_devices("elastic_trainer/checkpointer")

    def _manager(self, *, active_processes: set[int] | None, barrier: GroupBarrier | None) -> ocp.CheckpointManager:
        """:func:`orbax_manager` of this checkpointer's directory and options."""
        return orbax_manager(self.directory, max_to_keep=self._max_to_keep, async_save=self._async_save,
                             active_processes=active_processes, barrier=barrier)

    def _group_barrier(self, processes: frozenset[int]) -> GroupBarrier | None:
        """A barrier over ``processes``, named anew for each group (Orbax's barrier names repeat at every
        save, and the old group's may never have completed); ``None`` for a group of one process."""
        if len(processes) == 1:
            return None
        return GroupBarrier(processes, name=f"elastic_trainer_group{self.groups}")

    def save_over(self, processes: Collection[int]) -> None:
        """Save over ``processes`` only from now on: the live processes of a job that lost some.

        Every process in ``processes`` must call this, with the same set, at
        the same point of its loop (after the processes agreed on who lives).
        A save still being committed is given up: its closing barrier waits
        for processes that may be dead, so it fails at once, and its step
        becomes a checkpoint only if every process had written its part
        already. The survivors then go on with an Orbax manager over
        ``processes`` (``MultiprocessingOptions.active_processes``) whose
        barriers have new names. Nothing happens when ``processes`` are the
        group already. A process left out holds no part of the state: it
        saves nothing from then on.
        """
        processes = frozenset(processes)
        if processes == self.processes:
            return
        if self._barrier is not None:
            hide_given_up_saves()
            self._barrier.abort()
        try:
            self.manager.close()  # waits until the given-up save has ended
        except Exception:  # noqa: BLE001 - the given-up save failed; it committed nothing
            pass
        self._in_flight = None  # given up: it committed or not, as the manager's steps now say
        self.groups += 1
        barrier = self._group_barrier(processes)
        if barrier is not None and jax.process_index() in processes:
            # every member's old save has ended (committed or not) before any member lists the steps
            # as long as Orbax's own barriers wait (cluster.barrier_timeout_s on cluster=multiprocess)
            barrier(key="regrouped", timeout_ms=ocp.multihost.coordination_timeout() * 1000)
        self.processes, self._barrier = processes, barrier
        if self._saves_here():
            self.manager = self._manager(active_processes=set(processes), barrier=barrier)

    def _saves_here(self) -> bool:
        """Whether this process takes part in saves (it is in the group)."""
        return jax.process_index() in self.processes

    def describe(self) -> dict[str, Any]:
        """The directory and period, for the report; an automatic period says what it chose and why."""
        return {"dir": str(self.directory), **self.schedule.describe()}

    def prepare_save(self, arrays: PyTree) -> None:
        """Everything of a save of ``arrays`` that a process does on its own (compiling the checksums), so that
        a barrier between this and :meth:`save` lets every process start the save's collectives together."""
        if self._saves_here():
            compile_checksums(arrays)

    def save(self, step: int, arrays: PyTree, metadata: dict[str, Any]) -> list[SaveEnded]:
        """Start saving ``arrays`` and ``metadata`` (with the arrays' checksums) as step ``step``.

        Returns how the saves that ended meanwhile ended: the one in flight
        before (Orbax lets it end first), and this one if it already
        committed (a synchronous save) or failed for I/O. Other errors are raised.
        """
        if not self._saves_here():
            return []
        ended = [outcome for outcome in [self.wait()] if outcome is not None]
        if step in self.manager.all_steps() and step not in self._unreadable:
            return ended  # re-reached after a roll-back (to an older snapshot): the checkpoint committed for it stands
        metadata = {**metadata, CHECKSUMS_KEY: checksums(arrays)}
        if len(self.processes) == 1 and jax.process_count() > 1:
            # Orbax refuses a jax.Array that one process of several holds whole ("host local"); this process
            # is the group, so its arrays are written as the numpy arrays they are (restored the same way)
            arrays = jax.tree.map(np.asarray, arrays)
        try:
            if step in self._unreadable:
                move_aside(self.directory, step)
                self.manager.reload()
                self._unreadable.discard(step)
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(arrays), metadata=ocp.args.JsonSave(metadata)),
                force=True,
            )
        except Exception as error:
            return [*ended, self._failed_saves.add(step, error, primary=self._primary())]
        if self._async_save:
            self._in_flight = step
        else:
            ended.append(SaveEnded(step, time.time()))
        return ended

    def _primary(self) -> bool:
        """Whether this process is Orbax's primary host, which owns the checkpoint folders."""
        return jax.process_index() == min(self.processes)

    def discard(self, step: int) -> None:
        """Make sure the save of ``step`` never becomes restorable: let it end, then delete it.

        Orbax commits a step only when its save finished, but a save that
        finished while a slice was lost may hold bad data, so it goes too.
        Later saves are unaffected. After a loss of processes, call
        :meth:`save_over` first: the old group's save may wait for the dead.
        """
        if not self._saves_here():
            return
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - a failed save committed nothing; the failure is handled by the caller
            pass
        if step in self.manager.all_steps():
            self.manager.delete(step)

    def steps_newest_first(self) -> list[int]:
        """Every committed step not marked unreadable, newest first."""
        return sorted((s for s in self.manager.all_steps() if s not in self._unreadable), reverse=True)

    def latest_step(self) -> int | None:
        """The newest step that Orbax committed and that is not marked unreadable, or ``None``."""
        steps = self.steps_newest_first()
        return steps[0] if steps else None

    def mark_unreadable(self, step: int) -> None:
        """Stop offering step ``step`` for restores; its files stay as they are."""
        self._unreadable.add(step)

    def metadata(self, step: int) -> dict[str, Any]:
        """The metadata saved with step ``step``, read alone (no array is)."""
        with self._restoring_manager() as manager:
            return manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata

    def restore(self, step: int, like: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Load step ``step`` into arrays shaped and sharded like ``like``; returns them and the metadata.

        Raises :class:`ConfigError` when the checkpoint holds another model's
        state (other arrays, shapes or dtypes), before reading any array, and
        :class:`ChecksumMismatch` when an array read differs from the one saved.
        """
        _check_same_state(self.manager, self.directory, step, like)
        compile_checksums(like)  # before Orbax's closing barrier, so that the processes verify together
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
        state = ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        with self._restoring_manager() as manager:
            restored = manager.restore(step, args=ocp.args.Composite(state=state, metadata=ocp.args.JsonRestore()))
        verify_checksums(restored.state, restored.metadata.get(CHECKSUMS_KEY))
        return restored.state, restored.metadata

    @contextlib.contextmanager
    def _restoring_manager(self) -> Iterator[ocp.CheckpointManager]:
        """The manager a restore goes through: :attr:`manager`, except over every process of a job.

        There Orbax's barriers are all-gathers (``sync_global_devices``), and
        the one that closes a restore is reached by each process once it has
        read its shards: one that read later than the collective timeout
        failed it (measured: 3 of 5 restores of a re-formed group of 3
        processes failed, "Gloo AllGather failed: Timed out waiting 2000ms",
        and every checkpoint looked unreadable). A restore goes through a
        manager of the same processes whose barriers meet in the coordination
        service instead, bounded by ``cluster.barrier_timeout_s``. Saves keep
        the all-gather: the processes meet before it, and it fails at once
        when a process dies during the save.
        """
        if self._barrier is None or self.groups:  # one process, or a group: barriers in the service already
            yield self.manager
            return
        manager = self._manager(active_processes=set(self.processes), barrier=self._barrier)
        try:
            yield manager
        finally:
            manager.close()

    @property
    def saving(self) -> bool:
        """Whether an asynchronous save may still be committing (:meth:`wait` ends it)."""
        return self._in_flight is not None

    def wait(self) -> SaveEnded | None:
        """Block until the save in flight has ended; how it ended, or ``None`` when none was in flight.

        A failure for I/O is returned (its temporary folder removed); other errors are raised.
        """
        step, self._in_flight = self._in_flight, None
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            if step is None:
                raise
            end_background_writes(self.manager)
            return self._failed_saves.add(step, error, primary=self._primary(),
                                          end_writes=lambda: end_save_writes(self.manager))
        self._failed_saves.remove_leftovers(primary=self._primary())
        return None if step is None else SaveEnded(step, time.time())

    def close(self) -> None:
        """Finish pending saves and release Orbax's resources (a last save that fails for I/O commits nothing)."""
        self.wait()
        self.manager.close()


def _check_same_state(manager: ocp.CheckpointManager, directory: epath.Path, step: int, like: PyTree) -> None:
    """Raise :class:`ConfigError` unless step ``step`` holds arrays with ``like``'s names, shapes and dtypes."""
    stored = _flat_arrays(manager.item_metadata(step)["state"])
    wanted = _flat_arrays(like)
    if not stored:
        return  # no array metadata to compare with: Orbax's own restore decides
    difference = _first_difference(stored, wanted)
    if difference:
        raise ConfigError(
            f"the checkpoint of step {step} in {directory} holds another model's state ({difference}); "
            "resume with the model and optimizer it was saved with (and its training mode, which may keep more), "
            "or choose another checkpoint.dir."
        )


def _check_directory(directory: epath.Path) -> None:
    """Raise :class:`ConfigError` unless ``directory`` is, or can be created as, a writable directory (on object
    storage: unless its bucket exists)."""
    if is_object_store(directory):
        _check_bucket(directory)
        return
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"checkpoint.dir {directory} is a file, not a directory; point checkpoint.dir at a directory.")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"checkpoint.dir {directory} cannot be created ({error.strerror}); choose a directory you can write to."
        ) from error
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"checkpoint.dir {directory} is not writable; fix its permissions or choose another checkpoint.dir."
        )


def _check_bucket(directory: epath.Path) -> None:
    """Raise :class:`ConfigError` unless the bucket of ``directory`` (``gs://BUCKET/...``) can be reached and exists."""
    bucket = epath.Path("/".join(str(directory).split("/")[:3]))
    try:
        exists = bucket.exists()
    except Exception as error:  # noqa: BLE001 - gcsfs's errors of the storage and of the credentials
        raise ConfigError(
            f"checkpoint.dir {directory} cannot be reached ({type(error).__name__}: {str(error).splitlines()[0]}); "
            "check the bucket's name and the credentials (the Google Cloud application default credentials)."
        ) from error
    if not exists:
        raise ConfigError(f"checkpoint.dir {directory}: the bucket {bucket} does not exist; create it, or "
                          "choose another checkpoint.dir.")


def _flat_arrays(tree: PyTree) -> dict[str, tuple[tuple[int, ...], np.dtype] | None]:
    """``{"params.layer.weight": (shape, dtype)}`` for the arrays of ``tree`` (or of Orbax's metadata of it).

    PRNG keys map to ``None``: Orbax stores their raw data, of another shape and dtype.
    """
    tree = getattr(tree, "tree", tree)  # Orbax's TreeMetadata wraps the tree
    flat = ocp.tree.to_flat_dict(tree, is_leaf=lambda leaf: hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
    arrays = {}
    for path, leaf in flat.items():
        dtype = getattr(leaf, "dtype", None)
        if hasattr(leaf, "shape") and dtype is not None:
            key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            arrays[".".join(str(part) for part in path)] = None if key else (tuple(leaf.shape), np.dtype(dtype))
    return arrays


def _first_difference(stored: dict, wanted: dict) -> str | None:
    """The first way ``stored`` and ``wanted`` (from :func:`_flat_arrays`) differ, in words, or ``None``."""
    for name in sorted(set(stored) | set(wanted), key=lambda name: (not name.startswith("params."), name)):
        if name not in wanted:
            return f"{name} is in the checkpoint but not in this run"
        if name not in stored:
            return f"{name} is in this run but not in the checkpoint"
        if stored[name] is None or wanted[name] is None:
            continue
        (stored_shape, stored_dtype), (shape, dtype) = stored[name], wanted[name]
        if stored_shape != shape:
            return f"{name} has shape {stored_shape} there and {shape} in this run"
        if stored_dtype != dtype:
            return f"{name} has dtype {stored_dtype} there and {dtype} in this run"
    return None
