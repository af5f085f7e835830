"""A slow peer never ends a job: cluster=multiprocess with one process late to a step by more than the collective
timeout (as a host whose compilation cache missed is late to the first step), and the failure-free job beside CPU
hogs. The processes meet before each step's collectives (``MultiprocessCluster.check_launch``), so the others wait
for the late one there instead of in collectives that would give up.

The late process sleeps in ``et_step_start`` (tests/slow_peer_plugin.py). The others' own clock shows that they
waited for it; no process's clock is compared with another's.
"""

import json
import subprocess
import sys
import time
import types

import jax
import pytest
from slow_peer_plugin import DELAY_ENV, delay
from test_fault_matrix import CLI_TINY, processes_of
from test_multiprocess import report_of, run_dir, run_job  # noqa: F401 - run_dir is a fixture
from test_rejoin import FakeClient

from elastic_trainer.clusters.multicontroller import _keys as keys
from elastic_trainer.clusters.multicontroller import _membership
from elastic_trainer.clusters.multicontroller._membership import MEET_POLL_MS, Membership

COLLECTIVE_TIMEOUT_S = 2
"""Set explicitly, so that the delay below outlasts it whatever the default."""
LATE_BY_S = COLLECTIVE_TIMEOUT_S + 3
"""How much later than the others the late process reaches its step."""
THREE = ["cluster=multiprocess", "cluster.num_processes=3", f"cluster.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"]
DELAYED = ["+logger=tensorboard", "logger._target_=tests.slow_peer_plugin.DelayedProcess"]


def steps_of(events_file) -> dict[int, dict]:
    """Each step's event in one process's event log, by step number (1-based)."""
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    return {event["step"]: event for event in events if event["event"] == "step"}


def reports_of(run_dir) -> list[dict]:
    """Every process's own report: process 0's (the run's) and the others' (one attempt each here)."""
    return [report_of(run_dir), *(json.loads((run_dir / f"process{i}" / "report.attempt0.json").read_text())
                                  for i in (1, 2))]


@pytest.mark.parametrize("late_step", [0, 5], ids=["first_step", "later_step"])
def test_a_process_late_to_a_step_by_more_than_the_collective_timeout_is_waited_for(run_dir, monkeypatch, late_step):
    """Process 1 reaches step ``late_step + 1`` LATE_BY_S after the others (the first step, where a host's compile
    differs; a later one, a busy host): the job trains every step, records no failure, and every process agrees."""
    monkeypatch.setenv(DELAY_ENV, delay(process=1, step=late_step, seconds=LATE_BY_S)[DELAY_ENV])
    result = run_job(run_dir, *CLI_TINY, *THREE, *DELAYED, "+strategy=scale_down")
    assert result.returncode == 0, result.stderr
    for report in reports_of(run_dir):
        assert report["steps_completed"] == 12 and report["failures"] == []
        assert report["samples"] == {"consumed": 12 * 48, "duplicated": 0, "skipped": 0}
    (attempt,) = report_of(run_dir)["process_exits"]
    assert attempt["exit_codes"] == [0, 0, 0]
    # process 0 (on its own clock) spent longer than the collective timeout in that step: it waited for process 1
    late = steps_of(run_dir / "events.jsonl")[late_step + 1]
    assert late["end"] - late["time"] > LATE_BY_S - 0.5 > COLLECTIVE_TIMEOUT_S


@pytest.fixture
def two_cpu_hogs():
    """Two busy Python processes beside the test, each ended after 10 minutes at most, killed at the end."""
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 600\n"
                                                    "while time.monotonic() < end: pass"]) for _ in range(2)]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


@pytest.mark.slow  # python -m pytest -m slow: 5 runs of 3 processes on a loaded machine
def test_the_failure_free_job_beside_two_cpu_hogs_never_stops(run_dir, two_cpu_hogs):
    """The failure-free 3-process job with the default collective timeout, two CPU hogs beside it, 5 runs in a row:
    every run trains every step and records no failure (a busy host once ended such a job at its first step)."""
    for run in range(5):
        attempt_dir = run_dir / f"run{run}"
        attempt_dir.mkdir()
        began = time.monotonic()
        result = run_job(attempt_dir, *CLI_TINY, "cluster=multiprocess", "cluster.num_processes=3",
                         "+strategy=scale_down")
        assert result.returncode == 0, f"run {run}: {result.stderr}"
        report = report_of(attempt_dir)
        assert (report["steps_completed"], report["failures"]) == (12, []), f"run {run} ({time.monotonic() - began:.0f} s)"
        assert not processes_of(attempt_dir)


# ---------------------------------------------------------------------- the meeting before a dispatch, on a fake clock


class StoreOnce(FakeClient):
    """The key-value store as the coordination service keeps it: a key set without overwriting is refused once
    it is there."""

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.store and not allow_overwrite:
            raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: {key}")
        self.store[key] = value

    def key_value_delete(self, key):
        """The key and every key under it, as the service deletes a directory."""
        for name in [name for name in self.store if name == key or name.startswith(key + "/")]:
            del self.store[name]


@pytest.fixture
def meeting(monkeypatch):
    """Process ``me`` of a job of 3 one-process slices about to dispatch its 8th step, on a fake clock that each
    wait for the verdict moves on by :data:`MEET_POLL_MS`; ``arrivals`` maps a peer to when it comes (never if
    absent), ``dead`` holds the peers seen dead on this host, ``killed`` those killed as stuck."""
    state = types.SimpleNamespace(now=0.0, arrivals={}, dead=set(), killed=[], me=0)

    def others_meanwhile(key):
        state.now += MEET_POLL_MS / 1000
        for process, at in state.arrivals.items():
            if at <= state.now:
                client.key_value_set(keys.ready(8, process), "1", allow_overwrite=True)

    client = StoreOnce(on_wait=others_meanwhile)
    monkeypatch.setattr(_membership, "time", types.SimpleNamespace(monotonic=lambda: state.now,
                                                                   sleep=lambda s: others_meanwhile(None)))
    monkeypatch.setattr(_membership.jax, "process_index", lambda: state.me)
    monkeypatch.setattr(_membership, "dead_here", lambda client, process: process in state.dead)
    monkeypatch.setattr(_membership, "_kill_if_stuck", lambda client, process: state.killed.append(process))
    membership = Membership(num_processes=3, processes_per_slice=1, client=lambda: client, on_lost=lambda p: None)
    membership.dispatched = 7
    state.membership = membership
    state.meet = lambda: membership.meet(stuck_after_s=30)
    state.client = client
    return state


def test_the_last_process_to_come_lets_every_one_go(meeting):
    meeting.arrivals = {1: 0.0, 2: 0.0}
    meeting.client.store.update({keys.ready(8, 1): "1", keys.ready(8, 2): "1"})
    assert meeting.meet() is True
    assert meeting.client.store[keys.verdict(8)] == "go" and meeting.killed == []


def test_a_peer_late_by_seconds_is_waited_for(meeting):
    """Process 2 comes 5 s after process 0 (more than any collective timeout): process 0 waits, then goes."""
    meeting.arrivals = {1: 0.0, 2: 5.0}
    assert meeting.meet() is True
    assert meeting.now >= 5.0 and meeting.killed == []


def test_a_peer_that_never_comes_is_stuck_and_every_process_follows_the_verdict(meeting):
    """Process 2 never comes: once process 0 has waited stuck_after_s, the verdict is to agree on who lives, and
    process 2 is killed; process 1, coming after the verdict, follows it though every other note is there."""
    meeting.arrivals = {1: 0.0}
    assert meeting.meet() is False
    assert meeting.client.store[keys.verdict(8)] == "agree" and meeting.killed == [2] and meeting.now >= 30
    meeting.me, meeting.killed = 1, []
    meeting.client.store[keys.ready(8, 2)] = "1"  # even had it come meanwhile: the verdict is written
    assert meeting.meet() is False and meeting.killed == []


def test_a_peer_dead_on_this_host_ends_the_wait_at_once(meeting):
    meeting.arrivals, meeting.dead = {1: 0.0}, {2}
    assert meeting.meet() is False
    assert meeting.now < 1 and meeting.killed == []  # dead, not stuck: the agreement finds it


def test_the_lowest_process_deletes_the_meetings_every_process_is_past(meeting):
    """At the first meeting of a block, the block before the last goes, in one call; the last block stays (a peer
    may still read its last meeting's verdict)."""
    first_of_block_2 = 2 * keys.MEETINGS_PER_BLOCK
    meeting.membership.dispatched = first_of_block_2 - 1
    past, recent = keys.ready(5, 1), keys.ready(first_of_block_2 - 1, 1)
    meeting.client.store.update({past: "1", recent: "1", keys.ready(first_of_block_2, 1): "1",
                                 keys.ready(first_of_block_2, 2): "1"})
    assert meeting.meet() is True
    assert past not in meeting.client.store and recent in meeting.client.store
