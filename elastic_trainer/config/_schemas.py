"""Structured-config schemas, and the one place where configs become objects."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

from .._checkpoint import check_period
from .._data import StdlibText
from .._failures import ConfigError, check_at_least
from ..clusters._pathways import load_health_checker
from .._period import check_mtbf
from ._settings import check_multiprocess_settings, check_trainer_settings


@dataclasses.dataclass
class TrainerConfig:
    """``trainer``: how long and how wide to train."""

    steps: int = 300
    global_batch_size: int = 48
    within_slice: str = "replicated"
    snapshot_period: int = 10
    step_timeout_s: float = 300.0
    compilation_cache_dir: str | None = None

    def __post_init__(self):
        check_trainer_settings(
            steps=self.steps,
            global_batch_size=self.global_batch_size,
            snapshot_period=self.snapshot_period,
            step_timeout_s=self.step_timeout_s,
            within_slice=self.within_slice,
        )
        if self.compilation_cache_dir and Path(self.compilation_cache_dir).is_file():
            raise ConfigError(
                f"trainer.compilation_cache_dir {self.compilation_cache_dir} is a file, not a directory; "
                "point it at a directory."
            )


@dataclasses.dataclass
class CheckpointConfig:
    """``checkpoint``: Orbax checkpoints of the train state."""

    enabled: bool = True
    period: Any = 100  # steps, or "auto"; OmegaConf has no int-or-string type
    mtbf_s: float | None = None
    max_to_keep: int = 3
    dir: str | None = None
    resume: bool = False
    async_save: bool = True

    def __post_init__(self):
        check_period(self.period)
        check_mtbf(self.mtbf_s)
        check_at_least("checkpoint.max_to_keep", self.max_to_keep, 1)
        if self.resume and not self.enabled:
            raise ConfigError("checkpoint.resume needs checkpoint.enabled=true.")


@dataclasses.dataclass
class SimulatedClusterConfig:
    """``cluster=simulated``: slices of CPU devices in this process."""

    _target_: str = "elastic_trainer.SimulatedCluster"
    slices: int = 4
    devices_per_slice: int = 2

    def __post_init__(self):
        check_at_least("cluster.slices", self.slices, 1)
        check_at_least("cluster.devices_per_slice", self.devices_per_slice, 1)


@dataclasses.dataclass
class MultiprocessClusterConfig:
    """``cluster=multiprocess``: slices made of JAX processes (``jax.distributed``)."""

    _target_: str = "elastic_trainer.MultiprocessCluster"
    num_processes: int = 2
    devices_per_process: int | None = 2
    processes_per_slice: int = 1
    heartbeat_timeout_s: int = 5
    collective_timeout_s: int = 10
    initialization_timeout_s: int = 120
    platform: str | None = "cpu"
    launcher: str = "local"

    def __post_init__(self):
        # checked here too, not only by MultiprocessCluster: the local launcher checks the config before it
        # starts any process, and the cluster itself is built only in the processes it starts
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_target_"}
        check_multiprocess_settings(**settings)


@dataclasses.dataclass
class TransformerConfig:
    """``model=transformer``: the default decoder-only language model."""

    _target_: str = "elastic_trainer.Transformer"
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers", "mlp_ratio"):
            check_at_least(f"model.{name}", getattr(self, name), 1)
        if self.d_model % self.num_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must divide model.d_model ({self.d_model}).")


@dataclasses.dataclass
class StdlibTextConfig:
    """``data=stdlib_text``: byte-level text from Python's standard library."""

    _target_: str = "elastic_trainer.StdlibText"
    seq_len: int = 64
    max_bytes: int = 4_000_000

    def __post_init__(self):
        check_at_least("data.seq_len", self.seq_len, 1)
        check_at_least("data.max_bytes", self.max_bytes, self.seq_len + 1)


@dataclasses.dataclass
class WarmupCosineConfig:
    """A learning-rate schedule: linear warm-up, then cosine decay."""

    _target_: str = "optax.warmup_cosine_decay_schedule"
    init_value: float = 0.0
    peak_value: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 300
    end_value: float = 3e-4

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
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.01

    def __post_init__(self):
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {value}.")
        check_at_least("optimizer.weight_decay", self.weight_decay, 0)


@dataclasses.dataclass
class FunctionConfig:
    """A function named by ``_target_`` (``loss=next_token``)."""

    _target_: str = MISSING
    _partial_: bool = True


def schema_of(cls: type) -> type:
    """A schema built from ``cls``'s constructor: ``_target_`` (its import path), then each parameter with its
    annotation and default (``MISSING`` where it has none), so that the defaults live in the constructor only."""
    target = f"{cls.__module__}.{cls.__qualname__}"
    hints = typing.get_type_hints(cls.__init__)  # the plugins' annotations are strings (``from __future__``)
    fields = [("_target_", str, dataclasses.field(default=target))]
    for name, parameter in inspect.signature(cls).parameters.items():
        default = MISSING if parameter.default is inspect.Parameter.empty else parameter.default
        fields.append((name, hints[name], dataclasses.field(default=default)))
    doc = f"The schema of ``{target}``; its defaults and value checks live in its constructor."
    namespace = {"__module__": __name__, "__doc__": doc}  # found where it is stored, so that configs pickle
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields, namespace=namespace)


ScaleDownConfig = schema_of(ScaleDown)  # +strategy=scale_down
PauseResumeConfig = schema_of(PauseResume)  # +strategy=pause_resume
FullRestartConfig = schema_of(FullRestart)  # +strategy=full_restart


@dataclasses.dataclass
class PathwaysClusterConfig:
    """``cluster=pathways``: the slices of a Pathways job, through pathwaysutils (an optional extra)."""

    _target_: str = "elastic_trainer.PathwaysCluster"
    health_checker: str | None = None

    def __post_init__(self):
        # the class is loaded here too, so that a bad name is said in one sentence that names the field (not as
        # the cluster failing to build)
        if self.health_checker is not None:
            load_health_checker(self.health_checker)


@dataclasses.dataclass
class FallbackConfig:
    """``+strategy=pause_then_scale_down`` and other chains: each strategy takes over when the one before gives up."""

    _target_: str = "elastic_trainer_plugins.fallback.Fallback"
    strategies: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ScheduledFailureConfig:
    """One entry of ``chaos.failures``."""

    at_step: int = MISSING
    slice: int = MISSING
    phase: str = "train_step"
    down_for_s: float = 1e9
    hang: bool = False


@dataclasses.dataclass
class ChaosConfig:
    """``+chaos=schedule`` or ``+chaos=random``; value checks live in the plugin's constructor."""

    _target_: str = "elastic_trainer_plugins.chaos.Chaos"
    failures: list[ScheduledFailureConfig] = dataclasses.field(default_factory=list)
    mean_steps_between_failures: float = 0.0
    random_down_for_s: float = 1e9
    seed: int = 0
    steps_per_failure: int = 0

    def __post_init__(self):
        check_at_least("chaos.seed", self.seed, 0)  # numpy seeds must not be negative


@dataclasses.dataclass
class Config:
    """The whole run. Groups without a schema of ours (a user's model) are free-form."""

    seed: int = 0
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    cluster: Any = MISSING
    data: Any = MISSING
    model: Any = MISSING
    optimizer: Any = MISSING
    loss: Any = MISSING
    strategy: Any = None
    chaos: Any = None

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
        ("loss", "function", FunctionConfig),
        ("strategy", "scale_down", ScaleDownConfig),
        ("strategy", "pause_resume", PauseResumeConfig),
        ("strategy", "full_restart", FullRestartConfig),
        ("strategy", "fallback", FallbackConfig),
        ("chaos", "chaos", ChaosConfig),
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
