"""``cluster=pathways`` under pathwaysutils' own model of a Pathways device loss, its only source of failure.

pathwaysutils 0.1.13 ships ``pathwaysutils.test.mock_fault_injection.DeviceLossSimulator``: once a device is
marked lost, reading an array on it (``np.asarray``, ``jax.block_until_ready``, ``Array.block_until_ready``,
...) raises ``JaxRuntimeError("DATA_LOSS: ...")``, corruption flows from the inputs of a jitted call to its
outputs, and it is sticky: an array made before a loss stays unreadable after its device reconnects. Here the
CPU devices are grouped into slices as the simulated cluster groups them (4 slices of 2), the loss is the
simulator's ``mark_slice_lost``, the error is the one the simulator raises wherever the trainer first reads an
array of the lost slice, pathwaysutils' ``is_error_due_to_slice_down`` classifies it (``PathwaysCluster``'s
``et_classify_failure``), and the health the strategies see is pathwaysutils' own ``DefaultSliceHealthChecker``
(a ``pmap`` on each slice, which the simulator fails on a lost one). Nothing of ours injects anything:
``PathwaysCluster`` is not an injectable cluster.

Each strategy's cell checks every invariant of the fault matrix (``tests/test_fault_matrix.py``,
``check_invariants``: 0 duplicated or skipped samples, the final state and every checkpoint the failure-free
run's, lost steps within the bound) and that no array made before a loss was read once its slice was back.

Two things the simulator does not do are done by :class:`PathwaysFaults`, each the simulator's own rule applied
where its patches do not reach (they are test plumbing, not failures):

- its ``jax.jit`` wrapper is a plain function, without jit's ahead-of-time methods (``lower``, ``trace``): the
  trainer compiles its steps ahead of time, so the wrapper gets them back from the function it wraps, and a
  compiled program's call (``jax.stages.Compiled.__call__``) carries corruption from its inputs to its outputs
  as the simulator's jit wrapper does;
- it keys arrays by ``id()`` and marks lost only the arrays it has seen: every live array is shown to it just
  before a loss (on real hardware every array on the device is lost), and every array it has seen is kept alive
  for the test, so that a new array at a freed one's address does not inherit its corruption.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from test_fault_matrix import (
    BATCH, FAIL_AT, MAX_WORKERS, PERIOD, STEPS, Cell, check_invariants, failure_free, run_worker,  # noqa: F401
)

import elastic_trainer as et
from elastic_trainer.clusters import AbstractInjectableCluster, PathwaysCluster
from elastic_trainer.launch._supervisor import RESTART_EXIT_CODE
from elastic_trainer_plugins.fallback import Fallback
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.hot_swap import HotSwap
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

elastic = pytest.importorskip("pathwaysutils.elastic.elastic")  # the `pathways` extra, part of `test`
mock_fault_injection = pytest.importorskip("pathwaysutils.test.mock_fault_injection")

LOST = 1  # the slice lost in every cell


def slice_to_devices() -> dict[int, list[jax.Device]]:
    """The 8 CPU devices as 4 slices of 2, as ``SimulatedCluster(slices=4, devices_per_slice=2)`` groups them."""
    devices = jax.devices()
    return {index: devices[2 * index: 2 * index + 2] for index in range(4)}


class PathwaysFaults:
    """pathwaysutils' ``DeviceLossSimulator`` over :func:`slice_to_devices`, started on entry and stopped on exit.

    :attr:`stale_reads` lists (as stacks) every read of a corrupt array while none of its devices is lost: an
    array made before a loss, read after its slice came back.
    """

    def __init__(self):
        self.slices = slice_to_devices()
        self.simulator = mock_fault_injection.DeviceLossSimulator()
        self.down: set[int] = set()
        self.stale_reads: list[str] = []
        self._seen: list[jax.Array] = []  # every array the simulator tracks, kept alive: it keys them by id()
        self._patchers: list = []

    def __enter__(self) -> PathwaysFaults:
        sim = self.simulator
        sim.start()
        track, is_corrupted = sim.track_array, sim.is_array_corrupted

        def track_and_keep(arr) -> None:
            new = isinstance(arr, jax.Array) and not isinstance(arr, jax.core.Tracer)
            if new and id(arr) not in sim._array_devices:
                self._seen.append(arr)
            track(arr)

        def detect_stale(arr) -> bool:
            corrupted = is_corrupted(arr)
            if corrupted and not sim._array_devices.get(id(arr), set()) & self._lost_device_ids():
                self.stale_reads.append("".join(traceback.format_stack(limit=14)))
            return corrupted

        sim.track_array, sim.is_array_corrupted = track_and_keep, detect_stale

        def with_aot_methods(their_jit: Callable) -> Callable:
            def jit(fun=None, **kwargs):
                if fun is None:
                    return lambda f: jit(f, **kwargs)
                wrapped = their_jit(fun, **kwargs)
                for name in ("lower", "trace", "eval_shape"):
                    setattr(wrapped, name, getattr(wrapped.__wrapped__, name))
                return wrapped
            return jit

        call = jax.stages.Compiled.__call__

        def propagating_call(compiled, *args, **kwargs):
            inputs = [leaf for leaf in jax.tree.leaves((args, kwargs)) if isinstance(leaf, jax.Array)]
            corrupted = any([sim.is_array_corrupted(leaf) for leaf in inputs])  # before: donated inputs are deleted
            out = call(compiled, *args, **kwargs)
            for leaf in [leaf for leaf in jax.tree.leaves(out) if isinstance(leaf, jax.Array)]:
                sim.track_array(leaf)  # as the simulator's jit wrapper does (propagate_corruption)
                sim._array_generation[id(leaf)] = sim._generation
                (sim._corrupted_array_ids.add if corrupted else sim._corrupted_array_ids.discard)(id(leaf))
            return out

        self._patchers = [mock.patch.object(jax, "jit", with_aot_methods(jax.jit)),
                          mock.patch.object(jax.stages.Compiled, "__call__", propagating_call)]
        for patcher in self._patchers:
            patcher.start()
        return self

    def __exit__(self, *exc_info) -> None:
        for patcher in reversed(self._patchers):
            patcher.stop()
        self.simulator.stop()

    def _lost_device_ids(self) -> set[int]:
        return {device.id for index in self.down for device in self.slices[index]}

    def lose(self, index: int) -> None:
        """Slice ``index`` is lost: with every array on it (each live array shown to the simulator first)."""
        for arr in jax.live_arrays():
            self.simulator.track_array(arr)
        self.simulator.mark_slice_lost(index, self.slices)
        self.down.add(index)

    def reconnect(self, index: int) -> None:
        """Slice ``index`` is back (its old arrays stay lost)."""
        self.simulator.mark_slice_connected(index, self.slices)
        self.down.discard(index)


class SliceLoss:
    """The cells' schedule: slice :data:`LOST` is lost through the simulator as step :data:`FAIL_AT` starts, and
    comes back when ``back`` says: never (``None``), ``"while_waited_for"`` (as a recovery polls health for the
    second time) or ``"after_recovery"`` (as the failed step starts again, on the slices left). It also keeps each
    failure the trainer's recovery was handed."""

    def __init__(self, faults: PathwaysFaults, back: str | None = None):
        self.faults, self.back = faults, back
        self.struck = False
        self.polls_since = 0
        self.errors: list[BaseException] = []

    @et.hookimpl
    def et_step_start(self, trainer, step):
        if step == FAIL_AT and not self.struck:
            self.struck = True
            self.faults.lose(LOST)
        elif step == FAIL_AT and self.back == "after_recovery" and LOST in self.faults.down:
            self.faults.reconnect(LOST)

    @et.hookimpl(tryfirst=True)
    def et_slice_health(self, trainer):
        if self.back == "while_waited_for" and LOST in self.faults.down:
            self.polls_since += 1
            if self.polls_since == 3:  # 1: the classification's, 2: the wait's first, 3: after one poll interval
                self.faults.reconnect(LOST)
        return None  # pathwaysutils' health checker answers

    @et.hookimpl
    def et_recovery_start(self, trainer, failure):
        self.errors.append(failure.error)


def pathways(spare_slices: int = 0) -> PathwaysCluster:
    return PathwaysCluster(spare_slices=spare_slices, slice_to_devices=slice_to_devices())


def run_cell(make, tmp_path, faults: PathwaysFaults, *, new_strategy, new_cluster=pathways, back=None,
             between_workers: Callable[[], None] = lambda: None) -> tuple[Cell, SliceLoss]:
    """Run the schedule under ``new_strategy()``, restarting workers as the supervisor would (a restarted worker
    is a new single controller: a new trainer and cluster; ``between_workers`` runs before it starts)."""
    children_before = set(psutil.Process().children(recursive=True))
    loss, workers = SliceLoss(faults, back), []
    while not workers or workers[-1].exit_code == RESTART_EXIT_CODE:
        assert len(workers) < MAX_WORKERS, "the worker restarts did not end"
        resume = bool(workers) and workers[-1].report["failures"][-1]["restored_from"] == "checkpoint"
        if workers:
            between_workers()
        workers.append(run_worker(make, tmp_path, strategy=new_strategy(), plugins=[loss], resume=resume,
                                  cluster=new_cluster()))
    orphans = [p for p in psutil.Process().children(recursive=True) if p not in children_before]
    return Cell(workers, None, [], orphans), loss


def check_pathways_failure(cell: Cell, loss: SliceLoss, faults: PathwaysFaults) -> dict:
    """The error reached the trainer as the simulator raises it and pathwaysutils classified it; the slice was
    found lost by pathwaysutils' health checker (the error does not name it); nothing stale was read."""
    assert faults.stale_reads == [], f"an array made before the loss was read after it:\n{faults.stale_reads[0]}"
    [error] = loss.errors
    assert isinstance(error, jax.errors.JaxRuntimeError) and str(error).startswith("DATA_LOSS: Simulated device loss")
    assert elastic.is_error_due_to_slice_down(error, log_traceback=False)
    raised_in = traceback.extract_tb(error.__traceback__)[-1]
    assert raised_in.filename == mock_fault_injection.__file__, raised_in  # the simulator raised it
    assert not any(isinstance(w.trainer.cluster, AbstractInjectableCluster) for w in cell.workers)
    [failure] = cell.merged_report()["failures"]
    assert (failure["kind"], failure["phase"], failure["slices"], failure["step"]) \
        == ("slice_lost", "train_step", [LOST], FAIL_AT)
    return failure


@pytest.fixture
def faults():
    with PathwaysFaults() as started:
        yield started


def test_health_is_what_pathwaysutils_checker_finds_under_the_simulator(faults):
    """pathwaysutils' default checker (a pmap on each slice) finds a slice the simulator lost down, and back once
    it reconnects; its loss counts once, and stays counted (what it held is gone)."""
    cluster = pathways()
    assert (cluster.healthy_slices(), cluster.incarnations()) == ([0, 1, 2, 3], (0, 0, 0, 0))
    faults.lose(2)
    assert (cluster.healthy_slices(), cluster.incarnations()) == ([0, 1, 3], (0, 0, 1, 0))
    assert (cluster.healthy_slices(), cluster.incarnations()) == ([0, 1, 3], (0, 0, 1, 0))  # the same loss
    faults.reconnect(2)
    assert (cluster.healthy_slices(), cluster.incarnations()) == ([0, 1, 2, 3], (0, 0, 1, 0))
    assert faults.stale_reads == []


def test_scale_down(tiny_trainer_kwargs, failure_free, tmp_path, faults):
    cell, loss = run_cell(tiny_trainer_kwargs, tmp_path, faults,
                          new_strategy=lambda: ScaleDown(compile_ahead=False, timeout_s=0))
    failure = check_pathways_failure(cell, loss, faults)
    check_invariants(cell, failure_free)
    # the step had taken the state (one program over every slice, the state donated): the checkpoint before it
    assert (failure["action"], failure["slices_after"], failure["restored_from"], failure["lost_steps"]) \
        == ("scale_down", 3, "checkpoint", FAIL_AT - PERIOD)


def test_pause_resume(tiny_trainer_kwargs, failure_free, tmp_path, faults):
    cell, loss = run_cell(tiny_trainer_kwargs, tmp_path, faults, new_strategy=lambda: PauseResume(timeout_s=30),
                          back="while_waited_for")
    failure = check_pathways_failure(cell, loss, faults)
    check_invariants(cell, failure_free)
    assert (failure["action"], failure["slices_after"], failure["restored_from"]) == ("pause_resume", 4, "checkpoint")
    assert failure["waiting_s"] > 0 and loss.polls_since == 3  # it waited, until the health checker saw it back


def test_hot_swap(tiny_trainer_kwargs, failure_free, tmp_path, faults):
    cell, loss = run_cell(
        tiny_trainer_kwargs, tmp_path, faults, new_cluster=lambda: pathways(spare_slices=1),
        new_strategy=lambda: Fallback([HotSwap(compile_ahead=False), ScaleDown(compile_ahead=False, timeout_s=0)]),
    )
    failure = check_pathways_failure(cell, loss, faults)
    check_invariants(cell, failure_free)
    assert (failure["action"], failure["slices_after"], failure["spares_taken"], failure["restored_from"]) \
        == ("hot_swap", 3, [3], "checkpoint")


def test_full_restart(tiny_trainer_kwargs, failure_free, tmp_path, faults):
    """A restart is the single controller's: a new trainer and cluster in this process (the simulator's devices
    live here), once the job has its slice back, as a restarted Pathways job gets its slices from the
    scheduler. The new controller reads nothing of the old one's arrays."""
    cell, loss = run_cell(tiny_trainer_kwargs, tmp_path, faults, new_strategy=lambda: FullRestart(max_restarts=3),
                          between_workers=lambda: faults.reconnect(LOST))
    failure = check_pathways_failure(cell, loss, faults)
    check_invariants(cell, failure_free)
    assert len(cell.workers) == 2 and (failure["action"], failure["restored_from"]) == ("full_restart", "checkpoint")
    assert cell.workers[1].report["resumed_from"] == PERIOD


def test_a_slice_back_is_taken_back_without_reading_what_it_held(tiny_trainer_kwargs, failure_free, tmp_path, faults):
    """scale_down goes on without the lost slice; the slice comes back while the failed step runs again, and
    the next step boundary takes it back (pathwaysutils' health checker finds it up). Every array made before the
    loss stays lost (sticky): the trainer reads none of them, here the scalars the full mesh's step was given
    before the loss included. The probe shows that such a read would be caught."""
    probe = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("d",)), jax.sharding.PartitionSpec("d")))
    cell, loss = run_cell(tiny_trainer_kwargs, tmp_path, faults,
                          new_strategy=lambda: ScaleDown(compile_ahead=False, timeout_s=0), back="after_recovery")
    failure = check_pathways_failure(cell, loss, faults)
    check_invariants(cell, failure_free)
    assert (failure["action"], failure["slices_after"]) == ("scale_down", 3)
    [worker] = cell.workers
    assert [(r["reason"], r["slices_after"]) for r in worker.report["resizes"]] == [("failure", 3), ("scale_up", 4)]
    assert worker.trainer.cluster.incarnations() == (0, 1, 0, 0)
    assert LOST not in faults.down
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        np.asarray(probe)  # made before the loss: still lost, the slice back or not
    assert len(faults.stale_reads) == 1
