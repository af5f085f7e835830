"""For plugin and strategy authors: what a plugin sees of the trainer, and what it builds on.

A user of the trainer needs none of this (``elastic_trainer`` has what they
need). A plugin implements hooks (``elastic_trainer.hookimpl``, specified by
:data:`hookspec` in ``elastic_trainer.hookspecs``) and reads the trainer through
:class:`TrainerView`; a strategy subclasses :class:`AbstractStrategy` and answers
a :class:`Failure` with a :class:`RecoveryPlan`; a training mode subclasses
:class:`AbstractTrainingMode`. Import it as ``import elastic_trainer.plugin as etp``.
A backend author's surfaces (the abstract clusters) are in ``elastic_trainer.clusters``.
"""

from ._compiled_step import CompiledStep as CompiledStep, StepMonitor as StepMonitor
from ._failures import (
    Failure as Failure,
    RecoveryPlan as RecoveryPlan,
    RestartRequested as RestartRequested,
    RetryBudget as RetryBudget,
    StepInterrupted as StepInterrupted,
    SyncMismatchError as SyncMismatchError,
)
from ._goodput import BADPUT_CATEGORIES as BADPUT_CATEGORIES, GoodputClock as GoodputClock
from ._mesh import (
    DEVICE_AXIS as DEVICE_AXIS,
    SLICE_AXIS as SLICE_AXIS,
    WithinSlice as WithinSlice,
    batch_sharding as batch_sharding,
    make_mesh as make_mesh,
    state_shardings as state_shardings,
)
from ._plugins import DEFAULT_PLUGINS as DEFAULT_PLUGINS, make_plugin_manager as make_plugin_manager
from ._protocols import (
    RestartingStrategy as RestartingStrategy,
    RunView as RunView,
    Strategy as Strategy,
    TrainerView as TrainerView,
    restarts_process as restarts_process,
)
from ._report import report_events as report_events, summary_table as summary_table, write_report as write_report
from ._state import TrainState as TrainState, init_train_state as init_train_state
from ._step import StepFunctions as StepFunctions
from ._strategy import AbstractStrategy as AbstractStrategy, one_slice_lost as one_slice_lost
from ._stragglers import StragglerDrops as StragglerDrops
from ._training_mode import AbstractTrainingMode as AbstractTrainingMode, SynchronousMode as SynchronousMode
from .hookspecs import hookspec as hookspec

__all__ = [
    "BADPUT_CATEGORIES",
    "DEFAULT_PLUGINS",
    "DEVICE_AXIS",
    "SLICE_AXIS",
    "AbstractStrategy",
    "AbstractTrainingMode",
    "CompiledStep",
    "Failure",
    "GoodputClock",
    "RecoveryPlan",
    "RestartRequested",
    "RestartingStrategy",
    "RetryBudget",
    "RunView",
    "StepFunctions",
    "StepInterrupted",
    "StepMonitor",
    "Strategy",
    "StragglerDrops",
    "SyncMismatchError",
    "SynchronousMode",
    "TrainState",
    "TrainerView",
    "WithinSlice",
    "batch_sharding",
    "hookspec",
    "init_train_state",
    "make_mesh",
    "make_plugin_manager",
    "one_slice_lost",
    "report_events",
    "restarts_process",
    "state_shardings",
    "summary_table",
    "write_report",
]
