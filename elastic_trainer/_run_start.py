"""A run's start: JAX joined, the initial train state made, and every collaborator of the loop built."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._goodput import GoodputClock
from ._layouts import Layouts
from ._ledger import SampleLedger
from ._records import LOSSES_ON_DEVICE, FailureLog, RunContext, StepHistory
from ._recovery import TrainingContext
from .checkpoints._run_checkpoints import RunCheckpoints, refuse_to_overwrite
from ._snapshots import HostSnapshots
from ._state import TrainState, init_train_state
from ._step import check_fits, make_step_functions
from ._step_cache import StepCache
from ._step_runner import StepRunner
from ._stragglers import StragglerWatch
from ._take_back import take_back
from ._watchdog import Watchdog
from ._failures import PluginError, SpareWarning
from ._plugins import answering
from ._training_mode import AbstractTrainingMode, SynchronousMode
from .clusters import AbstractMultiControllerCluster, admission_of, has_spares
from .clusters._base import AbstractWholeArrayLossCluster

if TYPE_CHECKING:
    from ._trainer import Trainer


def start_run(trainer: Trainer, *, watchdog: Watchdog, failures: FailureLog) -> tuple[TrainingContext, PyTree]:
    """Join the job, make the initial train state (``et_run_start`` sees it), check that the model fits the data,
    and build the run's collaborators; the run's context and the training mode's state, on no layout yet."""
    clock = GoodputClock(trainer.started_at)
    with clock.measure("startup"):
        if trainer.checkpointer and not trainer.resume and not admission_of(trainer.cluster):  # a replacement goes on
            refuse_to_overwrite(trainer.checkpointer)
        trainer.cluster.configure_jax()
        state = init_train_state(trainer.model, trainer.optimizer,
                                 key=jax.random.fold_in(jax.random.key(trainer.seed), 1))
    mode = _training_mode(trainer)
    trainer.hook.et_run_start(trainer=trainer, state=state, mode=mode)
    if trainer.strategy is None and has_spares(trainer.cluster):
        warnings.warn("the cluster keeps spare slices but no strategy is selected, so a failure stops training and "
                      "no spare is used; select one with +strategy=hot_swap.", SpareWarning, stacklevel=3)
    with clock.measure("startup"):
        train_arrays, static = eqx.partition(state, eqx.is_array)
        sample = jax.tree.map(np.asarray, trainer.data.get_batch(np.zeros(1, dtype=np.int64)))
        functions = make_step_functions(trainer.loss_fn, trainer.optimizer, static, train_arrays,
                                        has_aux=trainer.has_aux)
        check_fits(functions, train_arrays, sample, trainer.global_batch_size)
        arrays = _own_buffers(mode.init(train_arrays))
        step_cache = StepCache(functions, arrays, sample, within_slice=trainer.within_slice,
                               max_layouts=trainer.max_cached_layouts, mode=mode)
    run = RunContext(cluster=trainer.cluster, hooks=trainer.hook, plugin_manager=trainer.plugin_manager,
                     view=trainer, clock=clock, failures=failures)

    def train_state(arrays: PyTree) -> TrainState:  # the train state in the mode's state, non-array part included
        return eqx.combine(mode.train_state(arrays), static)

    checkpoints = _run_checkpoints(trainer, run, train_state, mode)
    layouts = Layouts(run, steps=step_cache, global_batch_size=trainer.global_batch_size,
                      release=checkpoints and checkpoints.release,
                      take_back=lambda state, slices, returning: take_back(ctx, state, slices, returning))
    ctx = TrainingContext(
        **vars(run), layouts=layouts, stragglers=StragglerWatch(trainer.straggler_rule),
        checkpoints=checkpoints, snapshots=HostSnapshots(trainer.snapshot_period, jax.tree.structure(arrays)),
        history=StepHistory(SampleLedger(trainer.data.num_samples, seed=trainer.seed, start_position=0),
                            on_device=0 if isinstance(trainer.cluster, AbstractWholeArrayLossCluster)
                            else LOSSES_ON_DEVICE),
        abstract=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays), static=static,
        train_state=train_state, mode=mode,
        step_cache=step_cache, runner=StepRunner(trainer.cluster, trainer.data, watchdog, sample, hooks=trainer.hook,
                                                 view=trainer, structure=jax.tree.structure(arrays), seed=trainer.seed),
    )
    return ctx, arrays


def _own_buffers(arrays: PyTree) -> PyTree:
    """``arrays`` with a copy of each array it holds more than once (a mode's state that starts an average as the
    parameters themselves): a step donates every leaf, and one buffer donated twice crashes XLA."""
    seen: set[int] = set()

    def own(leaf: jax.Array) -> jax.Array:
        if id(leaf) in seen:
            return jnp.copy(leaf)
        seen.add(id(leaf))
        return leaf

    return jax.tree.map(own, arrays)


def _training_mode(trainer: Trainer) -> AbstractTrainingMode:
    """The mode a plugin chose (``et_training_mode``), else the synchronous one: split into its gradients and
    its update where each process runs its own part of every program (a multi-controller cluster)."""
    mode = trainer.hook.et_training_mode(trainer=trainer)
    if mode is None:
        return SynchronousMode(split=isinstance(trainer.cluster, AbstractMultiControllerCluster))
    if not isinstance(mode, AbstractTrainingMode):
        raise PluginError(
            f"{answering(trainer.plugin_manager, 'et_training_mode')} returned {mode!r} from et_training_mode; a "
            "plugin must return an elastic_trainer.plugin.AbstractTrainingMode, or None to leave the choice to the "
            "next plugin."
        )
    return mode


def _run_checkpoints(trainer: Trainer, run: RunContext, train_state: Callable[[PyTree], TrainState],
                     mode: AbstractTrainingMode) -> RunCheckpoints | None:
    """The run's checkpoints (``None`` without a checkpointer), with what they check a resume against."""
    if trainer.checkpointer is None:
        return None
    return RunCheckpoints(
        trainer.checkpointer, run, train_state=train_state,
        data_order={"seed": trainer.seed, "num_samples": trainer.data.num_samples},
        run_metadata={"global_batch_size": trainer.global_batch_size, "cluster": trainer.cluster.describe(),
                      "within_slice": trainer.within_slice, "training_mode": mode.name},
    )
