"""``python -m elastic_trainer``: the Hydra app that trains what ``conf/`` describes."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gc
import importlib.metadata
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import hydra
import jax.extend.backend
import psutil
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.object_type import ObjectType
from hydra.types import RunMode
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import ConfigCompositionException, HydraException
from hydra.plugins.config_source import ConfigSource
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from ..clusters.multicontroller._multiprocess import job_processes
from ..config._build import build_strategy, build_trainer, checkpoint_directory
from ..config._schemas import check_config, omegaconf_message, register_configs
from .._failures import ConfigError, PluginError, RestartRequested, TrainingStopped
from .._preemption import Preempted, exit_status, stop_signals
from .._run_lock import hold_run_locks
from .._protocols import RestartingStrategy, restarts_process
from .._strategy import DEFAULT_MAX_RESTARTS, AbstractStrategy
from .._plugins import (
    DISABLE_AUTOLOAD_ENV, ENTRY_POINT_GROUP, LOAD_PLUGINS_ENV, describe_plugins, make_plugin_manager, strategy_name,
)
from ._launcher import launch
from ._processes import die_with_parent
from ._supervisor import RESTART_EXIT_CODE, is_worker, supervise

CONFIG_MODULE = "elastic_trainer_conf"
LIST_PLUGINS = "--list-plugins"
EXIT_BAD_INPUT = 2
EXIT_TRAINING_STOPPED = 3
REGROUPS_WITHOUT_RESTARTS = 10
"""How often a multi-process job whose strategy restarts no process may be re-formed (a wait for lost processes)."""


def _job_started_at() -> float:
    """When this job's wall clock starts: the process start for a single run
    (start-up is part of its cost), the job's own start for each job of a
    multirun (jobs after the first do not start the interpreter again, so
    none is charged for it)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return time.time()
    return process_started_at()


def process_started_at() -> float:
    """When this process started, on the ``time.time()`` clock, exact to the kernel's clock tick (10 ms).

    psutil's ``create_time()`` adds the start's clock ticks to ``/proc/stat``'s
    boot time, which is whole seconds, so it can read up to 1 s early. Here
    both ends are relative to boot: ``/proc/self/stat``'s ``starttime`` (clock
    ticks after boot) against ``/proc/uptime`` (seconds after boot) read now,
    taken from ``time.time()`` now. Without ``/proc`` (macOS): psutil's.
    """
    try:
        uptime_s, now = float(Path("/proc/uptime").read_text().split()[0]), time.time()
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])  # field 22
        return now - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return psutil.Process().create_time()


@hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _app(cfg: DictConfig) -> None:
    started_at = _job_started_at()
    die_with_parent()  # a worker never outlives its launcher or supervisor
    try:
        _end_job(_run(cfg, started_at=started_at))
    except (ConfigError, PluginError) as error:
        _fail(str(error))


def _run(cfg: DictConfig, *, started_at: float) -> int:
    """Train what ``cfg`` describes, in this process or in workers under it, holding the locks of its
    directories (taken before anything else: JAX has not started); the job's exit status."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with hold_run_locks(_job_directories(cfg, run_dir)):
        return _run_locked(cfg, run_dir=run_dir, started_at=started_at)


def _job_directories(cfg: DictConfig, run_dir: Path) -> list[tuple[Path, str]]:
    """The directories a job locks, with their names for a message: its run and checkpoint directories.

    None for a process that a scheduler started (``cluster.launcher=none``):
    the job has several such processes and none knows which it is before
    JAX starts, so process 0's trainer locks them once JAX knows.
    """
    if cfg.cluster.get("launcher") == "none":
        return []
    directories = [(run_dir, "the run directory (hydra.run.dir)")]
    if (checkpoints := checkpoint_directory(cfg.checkpoint, run_dir)) is not None:
        directories.append((checkpoints, "checkpoint.dir"))
    return directories


def _run_locked(cfg: DictConfig, *, run_dir: Path, started_at: float) -> int:
    """:func:`_run`, once the job's directories are locked."""
    hydra_cfg = HydraConfig.get()
    strategy = build_strategy(cfg)
    search_path = [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath=")]  # for new processes
    job = dict(overrides=[*hydra_cfg.overrides.task, *search_path], run_dir=run_dir, started_at=started_at,
               stop_signals=stop_signals(cfg.trainer.get("preemption_signal")))
    if cfg.cluster.get("launcher") == "local" and not is_worker():
        return _launch(cfg, strategy, job)
    # a strategy may restart the process without declaring it (elastic_trainer.plugin.RestartingStrategy): then
    # the default
    supervised = dict(**job, max_restarts=strategy.max_restarts
                      if isinstance(strategy, (AbstractStrategy, RestartingStrategy)) else DEFAULT_MAX_RESTARTS,
                      strategy=strategy_name(strategy))
    if restarts_process(strategy) and not is_worker():  # declared: a supervisor from the start
        return supervise(**supervised)
    try:
        _train(cfg, started_at=started_at, strategy=strategy)
        return 0
    except RestartRequested as restart:
        print(f"elastic_trainer: {restart}", file=sys.stderr)
        if not _restarts_here(cfg):
            return RESTART_EXIT_CODE  # the supervisor, launcher or scheduler that started this process restarts it
    except Preempted as stop:
        print(f"elastic_trainer: {stop}", file=sys.stderr)
        return stop.exit_status
    except TrainingStopped as stop:
        print(f"elastic_trainer: training stopped: {stop}", file=sys.stderr)
        return EXIT_TRAINING_STOPPED
    _release_devices()  # the strategy did not declare it restarts the process: this one supervises from here
    return supervise(**supervised, first_attempt_ran_here=True)


def _launch(cfg: DictConfig, strategy: object, job: dict) -> int:
    """Start the processes of a multi-process job here (``cluster.launcher=local``); the job's exit status."""
    check_config(cfg)
    if cfg.checkpoint.period == "auto":
        raise ConfigError(
            "checkpoint.period=auto does not work with several processes (each would choose its own "
            "period from its own measurements, and Orbax saves together); give a number of steps."
        )
    processes = job_processes(num_processes=cfg.cluster.num_processes, spare_slices=cfg.cluster.spare_slices,
                              processes_per_slice=cfg.cluster.processes_per_slice)
    return launch(**job, num_processes=processes,
                  max_restarts=strategy.max_restarts if restarts_process(strategy) else REGROUPS_WITHOUT_RESTARTS,
                  serves_coordinator=cfg.cluster.coordinator == "separate",
                  heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s)


def _train(cfg: DictConfig, *, started_at: float, strategy: object) -> None:
    """Train in this process."""
    _exempt_imports_from_collection()
    trainer = build_trainer(cfg, run_dir=HydraConfig.get().runtime.output_dir, started_at=started_at,
                            strategy=strategy)
    try:
        trainer.fit()
    finally:
        if trainer.checkpointer:
            trainer.checkpointer.close()


@functools.cache
def _exempt_imports_from_collection() -> None:
    """Keep Python's cyclic garbage collector off the objects made so far, which live as long as the process.

    The imports (JAX, XLA's bindings, Orbax, Hydra) leave about 158,000
    objects that every full collection walked, every few seconds of training:
    0.13 to 0.23 s each here, and one that fell in a recovery made it that
    much slower (the hot swap's, in ``benchmarks/recovery.py``). ``gc.freeze``
    moves them to a generation the collector skips. It runs before anything of
    the run exists, so all the run lets go of stays collectable (a freeze after
    the first step, tried before, made the soak test's memory grow faster).
    Once per process: the next job of a multirun (Hydra's basic launcher runs
    them one after another in this process) would freeze the last one's garbage.
    """
    gc.freeze()


def _release_devices() -> None:
    """Free what the training in this process held (its arrays, then JAX's devices and their memory), which the
    workers this process goes on to supervise need."""
    gc.collect()  # the finished run's arrays, held in reference cycles through its exception's traceback
    jax.extend.backend.clear_backends()


def _restarts_here(cfg: DictConfig) -> bool:
    """Whether this process starts the next worker itself when its training asks for a restart: yes unless
    something else started it and restarts it (a supervisor, the local launcher, or the scheduler of a
    ``cluster.launcher=none`` job)."""
    return not is_worker() and cfg.cluster.get("launcher") != "none"


_worst_job_status = 0


def _end_job(status: int) -> None:
    """End a job with exit status ``status``: a single run exits with it; in a
    multirun the sweep goes on (a stopped job has its report like any other)
    and the command exits with the worst status once every job has run, unless
    a stop signal ended the job (status 128 + the signal): that ends the sweep."""
    global _worst_job_status
    if HydraConfig.get().mode == RunMode.MULTIRUN and status <= 128:
        _worst_job_status = max(_worst_job_status, status)
    elif status:
        sys.exit(status)


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning on the terminal as one line, like the run's other sentences (not Python's two, with the source)."""
    return f"elastic_trainer: warning: {message}\n"


def _fail(message: str) -> None:
    print(f"elastic_trainer: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def check_group_choices(overrides: list[str]) -> None:
    """Raise :class:`ConfigError` when an override picks a group option that does not exist.

    Hydra reports this too, but as several lines with its search path; this
    says it in one sentence and suggests the closest option. The options are
    those Hydra sees: the built-in ones, those that installed Hydra searchpath
    plugins add (a third-party strategy) and those of the command line's
    ``hydra.searchpath``. With ``--config-dir``, which only Hydra's own
    argument parser reads, the check is left to Hydra.
    """
    if any(o.startswith(("--config-dir", "-cd")) for o in overrides):
        return
    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except HydraException:
        return  # a syntax error: Hydra explains it
    search_path = [o.input_line for o in parsed if o.key_or_group == "hydra.searchpath"]
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        loader = GlobalHydra.instance().config_loader()

        def options(group: str, kind: ObjectType = ObjectType.CONFIG) -> list[str]:
            return loader.get_group_options(group, results_filter=kind, config_name="config", overrides=search_path)

        groups = set(options("", ObjectType.GROUP)) - {"hydra"}
        for override in parsed:
            group = override.key_or_group
            if group not in groups or override.is_delete():
                continue
            choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            prefix = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++"}.get(override.type, "")
            for choice in choices:
                if choice not in options(group):
                    raise ConfigError(_unknown_option_message(group, str(choice), options(group), prefix=prefix))


def check_values(overrides: list[str]) -> DictConfig | None:
    """Raise :class:`ConfigError` when an override names a key the config does not have (the closest one
    suggested) or gives a value that does not fit its schema (``trainer.steps=ten``); the config composed, or
    ``None`` where Hydra is left to compose it.

    Hydra reports these too, but in several lines and with exit status 1; this
    composes the config first (with the command line's ``hydra.searchpath``)
    and says it in one sentence. Sweeps are left to Hydra, which expands them
    first.
    """
    arguments = [o for o in overrides if not o.startswith("-")]
    if len(arguments) < len(overrides):
        return None  # -m, --cfg job, --config-dir ...: Hydra's own business
    try:
        parsed = OverridesParser.create().parse_overrides(arguments)
    except HydraException:
        return None  # a syntax error: Hydra explains it
    if any(o.is_sweep_override() for o in parsed):
        return None
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        try:
            return compose("config", overrides=arguments)
        except ConfigCompositionException as error:
            cause = error.__cause__
            if isinstance(cause, OmegaConfBaseException) and cause.full_key == "cluster.spare_slices":
                raise ConfigError(_no_spares_message(parsed)) from error
            if isinstance(cause, OmegaConfBaseException) and cause.full_key:
                raise ConfigError(_override_message(cause, _failed_key(error, parsed))) from error
        except Exception:  # noqa: BLE001 - anything else: Hydra composes again and explains it
            pass
    return None


def _no_spares_message(overrides: list[Override]) -> str:
    """One sentence for ``cluster.spare_slices`` set on a cluster that keeps no spare slices."""
    kind = next((o.value() for o in overrides if o.key_or_group == "cluster"), "?")
    return (f"cluster={kind} keeps no spare slices: cluster.spare_slices is cluster=simulated's, "
            "cluster=multiprocess's and cluster=pathways's only (docs/clusters.md, \"Spare slices\"); drop it, or "
            "choose one of those.")


def _failed_key(error: ConfigCompositionException, overrides: list[Override]) -> str:
    """The key of the override that Hydra could not apply (its message quotes the override, or its key)."""
    message = str(error)
    return next((o.key_or_group for o in overrides if o.input_line in message or f"'{o.key_or_group}'" in message), "")


def _override_message(cause: OmegaConfBaseException, override: str) -> str:
    """One sentence for an override of key ``override`` that OmegaConf refused with ``cause``."""
    # the key in the config, dotted as an override writes it (strategy.strategies[0] -> strategy.strategies.0)
    key = cause.full_key.replace("[", ".").replace("]", "")
    within = override.startswith(key) or key.startswith(override)  # else a key inside the value (a list's entry)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.parent_node is not None:
        if not within:
            return _unknown_key_message(cause, where=f"a {override} entry", path="")
        parent = key.rpartition(".")[0]
        return _unknown_key_message(cause, where=parent or "the config", path=f"{parent}." if parent else "",
                                    may_add=not dataclasses.is_dataclass(cause.object_type))
    return omegaconf_message(cause, cause.full_key if within else f"{override} ({cause.full_key})")


def _unknown_key_message(cause: OmegaConfBaseException, *, where: str, path: str, may_add: bool = False) -> str:
    """``where`` has no key ``cause.key``: the closest of its keys suggested (written ``path`` + key), and, for
    a config without a schema (``may_add``), how to add the key instead."""
    name, keys = str(cause.key), [str(k) for k in cause.parent_node.keys() if not str(k).startswith("_")]
    close = difflib.get_close_matches(name, keys, n=1)
    hint = f" (did you mean {path}{close[0]}?)" if close else ""
    add = f", or add it with +{path}{name}=<value>" if may_add else ""
    return f"{where} has no key {name!r}{hint}; its keys are: {', '.join(keys)}{add}."


def _unknown_option_message(group: str, choice: str, options: list[str], *, prefix: str) -> str:
    if not options:
        return f"there is no {group} {choice!r}: no {group} options are installed."
    close = difflib.get_close_matches(choice, options, n=1)
    hint = f" (did you mean {prefix}{group}={close[0]}?)" if close else ""
    return f"there is no {group} {choice!r}{hint}; choose one of: {', '.join(options)}."


def available_strategies() -> list[tuple[str, str]]:
    """Each ``+strategy=NAME`` option Hydra sees, with its origin, sorted by name.

    The origin is ``"built-in"`` for ``conf/strategy/``, else the distribution
    (and version) whose Hydra searchpath plugin added the option.
    """
    found: dict[str, str] = {}
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        for source in GlobalHydra.instance().config_loader().get_sources():
            if source.available() and source.is_group("strategy"):
                for name in source.list("strategy", ObjectType.CONFIG):
                    found.setdefault(name, _config_origin(source))  # the first source wins, as in Hydra
    return sorted(found.items())


def _config_origin(source: ConfigSource) -> str:
    if source.scheme() == "pkg" and source.path == CONFIG_MODULE:
        return "built-in"
    if source.scheme() == "pkg":
        package = source.path.split(".")[0]
        distributions = importlib.metadata.packages_distributions().get(package)
        if distributions:
            return f"{distributions[0]} {importlib.metadata.version(distributions[0])}"
    return f"{source.provider} ({source.scheme()}://{source.path})"


def list_plugins() -> str:
    """What ``--list-plugins`` prints: the plugins a run loads, with origin and hooks, and the strategies."""
    plugins = describe_plugins(make_plugin_manager())
    lines = ["plugins, each with its origin and then the hooks it implements:"]
    for info in plugins:
        lines += [f"  {info.name} ({info.origin})", f"      {', '.join(info.hooks)}"]
    installed = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    skipped = sorted(installed - {info.name for info in plugins})
    if skipped:
        lines.append(f"installed but not loaded ({DISABLE_AUTOLOAD_ENV} or {LOAD_PLUGINS_ENV}): {', '.join(skipped)}")
    strategies = available_strategies()
    width = max(len(name) for name, _ in strategies)
    lines.append("strategies (+strategy=NAME):")
    lines += [f"  {name:<{width}}  {origin}" for name, origin in strategies]
    return "\n".join(lines)


def main() -> None:
    """Run the app on ``sys.argv`` (Hydra overrides such as ``trainer.steps=20``).

    With ``--list-plugins``, print the plugins and strategies instead and exit.
    """
    if LIST_PLUGINS in sys.argv[1:]:
        try:
            print(list_plugins())
        except PluginError as error:
            _fail(str(error))
        return
    register_configs()
    warnings.formatwarning = _warning_line
    if not is_worker():  # a worker's overrides are those its supervisor or launcher checked, with its own added
        try:
            check_group_choices(sys.argv[1:])
            check_values(sys.argv[1:])
        except ConfigError as error:
            _fail(str(error))
    try:
        _app()
    except KeyboardInterrupt:  # Ctrl-C before training started (once it has, the trainer stops at a step)
        print("elastic_trainer: interrupted before training started; nothing was saved.", file=sys.stderr)
        sys.exit(exit_status(signal.SIGINT))
    sys.exit(_worst_job_status)
