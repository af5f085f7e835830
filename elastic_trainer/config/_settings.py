"""The value checks that constructors and their config schemas share, each written once.

The constructors (``Trainer``, ``SimulatedCluster``, ``MultiprocessCluster``,
``Transformer``, ``StdlibText``) and their config schemas both call these:
the schema so that a bad value stops the command line before anything starts,
the constructor for code that builds the objects itself.
"""

from __future__ import annotations

from .._failures import ConfigError, check_at_least
from ..checkpoints._storage import checkpoint_path
from ..checkpoints._young_daly import check_mtbf


def check_trainer_settings(
    *, steps: int, global_batch_size: int, snapshot_period: int, step_timeout_s: float, within_slice: str,
    max_cached_layouts: int,
) -> None:
    """Raise :class:`ConfigError` with one sentence for any bad ``trainer.*`` value."""
    check_at_least("trainer.steps", steps, 1)
    check_at_least("trainer.global_batch_size", global_batch_size, 1)
    check_at_least("trainer.snapshot_period", snapshot_period, 0)
    check_at_least("trainer.step_timeout_s", step_timeout_s, 0)
    check_at_least("trainer.max_cached_layouts", max_cached_layouts, 1)
    if within_slice not in ("replicated", "sharded"):
        raise ConfigError(f"trainer.within_slice must be 'replicated' or 'sharded', got {within_slice!r}.")


def check_multiprocess_settings(
    *,
    num_processes: int,
    devices_per_process: int | None,
    processes_per_slice: int,
    spare_slices: int,
    heartbeat_timeout_s: int,
    collective_timeout_s: int | None,
    initialization_timeout_s: int,
    barrier_timeout_s: int,
    platform: str | None,
    launcher: str,
    coordinator: str,
) -> None:
    """Raise :class:`ConfigError` with one sentence for any bad ``cluster.*`` value of ``cluster=multiprocess``."""
    check_at_least("cluster.num_processes", num_processes, 1)
    if devices_per_process is not None:
        check_at_least("cluster.devices_per_process", devices_per_process, 1)
    check_at_least("cluster.processes_per_slice", processes_per_slice, 1)
    if num_processes % processes_per_slice:
        raise ConfigError(
            f"cluster.processes_per_slice ({processes_per_slice}) must divide "
            f"cluster.num_processes ({num_processes}); a slice is that many whole processes."
        )
    check_at_least("cluster.spare_slices", spare_slices, 0)
    # whole seconds: JAX's and XLA's own units
    check_at_least("cluster.heartbeat_timeout_s", heartbeat_timeout_s, 1)
    if collective_timeout_s is not None:
        check_at_least("cluster.collective_timeout_s", collective_timeout_s, 1)
    check_at_least("cluster.initialization_timeout_s", initialization_timeout_s, 1)
    check_at_least("cluster.barrier_timeout_s", barrier_timeout_s, 1)
    if platform not in ("cpu", None):
        raise ConfigError(
            f"cluster.platform must be 'cpu' (gloo collectives between processes on CPU) or null "
            f"(JAX's default platform and its collectives), got {platform!r}."
        )
    if launcher not in ("local", "none"):
        raise ConfigError(
            f"cluster.launcher must be 'local' (the command starts the processes here) or 'none' "
            f"(a scheduler started them), got {launcher!r}."
        )
    if coordinator not in ("separate", "process0"):
        raise ConfigError(
            f"cluster.coordinator must be 'separate' (JAX's coordination service in a process of its own) or "
            f"'process0' (process 0 hosts it, and may not be lost), got {coordinator!r}."
        )


def check_simulated_settings(*, slices: int, devices_per_slice: int, spare_slices: int) -> None:
    """Raise :class:`ConfigError` with one sentence for any bad ``cluster.*`` value of ``cluster=simulated``."""
    check_at_least("cluster.slices", slices, 1)
    check_at_least("cluster.devices_per_slice", devices_per_slice, 1)
    check_at_least("cluster.spare_slices", spare_slices, 0)


def check_transformer_settings(
    *, vocab_size: int, seq_len: int, d_model: int, num_heads: int, num_layers: int, mlp_ratio: int
) -> None:
    """Raise :class:`ConfigError` with one sentence for any bad ``model.*`` value of ``model=transformer``."""
    sizes = {"vocab_size": vocab_size, "seq_len": seq_len, "d_model": d_model, "num_heads": num_heads,
             "num_layers": num_layers, "mlp_ratio": mlp_ratio}
    for name, size in sizes.items():
        check_at_least(f"model.{name}", size, 1)
    if d_model % num_heads:
        raise ConfigError(f"model.num_heads ({num_heads}) must divide model.d_model ({d_model}).")


def check_stdlib_text_settings(*, seq_len: int) -> None:
    """Raise :class:`ConfigError` with one sentence for a bad ``data.seq_len`` of ``data=stdlib_text``."""
    check_at_least("data.seq_len", seq_len, 1)


def check_period(period: object) -> None:
    """Raise :class:`ConfigError` unless ``period`` is a whole number of steps (at least 1) or ``"auto"``."""
    if period == "auto":
        return
    if isinstance(period, bool) or not isinstance(period, int):
        raise ConfigError(f"checkpoint.period must be a whole number of steps or 'auto', got {period!r}.")
    check_at_least("checkpoint.period", period, 1)


def check_checkpoint_settings(
    *, period: object, max_to_keep: int, mtbf_s: float | None, max_failed_saves: int, directory: str | None = None
) -> None:
    """Raise :class:`ConfigError` with one sentence for any bad ``checkpoint.*`` value (``directory``: a URL of a
    scheme Orbax cannot write to)."""
    if directory is not None:
        checkpoint_path(directory)
    check_period(period)
    check_mtbf(mtbf_s)
    check_at_least("checkpoint.max_to_keep", max_to_keep, 1)
    if isinstance(max_failed_saves, bool) or not isinstance(max_failed_saves, int) or max_failed_saves < 1:
        raise ConfigError(
            f"checkpoint.max_failed_saves must be a whole number of saves, at least 1 (1: stop at the first "
            f"save that fails for I/O), got {max_failed_saves!r}."
        )
