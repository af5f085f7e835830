import importlib.metadata

import equinox as eqx
import jax
import numpy as np
import pytest

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer import _plugins
from elastic_trainer.launch._cli import main


def test_built_ins_are_registered_by_name():
    manager = etp.make_plugin_manager(load_entry_points=False)
    for name in etp.DEFAULT_PLUGINS:
        assert manager.get_plugin(name) is not None, name


def test_entry_point_plugins_are_loaded_by_name(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="observer", value="json", group="elastic_trainer")
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: [ep])
    manager = etp.make_plugin_manager(load_entry_points=True)
    assert manager.get_plugin("observer").__name__ == "json"


def test_plugin_that_fails_to_import_is_named(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="broken", value="no_such_module_xyz", group="elastic_trainer")
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: [ep])
    with pytest.raises(et.PluginError, match=r"plugin 'broken' \(no_such_module_xyz\) failed to import"):
        etp.make_plugin_manager(load_entry_points=True)


def test_autoload_follows_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: calls.append(group) or [])
    etp.make_plugin_manager()
    assert calls == []  # conftest sets ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD
    monkeypatch.delenv(_plugins.DISABLE_AUTOLOAD_ENV)
    etp.make_plugin_manager()
    assert calls == ["elastic_trainer"]


def test_mesh_plugin_returning_garbage_is_a_plugin_error(tiny_trainer_kwargs):
    class BadMesh:
        @et.hookimpl
        def et_make_mesh(self):
            return "a mesh, trust me"

    trainer = et.Trainer(**tiny_trainer_kwargs(plugins=[BadMesh()]))
    with pytest.raises(et.PluginError, match="et_make_mesh returned 'a mesh, trust me'"):
        trainer.fit()


def two_entry_points(monkeypatch):
    eps = [
        importlib.metadata.EntryPoint(name="observer", value="json", group="elastic_trainer"),
        importlib.metadata.EntryPoint(name="other", value="csv", group="elastic_trainer"),
    ]
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: eps)


@pytest.mark.parametrize(
    ("allowed", "loaded"),
    [("observer", {"observer"}), (" other , observer ", {"observer", "other"}), ("", set())],
)
def test_allow_list_loads_only_the_entry_points_it_names(monkeypatch, allowed, loaded):
    two_entry_points(monkeypatch)
    monkeypatch.setenv(_plugins.LOAD_PLUGINS_ENV, allowed)
    manager = etp.make_plugin_manager(load_entry_points=True)
    assert {name for name in ("observer", "other") if manager.get_plugin(name)} == loaded
    assert all(manager.get_plugin(name) for name in etp.DEFAULT_PLUGINS)


def test_allow_list_naming_a_plugin_that_is_not_installed_is_an_error(monkeypatch):
    two_entry_points(monkeypatch)
    monkeypatch.setenv(_plugins.LOAD_PLUGINS_ENV, "observer,obsrever")
    message = r"names 'obsrever', which is not an installed plugin; installed: observer, other\."
    with pytest.raises(et.PluginError, match=message):
        etp.make_plugin_manager(load_entry_points=True)


class FakeCluster:
    def healthy_slices(self):
        return [0, 2]


class FakeTrainer:
    cluster = FakeCluster()


@pytest.mark.parametrize("value", ["1", "0", None])
def test_hook_calls_are_traced_to_stderr_when_asked(monkeypatch, capsys, value):
    if value is not None:
        monkeypatch.setenv(_plugins.TRACE_HOOKS_ENV, value)
    manager = etp.make_plugin_manager()
    assert manager.hook.et_slice_health(trainer=FakeTrainer()) == [0, 2]
    err = capsys.readouterr().err
    if value == "1":
        assert "et_slice_health [hook]\n" in err and "trainer: " in err
        assert "finish et_slice_health --> [0, 2] [hook]" in err
    else:
        assert err == ""


def test_plugins_are_described_with_their_origin_and_hooks(monkeypatch):
    (script,) = [ep for ep in importlib.metadata.distribution("pytest").entry_points if ep.name == "pytest"]
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: [script])

    class Observer:
        @et.hookimpl
        def et_run_end(self):
            pass

        @et.hookimpl
        def et_run_start(self):
            pass

    manager = etp.make_plugin_manager([Observer()], load_entry_points=False)
    manager.register(_plugins, name="pytest")  # as if the entry point named it
    described = {info.name: info for info in _plugins.describe_plugins(manager)}
    assert list(described)[: len(etp.DEFAULT_PLUGINS)] == list(etp.DEFAULT_PLUGINS)
    assert described["elastic_trainer_plugins.failures"] == _plugins.PluginInfo(
        "elastic_trainer_plugins.failures", "built-in", ("et_classify_failure",)
    )
    assert described["pytest"].origin == f"pytest {importlib.metadata.version('pytest')}"
    (observer,) = [info for info in described.values() if info.origin == "registered in code"]
    assert observer.hooks == ("et_run_start", "et_run_end")  # in the order hookspecs declares them


def test_list_plugins_prints_plugins_and_strategies_without_training(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["elastic_trainer", "--list-plugins"])
    main()
    out = capsys.readouterr().out
    for name in etp.DEFAULT_PLUGINS:
        assert f"  {name} (built-in)\n" in out
    assert "      et_classify_failure\n" in out
    strategies = out.split("strategies (+strategy=NAME):\n")[1].splitlines()
    for builtin in ("full_restart", "pause_resume", "scale_down"):
        assert any(line.split() == [builtin, "built-in"] for line in strategies), builtin


class Exploding:
    """An observer with a bug: it raises at the end of step 3."""

    @et.hookimpl
    def et_step_end(self, step):
        if step == 3:
            raise RuntimeError("metrics backend unreachable")


def test_a_raising_observer_is_named_and_the_training_state_is_unchanged(tiny_trainer_kwargs, tmp_path):
    uninterrupted = et.Trainer(**tiny_trainer_kwargs(steps=4)).fit().state
    buggy = et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=et.Checkpointer(tmp_path, period=2)))
    buggy.plugin_manager.register(Exploding(), name="exploding")
    with pytest.raises(et.PluginError) as error:
        buggy.fit()
    assert str(error.value).startswith(
        "plugin 'exploding' raised RuntimeError in et_step_end: metrics backend unreachable;"
    )
    assert buggy.failures == []  # not mistaken for a lost slice
    buggy.checkpointer.close()
    resumed = et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=et.Checkpointer(tmp_path, period=2), resume=True))
    result = resumed.fit()
    assert result.report["resumed_from"] == 2
    arrays = [jax.tree.leaves(eqx.filter(s, eqx.is_array)) for s in (uninterrupted, result.state)]
    for a, b in zip(*arrays, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class BrokenStrategy:
    name = "broken"

    @et.hookimpl
    def et_choose_recovery(self):
        return "retry"


class LoseSlice1AtStep2:
    @et.hookimpl
    def et_step_start(self, trainer, step):
        if step == 2:
            trainer.cluster.fail_slice(1, down_for_s=1e9)


def test_a_strategy_returning_an_invalid_plan_is_named(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(strategy=BrokenStrategy(), plugins=[LoseSlice1AtStep2()]))
    with pytest.raises(et.PluginError) as error:
        trainer.fit()
    assert str(error.value).startswith(
        "plugin 'strategy:broken' returned 'retry' from et_choose_recovery; a strategy must return an elastic_trainer.plugin.RecoveryPlan"
    )
