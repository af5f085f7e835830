"""Structured-config schemas for Hydra's ConfigStore, built from the constructors they configure where there is one."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from elastic_trainer_plugins.chaos import Chaos, ScheduledFailure, check_chaos_settings
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.diloco import DiLoCo
from elastic_trainer_plugins.hot_swap import HotSwap
from elastic_trainer_plugins.metrics import TensorBoard
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

from ..checkpoints._checkpointer import Checkpointer
from .._data import StdlibText
from .._failures import ConfigError, check_at_least
from .._models import Transformer
from .._preemption import stop_signals
from .._stragglers import StragglerRule
from .._trainer import Trainer
from ..clusters.multicontroller._multiprocess import MultiprocessCluster
from ..clusters._pathways import PathwaysCluster, load_health_checker
from ..clusters._simulated import SimulatedCluster
from ._settings import (
    check_checkpoint_settings,
    check_multiprocess_settings,
    check_simulated_settings,
    check_stdlib_text_settings,
    check_trainer_settings,
    check_transformer_settings,
)


def default_of(function: Callable, name: str) -> Any:
    """The default of ``function``'s parameter ``name``: a schema field takes it from there, so it is written once."""
    default = inspect.signature(function).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{function.__qualname__}'s parameter {name} has no default to take.")
    return default


DEFAULT_COMPILATION_CACHE_DIR = "${oc.env:JAX_COMPILATION_CACHE_DIR,'~/.cache/elastic_trainer/jax_cache'}"
"""JAX's persistent compilation cache: where JAX's own variable says, else one per user, shared by every run (on by
default, as MaxText's ``jax_cache_dir``), so that a re-run, resumed or restarted job loads its compiled steps."""


@dataclasses.dataclass
class TrainerConfig:
    """``trainer``: how long and how wide to train."""

    steps: int = 300
    """train until this many steps are completed."""
    global_batch_size: int = 48
    """samples per step over all devices (divisible by the device count)."""
    within_slice: str = default_of(Trainer, "within_slice")
    """the state within a slice: ``replicated``, or ``sharded`` over the slice's devices."""
    snapshot_period: int = default_of(Trainer, "snapshot_period")
    """copy the state to host memory every this many steps, restored if no slice survives (0: never)."""
    step_timeout_s: float = default_of(Trainer, "step_timeout_s")
    """a step that takes longer counts as a hung slice and is recovered (0: no limit)."""
    compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE_DIR
    """JAX's persistent compilation cache, shared by every run (MaxText's ``jax_cache_dir``); ``null``: off."""
    preemption_signal: str | None = default_of(Trainer, "preemption_signal")
    """a signal that stops training like SIGTERM and Ctrl-C: at a step boundary, with a checkpoint
    (``SIGUSR1``, say)."""
    max_cached_layouts: int = default_of(Trainer, "max_cached_layouts")
    """keep the compiled steps of at most this many layouts (the least recently used goes first)."""
    straggler_factor: float = StragglerRule.factor
    """a slice whose own step time is above this many times the other slices' median for ``straggler_steps``
    steps in a row is a straggler."""
    straggler_steps: int = StragglerRule.steps
    """how many steps in a row make a straggler; as many steps not slow and it has recovered."""

    def __post_init__(self):
        StragglerRule(self.straggler_factor, self.straggler_steps)  # checks them
        check_trainer_settings(
            steps=self.steps,
            global_batch_size=self.global_batch_size,
            snapshot_period=self.snapshot_period,
            step_timeout_s=self.step_timeout_s,
            within_slice=self.within_slice,
            max_cached_layouts=self.max_cached_layouts,
        )
        stop_signals(self.preemption_signal)  # a name that is no signal, or one that cannot be caught
        if self.compilation_cache_dir and Path(self.compilation_cache_dir).expanduser().is_file():
            raise ConfigError(
                f"trainer.compilation_cache_dir {self.compilation_cache_dir} is a file, not a directory; "
                "point it at a directory."
            )


@dataclasses.dataclass
class CheckpointConfig:
    """``checkpoint``: Orbax checkpoints of the train state."""

    enabled: bool = True
    """save Orbax checkpoints of the train state."""
    period: Any = default_of(Checkpointer, "period")  # steps, or "auto"; OmegaConf has no int-or-string type
    """save every this many steps (and at the last step); ``auto``: the Young/Daly period from the measured costs."""
    mtbf_s: float | None = default_of(Checkpointer, "mtbf_s")
    """for ``period=auto``: the expected seconds between failures; ``null``: the rate observed in the run."""
    max_to_keep: int = default_of(Checkpointer, "max_to_keep")
    """keep this many checkpoints; older ones are deleted."""
    dir: str | None = None
    """where to save; ``null``: ``checkpoints/`` in the run directory."""
    resume: bool = default_of(Trainer, "resume")
    """continue from the latest complete checkpoint in ``dir``."""
    async_save: bool = default_of(Checkpointer, "async_save")
    """commit saves in the background; the step loop waits only for the copy to host memory."""
    max_failed_saves: int = default_of(Checkpointer, "max_failed_saves")
    """a save that fails for I/O (a full disk, EIO) is reported and training goes on; this many in a row stop
    the run (exit status 3)."""

    def __post_init__(self):
        check_checkpoint_settings(period=self.period, max_to_keep=self.max_to_keep, mtbf_s=self.mtbf_s,
                                  max_failed_saves=self.max_failed_saves, directory=self.dir)
        if self.resume and not self.enabled:
            raise ConfigError("checkpoint.resume needs checkpoint.enabled=true.")


@dataclasses.dataclass
class WarmupCosineConfig:
    """A learning-rate schedule: linear warm-up, then cosine decay."""

    _target_: str = "optax.warmup_cosine_decay_schedule"
    init_value: float = 0.0
    """the learning rate at step 0."""
    peak_value: float = 3e-3
    """the learning rate at the end of the warm-up."""
    warmup_steps: int = 10
    """steps of linear warm-up."""
    decay_steps: int = 300
    """steps until the decay ends, the warm-up included (``trainer.steps`` in ``optimizer=adamw``)."""
    end_value: float = 3e-4
    """the learning rate at the end of the decay."""

    def __post_init__(self):
        for name in ("init_value", "peak_value", "end_value", "warmup_steps"):
            check_at_least(f"optimizer.learning_rate.{name}", getattr(self, name), 0)
        if self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"optimizer.learning_rate.decay_steps ({self.decay_steps}, trainer.steps by default) must exceed "
                f"warmup_steps ({self.warmup_steps}); train longer or lower optimizer.learning_rate.warmup_steps."
            )


@dataclasses.dataclass
class AdamWConfig:
    """``optimizer=adamw``: optax.adamw with a warm-up cosine schedule."""

    _target_: str = "optax.adamw"
    learning_rate: WarmupCosineConfig = dataclasses.field(default_factory=WarmupCosineConfig)
    """the learning-rate schedule."""
    b1: float = 0.9
    """the decay of the first-moment estimate."""
    b2: float = 0.999
    """the decay of the second-moment estimate."""
    weight_decay: float = 0.01
    """decoupled weight decay."""

    def __post_init__(self):
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {value}.")
        check_at_least("optimizer.weight_decay", self.weight_decay, 0)


@dataclasses.dataclass
class LossConfig:
    """``loss``: the loss function named by ``_target_`` (``loss=next_token``), and what it returns."""

    _target_: str = MISSING
    _partial_: bool = True
    has_aux: bool = default_of(Trainer, "has_aux")
    """the loss returns ``(loss, aux)``, ``aux`` a dict of scalars (accuracy, ...) shown in the progress line,
    the report's ``history`` and the logger (``Trainer(has_aux=True)``)."""


def schema_of(
    cls: type,
    *,
    target: str | bool = True,
    check: Callable[..., None] | None = None,
    leave_out: Collection[str] = (),
    types: Mapping[str, Any] | None = None,
) -> type:
    """A schema built from ``cls``'s constructor, so that its defaults live in the constructor only.

    Its fields are ``_target_``, then each parameter with its annotation and default (``MISSING`` where it has
    none). ``target`` is the ``_target_``: ``True`` for ``cls``'s import path, a string for another, ``False``
    for none (an entry that its parent's constructor builds). ``check`` is called in ``__post_init__`` with the
    fields its parameters name; ``leave_out`` names the parameters a config does not set (run-time arguments);
    ``types`` replaces annotations that OmegaConf does not understand.
    """
    path = f"{cls.__module__}.{cls.__qualname__}"
    hints = typing.get_type_hints(cls.__init__) | dict(types or {})  # the plugins' annotations are strings
    fields = [("_target_", str, dataclasses.field(default=path if target is True else target))] if target else []
    for name, parameter in inspect.signature(cls).parameters.items():
        if name not in leave_out:
            fields.append((name, hints[name], _field(parameter.default)))
    doc = f"The schema of ``{path}``; its defaults and value checks live in its constructor."
    # found where it is stored, so that configs pickle; built_from, whose docstring's :param fields describe the
    # fields in the configuration reference (docs/gen_reference.py)
    namespace = {"__module__": __name__, "__doc__": doc, "built_from": cls}
    if check is not None:
        namespace["__post_init__"] = _post_init(check)
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields, namespace=namespace)


def _field(default: Any) -> dataclasses.Field:
    """A schema field of this default: ``MISSING`` for none, a fresh list for a sequence (OmegaConf's lists)."""
    if default is inspect.Parameter.empty:
        return dataclasses.field(default=MISSING)
    if isinstance(default, (list, tuple)):
        return dataclasses.field(default_factory=functools.partial(list, default))
    return dataclasses.field(default=default)


def _post_init(check: Callable[..., None]) -> Callable[[Any], None]:
    """A schema's ``__post_init__`` that calls ``check`` with the fields its parameters name."""
    names = list(inspect.signature(check).parameters)

    def __post_init__(self) -> None:
        """Check the values with the constructor's own checks."""
        check(**{name: getattr(self, name) for name in names})

    return __post_init__


def _check_stdlib_text(*, seq_len: int, max_bytes: int) -> None:
    """StdlibText's own checks, and that ``max_bytes`` holds one window (StdlibText says so once it read the text)."""
    check_stdlib_text_settings(seq_len=seq_len)
    check_at_least("data.max_bytes", max_bytes, seq_len + 1)


def _check_pathways(*, health_checker: str | None, spare_slices: int) -> None:
    """Check ``spare_slices``, and load the class ``health_checker`` names, so that a bad name is one sentence
    naming the field (not as the cluster failing to build)."""
    check_at_least("cluster.spare_slices", spare_slices, 0)
    if health_checker is not None:
        load_health_checker(health_checker)


# the built-in classes are named by their public import paths (elastic_trainer.SimulatedCluster,
# elastic_trainer.strategies.ScaleDown), the ones a user imports them from
SimulatedClusterConfig = schema_of(  # cluster=simulated
    SimulatedCluster, target="elastic_trainer.SimulatedCluster", check=check_simulated_settings
)
# checked here too, not only by MultiprocessCluster: the local launcher checks the config before it starts any
# process, and the cluster itself is built only in the processes it starts
MultiprocessClusterConfig = schema_of(  # cluster=multiprocess
    MultiprocessCluster, target="elastic_trainer.MultiprocessCluster", check=check_multiprocess_settings
)
PathwaysClusterConfig = schema_of(  # cluster=pathways; slice_to_devices is for code that builds it itself
    PathwaysCluster, target="elastic_trainer.PathwaysCluster", check=_check_pathways,
    leave_out=("slice_to_devices",), types={"health_checker": str | None},
)
TransformerConfig = schema_of(  # model=transformer; the builder passes the key
    Transformer, target="elastic_trainer.Transformer", check=check_transformer_settings, leave_out=("key",)
)
StdlibTextConfig = schema_of(StdlibText, target="elastic_trainer.StdlibText", check=_check_stdlib_text)  # data=...
ScaleDownConfig = schema_of(ScaleDown, target="elastic_trainer.strategies.ScaleDown")  # +strategy=scale_down
PauseResumeConfig = schema_of(PauseResume, target="elastic_trainer.strategies.PauseResume")  # +strategy=pause_resume
FullRestartConfig = schema_of(FullRestart, target="elastic_trainer.strategies.FullRestart")  # +strategy=full_restart
HotSwapConfig = schema_of(HotSwap, target="elastic_trainer.strategies.HotSwap")  # +strategy=hot_swap
DiLoCoConfig = schema_of(DiLoCo, target="elastic_trainer.strategies.DiLoCo")  # +strategy=diloco
ScheduledFailureConfig = schema_of(ScheduledFailure, target=False)  # one entry of chaos.failures; Chaos checks it
ChaosConfig = schema_of(  # +chaos=schedule, +chaos=random, ...; typed entries, so that a bad one is one sentence
    Chaos, target="elastic_trainer.chaos.Chaos", check=check_chaos_settings,
    types={"failures": list[ScheduledFailureConfig]},
)
TensorBoardConfig = schema_of(TensorBoard, target="elastic_trainer.loggers.TensorBoard")  # +logger=tensorboard


@dataclasses.dataclass
class FallbackConfig:
    """``+strategy=pause_then_scale_down`` and other chains: each strategy takes over when the one before gives up."""

    _target_: str = "elastic_trainer.strategies.Fallback"
    strategies: list[Any] = dataclasses.field(default_factory=list)
    """the chain, first choice first: each entry a strategy's config with its ``_target_``."""


@dataclasses.dataclass
class Config:
    """The whole run. Groups without a schema of ours (a user's model) are free-form."""

    seed: int = 0
    """seeds the model's initialisation, the data order and the per-step keys."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    cluster: Any = MISSING
    """where to run: simulated slices of CPU devices, processes on JAX's distributed runtime, or Pathways."""
    data: Any = MISSING
    """what to train on."""
    model: Any = MISSING
    """what to train."""
    optimizer: Any = MISSING
    """how to update: an optax gradient transformation."""
    loss: Any = MISSING
    """what to minimise: ``loss_fn(model, batch, *, key) -> scalar`` (``-> (scalar, aux)`` with ``loss.has_aux``)."""
    strategy: Any = None
    """what to do when a slice is lost (none: a failure stops the run)."""
    chaos: Any = None
    """failure injection: slices lost on a schedule or at random."""
    logger: Any = None
    """where the run's scalars go besides the terminal and ``report.json``."""

    def __post_init__(self):
        check_at_least("seed", self.seed, 0)  # numpy seeds the data order, and its seeds must not be negative
        if isinstance(self.model, TransformerConfig) and isinstance(self.data, StdlibTextConfig):
            if self.model.seq_len < self.data.seq_len:
                raise ConfigError(f"model.seq_len ({self.model.seq_len}) must be at least data.seq_len "
                                  f"({self.data.seq_len}); it follows data.seq_len unless set.")
            if self.model.vocab_size < StdlibText.vocab_size:
                raise ConfigError(f"model.vocab_size ({self.model.vocab_size}) must be at least the data's "
                                  f"{StdlibText.vocab_size} tokens; byte-level text needs {StdlibText.vocab_size}.")
        cluster = self.cluster
        if isinstance(cluster, MultiprocessClusterConfig) and cluster.devices_per_process is not None:
            # the trainer checks this too, but only in the processes the local launcher has already started
            devices = cluster.num_processes * cluster.devices_per_process
            if self.trainer.global_batch_size % devices:
                raise ConfigError(
                    f"trainer.global_batch_size ({self.trainer.global_batch_size}) must be divisible by the job's "
                    f"{devices} devices (cluster.num_processes={cluster.num_processes} x "
                    f"cluster.devices_per_process={cluster.devices_per_process}); change one of them."
                )


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore, where ``conf/`` refers to them."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, name, node in (
        ("cluster", "simulated", SimulatedClusterConfig),
        ("cluster", "multiprocess", MultiprocessClusterConfig),
        ("cluster", "pathways", PathwaysClusterConfig),
        ("model", "transformer", TransformerConfig),
        ("data", "stdlib_text", StdlibTextConfig),
        ("optimizer", "adamw", AdamWConfig),
        ("loss", "function", LossConfig),
        ("strategy", "scale_down", ScaleDownConfig),
        ("strategy", "pause_resume", PauseResumeConfig),
        ("strategy", "full_restart", FullRestartConfig),
        ("strategy", "hot_swap", HotSwapConfig),
        ("strategy", "diloco", DiLoCoConfig),
        ("strategy", "fallback", FallbackConfig),
        ("chaos", "chaos", ChaosConfig),
        ("logger", "tensorboard", TensorBoardConfig),
    ):
        store.store(group=f"schema/{group}", name=name, node=node)


def check_config(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` with one sentence for any value the schemas reject."""
    try:
        OmegaConf.to_object(cfg)
    except OmegaConfBaseException as error:
        raise ConfigError(omegaconf_message(error)) from error


def omegaconf_message(error: OmegaConfBaseException, key: str | None = None) -> str:
    """One sentence for an OmegaConf error: the key (``key``, else the error's), and what is wrong with its value."""
    key = key or error.full_key
    if isinstance(error, MissingMandatoryValue):
        return f"{key} has no value; give it one."
    first = str(error.msg).splitlines()[0].rstrip(".")
    return f"{key}: {first[:1].lower()}{first[1:]}."
