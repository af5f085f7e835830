"""elastic_trainer: elastic, fault-tolerant JAX training.

A dead slice surfaces as a Python exception, a strategy plugin decides what to
do, and training continues at the exact step and data position.
"""

from .checkpoints._checkpointer import Checkpointer as Checkpointer
from .clusters import (
    AbstractCluster as AbstractCluster,
    AbstractInjectableCluster as AbstractInjectableCluster,
    AbstractMultiControllerCluster as AbstractMultiControllerCluster,
    AbstractProcessInjectableCluster as AbstractProcessInjectableCluster,
    AbstractRejoinCluster as AbstractRejoinCluster,
    AbstractSpareCluster as AbstractSpareCluster,
    AbstractTimedCluster as AbstractTimedCluster,
    SyncCall as SyncCall,
    MultiprocessCluster as MultiprocessCluster,
    PathwaysCluster as PathwaysCluster,
    SimulatedCluster as SimulatedCluster,
    has_spares as has_spares,
    mesh_slice_count as mesh_slice_count,
    vital_slices as vital_slices,
)
from ._elastic_retry import ElasticRun as ElasticRun, elastic_retry as elastic_retry
from ._data import AbstractDataset as AbstractDataset, StdlibText as StdlibText, sample_ids as sample_ids
from ._failures import (
    CheckpointWarning as CheckpointWarning,
    ConfigError as ConfigError,
    Failure as Failure,
    PluginError as PluginError,
    RecoveryPlan as RecoveryPlan,
    RestartRequested as RestartRequested,
    RetryBudget as RetryBudget,
    SliceLostError as SliceLostError,
    SpareWarning as SpareWarning,
    StepInterrupted as StepInterrupted,
    SyncMismatchError as SyncMismatchError,
    TrainingStopped as TrainingStopped,
)
from ._preemption import Preempted as Preempted
from ._run_lock import RunLockedError as RunLockedError, StaleLockWarning as StaleLockWarning
from ._goodput import BADPUT_CATEGORIES as BADPUT_CATEGORIES, GoodputClock as GoodputClock
from ._report import report_events as report_events, summary_table as summary_table, write_report as write_report
from ._mesh import (
    DEVICE_AXIS as DEVICE_AXIS,
    SLICE_AXIS as SLICE_AXIS,
    WithinSlice as WithinSlice,
    batch_sharding as batch_sharding,
    make_mesh as make_mesh,
    state_shardings as state_shardings,
)
from ._models import Transformer as Transformer, next_token_loss as next_token_loss
from ._plugins import DEFAULT_PLUGINS as DEFAULT_PLUGINS, make_plugin_manager as make_plugin_manager
from ._protocols import (
    RestartingStrategy as RestartingStrategy,
    RunView as RunView,
    Strategy as Strategy,
    TrainerView as TrainerView,
    restarts_process as restarts_process,
)
from ._state import TrainState as TrainState, init_train_state as init_train_state
from ._compiled_step import CompiledStep as CompiledStep, StepMonitor as StepMonitor
from ._step import StepFunctions as StepFunctions
from ._training_mode import AbstractTrainingMode as AbstractTrainingMode, SynchronousMode as SynchronousMode
from ._strategy import AbstractStrategy as AbstractStrategy, one_slice_lost as one_slice_lost
from ._stragglers import StragglerDrops as StragglerDrops
from ._trainer import FitResult as FitResult, Trainer as Trainer
from .hookspecs import hookimpl as hookimpl, hookspec as hookspec
from ._grain import GrainDataset as GrainDataset
from ._nnx import NnxModel as NnxModel

__version__ = "0.1.0"
