"""The plugin manager: built-in plugins, entry-point plugins and those passed in."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Iterable

import pluggy

from . import hookspecs
from ._failures import ConfigError, PluginError, TrainingStopped
from ._protocols import Strategy

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
DISABLE_AUTOLOAD_ENV = "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD"
LOAD_PLUGINS_ENV = "ELASTIC_TRAINER_LOAD_PLUGINS"
"""Comma-separated names of the entry-point plugins to load (empty: none); unset loads all."""
TRACE_HOOKS_ENV = "ELASTIC_TRAINER_TRACE_HOOKS"
"""When set (and not ``0``), every hook call and its result is traced to stderr."""

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


def make_plugin_manager(
    plugins: Iterable[object] = (), *, defaults: Iterable[str] = DEFAULT_PLUGINS, load_entry_points: bool | None = None
) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, the entry-point group and ``plugins``.

    :param plugins: extra plugins (modules or objects with hook implementations),
        registered after the others.
    :param defaults: the built-in plugins to register, named as in :data:`DEFAULT_PLUGINS`.
    :param load_entry_points: load the ``elastic_trainer`` entry-point group
        (only the plugins ``ELASTIC_TRAINER_LOAD_PLUGINS`` names, when it is
        set); by default yes, unless ``ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD`` is set.

    With ``ELASTIC_TRAINER_TRACE_HOOKS`` set, the manager traces every hook call
    to stderr (pluggy's :meth:`~pluggy.PluginManager.enable_tracing`).
    """
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    if _env_flag(TRACE_HOOKS_ENV):
        manager.trace.root.setwriter(_write_trace)
        manager.enable_tracing()
    for name in defaults:
        manager.register(_load_default(name), name=name)
    if load_entry_points is None:
        load_entry_points = not _env_flag(DISABLE_AUTOLOAD_ENV)
    if load_entry_points:
        _load_entry_points(manager)
    for plugin in plugins:
        manager.register(plugin)
    return manager


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """A registered plugin, as ``python -m elastic_trainer --list-plugins`` shows it.

    :param name: the name it is registered under.
    :param origin: ``"built-in"``, the distribution and version it came from
        (``"my-dist 1.0"``), or ``"registered in code"``.
    :param hooks: the hooks it implements, in the order ``hookspecs`` declares them.
    """

    name: str
    origin: str
    hooks: tuple[str, ...]


def describe_plugins(manager: pluggy.PluginManager) -> list[PluginInfo]:
    """Every plugin registered with ``manager``, in registration order, with its origin and hooks."""
    entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    hook_order = [name for name in vars(hookspecs) if name.startswith("et_")]
    described = []
    for name, plugin in manager.list_name_plugin():
        if name in DEFAULT_PLUGINS:
            origin = "built-in"
        elif name in entry_points:
            origin = distribution_of(entry_points[name])
        else:
            origin = "registered in code"
        hooks = sorted((caller.name for caller in manager.get_hookcallers(plugin) or ()), key=hook_order.index)
        described.append(PluginInfo(name, origin, tuple(hooks)))
    return described


def distribution_of(entry_point: importlib.metadata.EntryPoint) -> str:
    """The name and version of the distribution that installed ``entry_point``."""
    dist = entry_point.dist
    if dist is None:
        return f"entry point {entry_point.value}"
    return f"{dist.name} {dist.version}"


def selected_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The ``elastic_trainer`` entry points to load: all, or those ``ELASTIC_TRAINER_LOAD_PLUGINS`` names.

    Raises :class:`PluginError` when it names a plugin that is not installed.
    """
    entry_points = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    allowed = os.environ.get(LOAD_PLUGINS_ENV)
    if allowed is None:
        return entry_points
    names = {name.strip() for name in allowed.split(",") if name.strip()}
    installed = {ep.name for ep in entry_points}
    unknown = sorted(names - installed)
    if unknown:
        what = "is not an installed plugin" if len(unknown) == 1 else "are not installed plugins"
        raise PluginError(
            f"{LOAD_PLUGINS_ENV} names {', '.join(map(repr, unknown))}, which {what}; "
            f"installed: {', '.join(sorted(installed)) or 'none'}."
        )
    return [ep for ep in entry_points if ep.name in names]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _write_trace(message: str) -> None:
    sys.stderr.write(message)


def _load_default(name: str) -> object:
    module_name, _, class_name = name.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)() if class_name else module


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    # pluggy's load_setuptools_entrypoints does the same, but an import error
    # from it does not say which plugin failed; this loop names it.
    for entry_point in selected_entry_points():
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


OBSERVER_HOOKS = (
    "et_run_start", "et_step_start", "et_step_end", "et_before_checkpoint_save", "et_after_checkpoint_save",
    "et_before_restore", "et_after_restore", "et_recovery_start", "et_run_end",
)
"""Hooks whose results are ignored: plugins only watch through them."""


class GuardedHooks:
    """The manager's hooks, with an observer's exception turned into a
    :class:`PluginError` that names the plugin and the hook.

    Only :data:`OBSERVER_HOOKS` are guarded: a plugin that merely watches must
    not pass for a failure of the hardware. Errors that are already ours
    (bad config, a stop, a plugin error) go through unchanged.
    """

    def __init__(self, manager: pluggy.PluginManager):
        self._manager = manager

    def __getattr__(self, name: str):
        """The hook ``name``, guarded if it is an observer's; made once, then an attribute of its own (a hook is
        called every step)."""
        caller = getattr(self._manager.hook, name)
        if name not in OBSERVER_HOOKS:
            self.__dict__[name] = caller
            return caller

        def call(**kwargs):
            try:
                return caller(**kwargs)
            except (ConfigError, PluginError, TrainingStopped):
                raise
            except Exception as error:
                raise PluginError(
                    f"plugin {_raiser(caller, error)!r} raised {type(error).__name__} in {name}: {error}; "
                    "training stopped with its state as it was before the hook; fix or remove the plugin."
                ) from error

        self.__dict__[name] = call
        return call


def strategy_name(strategy: object) -> str:
    """A strategy's name for the report: its ``name`` attribute (:class:`~elastic_trainer.hookspecs.Strategy`), else
    its class name."""
    return strategy.name if isinstance(strategy, Strategy) else type(strategy).__name__


def registers_hooks(manager: pluggy.PluginManager, obj: object) -> bool:
    """Whether ``obj`` has hook implementations (methods marked with ``et.hookimpl``), by ``manager``'s rule; read
    from its class, so that no property of ``obj`` is evaluated."""
    return any(manager.parse_hookimpl_opts(type(obj), name) is not None for name in dir(type(obj)))


def _raiser(caller: pluggy.HookCaller, error: Exception) -> str:
    """The name of the plugin whose hook implementation raised ``error`` (innermost in its traceback)."""
    plugin_of_code = {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()}
    name, traceback = "unknown", error.__traceback__
    while traceback is not None:
        name = plugin_of_code.get(traceback.tb_frame.f_code, name)
        traceback = traceback.tb_next
    return name


def answering(manager: pluggy.PluginManager, hook_name: str) -> str:
    """Who answered a firstresult hook, for an error message: the plugin's name
    when one implements it, else the names of all that do, first called first."""
    names = [
        impl.plugin_name for impl in reversed(getattr(manager.hook, hook_name).get_hookimpls())
        if not (impl.hookwrapper or impl.wrapper)
    ]
    return f"plugin {names[0]!r}" if len(names) == 1 else f"one of the plugins {', '.join(map(repr, names))}"
