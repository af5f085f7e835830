"""The plugin manager: built-in plugins, entry-point plugins and those passed in."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable

import pluggy

from . import hookspecs
from ._failures import PluginError

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
DISABLE_AUTOLOAD_ENV = "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD"

DEFAULT_PLUGINS = (
    "elastic_trainer_plugins.failures",
    "elastic_trainer_plugins.health",
    "elastic_trainer_plugins.mesh",
    "elastic_trainer_plugins.progress:ProgressPlugin",
    "elastic_trainer_plugins.report",
    "elastic_trainer_plugins.events:EventLog",
)
"""Built-in plugins, registered like third-party ones under these names:
``module`` registers the module, ``module:Class`` an instance of the class."""


def make_plugin_manager(plugins: Iterable[object] = (), *, load_entry_points: bool | None = None) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, the entry-point group and ``plugins``.

    :param plugins: extra plugins (modules or objects with hook implementations),
        registered after the others.
    :param load_entry_points: load the ``elastic_trainer`` entry-point group;
        by default yes, unless ``ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD`` is set.
    """
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        manager.register(_load_default(name), name=name)
    if load_entry_points is None:
        load_entry_points = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if load_entry_points:
        _load_entry_points(manager)
    for plugin in plugins:
        manager.register(plugin)
    return manager


def _load_default(name: str) -> object:
    module_name, _, class_name = name.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)() if class_name else module


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    # pluggy's load_setuptools_entrypoints does the same, but an import error
    # from it does not say which plugin failed; this loop names it.
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if manager.get_plugin(entry_point.name) is not None or manager.is_blocked(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
        except Exception as error:
            raise PluginError(
                f"plugin {entry_point.name!r} ({entry_point.value}) failed to import: {error}; "
                f"fix or uninstall it, or set {DISABLE_AUTOLOAD_ENV}=1 to skip entry-point plugins."
            ) from error
        manager.register(plugin, name=entry_point.name)
