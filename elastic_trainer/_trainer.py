"""The trainer: a flat step loop that calls hooks and never branches on a strategy."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pluggy
from jaxtyping import PyTree

from ._checkpoint import Checkpointer
from ._cluster import AbstractCluster, SimulatedCluster
from ._data import AbstractDataset, sample_ids
from ._failures import ConfigError, Failure, PluginError, TrainingStopped, check_at_least
from ._goodput import GoodputClock
from ._mesh import DEVICE_AXIS, SLICE_AXIS, WithinSlice, batch_sharding
from ._plugins import make_plugin_manager
from ._state import TrainState, init_train_state
from ._step import LossFn, compile_step, make_step_fn


class FitResult(NamedTuple):
    """What :meth:`Trainer.fit` returns: the final train state and the run report."""

    state: TrainState
    report: dict[str, Any]


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
    :param plugins: extra plugins, registered after the built-in ones.
    :param plugin_manager: use this manager instead of building one.
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
        plugins: Iterable[object] = (),
        plugin_manager: pluggy.PluginManager | None = None,
        checkpointer: Checkpointer | None = None,
        resume: bool = False,
        run_dir: str | Path | None = None,
        started_at: float | None = None,
    ):
        self.cluster = SimulatedCluster() if cluster is None else cluster
        check_at_least("trainer.steps", steps, 1)
        check_at_least("trainer.global_batch_size", global_batch_size, 1)
        if within_slice not in ("replicated", "sharded"):
            raise ConfigError(f"trainer.within_slice must be 'replicated' or 'sharded', got {within_slice!r}.")
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.data = data
        self.steps = steps
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.within_slice = within_slice
        if resume and checkpointer is None:
            raise ConfigError("resuming needs a checkpointer; pass checkpointer= (checkpoint.dir from the CLI).")
        self.checkpointer = checkpointer
        self.resume = resume
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.started_at = started_at
        self.plugin_manager = make_plugin_manager(plugins) if plugin_manager is None else plugin_manager
        self.mesh: jax.sharding.Mesh | None = None
        self.failures: list[dict[str, Any]] = []

    @property
    def hook(self) -> pluggy.HookRelay:
        """The plugin manager's hooks; call them with keyword arguments."""
        return self.plugin_manager.hook

    def fit(self) -> FitResult:
        """Train until ``steps`` steps are completed; returns the state and report.

        Raises :class:`TrainingStopped` (with the report attached) when a failure
        stops training before the last step.
        """
        clock = GoodputClock(self.started_at)
        with clock.measure("startup"):
            self.cluster.configure_jax()
            state = init_train_state(self.model, self.optimizer, key=jax.random.fold_in(jax.random.key(self.seed), 1))
        self.hook.et_run_start(trainer=self, state=state)
        with clock.measure("startup"):
            self.mesh = self._make_mesh(self.cluster.slice_devices())
            arrays, static = eqx.partition(state, eqx.is_array)
            step_fn = make_step_fn(self.loss_fn, self.optimizer, static)
            batch_spec = self._batch_spec()
        with clock.measure("compile"):
            compiled, shardings = compile_step(step_fn, arrays, batch_spec, self.mesh, within_slice=self.within_slice)
        with clock.measure("startup"):
            arrays = jax.device_put(arrays, shardings)
        if self.resume:
            with clock.measure("checkpoint_restore"):
                arrays = self._restore(arrays, static)
        steps_completed = start_step = int(arrays.step)
        position = start_position = int(arrays.data_position)

        batch: jax.Array | None = None  # the next step's batch, when prepared ahead
        losses: list[jax.Array] = []
        stopped: TrainingStopped | None = None
        try:
            for step in range(start_step, self.steps):
                try:
                    with clock.measure("productive", on_error="wasted_progress"):
                        arrays, metrics, batch = self._run_step(compiled, arrays, batch, position, last=step + 1 == self.steps)
                except Exception as error:
                    self._recover(error, step=step, phase="train_step")
                with clock.measure("productive"):
                    position += self.global_batch_size
                    losses.append(metrics["loss"])
                    steps_completed = step + 1
                    self.hook.et_step_end(trainer=self, step=steps_completed, metrics=metrics)
                if self.checkpointer and (self.checkpointer.due(steps_completed) or steps_completed == self.steps):
                    with clock.measure("checkpoint_save"):
                        self._save(steps_completed, arrays, position)
        except TrainingStopped as stop:
            stopped = stop
        if self.checkpointer:
            with clock.measure("checkpoint_save"):
                self.checkpointer.wait()
        clock.stop()

        report = self._report(clock, losses, steps_completed=steps_completed, samples=position - start_position)
        report["stopped"] = None if stopped is None else str(stopped)
        self.hook.et_run_end(trainer=self, report=report)
        if stopped is not None:
            stopped.report = report
            raise stopped
        return FitResult(eqx.combine(arrays, static), report)

    def _save(self, step: int, arrays: PyTree, position: int) -> None:
        self.hook.et_before_checkpoint_save(trainer=self, step=step)
        self.checkpointer.save(step, arrays, self._checkpoint_metadata(step, position))
        self.hook.et_after_checkpoint_save(trainer=self, step=step, directory=str(self.checkpointer.directory))

    def _checkpoint_metadata(self, step: int, position: int) -> dict[str, Any]:
        return {
            "step": step,
            "data_position": position,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "cluster": self.cluster.describe(),
            "mesh": dict(self.mesh.shape),
            "within_slice": self.within_slice,
        }

    def _restore(self, arrays: PyTree, static: PyTree) -> PyTree:
        step = self.checkpointer.latest_step()
        if step is None:
            raise ConfigError(
                f"checkpoint.resume is set but {self.checkpointer.directory} holds no complete checkpoint; "
                "point checkpoint.dir at a run's checkpoints, or drop checkpoint.resume to start afresh."
            )
        self.hook.et_before_restore(trainer=self, step=step, source="checkpoint")
        arrays, _ = self.checkpointer.restore(step, like=arrays)
        self.hook.et_after_restore(trainer=self, step=step, source="checkpoint", state=eqx.combine(arrays, static))
        return arrays

    def _make_mesh(self, slice_devices: list[list[jax.Device]]) -> jax.sharding.Mesh:
        mesh = self.hook.et_make_mesh(trainer=self, slice_devices=slice_devices)
        if not isinstance(mesh, jax.sharding.Mesh) or mesh.axis_names != (SLICE_AXIS, DEVICE_AXIS):
            raise PluginError(
                f"et_make_mesh returned {mesh!r}; a plugin must return a jax.sharding.Mesh "
                f"with axes ({SLICE_AXIS!r}, {DEVICE_AXIS!r})."
            )
        if self.global_batch_size % mesh.size:
            raise ConfigError(
                f"trainer.global_batch_size ({self.global_batch_size}) must be divisible by the "
                f"{mesh.size} devices of the mesh."
            )
        return mesh

    def _batch_spec(self) -> jax.ShapeDtypeStruct:
        sample = np.asarray(self.data.get_batch(np.zeros(1, dtype=np.int64)))
        shape = (self.global_batch_size, *sample.shape[1:])
        return jax.ShapeDtypeStruct(shape, jnp.dtype(sample.dtype), sharding=batch_sharding(self.mesh))

    def _run_step(self, compiled, arrays: PyTree, batch: jax.Array | None, position: int, *, last: bool):
        """Run one step to completion; returns the new arrays, metrics and the next batch.

        ``batch`` is the one prepared during the previous step, or ``None`` to
        prepare it now (the first step).

        The next batch is prepared while the step runs, but the step is waited
        for before the next one starts: one step in flight at a time. XLA:CPU
        deadlocks when several multi-device steps with collectives run at once
        (measured with 8 devices on 2 cores), and a failure must surface at the
        step it belongs to, so a strategy knows exactly which step was lost.
        """
        arrays, metrics = compiled(arrays, self._batch(position) if batch is None else batch)
        next_batch = None if last else self._batch(position + self.global_batch_size)
        jax.block_until_ready(arrays)
        return arrays, metrics, next_batch

    def _batch(self, position: int) -> jax.Array:
        ids = sample_ids(self.data.num_samples, seed=self.seed, start=position, count=self.global_batch_size)
        return jax.device_put(self.data.get_batch(ids), batch_sharding(self.mesh))

    def _recover(self, error: Exception, *, step: int, phase: str) -> None:
        failure: Failure = self.hook.et_classify_failure(error=error, step=step, phase=phase)
        slices = self.mesh.shape[SLICE_AXIS]
        self.failures.append(
            {"step": step, "phase": phase, "slices": list(failure.slices), "kind": failure.kind, "action": "stop",
             "slices_before": slices, "slices_after": slices, "restored_from": "none", "lost_steps": 0, "recovery_s": 0.0}
        )
        if not failure.elastic:
            raise TrainingStopped(f"step {step + 1} failed with a fatal error: {error}") from error
        plan = self.hook.et_choose_recovery(trainer=self, failure=failure)
        if plan is None:
            raise TrainingStopped(
                f"step {step + 1} failed ({failure.kind}) and no strategy is selected, so training stops "
                "the traditional way; select one with +strategy=NAME to keep training through failures."
            ) from error
        raise PluginError(f"et_choose_recovery returned {plan!r}, but this version cannot execute recovery plans yet.")

    def _report(self, clock: GoodputClock, losses: list[jax.Array], *, steps_completed: int, samples: int) -> dict:
        losses = [float(loss) for loss in jax.device_get(losses)]
        return {
            "strategy": None,
            "cluster": self.cluster.describe(),
            "steps_target": self.steps,
            "steps_completed": steps_completed,
            "loss_first": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            **clock.summary(),
            "failures": self.failures,
            "samples": {"consumed": samples, "duplicated": 0, "skipped": 0},
        }
