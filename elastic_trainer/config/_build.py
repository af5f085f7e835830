"""The one place where configs become objects: the trainer, its cluster, checkpointer and strategy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
from etils import epath
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..checkpoints._checkpointer import Checkpointer
from ..checkpoints._storage import checkpoint_path
from ..clusters import AbstractCluster, AbstractMultiControllerCluster, admission_of, has_spares
from .._failures import ConfigError
from .._stragglers import StragglerRule
from .._trainer import Trainer
from ._schemas import check_config


def build_trainer(
    cfg: DictConfig, *, run_dir: str | Path | None = None, started_at: float | None = None, strategy: object = None
) -> Trainer:
    """Validate ``cfg`` and build the trainer it describes; nothing runs yet.

    ``strategy``, if given, is the one already built from ``cfg.strategy``.

    Raises :class:`ConfigError` with one sentence for any bad value. The
    cluster configures JAX before anything else touches a device.
    """
    check_config(cfg)
    cluster = _instantiate(cfg, "cluster")
    cluster.configure_jax()
    if cfg.trainer.compilation_cache_dir:
        use_persistent_compilation_cache(Path(cfg.trainer.compilation_cache_dir).expanduser())
    return Trainer(
        checkpointer=_checkpointer(cfg.checkpoint, run_dir, cluster=cluster),
        resume=cfg.checkpoint.resume,
        model=_instantiate(cfg, "model", key=jax.random.fold_in(jax.random.key(cfg.seed), 0)),
        loss_fn=_instantiate(OmegaConf.create({"loss": _without(cfg.loss, "has_aux")}), "loss"),
        has_aux=cfg.loss.get("has_aux", False),
        optimizer=_instantiate(cfg, "optimizer"),
        data=_instantiate(cfg, "data"),
        cluster=cluster,
        steps=cfg.trainer.steps,
        global_batch_size=cfg.trainer.global_batch_size,
        within_slice=cfg.trainer.within_slice,
        snapshot_period=cfg.trainer.snapshot_period,
        step_timeout_s=cfg.trainer.step_timeout_s,
        preemption_signal=cfg.trainer.preemption_signal,
        max_cached_layouts=cfg.trainer.max_cached_layouts,
        straggler_rule=StragglerRule(cfg.trainer.straggler_factor, cfg.trainer.straggler_steps),
        strategy=strategy if strategy is not None else build_strategy(cfg),
        plugins=[_instantiate(cfg, group) for group in ("chaos", "logger") if cfg[group] is not None],
        seed=cfg.seed,
        run_dir=run_dir,
        started_at=started_at,
    )


def use_persistent_compilation_cache(directory: Path) -> None:
    """Keep every compiled step in JAX's persistent compilation cache in ``directory``, so that a resumed,
    restarted or re-run job, and a recovery onto a layout an earlier run compiled, loads it instead.

    JAX by default keeps only compiles that took over a second; a step
    compiled ahead in the background is worth keeping whatever it took, so
    the threshold goes to 0 unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
    says otherwise.
    """
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def build_strategy(cfg: DictConfig) -> object | None:
    """The strategy plugin ``cfg.strategy`` describes, or ``None``."""
    return None if cfg.strategy is None else _instantiate(cfg, "strategy")


def checkpoint_directory(cfg: DictConfig, run_dir: str | Path | None) -> epath.Path | None:
    """Where the checkpoints of ``cfg`` (the ``checkpoint`` section) go: ``dir`` (a local directory or a ``gs://``
    URL), else ``checkpoints/`` in the run directory; ``None`` when checkpoints are off or there is neither.

    Raises :class:`ConfigError` for a URL of a scheme Orbax cannot write to."""
    directory = cfg.dir or (run_dir and Path(run_dir) / "checkpoints")
    return checkpoint_path(directory) if cfg.enabled and directory else None


def _checkpointer(cfg: DictConfig, run_dir: str | Path | None, *, cluster: AbstractCluster) -> Checkpointer | None:
    directory = checkpoint_directory(cfg, run_dir)
    if directory is None:
        return None
    spares_wait = has_spares(cluster) and isinstance(cluster, AbstractMultiControllerCluster)  # and save nothing
    return Checkpointer(
        directory, period=cfg.period, max_to_keep=cfg.max_to_keep, async_save=cfg.async_save, mtbf_s=cfg.mtbf_s,
        max_failed_saves=cfg.max_failed_saves, admission=admission_of(cluster),
        processes=cluster.live_processes() if spares_wait else None,
    )


def _without(node: DictConfig, key: str) -> DictConfig:
    """``node`` without ``key``: a setting of the trainer's kept in a section whose other keys build an object
    (``loss.has_aux``)."""
    return OmegaConf.masked_copy(node, [k for k in node if k != key])


def _instantiate(cfg: DictConfig, section: str, **kwargs: Any) -> Any:
    try:
        return instantiate(cfg[section], **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        root = error  # the first error in the chain, in one line: Hydra's own messages run over several
        while root.__cause__ is not None:
            root = root.__cause__
        detail = (str(root).splitlines() or [""])[0].rstrip(".")
        raise ConfigError(
            f"could not build {section} from its config ({cfg[section].get('_target_')}): "
            f"{type(root).__name__}: {detail}."
        ) from error
