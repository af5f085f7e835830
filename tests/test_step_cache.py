"""The step cache keeps at most ``max_layouts`` compiled steps: least recently used out first, never the layout in
use nor a compile under way, and an evicted step's executable is freed (JAX's own caches let go of it too)."""

import gc
import threading

import equinox as eqx
import jax
import numpy as np
import optax

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer._state import init_train_state
from elastic_trainer._step import check_fits, make_step_functions
from elastic_trainer._goodput import GoodputClock
from elastic_trainer._layouts import Layouts
from elastic_trainer._records import FailureLog, Layout, RunContext
from elastic_trainer._step_cache import StepCache
from elastic_trainer._compiled_step import FusedStep, SplitStep
from elastic_trainer_plugins.scale_down import ScaleDown

BATCH = 8


def new_cache(max_layouts: int, **kwargs) -> StepCache:
    model = et.Transformer(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=1, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    arrays, static = eqx.partition(init_train_state(model, optimizer, key=jax.random.key(1)), eqx.is_array)
    functions = make_step_functions(et.next_token_loss, optimizer, static, arrays)
    return StepCache(functions, arrays, np.zeros((1, 9), np.int32), within_slice="replicated", max_layouts=max_layouts,
                     **kwargs)


def mesh_of(slice_: int) -> jax.sharding.Mesh:
    """The mesh of one simulated slice of 2 devices: a layout of its own."""
    return etp.make_mesh([jax.devices()[2 * slice_: 2 * slice_ + 2]])


def cached(cache: StepCache, slice_: int) -> bool:
    """Get the step for slice ``slice_``'s layout; whether it was already compiled (or under way)."""
    return cache.get(mesh_of(slice_), BATCH)[2]["compile_cached"]


def live_executables() -> int:
    gc.collect()
    return len(jax.devices()[0].client.live_executables())


def test_the_least_recently_used_layout_goes_first():
    cache = new_cache(max_layouts=2)
    assert [cached(cache, s) for s in (0, 1, 2)] == [False, False, False]  # slice 0's layout is evicted
    assert (len(cache), cache.evicted) == (2, 1)
    assert cached(cache, 1) is True  # used again: now slice 2's layout is the least recently used
    assert cached(cache, 0) is False
    assert (len(cache), cache.evicted) == (2, 2)
    assert cached(cache, 1) is True and cached(cache, 2) is False


def test_a_layouts_step_is_one_donating_program_or_with_split_its_gradients_and_update():
    # one program, as a hand-written loop's, unless the cluster's processes each run their own part of every program
    fused, _, _ = new_cache(max_layouts=1).get(mesh_of(0), BATCH)
    split, _, _ = new_cache(max_layouts=1, mode=etp.SynchronousMode(split=True)).get(mesh_of(0), BATCH)
    assert isinstance(fused, FusedStep) and len(fused.executables) == 1
    assert isinstance(split, SplitStep) and len(split.executables) == 2
    # the state is donated to the one program, and to the split step's update only
    aliased = [executable.memory_analysis().alias_size_in_bytes for executable in (*fused.executables,
                                                                                   *split.executables)]
    assert aliased[0] > 0 and aliased[1] == 0 and aliased[2] == aliased[0]


def test_the_layout_in_use_stays_and_compiling_ahead_keeps_within_the_bound():
    cache = new_cache(max_layouts=1)
    cached(cache, 0)
    cache.compile_ahead(mesh_of(1), BATCH)  # no room: the one layout kept is the one in use
    assert (len(cache), cache.compiled_ahead) == (1, 0)
    assert cached(cache, 0) is True
    cache = new_cache(max_layouts=3)
    cached(cache, 0)
    for slice_ in (1, 2, 3):
        cache.compile_ahead(mesh_of(slice_), BATCH)
    assert (len(cache), cache.compiled_ahead) == (3, 2)  # slice 3's layout did not fit
    assert [cached(cache, s) for s in (1, 2)] == [True, True]
    cache.close()


def test_a_compile_under_way_is_not_evicted():
    cache = new_cache(max_layouts=2)
    release = threading.Event()
    cache._background.submit(release.wait)  # holds the background thread: what is compiled ahead stays under way
    cache.compile_ahead(mesh_of(3), BATCH)
    cached(cache, 0)
    cached(cache, 1)  # 3 layouts: slice 0's goes, slice 3's compile is under way and stays
    assert (len(cache), cache.evicted) == (2, 1)
    release.set()
    cache._background.submit(lambda: None).result()  # one background thread, in order: slice 3's compile is done
    assert cached(cache, 3) is True
    cache.close()


def test_a_layout_needed_while_its_compile_is_queued_is_compiled_at_once():
    cache = new_cache(max_layouts=4)
    cached(cache, 0)
    release = threading.Event()
    cache._background.submit(release.wait, 120)  # holds the background thread: the compiles ahead stay queued
    cache.compile_ahead(mesh_of(1), BATCH, slices=(1,))
    cache.compile_ahead(mesh_of(2), BATCH, slices=(2,))
    assert cached(cache, 2) is False  # compiled here, not after slice 1's and the held task
    assert not release.is_set() and cache.compiled_ahead == 1
    by_slices = {record.slices: record for record in cache.records}
    assert by_slices[(2,)].ahead and by_slices[(2,)].ready_at is not None  # asked for ahead, compiled when needed
    assert by_slices[(1,)].started_at is None  # still queued
    release.set()
    cache.close()


def test_every_compile_is_recorded_with_when_it_was_asked_for_and_ready():
    cache = new_cache(max_layouts=4)
    cache.get(mesh_of(0), BATCH, slices=(0,))
    cache.compile_ahead(mesh_of(1), BATCH, slices=(1,))
    cache._background.submit(lambda: None).result()
    cache.get(mesh_of(1), BATCH, slices=(1,))
    first, ahead = (record.to_json() for record in cache.records)
    assert (first["slices"], first["ahead"], ahead["slices"], ahead["ahead"]) == ([0], False, [1], True)
    for record in (first, ahead):
        assert record["requested_at"] <= record["started_at"] <= record["ready_at"]
        assert record["compile_s"] == record["ready_at"] - record["started_at"]
    cache.close()


def test_an_evicted_layout_frees_its_executable():
    cache = new_cache(max_layouts=2)
    for slice_ in (0, 1):
        cached(cache, slice_)
    kept = live_executables()
    for slice_ in (2, 3, 0, 1):
        cached(cache, slice_)
    assert cache.evicted == 4
    assert live_executables() == kept


def executables_by_slice() -> list[int]:
    """Per slice: the live executables that run on its devices alone (its layout's compiled step)."""
    gc.collect()
    live = [set(e.local_devices()) for e in jax.devices()[0].client.live_executables()]
    return [sum(devices == set(mesh_of(s).devices.flat) for devices in live) for s in range(4)]


def test_an_evicted_layout_is_freed_while_one_compiled_alongside_it_is_kept():
    # slices 0 and 1 are compiled from the same function objects, whose lowering they share; evicting 0 must
    # free 0's executable while 1's stays, as must evicting 1 later
    before = executables_by_slice()  # an earlier test's, not yet collected

    def added() -> list[int]:
        return [now - then for now, then in zip(executables_by_slice(), before, strict=True)]

    cache = new_cache(max_layouts=2)
    for slice_ in (0, 1):
        cached(cache, slice_)
    assert added() == [1, 1, 0, 0]
    cached(cache, 2)
    assert cache.evicted == 1 and added() == [0, 1, 1, 0]
    cached(cache, 3)
    assert cache.evicted == 2 and added() == [0, 0, 1, 1]


LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
"""The event JAX records each time it lowers a program to StableHLO (a miss of its lowering cache)."""


def test_layouts_of_the_same_shape_are_lowered_once_until_an_eviction():
    lowered = []

    def count(event: str, duration: float, **_: object) -> None:
        if event == LOWERED:
            lowered.append(event)

    cache = new_cache(max_layouts=3)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for slice_ in (0, 1, 2):
            cached(cache, slice_)
        assert len(lowered) == 1  # the fused step, once for the three layouts of 2 devices
        cached(cache, 3)  # compiled from the same lowering, then slice 0's layout is evicted: a new generation
        assert cache.evicted == 1 and len(lowered) == 1
        cached(cache, 0)  # the new generation's first layout is lowered anew
        assert cache.evicted == 2 and len(lowered) == 2
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def test_a_run_again_loads_its_compiles_from_the_persistent_compilation_cache(tiny_trainer_kwargs):
    """The tests share one persistent compilation cache (conftest.py): the same job run a second time loads every
    step the first run compiled, the full layout's and those compiled ahead, and its report says so. (A run ends
    without waiting for its compiles ahead: the second may finish one the first had not, which it compiles.)"""

    def compiles():
        trainer = et.Trainer(**tiny_trainer_kwargs(steps=3, global_batch_size=24), strategy=ScaleDown())
        report = trainer.fit().report
        return report["compile_cache"]["layouts"]

    def finished(records):
        return {tuple(sorted(record["slices"])): record for record in records if record["ready_at"] is not None}

    first = finished(compiles())
    again = compiles()
    assert again[0]["slices"] == [0, 1, 2, 3] and not again[0]["ahead"]
    assert [sorted(record["slices"]) for record in again[1:]] == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    compiled_before = [record for slices, record in finished(again).items() if slices in first]
    assert compiled_before[0] is again[0] and all(record["loaded"] for record in compiled_before)


class ServiceOnSlice0(et.SimulatedCluster):
    """A simulated cluster whose slice 0, like process 0's with cluster.coordinator=process0, ends the job if lost."""

    protected_slices = (0,)


def test_no_layout_without_a_slice_whose_loss_ends_the_job_is_compiled_ahead(tiny_trainer_kwargs):
    # it is never trained, and with the coordination service in process 0 JAX would not even cache its compile
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=2, global_batch_size=24, cluster=ServiceOnSlice0(slices=4),
                                               strategy=ScaleDown()))
    layouts = trainer.fit().report["compile_cache"]["layouts"]
    assert [sorted(record["slices"]) for record in layouts if record["ahead"]] == [[0, 2, 3], [0, 1, 3], [0, 1, 2]]


class LikelyLayouts:
    """Hooks as the trainer calls them: every "one slice fewer" layout (scale_down's answer) and plain meshes."""

    def et_likely_layouts(self, trainer):
        return [[[s for s in range(4) if s != lost] for lost in range(4)]]

    def et_make_mesh(self, trainer, slice_devices):
        return etp.make_mesh(slice_devices)


class QueuedCompiles:
    """A step cache that notes the order of the compiles asked for ahead, and which stay queued."""

    mode = etp.SynchronousMode()

    def __init__(self):
        self.queued = []
        self.kept = None

    def compile_ahead(self, mesh, batch_size, slices):
        self.queued.append(slices)

    def drop_queued(self, keep):
        self.kept = sorted(keep)


def run_context(cluster, hooks, *, view):
    """What Layouts reaches the cluster and the plugins through, for a test without a trainer."""
    return RunContext(cluster=cluster, hooks=hooks, plugin_manager=None, view=view, clock=GoodputClock(),
                      failures=FailureLog())


def test_the_layouts_compiled_ahead_first_drop_the_slices_that_failed_most_often():
    cluster = et.SimulatedCluster(slices=4, devices_per_slice=2)
    for slice_, times in ((2, 2), (0, 1)):
        for _ in range(times):
            cluster.fail_slice(slice_, down_for_s=0)
    steps = QueuedCompiles()
    layouts = Layouts(run_context(cluster, LikelyLayouts(), view=None), steps=steps, global_batch_size=24)
    full = Layout((0, 1, 2, 3), etp.make_mesh(cluster.slice_devices()), 24, 1.0, None, None, 0.0, False)
    layouts.compile_likely(full)
    assert steps.queued == [(0, 1, 3), (1, 2, 3), (0, 2, 3), (0, 1, 2)]  # slice 2 failed twice, slice 0 once


class OneSliceFewer(LikelyLayouts):
    def et_likely_layouts(self, trainer):
        return [[[s for s in trainer.slices if s != lost] for lost in trainer.slices]]


def test_the_likely_layouts_are_queued_once_per_layout_in_use_and_those_of_the_old_one_dropped():
    cluster = et.SimulatedCluster(slices=4, devices_per_slice=2)
    steps, view = QueuedCompiles(), type("View", (), {"slices": (0, 1, 2, 3)})()
    layouts = Layouts(run_context(cluster, OneSliceFewer(), view=view), steps=steps, global_batch_size=24)
    layout = lambda slices: Layout(slices, etp.make_mesh([cluster.slice_devices()[s] for s in slices]), 24, 1.0,  # noqa: E731
                                   None, None, 0.0, False)
    layouts.compile_likely(layout((0, 1, 2, 3)))
    layouts.compile_likely(layout((0, 1, 2, 3)))  # after the next step on the same layout: nothing new
    assert len(steps.queued) == 4
    view.slices = (0, 2, 3)  # slice 1 lost: the run goes on with a new layout
    layouts.compile_likely(layout((0, 2, 3)))
    assert steps.queued[4:] == [(2, 3), (0, 3), (0, 2)]
    assert steps.kept == [(0, 2), (0, 3), (2, 3)]  # any other compile not started yet is dropped


def test_compiles_queued_ahead_that_did_not_start_are_dropped_but_those_to_keep():
    cache = new_cache(max_layouts=4)
    cached(cache, 0)
    release = threading.Event()
    cache._background.submit(release.wait, 120)  # holds the background thread: the compiles ahead stay queued
    for slice_ in (1, 2):
        cache.compile_ahead(mesh_of(slice_), BATCH, slices=(slice_,))
    cache.drop_queued(keep=[(2,)])
    assert (len(cache), cache.compiled_ahead) == (2, 1)  # the layout in use and slice 2's
    release.set()
    cache._background.submit(lambda: None).result()  # one background thread, in order: slice 2's compile is done
    assert cached(cache, 2) is True and cached(cache, 1) is False
    by_slices = {record.slices: record for record in cache.records}
    assert by_slices[(1,)].ahead and by_slices[(1,)].started_at is None  # dropped before it started: recorded so
    cache.close()


def test_the_model_is_traced_once_per_batch_shape_and_each_layout_replays_that_trace():
    """The loss's Python runs once per batch shape however many layouts compile (the start's check that the model
    fits the data included), and a replayed step lowers to the same program as one traced directly."""
    model = et.Transformer(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=1, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    arrays, static = eqx.partition(init_train_state(model, optimizer, key=jax.random.key(1)), eqx.is_array)
    batch_shapes = []

    def loss(params, batch, *, key):
        batch_shapes.append(batch.shape)
        return et.next_token_loss(params, batch, key=key)

    functions = make_step_functions(loss, optimizer, static, arrays)
    sample = np.zeros((1, 9), np.int32)
    check_fits(functions, arrays, sample, BATCH)
    for split in (False, True):
        cache = StepCache(functions, arrays, sample, within_slice="replicated",
                          mode=etp.SynchronousMode(split=split))
        for slice_ in range(2):
            cache.get(mesh_of(slice_), BATCH)
        cache.close()
    cache = StepCache(functions, arrays, sample, within_slice="replicated")
    cache.get(etp.make_mesh([jax.devices()[:2], jax.devices()[2:4]]), 2 * BATCH)  # another batch: traced anew
    cache.close()
    assert batch_shapes == [(BATCH, 9), (2 * BATCH, 9)]

    # a replay (of the check's trace, made without a mesh) lowers to the program traced directly on the mesh
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(arrays)]
    batch = jax.ShapeDtypeStruct((BATCH, 9), np.int32, sharding=etp.batch_sharding(mesh_of(1)))
    replayed, direct = (jax.jit(f).lower(leaves, batch).as_text()
                        for f in (functions.gradients, functions.gradients.__wrapped__))
    assert replayed == direct
    assert batch_shapes == [(BATCH, 9), (2 * BATCH, 9), (BATCH, 9)]  # only the direct trace ran the loss again
