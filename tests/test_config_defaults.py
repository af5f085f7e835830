"""The strategies' defaults live in their constructors: the schemas are built from them, and the YAMLs repeat them.

The YAMLs in conf/strategy are the documentation Hydra users read (every key,
commented), so they name each constructor parameter with its default; these
tests keep the two equal.
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

from elastic_trainer.config._schemas import register_configs
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

STRATEGIES = {"scale_down": ScaleDown, "pause_resume": PauseResume, "full_restart": FullRestart}
CHAIN_OVERRIDES = [{"timeout_s": 30.0}, {}]  # pause_then_scale_down waits 30 s, not pause_resume's 300 s
PARAMETRIZE = pytest.mark.parametrize(("name", "cls"), STRATEGIES.items(), ids=STRATEGIES)


def target(cls: type) -> str:
    """The import path Hydra's ``_target_`` names ``cls`` by."""
    return f"{cls.__module__}.{cls.__qualname__}"


def constructor_defaults(cls: type) -> dict[str, typing.Any]:
    """Each of ``cls``'s constructor parameters and its default."""
    return {name: parameter.default for name, parameter in inspect.signature(cls).parameters.items()}


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


@PARAMETRIZE
def test_each_strategy_schema_is_its_constructor_signature(name, cls):
    register_configs()
    schema = OmegaConf.get_type(ConfigStore.instance().load(f"schema/strategy/{name}.yaml").node)
    hints = typing.get_type_hints(cls.__init__)
    expected = [("_target_", str, target(cls))]
    expected += [(parameter, hints[parameter], default) for parameter, default in constructor_defaults(cls).items()]
    assert [(field.name, field.type, field.default) for field in dataclasses.fields(schema)] == expected
