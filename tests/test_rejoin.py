"""The parts of a rejoin that run in one process: the state from a peer, its trip through host memory, the
admission's record, and when the launcher starts a replacement (tests/test_multiprocess.py runs it for real)."""

import jax
import jax.numpy as jnp
import numpy as np

import elastic_trainer as et
from elastic_trainer._mesh import state_shardings
from elastic_trainer.clusters import Admission
from elastic_trainer.clusters._rejoin import donor_of, from_host, from_peers, to_host
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
    mesh = et.make_mesh(et.SimulatedCluster(4, 2).slice_devices())
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
    shared = from_peers(state, shardings, donor=1)
    for shard in shared["w"].addressable_shards:  # every device's shard, NaN-holding slices included
        np.testing.assert_array_equal(np.asarray(shard.data), donor_w[shard.index])
    assert {int(s.data) for s in shared["step"].addressable_shards} == {41}
    for shard in shared["flag"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.array([True, False])[shard.index])
    assert shared["w"].sharding == shardings["w"] and shared["flag"].dtype == bool


def test_the_state_goes_through_host_memory_onto_a_larger_mesh_with_zeros_where_no_shard_was_held():
    small = et.make_mesh(et.SimulatedCluster(4, 2).slice_devices()[:2])
    large = et.make_mesh(et.SimulatedCluster(4, 2).slice_devices()[:3])
    like = {"w": jax.ShapeDtypeStruct((3, 8), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}
    values = {"w": np.arange(24, dtype=np.float32).reshape(3, 8), "n": np.int32(5)}
    held = jax.device_put(values, state_shardings(values, small, within_slice="sharded"))
    shardings = state_shardings(values, large, within_slice="sharded")
    moved = from_host(to_host(held), like, shardings)
    on_small = {device.id for device in small.devices.flat}
    for shard in moved["w"].addressable_shards:
        expected = values["w"][shard.index] if shard.device.id in on_small else 0
        np.testing.assert_array_equal(np.asarray(shard.data), expected)
    np.testing.assert_array_equal(np.asarray(from_peers(moved, shardings, donor=0)["w"]), values["w"])


def test_an_admission_reads_back_as_written_and_the_donor_is_the_first_slice_not_returning():
    admission = Admission(round=2, processes=(0, 1, 2), slices=(0, 1, 2), donor=0, step=20, position=960,
                          dispatched=21, agreements=57, incarnations=(0, 1, 0), checkpoint_group=3)
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
