"""The same synchronization calls in the same order on every live process: two processes that disagree stop with
one sentence naming both calls (the coordination service's store faked, as in tests/test_rejoin.py)."""

import pytest
from test_rejoin import FakeClient

import elastic_trainer as et
from elastic_trainer_plugins import failures
from elastic_trainer.clusters.multicontroller._call_order import CallOrder


def processes(client, count):
    """The call order of processes 0 to ``count - 1`` of one job."""
    return [CallOrder(lambda: client, lambda p=p: p) for p in range(count)]


def agree(orders, number, calls):
    """Agreement ``number``: every process notes its call, meets the others (the barrier), then checks."""
    for order, call in zip(orders, calls):
        order.note(number, call)
    return [order.check(number, call, live=range(len(orders))) for order, call in zip(orders, calls)]


def test_processes_that_make_the_same_calls_in_the_same_order_go_on():
    orders = processes(FakeClient(), 3)
    calls = [et.SyncCall.RUN_START, et.SyncCall.STEP_END, et.SyncCall.STEP_END, et.SyncCall.SAVE_START,
             et.SyncCall.SAVE_END, et.SyncCall.STEP_END]
    for number, call in enumerate(calls, start=1):
        assert agree(orders, number, [call] * 3) == [None] * 3


def test_a_process_that_skips_a_call_stops_both_with_one_sentence_naming_the_two_calls():
    client = FakeClient()
    first, second = processes(client, 2)
    agree([first, second], 1, [et.SyncCall.RUN_START] * 2)
    # process 1 skips the save's start: its next call is the save's end, under the same number as process 0's start
    first.note(2, et.SyncCall.SAVE_START)
    second.note(2, et.SyncCall.SAVE_END)
    with pytest.raises(et.SyncMismatchError) as on_first:
        first.check(2, et.SyncCall.SAVE_START, live=[0, 1])
    with pytest.raises(et.SyncMismatchError) as on_second:
        second.check(2, et.SyncCall.SAVE_END, live=[0, 1])
    assert str(on_first.value).startswith(
        "process 0 made synchronization call 2 at a checkpoint save's start but process 1 made call 2 at a "
        "checkpoint save's end there:")
    assert str(on_second.value).startswith(
        "process 1 made synchronization call 2 at a checkpoint save's end but process 0 made call 2 at a "
        "checkpoint save's start there:")
    assert str(on_first.value).count(". ") == 0 and str(on_first.value).endswith(".")


def test_a_live_process_behind_by_a_call_is_named_with_the_call_it_made_last():
    client = FakeClient()
    first, second = processes(client, 2)
    agree([first, second], 1, [et.SyncCall.STEP_END] * 2)
    agree([first, second], 2, [et.SyncCall.STEP_END] * 2)
    first.note(3, et.SyncCall.STEP_END)  # process 1 made one call fewer: its note for this slot is call 1's
    with pytest.raises(et.SyncMismatchError, match="but process 1 made call 1 at a step's end there"):
        first.check(3, et.SyncCall.STEP_END, live=[0, 1])


def test_a_process_with_no_note_at_all_is_said_to_have_made_none():
    (first, _) = processes(FakeClient(), 2)
    first.note(1, et.SyncCall.RUN_START)
    with pytest.raises(et.SyncMismatchError, match="but process 1 made none there"):
        first.check(1, et.SyncCall.RUN_START, live=[0, 1])


def test_a_mismatch_is_fatal_however_it_is_worded():
    """The run stops: the built-in classifier finds no slice-loss status in the message."""
    client = FakeClient()
    first, second = processes(client, 2)
    first.note(1, et.SyncCall.STEP_END)
    second.note(1, et.SyncCall.AWAIT_RETURNS)
    with pytest.raises(et.SyncMismatchError) as mismatch:
        first.check(1, et.SyncCall.STEP_END, live=[0, 1])
    assert not failures.et_classify_failure(error=mismatch.value, step=1, phase="train_step").elastic
