"""``elastic_retry``: our failure handling around a training loop the user keeps (MaxText's shape)."""

from __future__ import annotations

import functools
import importlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pluggy
from jax.sharding import Mesh

from . import hookspecs
from ._cluster import AbstractCluster
from ._failures import ConfigError, PluginError, RecoveryPlan
from ._plugins import GuardedHooks, answering
from ._recovery import carry_out_waits, wait_for_slices

T = TypeVar("T")

FAILURE_PLUGINS = ("elastic_trainer_plugins.failures", "elastic_trainer_plugins.health", "elastic_trainer_plugins.mesh")
"""The built-in plugins an :class:`ElasticRun` uses: failure classification, slice health, meshes."""


class ElasticRun:
    """What a function decorated with :func:`elastic_retry` is called with.

    Read :attr:`mesh` (the healthy slices, as a ``(slice, device)`` mesh) and
    :attr:`attempt` (0 first, then one more after each recovery), and iterate
    :meth:`steps` in the training loop. Hooks receive the run as ``trainer``:
    it has ``cluster``, ``slices``, ``mesh``, ``run_dir`` and ``failures``, so
    the built-in failure, health and mesh plugins, strategies and chaos work
    with it unchanged. The function keeps its own state: on a new attempt it
    restores it (from its checkpoint) onto the new mesh, as with MaxText's
    ``elastic_retry``.
    """

    def __init__(self, cluster: AbstractCluster, *, strategy: object, plugins: Iterable[object], run_dir: str | Path | None):
        self.cluster = cluster
        self.strategy = strategy
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.resume = False
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        for name in FAILURE_PLUGINS:
            self.plugin_manager.register(importlib.import_module(name), name=name)
        for plugin in (*plugins, strategy):
            if plugin is not None:
                self.plugin_manager.register(plugin)
        self.hook = GuardedHooks(self.plugin_manager)
        self.mesh: Mesh | None = None
        self.slices: tuple[int, ...] = ()
        self.attempt = 0
        self.step = 0
        self.failures: list[dict[str, Any]] = []
        self._incarnations = cluster.incarnations()
        self._pending_recovery: dict[str, Any] | None = None

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """The steps ``start`` to ``stop - 1``. The loop body is the step; once it
        is done, a slice lost meanwhile raises here, as a real runtime raises
        from the step, and the plugins hear of each step start and end."""
        for step in range(start, stop):
            self.step = step
            self.hook.et_step_start(trainer=self, step=step)
            yield step
            self.cluster.check_step(self.slices, since=self._incarnations)
            if self._pending_recovery is not None:
                pending, self._pending_recovery = self._pending_recovery, None
                pending["recovery_s"] = time.time() - pending["failed_at"]
            self.hook.et_step_end(trainer=self, step=step + 1, metrics={})

    def run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``function(self, *args, **kwargs)`` until it returns; recover between attempts."""
        started_at = time.time()
        self.cluster.configure_jax()
        self._use(sorted(self.cluster.healthy_slices()))
        while True:
            try:
                result = function(self, *args, **kwargs)
                break
            except (ConfigError, PluginError):
                raise
            except Exception as error:  # noqa: BLE001 - classified by the failure hook
                self._recover(error)
        self._write_report(started_at)
        return result

    def _recover(self, error: Exception) -> None:
        """Classify ``error``; let the strategy plan; wait and re-mesh as it says. Re-raise what is not survivable."""
        failed_at = time.time()
        failure = self.hook.et_classify_failure(error=error, step=self.step, phase="train_step")
        lost = [s for s in self.slices if s in failure.slices or s not in self.cluster.healthy_slices()]
        record = {"step": self.step, "slices": lost, "kind": failure.kind, "action": "stop",
                  "slices_before": len(self.slices), "failed_at": failed_at, "recovery_s": 0.0}
        self.failures.append(record)
        plan = self.hook.et_choose_recovery(trainer=self, failure=failure) if failure.elastic else None
        if plan is None:
            raise error
        if not isinstance(plan, RecoveryPlan):
            raise PluginError(
                f"{answering(self.plugin_manager, 'et_choose_recovery')} returned {plan!r} from et_choose_recovery; "
                "a strategy must return an et.RecoveryPlan, or None to leave the decision to the next plugin."
            )
        plan, healthy = carry_out_waits(
            plan, record, wait=lambda timeout_s: wait_for_slices(self.hook, self, timeout_s),
            restart=self._cannot_restart, error=error,
        )
        self._use(healthy)
        record["slices_after"] = len(healthy)
        self._pending_recovery = record
        self.attempt += 1

    @staticmethod
    def _cannot_restart() -> None:
        raise ConfigError("elastic_retry recovers inside this process; a strategy that restarts the process "
                          "(full_restart) needs the trainer's command line, python -m elastic_trainer.")

    def _use(self, slices: list[int]) -> None:
        """Mesh ``slices`` through the ``et_make_mesh`` hook; the data on them is as of now."""
        devices = self.cluster.slice_devices()
        self.slices = tuple(slices)
        self.mesh = self.hook.et_make_mesh(trainer=self, slice_devices=[devices[s] for s in slices])
        self._incarnations = self.cluster.incarnations()

    def _write_report(self, started_at: float) -> None:
        """``report.json`` in ``run_dir``: the failures, the attempts and the wall time."""
        if self.run_dir is None:
            return
        report = {
            "strategy": getattr(self.strategy, "name", None if self.strategy is None else type(self.strategy).__name__),
            "cluster": self.cluster.describe(),
            "attempts": self.attempt + 1,
            "failures": self.failures,
            "wall_s": time.time() - started_at,
            "started_at": started_at,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def elastic_retry(
    *,
    cluster: AbstractCluster,
    strategy: object = None,
    plugins: Iterable[object] = (),
    run_dir: str | Path | None = None,
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a training function that keeps its own loop with our failure handling.

    The function is called as ``function(run, *args, **kwargs)`` with an
    :class:`ElasticRun`; it trains on ``run.mesh`` and iterates ``run.steps``.
    When it raises, the failure is classified (``et_classify_failure``); an
    elastic one goes to ``strategy`` (``et_choose_recovery``: wait, fall back,
    scale down), and the function is called again on the new mesh. Anything
    else, or any failure without a strategy, is raised as it is. With
    ``run_dir``, a ``report.json`` records the failures and attempts.

    :param cluster: the slices to run on.
    :param strategy: a strategy plugin (``ScaleDown()``, ``PauseResume()``, ...), or ``None``.
    :param plugins: more plugins, for example failure injection.
    :param run_dir: where ``report.json`` goes, or ``None``.
    """

    def decorate(function: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            run = ElasticRun(cluster, strategy=strategy, plugins=plugins, run_dir=run_dir)
            return run.run(function, *args, **kwargs)

        return wrapper

    return decorate
