"""Recovery from lost slices: strategies, restore sources, sample accounting and chaos injection.

Runs are expensive (each new mesh is a compile), so the failure-free
baselines that several tests compare against are computed once per module.

The keep-global-batch runs use a global batch of 24, not 16: after losing one
of 4 slices of 2 devices, the batch must split over 6 devices.
"""

import asyncio
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import elastic_trainer as et
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.fallback import Fallback
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

BATCH = 24  # divisible by 8, 6, 4 and 2 devices: every mesh a keep_global run can shrink to
STEPS = 6
FAIL_AT = 3
FOREVER = 1e9

_cache: dict = {}


def params_of(state):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(state.params, eqx.is_array))]


def assert_params_close(actual, expected):
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def baseline_params(make, *, steps, global_batch_size=BATCH):
    """The params of a failure-free run (no strategy, no chaos), computed once per module."""
    key = ("baseline", steps, global_batch_size)
    if key not in _cache:
        _cache[key] = params_of(et.Trainer(**make(steps=steps, global_batch_size=global_batch_size)).fit().state)
    return _cache[key]


def fit(trainer):
    """``(state, report)``; ``state`` is None when the run stopped."""
    try:
        state, report = trainer.fit()
    except et.TrainingStopped as stopped:
        assert stopped.report is not None
        return None, stopped.report
    return state, report


def chaos(*failures, **kwargs):
    return Chaos(failures=[dict(f) for f in failures], **kwargs)


def lose(slice_, *, at_step=FAIL_AT, down_for_s=FOREVER, phase="train_step"):
    return {"at_step": at_step, "slice": slice_, "down_for_s": down_for_s, "phase": phase}


class RestoreRecorder:
    """Records every restore: its step, source, the state handed to plugins (copied to the host: the next step's
    update consumes the device buffers), its leaves' devices, and when (monotonic)."""

    def __init__(self):
        self.restored = []

    @et.hookimpl
    def et_after_restore(self, step, source, state):
        devices = [set(leaf.sharding.device_set) for leaf in jax.tree.leaves(eqx.filter(state, eqx.is_array))]
        self.restored.append((step, source, jax.device_get(state), devices, time.monotonic()))


# ------------------------------------------------------------------ scale_down, one slice lost for good


def shards_of(tree):
    """Every array of ``tree`` as ``(devices, dtype, [(device, shard on the host)])``, copied now: the next step's
    update consumes the device buffers."""
    return [(set(array.sharding.device_set), array.dtype,
             [(shard.device, np.asarray(shard.data)) for shard in array.addressable_shards])
            for array in jax.tree.leaves(tree)]


def assert_only_the_lost_shards_are_garbage(shards, dead):
    """NaN (or the largest integer) wherever ``dead`` devices held an array, finite floats elsewhere."""
    assert any(np.issubdtype(dtype, np.inexact) for _, dtype, _ in shards)
    for devices, dtype, array_shards in shards:
        assert dead <= devices
        for device, data in array_shards:
            if device in dead:
                if np.issubdtype(dtype, np.inexact):
                    assert np.isnan(data).all()
                else:
                    assert (data == np.iinfo(data.dtype).max).all()
            elif np.issubdtype(dtype, np.inexact):
                assert np.isfinite(data).all()


def capture_what_survives(trainer):
    """Wrap ``trainer.cluster.surviving`` so that each call's lost slices and the shards left of the state
    (the simulated cluster overwrites the lost slices' shards with NaN) are appended to the list returned."""
    surviving, captured = trainer.cluster.surviving, []

    def capture(tree, lost_slices):
        left = surviving(tree, lost_slices)
        captured.append((list(lost_slices), shards_of(left)))
        return left

    trainer.cluster.surviving = capture
    return captured


def scale_down_one_lost(make):
    """A scale_down run that loses slice 1 at step 3 for good, with what its recovery saw.

    What is left of the state once slice 1 is gone is captured (``capture_what_survives``).
    """
    if "scale_down_one_lost" not in _cache:
        recorder = RestoreRecorder()
        trainer = et.Trainer(**make(steps=STEPS, global_batch_size=BATCH, strategy=ScaleDown(compile_ahead=False),
                                    plugins=[chaos(lose(1)), recorder]))
        captured = capture_what_survives(trainer)
        state, report = fit(trainer)
        _cache["scale_down_one_lost"] = trainer, state, report, captured, recorder.restored
    return _cache["scale_down_one_lost"]


def test_scale_down_continues_from_a_replica_and_trains_like_a_failure_free_run(tiny_trainer_kwargs):
    _, state, report, _, _ = scale_down_one_lost(tiny_trainer_kwargs)
    assert state is not None, report["stopped"]
    assert report["steps_completed"] == STEPS and int(state.step) == STEPS
    [failure] = report["failures"]
    assert (failure["step"], failure["slice"], failure["slices"]) == (FAIL_AT, 1, [1])
    assert (failure["kind"], failure["action"]) == ("slice_lost", "scale_down")
    assert (failure["restored_from"], failure["lost_steps"]) == ("replica", 0)
    assert (failure["slices_before"], failure["slices_after"]) == (4, 3)
    resizes = [(r["step"], r["reason"], r["slices_before"], r["slices_after"], r["slices"]) for r in report["resizes"]]
    assert resizes == [(FAIL_AT, "failure", 4, 3, [0, 2, 3])]
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert int(state.data_position) == STEPS * BATCH
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


def test_recovery_never_reads_the_lost_slice(tiny_trainer_kwargs):
    trainer, state, report, captured, restored = scale_down_one_lost(tiny_trainer_kwargs)
    assert state is not None, report["stopped"]
    dead = set(trainer.cluster.slice_devices()[1])
    # What recovery works with has NaN (or the largest integer) wherever slice 1 held the state...
    [(lost, left)] = captured
    assert lost == [1]
    assert_only_the_lost_shards_are_garbage(left, dead)
    # ...yet the restored state is whole, off slice 1, and exactly the state before the failed step.
    [(step, source, restored_state, devices, _)] = restored
    assert (step, source) == (FAIL_AT, "replica")
    restored_params = params_of(restored_state)
    for leaf in restored_params:
        assert np.isfinite(leaf).all()
    assert devices and not any(dead & leaf_devices for leaf_devices in devices)
    assert int(restored_state.step) == FAIL_AT and int(restored_state.data_position) == FAIL_AT * BATCH
    assert_params_close(restored_params, baseline_params(tiny_trainer_kwargs, steps=FAIL_AT))


def test_a_slice_lost_while_the_step_runs_leaves_the_state_on_no_slice_and_the_snapshot_restores_it(
        tiny_trainer_kwargs):
    """The step is one program with the state donated to it, as a hand-written loop's: a slice lost while it
    runs (chaos's ``update`` phase strikes after the step's launch) fails it on every slice, and the state it
    took is gone from all of them. The run restores the host snapshot of the step before (taken after every
    step here), trains the failed step again, loses no committed step, and trains on like a failure-free run."""
    lost_slice = 2
    recorder = RestoreRecorder()
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, snapshot_period=1, strategy=ScaleDown(compile_ahead=False),
        plugins=[chaos(lose(lost_slice, phase="update")), recorder]))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    [failure] = report["failures"]
    assert (failure["step"], failure["phase"], failure["slices"]) == (FAIL_AT, "train_step", [lost_slice])
    assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("snapshot", 0, 3)
    [(step, source, restored_state, devices, _)] = recorder.restored
    assert (step, source) == (FAIL_AT, "snapshot")
    assert not any(set(trainer.cluster.slice_devices()[lost_slice]) & leaf_devices for leaf_devices in devices)
    assert int(restored_state.step) == FAIL_AT and int(restored_state.data_position) == FAIL_AT * BATCH
    assert_params_close(params_of(restored_state), baseline_params(tiny_trainer_kwargs, steps=FAIL_AT))
    assert report["steps_completed"] == STEPS
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


def test_a_step_that_took_the_state_and_failed_with_nothing_to_restore_stops_saying_why(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, snapshot_period=0, strategy=ScaleDown(compile_ahead=False),
        plugins=[chaos(lose(2, phase="update"))]))
    state, report = fit(trainer)
    assert state is None and report["steps_completed"] == FAIL_AT
    assert report["stopped"] == (
        "the failed step had taken the state from every slice (a step donates it) and there is no "
        "snapshot or checkpoint to restore from; keep trainer.snapshot_period above 0 or enable checkpoints.")
    assert [(f["restored_from"], f["ended_run"]) for f in report["failures"]] == [("none", True)]


def test_a_step_that_took_the_state_restores_the_checkpoint_whose_save_is_still_in_flight(
        tiny_trainer_kwargs, tmp_path, monkeypatch):
    """Orbax lists a step among its checkpoints as soon as its asynchronous save starts, before the folder is in
    place. The save of step 2 is held back here until well after step 3 has failed (its finalization waits), so
    the restore must wait for that save to end rather than find no directory and stop the run."""
    from orbax.checkpoint.path import atomicity

    finalize, held_back = atomicity.AtomicRenameTemporaryPath.finalize, []

    async def late_finalize(self):
        if not held_back:  # step 2's save, the first: the later ones need not wait (each cost the test 1 s)
            held_back.append(self)
            await asyncio.sleep(1.0)
        await finalize(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", late_finalize)
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, snapshot_period=0, strategy=ScaleDown(compile_ahead=False),
        checkpointer=et.Checkpointer(tmp_path, period=2), plugins=[chaos(lose(2, phase="update"))]))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    [failure] = report["failures"]
    assert (failure["restored_from"], failure["lost_steps"]) == ("checkpoint", FAIL_AT - 2)
    assert report["steps_completed"] == STEPS


# ------------------------------------------------------------------ scale_down, slice back soon


class WaitForAllSlices:
    """Makes the step that ends at ``after_step`` last until every slice is healthy again.

    Pins down at which step boundary a returning slice is seen, whatever the
    machine's speed.
    """

    def __init__(self, after_step, timeout_s=30.0):
        self.after_step = after_step
        self.timeout_s = timeout_s

    @et.hookimpl
    def et_step_end(self, trainer, step):
        deadline = time.monotonic() + self.timeout_s
        while step == self.after_step and len(trainer.cluster.healthy_slices()) < trainer.cluster.slices:
            assert time.monotonic() < deadline, "the lost slice did not come back"
            time.sleep(0.01)


def test_scale_down_scales_back_up_when_the_slice_returns(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, strategy=ScaleDown(compile_ahead=False),
        plugins=[chaos(lose(0, down_for_s=1.5)), WaitForAllSlices(after_step=FAIL_AT + 1)],
    ))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    [failure] = report["failures"]
    assert (failure["step"], failure["slices"], failure["restored_from"]) == (FAIL_AT, [0], "replica")
    assert (failure["slices_before"], failure["slices_after"]) == (4, 3)
    resizes = [(r["step"], r["reason"], r["slices_before"], r["slices_after"], r["slices"]) for r in report["resizes"]]
    assert resizes == [(FAIL_AT, "failure", 4, 3, [1, 2, 3]), (FAIL_AT + 1, "scale_up", 3, 4, [0, 1, 2, 3])]
    assert report["resizes"][1]["compile_cached"] is True  # back on the first layout: nothing to compile
    assert trainer.slices == (0, 1, 2, 3)
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


def test_a_slice_lost_for_no_time_still_fails_the_step(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=5, global_batch_size=BATCH, strategy=PauseResume(timeout_s=60),
                                               plugins=[chaos(lose(1, down_for_s=0.0))]))
    state, report = fit(trainer)
    assert trainer.cluster.incarnations() == (0, 1, 0, 0)  # chaos did lose it
    assert [(f["step"], f["slices"]) for f in report["failures"]] == [(FAIL_AT, [1])]
    assert state is not None, report["stopped"]
    assert report["failures"][0]["slices_after"] == 4


# ------------------------------------------------------------------ pause_resume


def test_pause_resume_waits_for_the_slice_then_resumes_on_all_slices(tiny_trainer_kwargs):
    recorder = RestoreRecorder()
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=STEPS, global_batch_size=BATCH, strategy=PauseResume(timeout_s=60),
                                               plugins=[chaos(lose(1, down_for_s=1.5)), recorder]))
    fail_slice, failed_at = trainer.cluster.fail_slice, []

    def timed_fail_slice(index, *, down_for_s):
        failed_at.append(time.monotonic())
        fail_slice(index, down_for_s=down_for_s)

    trainer.cluster.fail_slice = timed_fail_slice
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    [failure] = report["failures"]
    assert (failure["action"], failure["slices"], failure["restored_from"]) == ("pause_resume", [1], "replica")
    assert (failure["slices_before"], failure["slices_after"], failure["lost_steps"]) == (4, 4, 0)
    # The restore happened only once slice 1 was back; the wait took (almost all of) its 1.5 s down time.
    [fail_time], [(_, _, _, _, restore_time)] = failed_at, recorder.restored
    assert restore_time - fail_time >= 1.5
    assert failure["waiting_s"] > 0 and report["badput_s"]["waiting_for_slices"] > 0  # and the wait is booked
    assert report["resizes"] == []  # back on the same 4 slices
    assert trainer.slices == (0, 1, 2, 3)
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


def test_pause_resume_stops_when_the_slice_is_not_back_in_time(tiny_trainer_kwargs, tmp_path):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=STEPS, global_batch_size=BATCH,
                                               checkpointer=et.Checkpointer(tmp_path, period=2),
                                               strategy=PauseResume(timeout_s=0.2), plugins=[chaos(lose(1))]))
    with pytest.raises(et.TrainingStopped, match=r"fewer than the 4 the strategy needs") as stopped:
        trainer.fit()
    report = stopped.value.report
    assert report["steps_completed"] == FAIL_AT
    assert report["stopped"] == str(stopped.value)
    [failure] = report["failures"]
    assert (failure["step"], failure["action"], failure["restored_from"]) == (FAIL_AT, "pause_resume", "none")
    assert failure["waiting_s"] >= 0.2
    assert report["samples"] == {"consumed": FAIL_AT * BATCH, "duplicated": 0, "skipped": 0}
    # the last checkpoint before the failure is intact: a new run resumes from it
    resumed = et.Trainer(**tiny_trainer_kwargs(steps=FAIL_AT, global_batch_size=BATCH, resume=True,
                                               checkpointer=et.Checkpointer(tmp_path, period=2)))
    assert resumed.checkpointer.latest_step() == FAIL_AT - FAIL_AT % 2
    state, _ = resumed.fit()
    assert int(state.step) == FAIL_AT


def test_fallback_chain_scales_down_once_pause_resume_times_out(tiny_trainer_kwargs):
    chain = Fallback([PauseResume(timeout_s=0.5), ScaleDown(compile_ahead=False, scale_up=False)])
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=STEPS, global_batch_size=BATCH, strategy=chain,
                                               plugins=[chaos(lose(1))]))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    assert report["strategy"] == "pause_resume->scale_down" and report["steps_completed"] == STEPS
    [failure] = report["failures"]
    assert (failure["fell_back_from"], failure["action"]) == (["pause_resume"], "scale_down")
    assert failure["waiting_s"] >= 0.5  # pause_resume really waited before giving up
    assert (failure["slices_after"], failure["restored_from"], failure["lost_steps"]) == (3, "replica", 0)
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


# ------------------------------------------------------------------ a second failure while recovering


def test_scale_down_survives_a_second_failure_during_recovery(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=STEPS, global_batch_size=BATCH, strategy=ScaleDown(compile_ahead=False),
                                               plugins=[chaos(lose(1), lose(2, phase="recovery"))]))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    assert trainer.cluster.incarnations() == (0, 1, 1, 0)
    [failure] = report["failures"]
    assert (failure["step"], failure["phase"], failure["slices"]) == (FAIL_AT, "train_step", [1, 2])
    assert (failure["slices_before"], failure["slices_after"], failure["restored_from"]) == (4, 2, "replica")
    assert [(r["reason"], r["slices"]) for r in report["resizes"]] == [("failure", [0, 3])]
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


def test_pause_resume_survives_a_second_failure_during_recovery(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, strategy=PauseResume(timeout_s=60),
        plugins=[chaos(lose(1, down_for_s=0.3), lose(2, down_for_s=0.3, phase="recovery"))],
    ))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    assert trainer.cluster.incarnations() == (0, 1, 1, 0)
    [failure] = report["failures"]
    assert (failure["step"], failure["slices"], failure["restored_from"]) == (FAIL_AT, [1, 2], "replica")
    assert (failure["slices_before"], failure["slices_after"]) == (4, 4)
    assert trainer.slices == (0, 1, 2, 3)
    assert report["steps_completed"] == STEPS
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}


# ------------------------------------------------------------------ every slice lost


@pytest.mark.parametrize("strategy", [
    lambda: PauseResume(timeout_s=60),
    lambda: ScaleDown(compile_ahead=False, timeout_s=60),  # none left to go on with: it waits for one too
], ids=["pause_resume", "scale_down"])
def test_losing_every_slice_waits_for_them_and_restores_the_host_snapshot(tiny_trainer_kwargs, strategy):
    recorder = RestoreRecorder()
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, snapshot_period=2, strategy=strategy(),
        plugins=[chaos(*(lose(s, down_for_s=0.3) for s in range(4))), recorder],
    ))
    fail_slice, back_at = trainer.cluster.fail_slice, []

    def timed_fail_slice(index, *, down_for_s):
        back_at.append(time.monotonic() + down_for_s)
        fail_slice(index, down_for_s=down_for_s)

    trainer.cluster.fail_slice = timed_fail_slice
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    [failure] = report["failures"]
    assert (failure["step"], failure["slices"], failure["restored_from"]) == (FAIL_AT, [0, 1, 2, 3], "snapshot")
    assert failure["lost_steps"] == FAIL_AT - 2  # the last snapshot was taken after step 2
    assert failure["ended_run"] is False and failure["recovery_s"] > 0
    [(_, _, _, _, restored_at)] = recorder.restored
    assert restored_at >= min(back_at)  # restored only once a slice was back
    assert report["steps_completed"] == STEPS and int(state.step) == STEPS
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert report["badput_s"]["wasted_progress"] > 0
    assert_params_close(params_of(state), baseline_params(tiny_trainer_kwargs, steps=STEPS))


def test_scale_down_without_a_wait_stops_when_every_slice_is_lost_and_reports_that_failure_as_the_end(
        tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH, strategy=ScaleDown(compile_ahead=False, timeout_s=0),
        plugins=[chaos(*(lose(s) for s in range(4)))],
    ))
    with pytest.raises(et.TrainingStopped, match=r"^scale_down: 0 slice\(s\) healthy after waiting 0 s, fewer than "
                                                 r"the 1 the strategy needs; the last checkpoint is intact\.$"):
        trainer.fit()
    [failure] = trainer.failures
    assert (failure["step"], failure["action"], failure["ended_run"]) == (FAIL_AT, "scale_down", True)
    assert failure["recovery_s"] is None and failure["slices_after"] == 4  # it never recovered


# ------------------------------------------------------------------ no strategy


def test_chaos_without_a_strategy_stops_and_says_how_to_select_one(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=STEPS, plugins=[chaos(lose(1))]))
    with pytest.raises(et.TrainingStopped, match=r"\+strategy=NAME") as stopped:
        trainer.fit()
    report = stopped.value.report
    assert report["steps_completed"] == FAIL_AT
    [failure] = report["failures"]
    assert (failure["step"], failure["slices"], failure["action"]) == (FAIL_AT, [1], "stop")


# ------------------------------------------------------------------ keep_per_device


def test_keep_per_device_shrinks_the_global_batch_without_skipping_samples(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=STEPS, global_batch_size=16,
                                               strategy=ScaleDown(compile_ahead=False, batch_policy="keep_per_device"),
                                               plugins=[chaos(lose(1))]))
    state, report = fit(trainer)
    assert state is not None, report["stopped"]
    assert report["steps_completed"] == STEPS
    [failure] = report["failures"]
    assert (failure["slices_after"], failure["restored_from"]) == (3, "replica")
    consumed = FAIL_AT * 16 + (STEPS - FAIL_AT) * 12  # 2 devices per slice keep 2 samples each
    assert report["samples"] == {"consumed": consumed, "duplicated": 0, "skipped": 0}
    assert int(state.data_position) == consumed


# ------------------------------------------------------------------ configuration errors


def test_chaos_and_scale_down_reject_impossible_configurations(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(global_batch_size=BATCH, strategy=ScaleDown(compile_ahead=False),
                                               plugins=[chaos(lose(7))]))
    with pytest.raises(et.ConfigError, match="slice 7"):
        trainer.fit()
    with pytest.raises(et.ConfigError, match="lunch"):
        Chaos(failures=[{"at_step": 1, "slice": 0, "phase": "lunch"}])
    trainer = et.Trainer(**tiny_trainer_kwargs(strategy=ScaleDown(compile_ahead=False, min_slice_count=5)))
    with pytest.raises(et.ConfigError, match="min_slice_count"):
        trainer.fit()


# ------------------------------------------------------------------ random chaos


def random_run(make, *, strategy, down_for_s, run):
    """A run with random failures only; of steps 0 to 5, seed 9 draws a failure at step 3 only."""
    key = ("random", strategy, down_for_s, run)
    if key not in _cache:
        plan = ScaleDown(compile_ahead=False) if strategy == "scale_down" else PauseResume(timeout_s=60, max_retries=2)
        trainer = et.Trainer(**make(
            steps=STEPS, global_batch_size=BATCH, strategy=plan,
            plugins=[Chaos(mean_steps_between_failures=2, random_down_for_s=down_for_s, seed=9)],
        ))
        _cache[key] = fit(trainer)
    return _cache[key]


@pytest.mark.parametrize(("strategy", "down_for_s"), [
    ("scale_down", 0.0),
    # pause_resume always draws the victim from all 4 slices, so no timing can change what is drawn
    ("pause_resume", 0.2),
])
def test_random_chaos_is_deterministic(tiny_trainer_kwargs, strategy, down_for_s):
    struck = []
    for run in range(2):
        _, report = random_run(tiny_trainer_kwargs, strategy=strategy, down_for_s=down_for_s, run=run)
        struck.append([(f["step"], f["slices"]) for f in report["failures"]])
        assert struck[-1], "random chaos injected no failure"
    assert struck[0] == struck[1]
    assert struck[0][0][0] == 3


def test_random_chaos_strikes_a_step_once_even_when_it_is_retried(tiny_trainer_kwargs):
    state, report = random_run(tiny_trainer_kwargs, strategy="pause_resume", down_for_s=0.2, run=0)
    assert [f["step"] for f in report["failures"]] == [3]
    assert state is not None, report["stopped"]
    assert report["steps_completed"] == STEPS


@pytest.mark.parametrize(("retry_reset_steps", "stops"), [(3, True), (2, False), (0, True)])
def test_a_strategy_gives_up_past_max_retries_without_progress(tiny_trainer_kwargs, retry_reset_steps, stops):
    # failures at steps 2 and 4: 2 steps of progress between them
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=STEPS, global_batch_size=BATCH,
        strategy=PauseResume(timeout_s=30, max_retries=1, retry_reset_steps=retry_reset_steps),
        plugins=[chaos(lose(1, at_step=2, down_for_s=0.1), lose(2, at_step=4, down_for_s=0.1))],
    ))
    state, report = fit(trainer)
    assert [f["step"] for f in report["failures"]] == [2, 4]
    assert [f["ended_run"] for f in report["failures"]] == [False, stops]
    if stops:
        assert report["stopped"].startswith("pause_resume gave up after 1 recoveries")
        assert report["steps_completed"] == 4 and report["failures"][1]["recovery_s"] is None
    else:
        assert state is not None and report["steps_completed"] == STEPS
