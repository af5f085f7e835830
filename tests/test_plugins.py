import importlib.metadata

import pytest

import elastic_trainer as et
from elastic_trainer import _plugins


def test_built_ins_are_registered_by_name():
    manager = et.make_plugin_manager(load_entry_points=False)
    for name in et.DEFAULT_PLUGINS:
        assert manager.get_plugin(name) is not None, name


def test_entry_point_plugins_are_loaded_by_name(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="observer", value="json", group="elastic_trainer")
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: [ep])
    manager = et.make_plugin_manager(load_entry_points=True)
    assert manager.get_plugin("observer").__name__ == "json"


def test_plugin_that_fails_to_import_is_named(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="broken", value="no_such_module_xyz", group="elastic_trainer")
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: [ep])
    with pytest.raises(et.PluginError, match=r"plugin 'broken' \(no_such_module_xyz\) failed to import"):
        et.make_plugin_manager(load_entry_points=True)


def test_autoload_follows_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", lambda group: calls.append(group) or [])
    et.make_plugin_manager()
    assert calls == []  # conftest sets ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD
    monkeypatch.delenv(_plugins.DISABLE_AUTOLOAD_ENV)
    et.make_plugin_manager()
    assert calls == ["elastic_trainer"]


def test_mesh_plugin_returning_garbage_is_a_plugin_error(tiny_trainer_kwargs):
    class BadMesh:
        @et.hookimpl
        def et_make_mesh(self):
            return "a mesh, trust me"

    trainer = et.Trainer(**tiny_trainer_kwargs(plugins=[BadMesh()]))
    with pytest.raises(et.PluginError, match="et_make_mesh returned 'a mesh, trust me'"):
        trainer.fit()
