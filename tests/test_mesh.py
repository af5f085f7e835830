import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer._mesh import batch_sharding, keep_slices, move_replica, state_shardings


def mesh_of(slices, devices_per_slice):
    return et.SimulatedCluster(slices, devices_per_slice), etp.make_mesh(
        et.SimulatedCluster(slices, devices_per_slice).slice_devices()
    )


def test_mesh_rows_are_slices():
    cluster, mesh = mesh_of(4, 2)
    assert mesh.axis_names == ("slice", "device")
    assert [list(row) for row in mesh.devices] == cluster.slice_devices()


def test_batch_is_split_over_every_device():
    _, mesh = mesh_of(2, 2)
    assert batch_sharding(mesh).spec == P(("slice", "device"))


def test_sharded_state_splits_the_largest_divisible_axis_and_keeps_the_rest_whole():
    _, mesh = mesh_of(2, 4)
    state = {"w": jnp.zeros((3, 8)), "odd": jnp.zeros((3, 5)), "scalar": jnp.zeros(())}
    shardings = state_shardings(state, mesh, within_slice="sharded")
    assert shardings["w"].spec == P(None, "device")
    assert shardings["odd"].spec == P()
    assert shardings["scalar"].spec == P()
    assert all(s.spec == P() for s in jax.tree.leaves(state_shardings(state, mesh, within_slice="replicated")))


def test_a_replica_spreads_onto_a_spares_devices_keeping_the_survivors_buffers():
    """Slices 0 and 2 of 3 (2 devices each, the state split within each slice) hold the state; moved onto slices
    0, 2 and the spare 3: the survivors' devices keep their very buffers, the spare's get copies of the shards of
    the same index, and every value is the original's."""
    devices = et.SimulatedCluster(3, 2, spare_slices=1).slice_devices()
    survivors, swapped = etp.make_mesh([devices[s] for s in (0, 2)]), etp.make_mesh([devices[s] for s in (0, 2, 3)])
    state = {"w": jnp.arange(24.0).reshape(3, 8), "key": jax.random.key(7)}
    held = jax.device_put(state, state_shardings(state, survivors, within_slice="sharded"))
    spread_out = move_replica(held, survivors, [0, 1], state_shardings(state, swapped, within_slice="sharded"))
    assert spread_out["w"].sharding.mesh.devices.tolist() == swapped.devices.tolist()
    kept = {shard.device: shard.data.unsafe_buffer_pointer() for shard in held["w"].addressable_shards}
    for shard in spread_out["w"].addressable_shards:
        if shard.device in kept:
            assert shard.data.unsafe_buffer_pointer() == kept[shard.device], "a survivor's shard was copied"
        else:  # a copy of its own, which a survivor's donating step cannot overwrite
            assert shard.data.unsafe_buffer_pointer() not in kept.values(), "a spare's shard aliases a survivor's"
        assert (shard.data == state["w"][shard.index]).all()
    assert (jax.random.key_data(spread_out["key"]) == jax.random.key_data(state["key"])).all()


@pytest.mark.parametrize("within_slice", ["replicated", "sharded"])
@pytest.mark.parametrize("lost", [0, 2])
def test_a_replica_moves_in_one_pass_from_the_surviving_slices_alone(within_slice, lost):
    """Slices 0, 1 and 2 (2 devices each) hold the state; one is lost (the simulated cluster fills its shards with
    garbage) and the state moves onto the other two and the spare 3 with move_replica, in one pass: the values of
    keep_slices and then a move off every kept slice, every one the original's on every device, the survivors'
    very buffers kept, and nothing read from the lost slice (were every slice's shards read, the first slice's or
    the last's would be the ones copied)."""
    cluster = et.SimulatedCluster(3, 2, spare_slices=1)
    devices = cluster.slice_devices()
    survivors = [s for s in range(3) if s != lost]
    before, after = etp.make_mesh(devices[:3]), etp.make_mesh([devices[s] for s in (*survivors, 3)])
    state = {"w": jnp.arange(24.0).reshape(3, 8), "odd": jnp.arange(15.0).reshape(3, 5), "step": jnp.int32(7)}
    held = cluster.surviving(jax.device_put(state, state_shardings(state, before, within_slice=within_slice)), [lost])
    shardings = state_shardings(state, after, within_slice=within_slice)
    moved = move_replica(held, before, survivors, shardings)
    on_survivors = keep_slices(held, before, survivors)
    in_two_passes = move_replica(on_survivors, etp.make_mesh([devices[s] for s in survivors]), [0, 1], shardings)
    for name in state:
        assert moved[name].sharding == shardings[name]
        kept = {shard.device: shard.data.unsafe_buffer_pointer() for shard in held[name].addressable_shards
                if shard.device not in devices[lost]}
        two_passes = {shard.device: shard.data for shard in in_two_passes[name].addressable_shards}
        for shard in moved[name].addressable_shards:  # every device's shard: a whole array reads only the first
            np.testing.assert_array_equal(shard.data, state[name][shard.index])
            np.testing.assert_array_equal(shard.data, two_passes[shard.device])
            if shard.device in kept:
                assert shard.data.unsafe_buffer_pointer() == kept[shard.device], "a survivor's shard was copied"


def test_a_smaller_simulated_cluster_leaves_jax_the_devices_already_asked_for():
    # A process that asked for 8 devices, whose first cluster is one of 6: JAX starts with 8, so a cluster of 8 built
    # later in the same process still fits (a test's failure-free reference run of 3 processes of 2 devices once
    # started a pytest worker's JAX with 6, and the next test's 8-slice reference could not run)
    script = ("import jax; jax.config.update('jax_num_cpu_devices', 8); import elastic_trainer as et; "
              "et.SimulatedCluster(slices=3, devices_per_slice=2).configure_jax(); "
              "et.SimulatedCluster(slices=8, devices_per_slice=1).configure_jax(); print(len(jax.devices()))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["8"]
