import threading

import pytest

import elastic_trainer as et
from elastic_trainer._watchdog import Watchdog
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.scale_down import ScaleDown


def test_wait_within_the_limit_returns_and_errors_pass_through():
    Watchdog(1.0).wait(lambda: None)
    with pytest.raises(ZeroDivisionError):
        Watchdog(1.0).wait(lambda: 1 / 0)


def test_wait_beyond_the_limit_is_a_deadline_exceeded_failure():
    released = threading.Event()
    with pytest.raises(et.SliceLostError, match="DEADLINE_EXCEEDED"):
        Watchdog(0.2).wait(released.wait)  # a call that never returns on its own
    assert not released.is_set()  # the wait gave up while the call still ran
    released.set()


def test_a_hung_slice_is_detected_and_recovered_from(tiny_trainer_kwargs):
    chaos = Chaos(failures=[{"at_step": 2, "slice": 1, "down_for_s": 1e9, "hang": True}])
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=5, global_batch_size=24, step_timeout_s=1.0, strategy=ScaleDown(compile_ahead=False), plugins=[chaos]))
    state, report = trainer.fit()
    (failure,) = report["failures"]
    assert (failure["kind"], failure["slices"], failure["restored_from"]) == ("slice_hung", [1], "replica")
    assert failure["lost_steps"] == 0
    assert report["steps_completed"] == 5 and trainer.slices == (0, 2, 3)
    assert report["samples"]["duplicated"] == report["samples"]["skipped"] == 0
