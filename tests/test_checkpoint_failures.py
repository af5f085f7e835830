"""Slices lost while a checkpoint is saved or restored: nothing half-written is ever restored."""

import equinox as eqx
import jax
import numpy as np

import elastic_trainer as et
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

BATCH = 24


def params_of(state):
    return jax.tree.leaves(eqx.filter(state.params, eqx.is_array))


def saved_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_save_that_loses_a_slice_is_discarded_and_later_saves_still_happen(tiny_trainer_kwargs, tmp_path):
    baseline = et.Trainer(**tiny_trainer_kwargs(steps=6, global_batch_size=BATCH)).fit()
    chaos = Chaos(failures=[{"at_step": 4, "slice": 1, "phase": "checkpoint_save"}])
    state, report = et.Trainer(**tiny_trainer_kwargs(
        steps=6, global_batch_size=BATCH, strategy=ScaleDown(compile_ahead=False), plugins=[chaos],
        checkpointer=et.Checkpointer(tmp_path, period=2, max_to_keep=10),
    )).fit()
    assert saved_steps(tmp_path) == [2, 6]  # step 4's save was under way when the slice died
    (failure,) = report["failures"]
    assert (failure["step"], failure["phase"], failure["restored_from"], failure["lost_steps"]) == (
        4, "checkpoint_save", "replica", 0)
    assert report["samples"] == {"consumed": 6 * BATCH, "duplicated": 0, "skipped": 0}
    for a, b in zip(params_of(baseline.state), params_of(state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_restore_that_loses_a_slice_is_recovered_from_like_any_failure(tiny_trainer_kwargs, tmp_path):
    # Every slice lost at step 3 with no snapshot: the state must come from the checkpoint of step 2,
    # and slice 0 is lost again while that checkpoint is read back.
    chaos = Chaos(failures=[
        *({"at_step": 3, "slice": s, "down_for_s": 0.3} for s in range(4)),
        {"at_step": 2, "slice": 0, "phase": "checkpoint_restore", "down_for_s": 0.3},
    ])
    state, report = et.Trainer(**tiny_trainer_kwargs(
        steps=5, global_batch_size=BATCH, snapshot_period=0, strategy=PauseResume(timeout_s=30), plugins=[chaos],
        checkpointer=et.Checkpointer(tmp_path, period=2),
    )).fit()
    phases = [(f["phase"], f["restored_from"]) for f in report["failures"]]
    assert phases[-1] == ("recovery", "checkpoint")
    assert report["failures"][-1]["slices_after"] == 4
    assert int(state.step) == 5 and report["steps_completed"] == 5
    assert report["samples"] == {"consumed": 5 * BATCH, "duplicated": 0, "skipped": 0}
    assert all(np.isfinite(leaf).all() for leaf in params_of(state))


def test_a_step_saved_before_a_roll_back_keeps_its_checkpoint_when_reached_again(tiny_trainer_kwargs, tmp_path):
    # Every slice lost in step 5, just after step 4 was saved: the state comes back from the snapshot of
    # step 3, step 4 is trained again, and its save is due again; the checkpoint committed for it stands.
    baseline = et.Trainer(**tiny_trainer_kwargs(steps=6, global_batch_size=BATCH)).fit()
    chaos = Chaos(failures=[{"at_step": 4, "slice": s, "down_for_s": 0.3} for s in range(4)])
    state, report = et.Trainer(**tiny_trainer_kwargs(
        steps=6, global_batch_size=BATCH, snapshot_period=3, strategy=ScaleDown(compile_ahead=False),
        plugins=[chaos], checkpointer=et.Checkpointer(tmp_path, period=4, max_to_keep=10),
    )).fit()
    (failure,) = report["failures"]
    assert (failure["step"], failure["restored_from"], failure["lost_steps"]) == (4, "snapshot", 1)
    assert saved_steps(tmp_path) == [4, 6] and report["steps_completed"] == 6
    assert report["samples"] == {"consumed": 6 * BATCH, "duplicated": 0, "skipped": 0}
    for a, b in zip(params_of(baseline.state), params_of(state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
