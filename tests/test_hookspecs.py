import inspect

import jax
import numpy as np
import pytest
from conftest import CountingData

import elastic_trainer as et
from elastic_trainer import hookspecs

HOOKS = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("et_")]


class Recorder:
    """Implements every hook with all its arguments, and records each call."""

    def __init__(self):
        self.calls = []

    def _record(self, name, **kwargs):
        self.calls.append((name, sorted(kwargs)))

    @et.hookimpl
    def et_run_start(self, trainer, state, mode):
        self._record("et_run_start", trainer=trainer, state=state, mode=mode)

    @et.hookimpl
    def et_training_mode(self, trainer):
        self._record("et_training_mode", trainer=trainer)

    @et.hookimpl
    def et_step_start(self, trainer, step):
        self._record("et_step_start", trainer=trainer, step=step)

    @et.hookimpl
    def et_before_update(self, trainer, step):
        self._record("et_before_update", trainer=trainer, step=step)

    def et_before_boundary(self, trainer, step):
        self._record("et_before_boundary", trainer=trainer, step=step)

    @et.hookimpl
    def et_slice_health(self, trainer):
        self._record("et_slice_health", trainer=trainer)

    @et.hookimpl
    def et_likely_layouts(self, trainer):
        self._record("et_likely_layouts", trainer=trainer)

    @et.hookimpl
    def et_propose_resize(self, trainer, healthy_slices):
        self._record("et_propose_resize", trainer=trainer, healthy_slices=healthy_slices)

    @et.hookimpl
    def et_step_end(self, trainer, step, metrics):
        self._record("et_step_end", trainer=trainer, step=step, metrics=metrics)

    @et.hookimpl
    def et_run_end(self, trainer, report):
        self._record("et_run_end", trainer=trainer, report=report)

    @et.hookimpl
    def et_classify_failure(self, error, step, phase):
        self._record("et_classify_failure", error=error, step=step, phase=phase)

    @et.hookimpl
    def et_recovery_start(self, trainer, failure):
        self._record("et_recovery_start", trainer=trainer, failure=failure)

    @et.hookimpl
    def et_choose_recovery(self, trainer, failure):
        self._record("et_choose_recovery", trainer=trainer, failure=failure)

    @et.hookimpl
    def et_make_mesh(self, trainer, slice_devices):
        self._record("et_make_mesh", trainer=trainer, slice_devices=slice_devices)

    @et.hookimpl
    def et_before_checkpoint_save(self, trainer, step):
        self._record("et_before_checkpoint_save", trainer=trainer, step=step)

    @et.hookimpl
    def et_after_checkpoint_save(self, trainer, step, directory):
        self._record("et_after_checkpoint_save", trainer=trainer, step=step, directory=directory)

    @et.hookimpl
    def et_before_restore(self, trainer, step, source):
        self._record("et_before_restore", trainer=trainer, step=step, source=source)

    @et.hookimpl
    def et_after_restore(self, trainer, step, source, state):
        self._record("et_after_restore", trainer=trainer, step=step, source=source, state=state)


def register_recorder(trainer):
    """Register a :class:`Recorder`; returns the list its calls go to."""
    recorder = Recorder()
    trainer.plugin_manager.register(recorder, name="recorder")
    return recorder.calls


def test_recorder_covers_every_hook_with_every_argument():
    for name in HOOKS:
        spec = inspect.signature(getattr(hookspecs, name)).parameters
        assert list(inspect.signature(getattr(Recorder, name)).parameters)[1:] == list(spec), name


def test_every_hook_is_prefixed_and_documented():
    assert HOOKS
    for name in HOOKS:
        doc = getattr(hookspecs, name).__doc__
        assert doc and doc.strip().startswith("Called"), name
        assert ":param" in doc, name


STEP = ["et_step_start", "et_before_update", "et_step_end"]
BOUNDARY = ["et_slice_health", "et_propose_resize"]  # between steps, not after the last
SAVE = ["et_before_checkpoint_save", "et_after_checkpoint_save"]
START = ["et_training_mode", "et_run_start", "et_make_mesh", "et_likely_layouts"]


def test_plugin_sees_hooks_of_a_run_in_documented_order(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=3))
    calls = register_recorder(trainer)
    trainer.fit()
    names = [name for name, _ in calls]
    assert names == START + STEP + BOUNDARY + STEP + BOUNDARY + STEP + ["et_run_end"]
    for name, kwargs in calls:
        assert kwargs == sorted(inspect.signature(getattr(hookspecs, name)).parameters), name


class FailingData(CountingData):
    """Raises the error Pathways raises for a lost slice when asked for one given batch."""

    def __init__(self, fail_at_position: int):
        super().__init__()
        self.fail_at_position = fail_at_position
        self.position = 0

    def get_batch(self, sample_ids: np.ndarray) -> np.ndarray:
        if len(sample_ids) > 1:
            self.position += len(sample_ids)
            if self.position > self.fail_at_position:
                raise jax.errors.JaxRuntimeError("DATA_LOSS: slice 1 is unreachable")
        return super().get_batch(sample_ids)


def test_failure_without_strategy_calls_failure_hooks_then_stops(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=4, data=FailingData(fail_at_position=32)))
    calls = register_recorder(trainer)
    with pytest.raises(et.TrainingStopped, match=r"\+strategy=NAME") as stopped:
        trainer.fit()
    names = [name for name, _ in calls]
    assert names == START + STEP + BOUNDARY + STEP + BOUNDARY + [
        "et_step_start", "et_classify_failure", "et_slice_health", "et_recovery_start", "et_choose_recovery",
        "et_run_end",
    ]
    report = stopped.value.report
    assert report["steps_completed"] == 2
    assert report["failures"][0]["kind"] == "slice_lost"
    assert report["failures"][0]["action"] == "stop"


def test_plugin_sees_checkpoint_and_restore_hooks_in_documented_order(tiny_trainer_kwargs, tmp_path):
    first = et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=et.Checkpointer(tmp_path, period=2)))
    calls = register_recorder(first)
    first.fit()
    assert [name for name, _ in calls] == (
        START + STEP + BOUNDARY + STEP + SAVE + BOUNDARY + STEP + BOUNDARY + STEP + SAVE + ["et_run_end"]
    )
    resumed = et.Trainer(**tiny_trainer_kwargs(steps=5, checkpointer=et.Checkpointer(tmp_path, period=2), resume=True))
    calls = register_recorder(resumed)
    resumed.fit()
    assert [name for name, _ in calls] == (
        START + ["et_before_restore", "et_after_restore"] + STEP + SAVE + ["et_run_end"]
    )
    for name, kwargs in calls:
        assert kwargs == sorted(inspect.signature(getattr(hookspecs, name)).parameters), name
