import gc
import threading
import weakref

import pytest

import elastic_trainer as et
from elastic_trainer._watchdog import Watchdog
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.scale_down import ScaleDown


def test_wait_within_the_limit_returns_and_errors_pass_through():
    Watchdog(1.0).wait(lambda: None)
    with pytest.raises(ZeroDivisionError):
        Watchdog(1.0).wait(lambda: 1 / 0)


class Arrays:
    """Stands for a train state's arrays (an object that can be referred to weakly)."""


def test_an_error_handed_over_from_the_wait_holds_no_reference_cycle():
    # The failed wait's frames (and the arrays in them) must be freed as soon as the error is dropped, without
    # waiting for Python's cyclic collector: a cycle through the error's traceback kept them for long (1 GB RSS).
    held = []

    def failed_step():
        state = Arrays()  # what a step's frames hold: the train state's arrays
        held.append(weakref.ref(state))
        raise et.SliceLostError("DATA_LOSS: slice 1 lost", slices=[1])

    gc.disable()
    try:
        try:
            Watchdog(5.0).wait(failed_step)
        except et.SliceLostError:
            pass
        assert held and held[0]() is None, "the failed wait's frames are kept alive by a reference cycle"
    finally:
        gc.enable()


def test_wait_beyond_the_limit_is_a_deadline_exceeded_failure():
    released = threading.Event()
    with pytest.raises(et.SliceLostError, match="DEADLINE_EXCEEDED"):
        Watchdog(0.2).wait(released.wait)  # a call that never returns on its own
    assert not released.is_set()  # the wait gave up while the call still ran
    released.set()


def test_a_hung_slice_is_detected_and_recovered_from(tiny_trainer_kwargs):
    # the step hangs with the state taken (donated): every slice's part of it is lost, the host snapshot of the
    # step before (one after every step here) restores it
    chaos = Chaos(failures=[{"at_step": 2, "slice": 1, "down_for_s": 1e9, "hang": True}])
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=5, global_batch_size=24, step_timeout_s=3.0, snapshot_period=1,
                                               strategy=ScaleDown(compile_ahead=False), plugins=[chaos]))
    state, report = trainer.fit()
    (failure,) = report["failures"]
    assert (failure["kind"], failure["slices"], failure["restored_from"]) == ("slice_hung", [1], "snapshot")
    assert failure["lost_steps"] == 0
    assert report["steps_completed"] == 5 and trainer.slices == (0, 2, 3)
    assert report["samples"]["duplicated"] == report["samples"]["skipped"] == 0


def test_a_watchdog_let_go_of_ends_its_thread():
    """Runs one after another in one process (a sweep with Hydra's basic launcher, a notebook) leave no wait
    thread each: the thread ends with its watchdog."""
    def wait_threads() -> set[threading.Thread]:
        return {thread for thread in threading.enumerate() if thread.name == "et-step-wait"}

    before = wait_threads()
    watchdog = Watchdog(60.0)
    watchdog.wait(lambda: None)
    (thread,) = wait_threads() - before
    del watchdog
    thread.join(timeout=60)  # a bound only against a hang: the thread ends as soon as it reads the stop
    assert not thread.is_alive()
