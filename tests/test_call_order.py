"""The same synchronization calls in the same order on every live process: two processes that disagree stop with
one sentence naming both calls (the coordination service's store faked, as in tests/test_rejoin.py)."""

import json

import pytest
from test_cli import run_cli
from test_fault_matrix import CLI_TINY, processes
from test_rejoin import FakeClient

import elastic_trainer.plugin as etp
from elastic_trainer.clusters import SyncCall
from elastic_trainer_plugins import failures
from elastic_trainer.clusters.multicontroller._call_order import CallOrder


def call_orders(client, count):
    """The call order of processes 0 to ``count - 1`` of one job."""
    return [CallOrder(lambda: client, lambda p=p: p) for p in range(count)]


def agree(orders, number, calls):
    """Agreement ``number``: every process notes its call, meets the others (the barrier), then checks."""
    for order, call in zip(orders, calls):
        order.note(number, call)
    return [order.check(number, call, live=range(len(orders))) for order, call in zip(orders, calls)]


def test_processes_that_make_the_same_calls_in_the_same_order_go_on():
    orders = call_orders(FakeClient(), 3)
    calls = [SyncCall.RUN_START, SyncCall.STEP_END, SyncCall.STEP_END, SyncCall.SAVE_START,
             SyncCall.SAVE_END, SyncCall.STEP_END]
    for number, call in enumerate(calls, start=1):
        assert agree(orders, number, [call] * 3) == [None] * 3


def test_a_process_that_skips_a_call_stops_both_with_one_sentence_naming_the_two_calls():
    client = FakeClient()
    first, second = call_orders(client, 2)
    agree([first, second], 1, [SyncCall.RUN_START] * 2)
    # process 1 skips the save's start: its next call is the save's end, under the same number as process 0's start
    first.note(2, SyncCall.SAVE_START)
    second.note(2, SyncCall.SAVE_END)
    with pytest.raises(etp.SyncMismatchError) as on_first:
        first.check(2, SyncCall.SAVE_START, live=[0, 1])
    with pytest.raises(etp.SyncMismatchError) as on_second:
        second.check(2, SyncCall.SAVE_END, live=[0, 1])
    assert str(on_first.value).startswith(
        "process 0 made synchronization call 2 at a checkpoint save's start but process 1 made call 2 at a "
        "checkpoint save's end there:")
    assert str(on_second.value).startswith(
        "process 1 made synchronization call 2 at a checkpoint save's end but process 0 made call 2 at a "
        "checkpoint save's start there:")
    assert str(on_first.value).count(". ") == 0 and str(on_first.value).endswith(".")


def test_a_live_process_behind_by_a_call_is_named_with_the_call_it_made_last():
    client = FakeClient()
    first, second = call_orders(client, 2)
    agree([first, second], 1, [SyncCall.STEP_END] * 2)
    agree([first, second], 2, [SyncCall.STEP_END] * 2)
    first.note(3, SyncCall.STEP_END)  # process 1 made one call fewer: its note for this slot is call 1's
    with pytest.raises(etp.SyncMismatchError, match="but process 1 made call 1 at a step's end there"):
        first.check(3, SyncCall.STEP_END, live=[0, 1])


def test_a_process_with_no_note_at_all_is_said_to_have_made_none():
    (first, _) = call_orders(FakeClient(), 2)
    first.note(1, SyncCall.RUN_START)
    with pytest.raises(etp.SyncMismatchError, match="but process 1 made none there"):
        first.check(1, SyncCall.RUN_START, live=[0, 1])


def test_a_mismatch_is_fatal_however_it_is_worded():
    """The run stops: the built-in classifier finds no slice-loss status in the message."""
    client = FakeClient()
    first, second = call_orders(client, 2)
    first.note(1, SyncCall.STEP_END)
    second.note(1, SyncCall.AWAIT_RETURNS)
    with pytest.raises(etp.SyncMismatchError) as mismatch:
        first.check(1, SyncCall.STEP_END, live=[0, 1])
    assert not failures.et_classify_failure(error=mismatch.value, step=1, phase="train_step").elastic


@pytest.mark.slow  # python -m pytest -m slow
def test_two_real_processes_that_disagree_stop_with_the_sentence_naming_both_calls(tmp_path):
    """cluster=multiprocess, 2 processes: process 1 makes one call more (tests/extra_sync_plugin.py), so at the next
    agreement process 0 is at a step's end and process 1 at a wait for lost slices; the job stops, saying so."""
    result = run_cli(*CLI_TINY, "trainer.steps=12", *processes(2), "+logger=tensorboard",
                     "logger._target_=tests.extra_sync_plugin.ExtraSyncOnProcess1", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert ("process 0 made synchronization call" in result.stderr and "at a step's end but process 1 made call"
            in result.stderr and "at a wait for lost slices there" in result.stderr), result.stderr
    assert not (tmp_path / "report.json").exists() or json.loads((tmp_path / "report.json").read_text())[
        "steps_completed"] < 12
