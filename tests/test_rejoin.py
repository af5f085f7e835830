"""The parts of a rejoin that run in one process: the state from a peer, its trip through host memory, the
admission's record, and when the launcher starts a replacement (tests/test_multiprocess.py runs it for real)."""

import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer._mesh import state_shardings
from elastic_trainer.clusters import Admission
from elastic_trainer.clusters.multicontroller import _membership, _rejoin
from elastic_trainer.clusters.multicontroller._keys import KEY_PREFIX
from elastic_trainer.clusters.multicontroller._membership import Membership
from elastic_trainer.clusters.multicontroller._platform import PLATFORM_LAYERS
from elastic_trainer.clusters.multicontroller._rejoin import Rejoin, compile_from_peers, donor_of, from_host, to_host
from elastic_trainer.launch._launcher import _due_to_return, _job_ending


def slice_values(mesh, sharding, per_slice):
    """An array on ``sharding`` whose shards on slice ``i`` hold ``per_slice[i]`` (slices that disagree, as a
    returning slice's fresh state disagrees with the live ones')."""
    position = {device.id: i for i, row in enumerate(mesh.devices) for device in row}
    return jax.make_array_from_single_device_arrays(per_slice[0].shape, sharding, [
        jax.device_put(per_slice[position[device.id]][index], device)
        for device, index in sharding.addressable_devices_indices_map(per_slice[0].shape).items()
    ])


def test_every_slice_gets_the_donor_slices_values_exactly_whatever_the_others_hold():
    mesh = etp.make_mesh(et.SimulatedCluster(4, 2).slice_devices())
    like = {"w": jnp.zeros((3, 8), jnp.float32), "step": jnp.zeros((), jnp.int32), "flag": jnp.zeros((2,), bool)}
    shardings = state_shardings(like, mesh, within_slice="sharded")
    rng = np.random.default_rng(0)
    donor_w = rng.normal(size=(3, 8)).astype(np.float32)
    state = {
        "w": slice_values(mesh, shardings["w"], [np.full((3, 8), np.nan, np.float32), donor_w,
                                                 rng.normal(size=(3, 8)).astype(np.float32), np.zeros((3, 8), np.float32)]),
        "step": slice_values(mesh, shardings["step"], [np.int32(0), np.int32(41), np.int32(-7), np.int32(3)]),
        "flag": slice_values(mesh, shardings["flag"], [np.array([False, False]), np.array([True, False]),
                                                       np.array([True, True]), np.array([False, True])]),
    }
    shared = compile_from_peers(state, shardings, donor=1, returning=())(state)
    for shard in shared["w"].addressable_shards:  # every device's shard, NaN-holding slices included
        np.testing.assert_array_equal(np.asarray(shard.data), donor_w[shard.index])
    assert {int(s.data) for s in shared["step"].addressable_shards} == {41}
    for shard in shared["flag"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.array([True, False])[shard.index])
    assert shared["w"].sharding == shardings["w"] and shared["flag"].dtype == bool


def test_a_part_held_per_slice_changes_only_on_the_returning_slices_which_take_the_donors():
    """A semi-synchronous mode's rows (a leaf split over the slices, a row each): the live slices keep their own,
    and only the returning one takes the donor's; the replicated part is the donor's everywhere."""
    mesh = etp.make_mesh(et.SimulatedCluster(3, 2).slice_devices())
    rows = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    rows[2] = 0  # the returning slice's row: zeros, as from_host leaves it
    shardings = {"rows": NamedSharding(mesh, PartitionSpec(etp.SLICE_AXIS)),
                 "flat": NamedSharding(mesh, PartitionSpec((etp.SLICE_AXIS, "device"))),  # a part per device
                 "outer": NamedSharding(mesh, PartitionSpec())}
    state = {"rows": jax.device_put(rows, shardings["rows"]), "flat": jax.device_put(rows.ravel(), shardings["flat"]),
             "outer": slice_values(mesh, shardings["outer"], [np.float32(7), np.float32(-1), np.float32(0)])}
    shared = compile_from_peers(state, shardings, donor=0, returning=(2,))(state)
    expected = np.stack([rows[0], rows[1], rows[0]])
    np.testing.assert_array_equal(np.asarray(shared["rows"]), expected)
    np.testing.assert_array_equal(np.asarray(shared["flat"]), expected.ravel())
    assert {float(s.data) for s in shared["outer"].addressable_shards} == {7.0}


def test_the_state_goes_through_host_memory_onto_a_larger_mesh_with_zeros_where_no_shard_was_held():
    small = etp.make_mesh(et.SimulatedCluster(4, 2).slice_devices()[:2])
    large = etp.make_mesh(et.SimulatedCluster(4, 2).slice_devices()[:3])
    like = {"w": jax.ShapeDtypeStruct((3, 8), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}
    values = {"w": np.arange(24, dtype=np.float32).reshape(3, 8), "n": np.int32(5)}
    held = jax.device_put(values, state_shardings(values, small, within_slice="sharded"))
    shardings = state_shardings(values, large, within_slice="sharded")
    moved = from_host(to_host(held), like, shardings)
    on_small = {device.id for device in small.devices.flat}
    for shard in moved["w"].addressable_shards:
        expected = values["w"][shard.index] if shard.device.id in on_small else 0
        np.testing.assert_array_equal(np.asarray(shard.data), expected)
    np.testing.assert_array_equal(np.asarray(compile_from_peers(moved, shardings, donor=0, returning=(2,))(moved)["w"]), values["w"])


def test_an_admission_reads_back_as_written_and_the_donor_is_the_first_slice_not_returning():
    admission = Admission(round=2, processes=(0, 1, 2), slices=(0, 1, 2), donor=0, step=20, position=960,
                          dispatched=21, agreements=57, incarnations=(0, 1, 0), checkpoint_group=3, returning=(1,))
    assert Admission.from_json(admission.to_json()) == admission
    assert donor_of((0, 1, 2), returning=[0]) == 1 and donor_of((1, 3), returning=[]) == 0


def test_the_launcher_starts_a_replacement_only_once_it_is_due_and_its_loss_was_found(tmp_path, monkeypatch):
    back_at, lost = tmp_path / "process1.returns_at", tmp_path / "process1.lost"
    killed = [None, -9, None]  # process 1 killed, the others running
    assert _due_to_return(killed, tmp_path) == []  # lost for good: nothing noted
    back_at.write_text("100.0")
    monkeypatch.setattr("time.time", lambda: 50.0)
    lost.touch()
    assert _due_to_return(killed, tmp_path) == []  # not due yet
    monkeypatch.setattr("time.time", lambda: 150.0)
    lost.unlink()
    assert _due_to_return(killed, tmp_path) == []  # due, but the others have not found the loss yet
    lost.touch()
    assert _due_to_return(killed, tmp_path) == [1]
    assert not back_at.exists() and not lost.exists()  # one replacement per note


def test_a_replacement_that_was_not_taken_back_in_does_not_end_the_job():
    nobody_replaced = [[], [], []]
    assert not _job_ending([None, -9, None], nobody_replaced)  # killed: the others go on
    assert _job_ending([None, 0, None], nobody_replaced) and _job_ending([None, 2, None], nobody_replaced)
    process_1_replaced = [[], [-9], []]
    assert not _job_ending([None, 1, None], process_1_replaced)  # refused, or came back too late
    assert _job_ending([None, 0, None], process_1_replaced)  # it trained to the end


class FakeClient:
    """The coordination service's key-value store and barriers as a dict; a barrier named in ``missing`` times
    out (a process it waits for never comes)."""

    def __init__(self, missing=(), on_wait=lambda key: None):
        self.store, self.barriers, self.missing, self.on_wait = {}, [], missing, on_wait

    def key_value_try_get(self, key):
        if key not in self.store:
            raise KeyError(key)
        return self.store[key]

    def key_value_set(self, key, value, allow_overwrite=False):
        self.store[key] = value

    def key_value_delete(self, key):
        self.store.pop(key, None)

    def key_value_dir_get(self, directory):
        return [(k, v) for k, v in self.store.items() if k.startswith(directory + "/")]

    def blocking_key_value_get(self, key, timeout_ms):
        """A key not there yet is waited for: ``on_wait`` runs what the other processes do meanwhile."""
        if key not in self.store:
            self.on_wait(key)
        if key not in self.store:
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: {key} not set within {timeout_ms} ms")
        return self.store[key]

    def wait_at_barrier(self, name, timeout_ms, process_ids):
        self.barriers.append((name.rsplit("/", 1)[1], tuple(process_ids)))
        if name.rsplit("/", 1)[1] in self.missing:
            raise jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: Barrier timed out")


class ThreeProcesses:
    """The membership and rejoin of a job of 3 one-process slices as process 0 sees it, process 1 lost."""

    processes, processes_per_slice, live, failures = 3, 1, {0, 2}, [0, 1, 0]

    def __init__(self, client):
        self.membership = Membership(num_processes=self.processes, processes_per_slice=self.processes_per_slice,
                                     client=lambda: client, on_lost=lambda processes: None)
        self.membership.live, self.membership.failures = set(self.live), list(self.failures)
        self.membership.dispatched = 7
        self.rejoin = Rejoin(self.membership, client=lambda: client, initialization_timeout_s=60, barrier_timeout_s=30,
                             platform_layer=PLATFORM_LAYERS["cpu"])


@pytest.fixture
def process_0(monkeypatch):
    for module in (_rejoin, _membership):
        monkeypatch.setattr(module, "own_process_id", lambda: 0)


def test_live_processes_hear_of_a_replacement_where_they_agree_and_answer_it_when_taking_it_in(process_0):
    client = FakeClient(missing={"met"})
    cluster = ThreeProcesses(client)
    client.key_value_set(f"{KEY_PREFIX}join/1", "4242")  # the replacement of process 1, OS pid 4242, asks
    cluster.membership._offer_returns()
    cluster.membership._hear_returns()
    assert cluster.membership.returning_slices() == [1]
    restarted = []
    # it asked, then died: the barrier where every process meets times out, and the job goes on as it was
    assert not cluster.rejoin.take_in((0, 1, 2), step=5, position=240, checkpoint_group=2,
                               before_restart=lambda: restarted.append(True))
    assert client.barriers == [("met", (0, 1, 2))] and restarted == []
    assert cluster.membership.live == {0, 2} and cluster.membership.returning_slices() == []
    admission = Admission.from_json(client.store[f"{KEY_PREFIX}admitted/1/4242"])
    assert (admission.processes, admission.slices, admission.donor, admission.step) == ((0, 1, 2), (0, 1, 2), 0, 5)
    assert (admission.dispatched, admission.incarnations, admission.checkpoint_group) == (7, (0, 1, 0), 2)
    assert f"{KEY_PREFIX}join/1" not in client.store


def test_a_replacement_is_returning_only_while_it_asks(process_0):
    client = FakeClient()
    cluster = ThreeProcesses(client)
    client.key_value_set(f"{KEY_PREFIX}join/1", "4242")
    cluster.membership._offer_returns()
    cluster.membership._hear_returns()
    assert cluster.membership.returning_slices() == [1]
    client.key_value_delete(f"{KEY_PREFIX}join/1")  # it gave up waiting to be wanted, and ended
    cluster.membership._offer_returns()
    cluster.membership._hear_returns()
    assert cluster.membership.returning_slices() == [] and client.barriers == []


def test_spares_are_out_of_the_job_until_taken_in_and_a_spare_that_died_waiting_is_not_offered(process_0):
    """3 slices and a spare of one process each: the spare is not live, and once it asks it returns (a spare of the
    live processes' layouts); one that died while waiting (its OS pid ended on this host) is not offered."""
    client = FakeClient()
    membership = Membership(num_processes=4, processes_per_slice=1, client=lambda: client,
                            on_lost=lambda processes: None, spare_slices=1)
    assert membership.live == {0, 1, 2} and membership.healthy_slices() == [0, 1, 2]
    client.key_value_set(f"{KEY_PREFIX}pid/3", f"{socket.gethostname()} {os.getpid()}")  # a spare notes itself
    client.key_value_set(f"{KEY_PREFIX}join/3", str(os.getpid()))  # and asks
    membership._offer_returns()
    membership._hear_returns()
    assert membership.returning_slices() == [3]
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    client.key_value_set(f"{KEY_PREFIX}join/3", ended.stdout.strip())  # the spare, killed while it waited
    membership._offer_returns()
    membership._hear_returns()
    assert membership.returning_slices() == []


class TwoSlicesOfTwoProcesses(ThreeProcesses):
    """A job of 2 slices of 2 processes, process 2 of slice 1 killed and due back; process 3, its live partner,
    is leaving with it. Every process sees the same state after their agreement."""

    processes, processes_per_slice, live, failures = 4, 2, {0, 1, 3}, [0, 1]


def test_survivors_decide_whether_a_lost_slice_returns_only_once_its_live_partner_has_said_so(monkeypatch, tmp_path):
    """The order that made pause_resume re-form the job: a survivor asks before the partner noted its return."""
    monkeypatch.setenv(_rejoin.RETURNS_DIR_ENV, str(tmp_path))  # the local launcher's
    events = []

    def partner_leaves(key):  # process 3 reaches its part of the loss only once process 0 waits for it
        events.append(("survivor waits for", key))
        with monkeypatch.context() as patch:
            patch.setattr(_rejoin, "own_process_id", lambda: 3)
            TwoSlicesOfTwoProcesses(client).rejoin.note_own_return(1)
        events.append(("partner noted", sorted(k for k in client.store if "/3" in k)))

    client = FakeClient(on_wait=partner_leaves)
    client.key_value_set(f"{KEY_PREFIX}returns/2", repr(time.time() + 5))  # the killed process said when
    monkeypatch.setattr(_rejoin, "own_process_id", lambda: 0)
    assert TwoSlicesOfTwoProcesses(client).rejoin.lost_slices_return([1], within_s=60)
    assert events == [("survivor waits for", f"{KEY_PREFIX}left/3/1"),
                      ("partner noted", [f"{KEY_PREFIX}left/3/1", f"{KEY_PREFIX}returns/3"])]


def test_a_partner_that_never_says_whether_it_returns_is_waited_for_no_longer_than_a_barrier(process_0):
    client = FakeClient()  # process 3 never notes and is not known dead: the wait times out, the slice is not waited for
    client.key_value_set(f"{KEY_PREFIX}returns/2", repr(time.time() + 5))
    assert not TwoSlicesOfTwoProcesses(client).rejoin.lost_slices_return([1], within_s=60)


def test_a_partner_that_died_before_saying_it_returns_comes_back_with_its_slice(monkeypatch, tmp_path):
    """The order CI found: process 3 died (gloo's SIGABRT when its peer was killed) before it noted its return.
    Every survivor still waits for the slice, due when process 2 is; the lowest one notes process 3's return for
    it, so the launcher starts its replacement too."""
    monkeypatch.setenv(_rejoin.RETURNS_DIR_ENV, str(tmp_path))
    client = FakeClient()
    back_at = time.time() + 5
    client.key_value_set(f"{KEY_PREFIX}returns/2", repr(back_at))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    client.key_value_set(f"{KEY_PREFIX}pid/3", f"{socket.gethostname()} {ended.stdout.strip()}")  # dead on this host
    for survivor in (1, 0):
        monkeypatch.setattr(_rejoin, "own_process_id", lambda: survivor)
        assert TwoSlicesOfTwoProcesses(client).rejoin.lost_slices_return([1], within_s=60)
        assert (f"{KEY_PREFIX}returns/3" in client.store) == (survivor == 0)  # only the lowest writes
    assert float(client.store[f"{KEY_PREFIX}returns/3"]) == back_at
    assert float((tmp_path / "process3.returns_at").read_text()) == back_at
    assert not TwoSlicesOfTwoProcesses(client).rejoin.lost_slices_return([1], within_s=1)  # due later than 1 s
