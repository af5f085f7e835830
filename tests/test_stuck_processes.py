"""When a step fails on the multi-controller runtime, which live peers count as stuck before its collectives (and
are killed): on a fake clock, so that the order of events, not the machine's load, decides."""

import pytest
from test_rejoin import FakeClient

from elastic_trainer.clusters.multicontroller import _keys as keys
from elastic_trainer.clusters.multicontroller import _membership
from elastic_trainer.clusters.multicontroller._membership import STUCK_GRACE_S, processes_behind


@pytest.fixture
def peer_dispatches_late(monkeypatch):
    """A fake clock from 0; process 2 notes its dispatch of step 21 once ``STUCK_GRACE_S + 0.5`` s have passed (a
    loaded host), process 3 never does (stuck)."""
    client, now = FakeClient(), [0.0]

    def sleep(seconds):
        now[0] += seconds
        if now[0] > STUCK_GRACE_S + 0.5:
            client.key_value_set(keys.dispatched(2), "21")

    monkeypatch.setattr(_membership.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(_membership.time, "sleep", sleep)
    return client


def test_a_live_peer_slow_to_reach_the_failed_step_is_waited_for_until_the_collective_timeout(peer_dispatches_late):
    """The order that killed a live process in CI: a peer died, this process's step failed at once, and the third
    process reached the step after the grace but well within the collective timeout (6 s here)."""
    assert processes_behind(peer_dispatches_late, {2, 3}, 21, not_before=6.0) == [3]


def test_once_the_collective_timeout_ran_out_the_grace_alone_decides(peer_dispatches_late):
    """A step that failed by timing out (a hung peer): the collective timeout is past, and a peer not there within
    the grace counts as stuck."""
    assert processes_behind(peer_dispatches_late, {2, 3}, 21, not_before=0.0) == [2, 3]
