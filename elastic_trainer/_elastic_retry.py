"""``elastic_retry``: our failure handling around a training loop the user keeps (MaxText's shape).

Only what is specific to a user's own loop lives here; classifying a
failure, the strategy's plan and its waits are the trainer's own
(``_recovery.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from jax.sharding import Mesh

from .clusters import AbstractCluster, SyncCall, mesh_slice_count
from ._failures import ConfigError, PluginError
from ._goodput import GoodputClock
from ._layouts import make_mesh, with_spares
from ._plugins import GuardedHooks, make_plugin_manager, strategy_name
from ._records import FailureLog, PendingRecovery, RunContext
from ._recovery import carry_out, choose_plan, classify, ends_run_if_stopped, finish_recovery
from ._report import write_report

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
        plugins = [*plugins, *([strategy] if strategy is not None else [])]
        self.plugin_manager = make_plugin_manager(plugins, defaults=FAILURE_PLUGINS, load_entry_points=False)
        self.hook = GuardedHooks(self.plugin_manager)
        self.mesh: Mesh | None = None
        self.slices: tuple[int, ...] = ()
        self.attempt = 0
        self.step = 0
        self._failures = FailureLog()
        self._ctx = RunContext(cluster=cluster, hooks=self.hook, plugin_manager=self.plugin_manager, view=self,
                               clock=GoodputClock(), failures=self._failures)
        self._incarnations = cluster.incarnations()
        self._pending: PendingRecovery | None = None

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The failures so far, as the report lists them."""
        return self._failures.to_json()

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """The steps ``start`` to ``stop - 1``. The loop body is the step; once it
        is done, a slice lost meanwhile raises here, as a real runtime raises
        from the step, and the plugins hear of each step start and end."""
        for step in range(start, stop):
            self.step = step
            self.hook.et_step_start(trainer=self, step=step)
            yield step
            self.cluster.synchronize(SyncCall.STEP_END, self.slices, since=self._incarnations)
            finish_recovery(self._ctx, self._pending)
            self._pending = None
            self.hook.et_step_end(trainer=self, step=step + 1, metrics={})

    def run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``function(self, *args, **kwargs)`` until it returns; recover between attempts."""
        started_at = self._ctx.clock.started_at
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
        if self.run_dir is not None:
            write_report(self.run_dir, {
                "strategy": None if self.strategy is None else strategy_name(self.strategy),
                "cluster": self.cluster.describe(), "attempts": self.attempt + 1, "failures": self.failures,
                "wall_s": self._ctx.clock.summary()["wall_s"], "started_at": started_at,
            })
        return result

    def _recover(self, error: Exception) -> None:
        """Classify ``error``; let the strategy plan; wait and re-mesh as it says. Re-raise what is not survivable."""
        failure, index = classify(self._ctx, error, step=self.step, phase="train_step", slices=self.slices,
                                  since=self._incarnations)
        with ends_run_if_stopped(self._ctx, index):
            plan = choose_plan(self._ctx, failure) if failure.elastic else None
            if plan is None:
                raise error
            plan, healthy = carry_out(self._ctx, plan, index, error=error, restart=self._cannot_restart)
        self._use(healthy)
        self._failures.amend(index, slices_after=len(self.slices))
        self._pending = PendingRecovery(index, self._failures[index].failed_at)
        self.attempt += 1

    @staticmethod
    def _cannot_restart() -> NoReturn:
        raise ConfigError("elastic_retry recovers inside this process; a strategy that restarts the process "
                          "(full_restart) needs the trainer's command line, python -m elastic_trainer.")

    def _use(self, slices: list[int]) -> None:
        """Mesh ``slices`` through the ``et_make_mesh`` hook, as many as a mesh holds (those in use first, then
        spares); the data on them is as of now."""
        devices = self.cluster.slice_devices()
        self.slices = with_spares(slices, in_use=self.slices, limit=mesh_slice_count(self.cluster))
        self.mesh = make_mesh(self.hook, self, [devices[s] for s in self.slices])
        self._incarnations = self.cluster.incarnations()


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
