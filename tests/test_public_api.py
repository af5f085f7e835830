"""The public API: what each public module's ``__all__`` holds, one import path per name, and the names that moved
out of ``elastic_trainer`` still working from there for a release, with a warning naming their new place."""

import importlib
import subprocess
import sys

import pytest

import elastic_trainer as et

PUBLIC_MODULES = ("elastic_trainer", "elastic_trainer.plugin", "elastic_trainer.clusters",
                  "elastic_trainer.strategies", "elastic_trainer.chaos", "elastic_trainer.loggers")
MOVED = {  # a sample of the names elastic_trainer exported until 0.1.0, by where they live now
    "AbstractStrategy": "elastic_trainer.plugin",
    "TrainerView": "elastic_trainer.plugin",
    "RecoveryPlan": "elastic_trainer.plugin",
    "make_mesh": "elastic_trainer.plugin",
    "hookspec": "elastic_trainer.plugin",
    "AbstractCluster": "elastic_trainer.clusters",
    "SyncCall": "elastic_trainer.clusters",
    "has_spares": "elastic_trainer.clusters",
}


def exported(module_name: str) -> list[str]:
    return importlib.import_module(module_name).__all__


def test_the_top_level_holds_what_a_user_of_the_trainer_needs():
    assert len(et.__all__) <= 31
    assert {"Trainer", "FitResult", "elastic_retry", "SimulatedCluster", "strategies", "chaos", "hookimpl",
            "ConfigError", "TrainingStopped", "SliceLostError"} <= set(et.__all__)
    assert not {"AbstractCluster", "CompiledStep", "make_plugin_manager", "ScaleDown"} & set(et.__all__)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_exported_name_resolves(module_name):
    module = importlib.import_module(module_name)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{module_name}.{name}"


def test_each_name_has_one_public_import_path():
    homes: dict[str, list[str]] = {}
    for module_name in PUBLIC_MODULES:
        for name in exported(module_name):
            homes.setdefault(name, []).append(module_name)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


@pytest.mark.parametrize(("name", "home"), MOVED.items())
def test_a_moved_name_still_works_from_the_top_level_and_warns_with_its_new_place(name, home):
    with pytest.warns(DeprecationWarning, match=rf"^elastic_trainer\.{name} moved to {home}\.{name};"):
        found = getattr(et, name)
    assert found is getattr(importlib.import_module(home), name)
    assert name in exported(home)


def test_a_moved_name_imported_from_the_top_level_warns_too():
    with pytest.warns(DeprecationWarning, match=r"elastic_trainer\.Failure moved to elastic_trainer\.plugin\.Failure"):
        from elastic_trainer import Failure  # noqa: PLC0415
    assert Failure is importlib.import_module("elastic_trainer.plugin").Failure


def test_every_name_that_moved_is_exported_where_it_went_and_hidden_from_dir():
    for name, home in et._MOVED.items():
        assert name in exported(home), f"{name} moved to {home}, whose __all__ lacks it"
        assert name not in dir(et)
    assert {"AbstractStrategy", "TrainState", "AbstractCluster", "vital_slices"} <= set(et._MOVED)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        et.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("module", ["elastic_trainer_plugins.diloco", "elastic_trainer_plugins.metrics",
                                    "elastic_trainer_plugins.chaos", "elastic_trainer_plugins.scale_down"])
def test_a_program_may_import_a_built_in_plugin_first(module):
    """A third party subclassing a built-in plugin's class imports its module before elastic_trainer itself."""
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
