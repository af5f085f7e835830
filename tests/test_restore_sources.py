"""The restore policy: which source a recovery takes the state from, first choice first."""

from types import SimpleNamespace

import pytest

import elastic_trainer as et
from elastic_trainer._restore_sources import (POLICY, Checkpoint, Peer, Replica, RestoreRequest, Snapshot,
                                              restore_from_best)


def context(*, snapshot_step=None, checkpoint_step=None):
    """What the sources read of a run to say whether they hold a state: its snapshot and its checkpoints."""
    snapshot = None if snapshot_step is None else SimpleNamespace(step=snapshot_step)
    checkpoints = SimpleNamespace(checkpointer=SimpleNamespace(latest_step=lambda: checkpoint_step))
    return SimpleNamespace(snapshots=SimpleNamespace(latest=snapshot), checkpoints=checkpoints)


def request(*, survivors=(), consumed=False, donor=None):
    return RestoreRequest(arrays=None, old=None, survivors=list(survivors), new=None, step=7, since=(),
                          consumed=consumed, donor=donor)


def chosen(ctx, req):
    return next(type(source) for source in POLICY if source.available(ctx, req))


def test_a_surviving_replica_goes_first():
    assert chosen(context(snapshot_step=4, checkpoint_step=6), request(survivors=[0, 2])) is Replica


def test_the_snapshot_goes_before_a_checkpoint_even_a_newer_one():
    assert chosen(context(snapshot_step=4, checkpoint_step=6), request()) is Snapshot


def test_a_checkpoint_when_there_is_no_snapshot():
    assert chosen(context(checkpoint_step=6), request()) is Checkpoint


@pytest.mark.parametrize(("consumed", "why"), [(False, "every slice was lost"),
                                               (True, "the failed step had taken the state from every slice")])
def test_with_no_source_the_run_stops_and_says_why(consumed, why):
    with pytest.raises(et.TrainingStopped, match=f"^{why}.* there is no snapshot or checkpoint to restore from"):
        restore_from_best(context(), request(consumed=consumed))


def test_a_rejoin_takes_the_state_from_its_peer_before_any_other_source():
    assert chosen(context(snapshot_step=4, checkpoint_step=6), request(survivors=[0, 2], donor=0)) is Peer


def test_a_recovery_never_takes_it_from_a_peer():
    assert all(chosen(context(snapshot_step=4, checkpoint_step=6), request(survivors=survivors)) is not Peer
               for survivors in ([], [0]))
