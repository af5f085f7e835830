"""Each default lives in its object's constructor: the schemas are built from them, and the YAMLs repeat them.

The YAMLs in conf/ are the documentation Hydra users read (every key,
commented), so they name constructor parameters with their defaults; these
tests keep the two equal, and each schema equal to its constructor's
signature. The few values that differ on purpose are named here, each with why.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import OmegaConf
from test_config import CONF_DIR, compose_config

import elastic_trainer as et
from elastic_trainer.config._schemas import (
    CheckpointConfig,
    ScheduledFailureConfig,
    TrainerConfig,
    register_configs,
)
from elastic_trainer_plugins.chaos import Chaos, ScheduledFailure
from elastic_trainer_plugins.metrics import TensorBoard
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.diloco import DiLoCo
from elastic_trainer_plugins.hot_swap import HotSwap
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

STRATEGIES = {"scale_down": ScaleDown, "pause_resume": PauseResume, "full_restart": FullRestart, "hot_swap": HotSwap,
              "diloco": DiLoCo}
CHAIN_OVERRIDES = [{"timeout_s": 30.0}, {}]  # pause_then_scale_down waits 30 s, not pause_resume's 300 s
PARAMETRIZE = pytest.mark.parametrize(("name", "cls"), STRATEGIES.items(), ids=STRATEGIES)

SCHEMA_CLASSES = {  # each schema in Hydra's ConfigStore that is built from a constructor, and its class
    "cluster/simulated": et.SimulatedCluster,
    "cluster/multiprocess": et.MultiprocessCluster,
    "cluster/pathways": et.PathwaysCluster,
    "model/transformer": et.Transformer,
    "data/stdlib_text": et.StdlibText,
    "chaos/chaos": Chaos,
    "logger/tensorboard": TensorBoard,
    **{f"strategy/{name}": cls for name, cls in STRATEGIES.items()},
}
LEFT_OUT = {  # constructor parameters a config does not set
    "cluster/pathways": {"slice_to_devices"},  # devices, for code that builds the cluster itself
    "model/transformer": {"key"},  # the builder passes the PRNG key
}
RETYPED = {  # annotations OmegaConf does not understand, and the schema's type instead
    "cluster/pathways": {"health_checker": str | None},  # a class, or its "module:Class" name
    "chaos/chaos": {"failures": list[ScheduledFailureConfig]},  # typed entries: a bad one is one sentence
}
DOCUMENTED_GROUPS = ("cluster", "model", "data", "chaos", "logger")  # their YAMLs' values are checked against the constructors
NOT_DEFAULTS = {  # YAML values that differ from their constructor's default on purpose
    "model/transformer.seq_len": "${data.seq_len}: the model follows the data",
    "chaos/during_save.failures": "the option is its one failure, during a save",
    "chaos/one_failure.failures": "the option is its one failure",
    "chaos/periodic.steps_per_failure": "the option is one failure per 100 steps",
    "chaos/periodic.random_down_for_s": "its lost slices come back after 0.5 s",
    "chaos/periodic.seed": "${seed}: the run's seed",
    "chaos/random.mean_steps_between_failures": "the option is a failure every 100 steps on average",
    "chaos/random.random_down_for_s": "its lost slices come back after 5 s",
    "chaos/random.seed": "${seed}: the run's seed",
    "chaos/schedule.seed": "${seed}: the run's seed",
}
SHARED_DEFAULTS = [  # (schema, the callable it configures, the fields that take that callable's defaults)
    (TrainerConfig, et.Trainer, {"within_slice", "snapshot_period", "step_timeout_s", "preemption_signal", "max_cached_layouts"}),
    (CheckpointConfig, et.Checkpointer, {"period", "mtbf_s", "max_to_keep", "async_save", "max_failed_saves"}),
    (CheckpointConfig, et.Trainer, {"resume"}),
]


def target(cls: type) -> str:
    """The import path Hydra's ``_target_`` names ``cls`` by: the one public module whose ``__all__`` holds it."""
    paths = [f"{module.__name__}.{cls.__name__}" for module in (et, et.strategies, et.chaos, et.loggers)
             if cls.__name__ in module.__all__ and getattr(module, cls.__name__) is cls]
    assert len(paths) == 1, f"{cls.__qualname__} has {len(paths)} public import paths: {paths}"
    return paths[0]


def constructor_defaults(cls: type, left_out: typing.Collection[str] = ()) -> dict[str, typing.Any]:
    """Each of ``cls``'s constructor parameters (less ``left_out``) and its default, a sequence as a list."""
    parameters = inspect.signature(cls).parameters.items()
    return {name: as_config(p.default) for name, p in parameters if name not in left_out}


def as_config(value: typing.Any) -> typing.Any:
    """``value`` as a config holds it: a sequence as a list, no default as OmegaConf's ``MISSING``."""
    if value is inspect.Parameter.empty:
        return "???"
    return list(value) if isinstance(value, tuple) else value


def field_default(field: dataclasses.Field) -> typing.Any:
    """A dataclass field's default, made by its factory where it has one."""
    return field.default if field.default_factory is dataclasses.MISSING else field.default_factory()


def schema_fields(schema: type) -> list[tuple[str, typing.Any, typing.Any]]:
    """Each field of ``schema``: its name, type and default."""
    return [(field.name, field.type, field_default(field)) for field in dataclasses.fields(schema)]


def signature_fields(
    cls: type, left_out: typing.Collection[str] = (), retyped: dict[str, typing.Any] | None = None
) -> list[tuple[str, typing.Any, typing.Any]]:
    """The fields a schema of ``cls``'s constructor must have, ``_target_`` aside: name, type and default."""
    hints = typing.get_type_hints(cls.__init__) | (retyped or {})
    return [(name, hints[name], default) for name, default in constructor_defaults(cls, left_out).items()]


def without_target(node: dict[str, typing.Any], cls: type) -> dict[str, typing.Any]:
    """``node`` less its ``_target_``, which must name ``cls``."""
    node = dict(node)
    assert node.pop("_target_") == target(cls)
    return node


@PARAMETRIZE
def test_each_strategy_yaml_composes_to_its_constructor_defaults(name, cls):
    strategy = OmegaConf.to_container(compose_config(f"+strategy={name}").strategy)
    assert without_target(strategy, cls) == constructor_defaults(cls)


@PARAMETRIZE
def test_each_strategy_yaml_names_every_constructor_parameter(name, cls):
    written = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml"))
    written.pop("defaults")
    assert without_target(written, cls) == constructor_defaults(cls)


def test_each_member_of_pause_then_scale_down_has_its_class_defaults_but_the_documented_wait():
    members = OmegaConf.to_container(compose_config("+strategy=pause_then_scale_down").strategy.strategies)
    assert [member["_target_"] for member in members] == [target(PauseResume), target(ScaleDown)]
    for member, overrides in zip(members, CHAIN_OVERRIDES, strict=True):
        cls = get_class(member["_target_"])
        assert without_target(member, cls) == constructor_defaults(cls) | overrides
    assert constructor_defaults(PauseResume)["timeout_s"] != CHAIN_OVERRIDES[0]["timeout_s"]  # a real override


def test_each_member_of_swap_then_scale_down_has_its_class_defaults():
    members = OmegaConf.to_container(compose_config("+strategy=swap_then_scale_down").strategy.strategies)
    assert [member["_target_"] for member in members] == [target(HotSwap), target(ScaleDown)]
    for member in members:
        cls = get_class(member["_target_"])
        assert without_target(member, cls) == constructor_defaults(cls)


@pytest.mark.parametrize(("name", "cls"), SCHEMA_CLASSES.items(), ids=SCHEMA_CLASSES)
def test_each_schema_is_its_constructor_signature(name, cls):
    register_configs()
    schema = OmegaConf.get_type(ConfigStore.instance().load(f"schema/{name}.yaml").node)
    expected = [("_target_", str, target(cls)), *signature_fields(cls, LEFT_OUT.get(name, ()), RETYPED.get(name))]
    assert schema_fields(schema) == expected


def test_the_schema_of_a_scheduled_failure_is_its_signature():
    assert schema_fields(ScheduledFailureConfig) == signature_fields(ScheduledFailure)  # no _target_: Chaos builds it


def documented_yamls() -> list[str]:
    """``group/option`` of each YAML whose values are checked against its constructor."""
    return [f"{group}/{path.stem}" for group in DOCUMENTED_GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


def written_values(option: str) -> tuple[type, dict[str, typing.Any]]:
    """The class a YAML configures (by the schema its defaults list names) and the values it writes, unresolved."""
    written = OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{option}.yaml"))
    schema = written.pop("defaults")[0].removeprefix("/schema/").removesuffix("@_here_")
    cls = SCHEMA_CLASSES[schema]
    assert written.pop("_target_", target(cls)) == target(cls)  # written, or left to the schema
    return cls, written


@pytest.mark.parametrize("option", documented_yamls())
def test_each_yaml_value_is_its_constructor_default_unless_documented(option):
    cls, written = written_values(option)
    defaults = constructor_defaults(cls)
    assert set(written) <= set(defaults), f"{option}.yaml sets keys that {cls.__name__} does not take"
    differ = {f"{option}.{key}" for key, value in written.items() if value != defaults[key]}
    assert differ == {key for key in NOT_DEFAULTS if key.startswith(f"{option}.")}


def test_each_documented_exception_names_a_yaml_that_exists():
    assert {key.rsplit(".", 1)[0] for key in NOT_DEFAULTS} <= set(documented_yamls())


def test_config_yaml_names_every_trainer_and_checkpoint_field_with_its_schema_default():
    written = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))
    for section, schema in (("trainer", TrainerConfig), ("checkpoint", CheckpointConfig)):
        assert written[section] == {name: default for name, _, default in schema_fields(schema)}


@pytest.mark.parametrize(("schema", "function", "fields"), SHARED_DEFAULTS,
                         ids=[f"{s.__name__}-{f.__name__}" for s, f, _ in SHARED_DEFAULTS])
def test_trainer_and_checkpoint_schemas_take_the_defaults_of_what_they_configure(schema, function, fields):
    parameters = inspect.signature(function).parameters.items()
    defaults = {name: p.default for name, p in parameters if p.default is not inspect.Parameter.empty}
    shared = {name: default for name, _, default in schema_fields(schema) if name in defaults}
    assert set(shared) == fields
    assert shared == {name: defaults[name] for name in fields}
