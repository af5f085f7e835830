"""elastic_trainer: elastic, fault-tolerant JAX training.

A dead slice surfaces as a Python exception, a strategy plugin decides what to
do, and training continues at the exact step and data position.

This module holds what a user of the trainer needs (``__all__``). Strategies are
in :mod:`elastic_trainer.strategies`, failure injection in :mod:`elastic_trainer.chaos`,
loggers in :mod:`elastic_trainer.loggers`; plugin authors' surfaces in
:mod:`elastic_trainer.plugin`, backend authors' in :mod:`elastic_trainer.clusters`.
"""

import importlib as _importlib
import warnings as _warnings

from .checkpoints._checkpointer import Checkpointer as Checkpointer
from .clusters import (
    MultiprocessCluster as MultiprocessCluster,
    PathwaysCluster as PathwaysCluster,
    SimulatedCluster as SimulatedCluster,
)
from ._elastic_retry import ElasticRun as ElasticRun, elastic_retry as elastic_retry
from ._data import AbstractDataset as AbstractDataset, StdlibText as StdlibText, sample_ids as sample_ids
from ._failures import (
    AcceleratorUnusedWarning as AcceleratorUnusedWarning,
    CheckpointWarning as CheckpointWarning,
    ConfigError as ConfigError,
    PluginError as PluginError,
    SliceLostError as SliceLostError,
    SpareWarning as SpareWarning,
    TrainingStopped as TrainingStopped,
)
from ._preemption import Preempted as Preempted
from ._run_lock import RunLockedError as RunLockedError, StaleLockWarning as StaleLockWarning
from ._models import Transformer as Transformer, next_token_loss as next_token_loss
from ._trainer import FitResult as FitResult, Trainer as Trainer
from ._report import RunReport as RunReport
from .hookspecs import hookimpl as hookimpl
from ._grain import GrainDataset as GrainDataset
from ._nnx import NnxModel as NnxModel
from . import plugin as _plugin

__version__ = "0.1.0"

__all__ = [
    # the trainer and its result
    "Trainer",
    "FitResult",
    "RunReport",
    "Checkpointer",
    "elastic_retry",
    "ElasticRun",
    # data and models
    "AbstractDataset",
    "StdlibText",
    "GrainDataset",
    "sample_ids",
    "NnxModel",
    "Transformer",
    "next_token_loss",
    # the clusters a user picks
    "SimulatedCluster",
    "MultiprocessCluster",
    "PathwaysCluster",
    # strategies, failure injection, loggers, and the marker of a plugin's hooks
    "strategies",
    "chaos",
    "loggers",
    "hookimpl",
    # what a user catches or filters
    "ConfigError",
    "PluginError",
    "TrainingStopped",
    "SliceLostError",
    "Preempted",
    "RunLockedError",
    "AcceleratorUnusedWarning",
    "CheckpointWarning",
    "SpareWarning",
    "StaleLockWarning",
]

_BACKEND_NAMES = (
    "AbstractCluster", "AbstractInjectableCluster", "AbstractMultiControllerCluster",
    "AbstractProcessInjectableCluster", "AbstractRejoinCluster", "AbstractSpareCluster", "AbstractTimedCluster",
    "SyncCall", "has_spares", "mesh_slice_count", "vital_slices",
)
_MOVED = {**dict.fromkeys(_plugin.__all__, "elastic_trainer.plugin"),
          **dict.fromkeys(_BACKEND_NAMES, "elastic_trainer.clusters")}
"""The names this module exported until 0.1.0 that moved, by the module they live in now."""


_SUBMODULES = ("strategies", "chaos", "loggers")
"""Imported when first asked for: they import the built-in plugins (``elastic_trainer_plugins``), which import this
package, so importing them here would fail for a program whose first import is a built-in plugin's module."""


def __getattr__(name: str):
    """A submodule of :data:`_SUBMODULES` on first use; a moved name from its new module, with a
    ``DeprecationWarning`` naming where it lives now (PEP 562)."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_trainer' has no attribute {name!r}")
    _warnings.warn(
        f"elastic_trainer.{name} moved to {module}.{name}; import it from there "
        "(the old name goes in the next release).", DeprecationWarning, stacklevel=2,
    )
    return getattr(_importlib.import_module(module), name)
