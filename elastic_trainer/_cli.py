"""``python -m elastic_trainer``: the Hydra app that trains what ``conf/`` describes."""

from __future__ import annotations

import difflib
import importlib.resources
import sys
import time
from pathlib import Path

import hydra
import psutil
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from ._config import build_strategy, build_trainer, register_configs
from ._failures import ConfigError, PluginError, RestartRequested, TrainingStopped
from ._supervisor import RESTART_EXIT_CODE, is_worker, supervise

CONFIG_MODULE = "elastic_trainer_conf"
EXIT_BAD_INPUT = 2
EXIT_TRAINING_STOPPED = 3


_jobs_started = 0


def _job_started_at() -> float:
    """When this job's wall clock starts: the process start for the first job of
    the process, the job's own start for the later jobs of a multirun."""
    global _jobs_started
    _jobs_started += 1
    return psutil.Process().create_time() if _jobs_started == 1 else time.time()


@hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _app(cfg: DictConfig) -> None:
    started_at = _job_started_at()
    hydra_cfg = HydraConfig.get()
    try:
        strategy = build_strategy(cfg)
        if getattr(strategy, "restarts_process", False) and not is_worker():
            sys.exit(supervise(
                overrides=list(hydra_cfg.overrides.task), run_dir=Path(hydra_cfg.runtime.output_dir),
                max_restarts=strategy.max_restarts, started_at=started_at,
            ))
        trainer = build_trainer(cfg, run_dir=hydra_cfg.runtime.output_dir, started_at=started_at, strategy=strategy)
        try:
            trainer.fit()
        finally:
            if trainer.checkpointer:
                trainer.checkpointer.close()
    except (ConfigError, PluginError) as error:
        _fail(str(error))
    except RestartRequested as restart:
        print(f"elastic_trainer: {restart}", file=sys.stderr)
        sys.exit(RESTART_EXIT_CODE)
    except TrainingStopped as stop:
        print(f"elastic_trainer: training stopped: {stop}", file=sys.stderr)
        sys.exit(EXIT_TRAINING_STOPPED)


def _fail(message: str) -> None:
    print(f"elastic_trainer: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def check_group_choices(overrides: list[str]) -> None:
    """Raise :class:`ConfigError` when an override picks a group option that does not exist.

    Hydra reports this too, but as several lines with its search path; this
    says it in one sentence and suggests the closest option. Overrides that
    extend the search path are left to Hydra, which alone sees those options.
    """
    if any(o.startswith(("hydra.searchpath", "--config-dir", "-cd")) for o in overrides):
        return
    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except HydraException:
        return  # a syntax error: Hydra explains it
    groups = [p.name for p in importlib.resources.files(CONFIG_MODULE).iterdir() if p.is_dir()]
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        loader = GlobalHydra.instance().config_loader()
        for override in parsed:
            group = override.key_or_group
            if group not in groups or override.is_delete():
                continue
            choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            options = loader.get_group_options(group)
            for choice in choices:
                if choice not in options:
                    raise ConfigError(_unknown_option_message(group, str(choice), options))


def _unknown_option_message(group: str, choice: str, options: list[str]) -> str:
    if not options:
        return f"there is no {group} {choice!r}: no {group} options are installed."
    close = difflib.get_close_matches(choice, options, n=1)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"there is no {group} {choice!r}{hint}; choose one of: {', '.join(options)}."


def main() -> None:
    """Run the app on ``sys.argv`` (Hydra overrides such as ``trainer.steps=20``)."""
    register_configs()
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as error:
        _fail(str(error))
    _app()
