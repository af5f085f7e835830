import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import elastic_trainer as et
from elastic_trainer._mesh import batch_sharding, state_shardings


def mesh_of(slices, devices_per_slice):
    return et.SimulatedCluster(slices, devices_per_slice), et.make_mesh(
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
