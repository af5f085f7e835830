"""Host snapshots: a copy of the state in memory of its own, which the next step's donation does not touch."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import elastic_trainer.plugin as etp
from elastic_trainer._snapshots import HostSnapshots, host_copy


def test_a_snapshot_is_a_copy_and_the_next_step_still_takes_the_buffers_it_was_given():
    mesh = etp.make_mesh([jax.devices()[0:2], jax.devices()[2:4]])
    replicated = jax.device_put(np.arange(6, dtype=np.float32), NamedSharding(mesh, PartitionSpec()))
    sharded = jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2),
                             NamedSharding(mesh, PartitionSpec(etp.DEVICE_AXIS)))
    snapshots = HostSnapshots(2, jax.tree.structure([replicated, sharded]))
    snapshots.take(1, [replicated, sharded], slices=(0, 1))
    assert snapshots.latest is None  # not a snapshot step
    snapshots.take(2, [replicated, sharded], slices=(0, 1))
    copies = snapshots.latest.leaves
    assert all(copy.flags.owndata for copy in copies)  # on CPU np.asarray alone gives a view of the device buffer
    step = jax.jit(lambda x: x * 2, donate_argnums=0)
    jax.block_until_ready(step(replicated))
    assert replicated.is_deleted()  # a view kept by the snapshot would have made the step allocate instead
    np.testing.assert_array_equal(copies[0], np.arange(6))
    np.testing.assert_array_equal(snapshots.latest.arrays[1], np.arange(8).reshape(4, 2))
    assert host_copy(sharded).shape == (4, 2)
