"""The trainer: a flat step loop that calls hooks and never branches on a strategy."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
import optax
import pluggy
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._checkpoint import Checkpointer
from ._cluster import AbstractCluster, SimulatedCluster
from ._data import AbstractDataset, sample_ids
from ._failures import (
    CheckpointWarning,
    ConfigError,
    Failure,
    PluginError,
    RecoveryPlan,
    RestartRequested,
    SliceLostError,
    StepTimeoutError,
    TrainingStopped,
    check_at_least,
)
from ._goodput import GoodputClock
from ._ledger import SampleLedger
from ._mesh import DEVICE_AXIS, SLICE_AXIS, WithinSlice, batch_sharding, keep_slices
from ._plugins import GuardedHooks, answering, make_plugin_manager
from ._recovery import carry_out_waits, wait_for_slices
from ._state import TrainState, init_train_state
from ._step import LossFn, make_step_fn
from ._step_cache import StepCache
from ._watchdog import Watchdog
from .hookspecs import PROJECT_NAME



def _put(tree: PyTree, shardings: PyTree) -> PyTree:
    """Place ``tree`` (the same values in every process) on ``shardings``.

    Each process writes only its own devices' shards: with several
    processes, ``jax.device_put`` would first check with a collective per
    array that every process holds the same values.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(leaf: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def strategy_name(strategy: object) -> str:
    """A strategy's name: its ``name`` attribute, else its class name."""
    return getattr(strategy, "name", type(strategy).__name__)


def _implements_hooks(obj: object) -> bool:
    """Whether ``obj`` has hook implementations (methods marked with ``et.hookimpl``)."""
    return any(hasattr(getattr(type(obj), name, None), f"{PROJECT_NAME}_impl") for name in dir(type(obj)))


class FitResult(NamedTuple):
    """What :meth:`Trainer.fit` returns: the final train state and the run report."""

    state: TrainState
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The slices in use, their mesh, the global batch and the step compiled for them."""

    slices: tuple[int, ...]
    mesh: Mesh
    batch_size: int
    lr_scale: float
    compiled: Any
    shardings: PyTree


class Trainer:
    """Trains an Equinox model data-parallel over a cluster's slices.

    :param model: the ``eqx.Module`` to train.
    :param loss_fn: ``loss_fn(model, batch, *, key) -> scalar``.
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
    :param checkpointer: saves the state every ``checkpointer.period`` steps and
        at the end; no checkpoints if ``None``.
    :param resume: continue from the checkpointer's latest complete checkpoint
        (an error if there is none).
    :param run_dir: where plugins write files (``report.json``); none if ``None``.
    :param started_at: when the wall clock starts (``time.time()``); the call
        to :meth:`fit` if ``None``.
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
        snapshot_period: int = 10,
        step_timeout_s: float = 300.0,
        plugins: Iterable[object] = (),
        plugin_manager: pluggy.PluginManager | None = None,
        strategy: object | None = None,
        checkpointer: Checkpointer | None = None,
        resume: bool = False,
        run_dir: str | Path | None = None,
        started_at: float | None = None,
    ):
        self.cluster = SimulatedCluster() if cluster is None else cluster
        check_at_least("trainer.steps", steps, 1)
        check_at_least("trainer.global_batch_size", global_batch_size, 1)
        check_at_least("trainer.snapshot_period", snapshot_period, 0)
        check_at_least("trainer.step_timeout_s", step_timeout_s, 0)
        if within_slice not in ("replicated", "sharded"):
            raise ConfigError(f"trainer.within_slice must be 'replicated' or 'sharded', got {within_slice!r}.")
        if resume and checkpointer is None:
            raise ConfigError("resuming needs a checkpointer; pass checkpointer= (checkpoint.dir from the CLI).")
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.data = data
        self.steps = steps
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.within_slice = within_slice
        self.snapshot_period = snapshot_period
        self._watchdog = Watchdog(step_timeout_s)
        self.checkpointer = checkpointer
        self.resume = resume
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.started_at = started_at
        self.plugin_manager = make_plugin_manager(plugins) if plugin_manager is None else plugin_manager
        self._hooks = GuardedHooks(self.plugin_manager)
        self.strategy = strategy
        if strategy is not None:
            self.plugin_manager.register(strategy, name=f"strategy:{strategy_name(strategy)}")
        if _implements_hooks(cluster):  # a cluster may steer too (cluster=pathways classifies Pathways' errors)
            self.plugin_manager.register(cluster, name=f"cluster:{cluster.kind}")
        self.mesh: Mesh | None = None
        self.slices: tuple[int, ...] = ()
        self.failures: list[dict[str, Any]] = []
        self.ledger: SampleLedger | None = None  # the samples of committed steps, once fit starts
        self.resizes: list[dict[str, Any]] = []

    @property
    def hook(self) -> GuardedHooks:
        """The plugin manager's hooks; call them with keyword arguments. An
        observer hook that raises stops training with a :class:`PluginError` naming the plugin."""
        return self._hooks

    # ------------------------------------------------------------------ the loop

    def fit(self) -> FitResult:
        """Train until ``steps`` steps are completed; returns the state and report.

        Raises :class:`TrainingStopped` (with the report attached) when a failure
        stops training before the last step.
        """
        self._clock = clock = GoodputClock(self.started_at)
        with clock.measure("startup"):
            if self.checkpointer and not self.resume and self.checkpointer.latest_step() is not None:
                raise ConfigError(
                    f"{self.checkpointer.directory} already holds checkpoints (newest: step "
                    f"{self.checkpointer.latest_step()}); continue that run with checkpoint.resume=true, "
                    "or choose another checkpoint.dir."
                )
            self.cluster.configure_jax()
            state = init_train_state(self.model, self.optimizer, key=jax.random.fold_in(jax.random.key(self.seed), 1))
        self.hook.et_run_start(trainer=self, state=state)
        with clock.measure("startup"):
            arrays, self._static = eqx.partition(state, eqx.is_array)
            self._step_fn = make_step_fn(self.loss_fn, self.optimizer, self._static)
            sample = np.asarray(self.data.get_batch(np.zeros(1, dtype=np.int64)))
            self._sample_shape = sample.shape[1:]
            self._steps = StepCache(self._step_fn, arrays, sample, within_slice=self.within_slice)
            self._snapshot: tuple[int, PyTree] | None = None  # (step, host arrays)
            self._snapshot_in_flight: tuple[int, PyTree] | None = None  # (step, device arrays being copied)
            self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
            self._step_seconds: dict[int, float] = {}
        self._incarnations = self.cluster.incarnations()  # as of the last good state
        self._state_is_whole = True  # False while the arrays hold no trained state (a failed resume)
        self._all_slices = list(range(len(self.cluster.slice_devices())))
        layout = self._layout(tuple(self._all_slices), plan=None)
        with clock.measure("startup"):
            arrays = _put(arrays, layout.shardings)
            self._compile_likely_layouts(layout)
            self.cluster.check_step(layout.slices, since=self._incarnations)  # with several processes: all ready
        step = position = 0
        self.ledger = SampleLedger(self.data.num_samples, seed=self.seed, start_position=0)
        self._pending_recovery: dict[str, Any] | None = None
        self._losses: dict[int, jax.Array] = {}
        self._first_step_ended_at: float | None = None
        self._before_first_step: dict[str, float] | None = None  # badput up to the first step's end
        self._resumed_from: int | None = None  # the checkpoint step a resumed run continued from
        stopped: TrainingStopped | None = None
        try:
            if self.resume:
                arrays, layout = self._resume(arrays, layout)
            step, position = int(arrays.step), int(arrays.data_position)
            self.ledger = SampleLedger(self.data.num_samples, seed=self.seed, start_position=position)
            while step < self.steps:
                self.hook.et_step_start(trainer=self, step=step)
                began = time.time()
                try:
                    with clock.measure("productive", on_error="wasted_progress"):
                        ids = self._sample_ids(position, layout.batch_size)
                        new_arrays, metrics = self._run_step(layout, arrays, ids)
                except Exception as error:
                    arrays, layout = self._survive(error, step=step, phase="train_step", arrays=arrays, layout=layout)
                    step, position = int(arrays.step), int(arrays.data_position)
                    continue
                with clock.measure("productive"):
                    arrays = new_arrays
                    self.ledger.commit(step, ids)
                    self._losses[step] = metrics["loss"]
                    step += 1
                    position += layout.batch_size
                    self._finish_recovery()
                    if self._first_step_ended_at is None:  # what this process spent before its first step
                        self._first_step_ended_at, self._before_first_step = time.time(), dict(clock.badput_s)
                    self._incarnations = self.cluster.incarnations()
                    self.hook.et_step_end(trainer=self, step=step, metrics=metrics)
                    self._take_snapshot(step, arrays)
                self._step_seconds[step - 1] = time.time() - began
                if self.checkpointer and (self.checkpointer.due(step) or step == self.steps):
                    try:
                        with clock.measure("checkpoint_save"):
                            self._save(step, arrays, position)
                    except Exception as error:
                        arrays, layout = self._survive(
                            error, step=step, phase="checkpoint_save", arrays=arrays, layout=layout
                        )
                        step, position = int(arrays.step), int(arrays.data_position)
                        continue
                if step < self.steps:
                    arrays, layout = self._maybe_resize(step, arrays, layout)
        except TrainingStopped as stop:
            stopped = stop
            if isinstance(stop, RestartRequested):  # the state goes back to the last checkpoint
                step, position = self._restart_step, self.ledger.end_position()
        if self.checkpointer:
            with clock.measure("checkpoint_save"):
                self.checkpointer.wait()
        clock.stop()
        self._steps.close()

        report = self._report(steps_completed=step, position=position)
        report["stopped"] = None if stopped is None else str(stopped)
        self.hook.et_run_end(trainer=self, report=report)
        if stopped is not None:
            stopped.report = report
            raise stopped
        return FitResult(eqx.combine(arrays, self._static), report)

    def _sample_ids(self, position: int, count: int) -> np.ndarray:
        return sample_ids(self.data.num_samples, seed=self.seed, start=position, count=count)

    def _run_step(self, layout: _Layout, arrays: PyTree, ids: np.ndarray) -> tuple[PyTree, dict]:
        """Run one step to completion on ``layout``.

        The step is waited for before the next one starts: one step in flight
        at a time. XLA:CPU deadlocks when several multi-device steps with
        collectives run at once (measured with 8 devices on 2 cores), and a
        failure must surface at the step it belongs to, so that the state
        before it is known to be whole.
        """
        # each process reads only the samples of its own devices' shards
        batch = jax.make_array_from_callback(
            (len(ids), *self._sample_shape), batch_sharding(layout.mesh), lambda index: self.data.get_batch(ids[index[0]])
        )
        new_arrays, metrics = layout.compiled(arrays, batch, np.float32(layout.lr_scale))
        self.cluster.step_dispatched()

        def wait_for_step() -> None:
            jax.block_until_ready(new_arrays)
            self.cluster.check_step(layout.slices, since=self._incarnations)

        try:
            self._watchdog.wait(wait_for_step)
        except Exception as error:
            if isinstance(error, StepTimeoutError) or not isinstance(error, SliceLostError):
                self.cluster.explain_failure(error, layout.slices, since=self._incarnations, pending=new_arrays)
            raise
        return new_arrays, metrics

    # ------------------------------------------------------------------ layouts

    def _layout(self, slices: tuple[int, ...], *, plan: RecoveryPlan | None) -> _Layout:
        """Mesh the slices (through the hook) and get a step compiled for them."""
        all_devices = self.cluster.slice_devices()
        with self._clock.measure("remesh" if self.mesh is not None else "startup"):
            mesh = self._make_mesh([all_devices[i] for i in slices])
        batch_size, lr_scale = self._batch_for(mesh, slices, plan)
        with self._clock.measure("compile"):
            compiled, shardings, self._last_compile = self._steps.get(mesh, batch_size)
        self.mesh, self.slices = mesh, slices
        return _Layout(slices, mesh, batch_size, lr_scale, compiled, shardings)

    def _compile_likely_layouts(self, layout: _Layout) -> None:
        """Start compiling, in the background, the layouts plugins expect next."""
        all_devices = self.cluster.slice_devices()
        for slices in (s for layouts in self.hook.et_likely_layouts(trainer=self) for s in layouts):
            mesh = self._make_mesh([all_devices[i] for i in sorted(slices)])
            local = any(device.process_index == jax.process_index() for device in mesh.devices.flat)
            if mesh.size and layout.batch_size % mesh.size == 0 and local:  # a mesh without us is not ours to run
                self._steps.compile_ahead(mesh, layout.batch_size)

    def _make_mesh(self, slice_devices: list[list[jax.Device]]) -> Mesh:
        mesh = self.hook.et_make_mesh(trainer=self, slice_devices=slice_devices)
        if not isinstance(mesh, Mesh) or mesh.axis_names != (SLICE_AXIS, DEVICE_AXIS):
            raise PluginError(
                f"et_make_mesh returned {mesh!r}; a plugin must return a jax.sharding.Mesh "
                f"with axes ({SLICE_AXIS!r}, {DEVICE_AXIS!r})."
            )
        return mesh

    def _batch_for(self, mesh: Mesh, slices: tuple[int, ...], plan: RecoveryPlan | None) -> tuple[int, float]:
        """The global batch and learning-rate scale on ``mesh`` under ``plan``'s batch policy."""
        batch_size, lr_scale = self.global_batch_size, 1.0
        if plan is not None and not plan.keep_global_batch:
            full_devices = len(self.cluster.slice_devices()) * mesh.shape[DEVICE_AXIS]
            batch_size = self.global_batch_size * mesh.size // full_devices
            ratio = batch_size / self.global_batch_size
            lr_scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[plan.lr_scaling]
        if batch_size < 1 or batch_size % mesh.size:
            raise ConfigError(
                f"trainer.global_batch_size ({batch_size}) must be divisible by the {mesh.size} devices of "
                f"slices {list(slices)}, and by every device count the run may scale to."
            )
        return batch_size, lr_scale

    # ------------------------------------------------------------------ failures

    def _survive(
        self, error: Exception, *, step: int, phase: str, arrays: PyTree, layout: _Layout
    ) -> tuple[PyTree, _Layout]:
        """Recover from ``error``; a failure while recovering starts the recovery over."""
        if isinstance(error, PluginError):
            raise error  # a plugin's bug, not the hardware's
        while True:
            try:
                arrays, layout = self._recover(error, step=step, phase=phase, arrays=arrays, layout=layout)
                break
            except (TrainingStopped, PluginError):
                raise
            except Exception as again:  # noqa: BLE001 - classified like any other failure
                error, phase = again, "recovery"
        self._incarnations = self.cluster.incarnations()  # the state is whole again
        self._state_is_whole = True
        self._roll_back(int(arrays.step))
        return arrays, layout

    def _recover(
        self, error: Exception, *, step: int, phase: str, arrays: PyTree, layout: _Layout
    ) -> tuple[PyTree, _Layout]:
        """Classify the failure, let the strategy plan, and carry the plan out."""
        failed_at = getattr(error, "occurred_at", None) or time.time()  # a process death is stamped when it died
        clock = self._clock
        with clock.measure("detection"):
            failure: Failure = self.hook.et_classify_failure(error=error, step=step, phase=phase)
            lost = self._lost_slices(layout, failure.slices)
            failure = dataclasses.replace(failure, slices=lost)
        record = {
            "step": step, "phase": failure.phase, "slice": lost[0] if lost else None, "slices": list(lost),
            "kind": failure.kind, "action": "stop", "slices_before": len(layout.slices),
            "slices_after": len(layout.slices), "restored_from": "none", "lost_steps": 0, "recovery_s": 0.0,
            "failed_at": failed_at, "detection_s": time.time() - failed_at,
        }
        self.failures.append(record)
        self._regroup_checkpointer()  # before anything waits for a save that the lost processes were part of
        if not failure.elastic:
            raise TrainingStopped(f"step {step + 1} failed with a fatal error: {error}") from error
        plan = self.hook.et_choose_recovery(trainer=self, failure=failure)
        if plan is None:
            raise TrainingStopped(
                f"step {step + 1} failed ({failure.kind}) and no strategy is selected, so training stops "
                "the traditional way; select one with +strategy=NAME to keep training through failures."
            ) from error
        if not isinstance(plan, RecoveryPlan):
            raise PluginError(
                f"{answering(self.plugin_manager, 'et_choose_recovery')} returned {plan!r} from et_choose_recovery; "
                "a strategy must return an et.RecoveryPlan, or None to leave the decision to the next plugin."
            )
        def wait(timeout_s: float) -> list[int]:
            if timeout_s and not self.cluster.lost_slices_rejoin and self.cluster.healthy_slices() != self._all_slices:
                record["regrouped"] = True  # lost processes cannot rejoin the running job: re-form the whole job
                self._restart(record, step=step, error=error)
            return self._wait_for_slices(timeout_s)

        plan, healthy = carry_out_waits(
            plan, record, wait=wait, restart=lambda: self._restart(record, step=step, error=error), error=error
        )
        lost = self._lost_slices(layout, lost)  # slices may also have failed while recovering
        arrays = self.cluster.surviving(arrays, lost)  # what lived on lost slices is gone
        record["slices"] = list(lost)

        survivors = [s for s in layout.slices if s not in lost] if self._state_is_whole else []
        begin = time.time()
        try:
            new_layout = self._layout(tuple(healthy), plan=plan)
        except ConfigError as bad_layout:
            raise TrainingStopped(f"{plan.action}: {bad_layout}") from error
        record.update(**self._last_compile)
        record["remesh_s"] = time.time() - begin - record["compile_s"]
        begin = time.time()
        arrays, source, restored_step = self._restore(arrays, layout, survivors, new_layout, step=step)
        record.update(
            restore_s=time.time() - begin, restored_from=source, lost_steps=step - restored_step,
            slices_after=len(new_layout.slices),
        )
        seconds = record["remesh_s"] + record["compile_s"] + record["restore_s"]
        self._record_resize(step, layout, new_layout, reason="failure", seconds=seconds)
        self._pending_recovery = {"record": record, "failed_at": failed_at}
        return arrays, new_layout

    def _restart(self, record: dict[str, Any], *, step: int, error: Exception) -> None:
        """Give up this process: the next worker restores the last complete checkpoint."""
        if self.checkpointer is None:
            raise TrainingStopped(f"{record['action']}: a restart needs checkpoints; enable checkpoint.enabled.")
        with self._clock.measure("checkpoint_save"):
            self.checkpointer.wait()
        restored = self.checkpointer.latest_step() or 0
        record.update(restored_from="checkpoint" if restored else "none", lost_steps=step - restored)
        self._roll_back(restored)
        self._restart_step = restored
        raise RestartRequested(
            f"step {step + 1} lost slice(s) {record['slices']}; restarting the worker from step {restored}."
        ) from error

    def _lost_slices(self, layout: _Layout, reported: Sequence[int]) -> tuple[int, ...]:
        """Slices of ``layout`` whose data is gone: reported lost, unhealthy, or failed since the last step."""
        healthy = set(self.hook.et_slice_health(trainer=self))
        incarnations = self.cluster.incarnations()
        return tuple(
            s for s in layout.slices
            if s in reported or s not in healthy or incarnations[s] != self._incarnations[s]
        )

    def _finish_recovery(self) -> None:
        """After the first productive step since a failure: its recovery time is known."""
        if self._pending_recovery is not None:
            pending, self._pending_recovery = self._pending_recovery, None
            pending["record"]["recovery_s"] = time.time() - pending["failed_at"]

    def _wait_for_slices(self, timeout_s: float) -> list[int]:
        with self._clock.measure("waiting_for_slices"):
            return wait_for_slices(self.hook, self, timeout_s)

    def _restore(
        self, arrays: PyTree, old: _Layout, survivors: Sequence[int], new: _Layout, *, step: int
    ) -> tuple[PyTree, str, int]:
        """Restore the state onto ``new``: from a surviving replica, else the snapshot, else a checkpoint."""
        if survivors:
            source, restored_step = "replica", step
        elif self._snapshot is not None:
            source, restored_step = "snapshot", self._snapshot[0]
        elif self.checkpointer is not None and self.checkpointer.latest_step() is not None:
            source, restored_step = "checkpoint", self.checkpointer.latest_step()
        else:
            raise TrainingStopped("every slice was lost and there is no snapshot or checkpoint to restore from.")
        category = "remesh" if source == "replica" else "checkpoint_restore"
        since = self.cluster.incarnations()  # the restore must not outlive a slice it writes to
        self.hook.et_before_restore(trainer=self, step=restored_step, source=source)
        with self._clock.measure(category):
            if source == "replica":
                positions = [old.slices.index(s) for s in survivors]
                arrays = jax.device_put(keep_slices(arrays, old.mesh, positions), new.shardings)
            elif source == "snapshot":
                arrays = jax.device_put(self._snapshot[1], new.shardings)
            else:
                target = jax.tree.map(
                    lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                    self._abstract, new.shardings,
                )
                arrays, _ = self.checkpointer.restore(restored_step, like=target)
            jax.block_until_ready(arrays)
            self.cluster.check_step(new.slices, since=since)
        self.hook.et_after_restore(
            trainer=self, step=restored_step, source=source, state=eqx.combine(arrays, self._static)
        )
        return arrays, source, restored_step

    def _roll_back(self, to_step: int) -> None:
        """Forget the steps from ``to_step`` on: their samples, losses, and their time as goodput."""
        self.ledger.roll_back(to_step)
        self._losses = {s: loss for s, loss in self._losses.items() if s < to_step}
        rolled_back = [s for s in self._step_seconds if s >= to_step]
        self._clock.reclassify_productive(sum(self._step_seconds.pop(s) for s in rolled_back))

    def _take_snapshot(self, step: int, arrays: PyTree) -> None:
        """Every ``snapshot_period`` steps, copy the state to host memory without waiting for it.

        The copy starts at the snapshot step and runs during the next step;
        only then does the snapshot count (a copy still in flight is not used).
        """
        if self._snapshot_in_flight is not None:
            in_flight_step, in_flight = self._snapshot_in_flight
            self._snapshot, self._snapshot_in_flight = (in_flight_step, jax.device_get(in_flight)), None
        if self.snapshot_period and step % self.snapshot_period == 0:
            for leaf in jax.tree.leaves(arrays):
                leaf.copy_to_host_async()
            self._snapshot_in_flight = (step, arrays)

    def _maybe_resize(self, step: int, arrays: PyTree, layout: _Layout) -> tuple[PyTree, _Layout]:
        """Ask plugins whether to change slices at this step boundary; move the state if so."""
        healthy = self.hook.et_slice_health(trainer=self)
        target = self.hook.et_propose_resize(trainer=self, healthy_slices=list(healthy))
        if target is None or tuple(sorted(target)) == layout.slices:
            return arrays, layout
        begin = time.time()
        new_layout = self._layout(tuple(sorted(target)), plan=None)
        with self._clock.measure("remesh"):
            positions = list(range(len(layout.slices)))
            arrays = jax.device_put(keep_slices(arrays, layout.mesh, positions), new_layout.shardings)
            jax.block_until_ready(arrays)
        self._record_resize(step, layout, new_layout, reason="scale_up", seconds=time.time() - begin)
        return arrays, new_layout

    def _record_resize(self, step: int, old: _Layout, new: _Layout, *, reason: str, seconds: float) -> None:
        if old.slices != new.slices:
            self.resizes.append(
                {"step": step, "at": time.time(), "reason": reason, "slices_before": len(old.slices),
                 "slices_after": len(new.slices), "slices": list(new.slices), "seconds": seconds, **self._last_compile}
            )

    # ------------------------------------------------------------------ checkpoints

    def _save(self, step: int, arrays: PyTree, position: int) -> None:
        """Save ``step``; if a slice is lost meanwhile, the save is discarded and the failure raised."""
        began = time.time()
        self.hook.et_before_checkpoint_save(trainer=self, step=step)
        try:
            self.checkpointer.save(step, arrays, self._checkpoint_metadata(step, position))
        except Exception:
            try:
                self.cluster.check_step(self.slices, since=self._incarnations)  # a lost slice explains the failure
            finally:
                self._discard(step)
            raise
        try:
            self.cluster.check_step(self.slices, since=self._incarnations)
        except Exception:
            self._discard(step)
            raise
        self.checkpointer.saved(
            step,
            blocked_s=time.time() - began,
            step_times_s=list(self._step_seconds.values()),
            elapsed_s=time.time() - self._clock.started_at,
            failures=len(self.failures),
        )
        self.hook.et_after_checkpoint_save(trainer=self, step=step, directory=str(self.checkpointer.directory))

    def _discard(self, step: int) -> None:
        """Make sure the save of ``step``, interrupted by a failure, never becomes a checkpoint."""
        self._regroup_checkpointer()
        self.checkpointer.discard(step)

    def _regroup_checkpointer(self) -> None:
        """Once processes are lost, save over the live ones only: those with a device in a healthy slice.

        With one process (the simulated cluster) the group never changes, even when every slice is lost.
        A process that dies while the survivors form the group fails it (after the group's timeout); the
        processes then agree again on who lives, and that new loss is raised, to be recovered from like any
        other (the recovery regroups anew). Any other failure to form the group stands.
        """
        if self.checkpointer is None or jax.process_count() == 1:
            return
        live = self._live_processes()
        try:
            self.checkpointer.regroup(live)
        except Exception as error:
            try:
                self.cluster.check_step(self.slices, since=self._incarnations)
            except SliceLostError as lost:
                if self._live_processes() < live:
                    raise lost from error
            raise

    def _live_processes(self) -> set[int]:
        """The processes with a device in a healthy slice."""
        devices = self.cluster.slice_devices()
        return {d.process_index for s in self.cluster.healthy_slices() for d in devices[s]}

    def _checkpoint_metadata(self, step: int, position: int) -> dict[str, Any]:
        return {
            "step": step,
            "data_position": position,
            "seed": self.seed,
            "num_samples": self.data.num_samples,
            "global_batch_size": self.global_batch_size,
            "cluster": self.cluster.describe(),
            "slices": list(self.slices),
            "mesh": dict(self.mesh.shape),
            "within_slice": self.within_slice,
        }

    def _resume(self, arrays: PyTree, layout: _Layout) -> tuple[PyTree, _Layout]:
        """Restore the latest checkpoint; a slice lost meanwhile is recovered from like any failure."""
        try:
            with self._clock.measure("checkpoint_restore"):
                arrays = self._restore_checkpoint(arrays, layout)
            self._resumed_from = int(arrays.step)
            return arrays, layout
        except (ConfigError, PluginError, TrainingStopped):
            raise
        except Exception as error:  # noqa: BLE001 - classified by _survive
            self._state_is_whole = False  # the arrays hold no trained state yet: nothing to copy from
            step = self.checkpointer.latest_step()
            return self._survive(error, step=step, phase="checkpoint_restore", arrays=arrays, layout=layout)

    def _restore_checkpoint(self, like: PyTree, layout: _Layout) -> PyTree:
        """Restore the newest readable checkpoint.

        Unreadable ones (truncated, corrupt) are skipped, and named in a
        warning once an older one was read, or in the error when none was;
        their files are left as they are. A checkpoint of another model, or of
        another data order, is a :class:`ConfigError`.
        """
        skipped = []
        for step in self.checkpointer.steps_newest_first():
            self.hook.et_before_restore(trainer=self, step=step, source="checkpoint")
            try:
                arrays, metadata = self.checkpointer.restore(step, like=like)
            except ConfigError:
                raise  # another model's checkpoint: the wrong directory or model, not damage
            except Exception as error:  # noqa: BLE001 - a truncated or corrupt checkpoint: try the one before
                self.checkpointer.mark_unreadable(step)
                skipped.append((step, type(error).__name__))
                continue
            self._check_same_data(step, metadata)
            for bad_step, why in skipped:
                warnings.warn(
                    f"the checkpoint of step {bad_step} in {self.checkpointer.directory} is unreadable "
                    f"({why}); skipping it for the one before.",
                    CheckpointWarning,
                    stacklevel=2,
                )
            self.cluster.check_step(layout.slices, since=self._incarnations)
            self.hook.et_after_restore(
                trainer=self, step=step, source="checkpoint", state=eqx.combine(arrays, self._static)
            )
            return arrays
        unreadable = f" (unreadable: {', '.join(f'step {s} ({why})' for s, why in skipped)})" if skipped else ""
        raise ConfigError(
            f"checkpoint.resume is set but {self.checkpointer.directory} holds no complete, readable checkpoint"
            f"{unreadable}; point checkpoint.dir at a run's checkpoints, or drop checkpoint.resume to start afresh."
        )

    def _check_same_data(self, step: int, metadata: dict[str, Any]) -> None:
        """Raise :class:`ConfigError` when the checkpoint was trained on another sample order than this run's."""
        for name, ours in (("seed", self.seed), ("num_samples", self.data.num_samples)):
            theirs = metadata.get(name, ours)  # older checkpoints lack num_samples
            if theirs != ours:
                raise ConfigError(
                    f"the checkpoint of step {step} in {self.checkpointer.directory} was trained with {name}={theirs} "
                    f"and this run has {name}={ours}, which changes the order of the samples; resume with the same "
                    "seed and data, or choose another checkpoint.dir."
                )

    # ------------------------------------------------------------------ report

    def _report(self, *, steps_completed: int, position: int) -> dict:
        ordered = [float(loss) for _, loss in sorted(jax.device_get(self._losses).items())]
        return {
            "strategy": None if self.strategy is None else strategy_name(self.strategy),
            "cluster": self.cluster.describe(),
            "steps_target": self.steps,
            "steps_completed": steps_completed,
            "loss_first": ordered[0] if ordered else None,
            "final_loss": ordered[-1] if ordered else None,
            **self._clock.summary(),
            "failures": self.failures,
            "resizes": self.resizes,
            "compile_cache": {"compiled_ahead": self._steps.compiled_ahead, "saved_s": self._steps.saved_s},
            "checkpoint": None if self.checkpointer is None else self.checkpointer.describe(),
            "resumed_from": self._resumed_from,
            "samples": self.ledger.counts(position),
            "data_position": position,
            "started_at": self._clock.started_at,
            "ended_at": self._clock.ended_at,
            "first_step_ended_at": self._first_step_ended_at,
            "badput_before_first_step_s": self._before_first_step,
        }
