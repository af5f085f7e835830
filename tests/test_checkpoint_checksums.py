"""Silent corruption: bytes flipped inside an array's data, which Orbax decodes without error, are caught by the
checksums kept in the checkpoint's metadata; the restore warns and uses the checkpoint before."""

import gc
import itertools
import json

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import elastic_trainer as et
from elastic_trainer.checkpoints._checksums import CHECKSUMS_KEY, MAX_COMPILED, checksums

ZSTD_MAGIC = b"(\xb5/\xfd"


def first_zstd_block(data):
    """Where the first block of the zstd frame that opens ``data`` starts, and its size (RFC 8878, section 3.1.1)."""
    descriptor = data[4]
    single_segment, dictionary_id, content_size = (descriptor >> 5) & 1, descriptor & 3, descriptor >> 6
    start = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dictionary_id] + (single_segment, 2, 4, 8)[content_size]
    return start + 3, int.from_bytes(data[start:start + 3], "little") >> 3


def flip_64_bytes_inside_an_array_chunk(step_dir):
    """Flip 64 bytes in the middle of the first compressed chunk of an OCDBT data file; the file's path."""
    for data_file in sorted((step_dir / "state").glob("ocdbt.process_*/d/*")):
        data = bytearray(data_file.read_bytes())
        if data.startswith(ZSTD_MAGIC):  # a zarr chunk, zstd-compressed (B-tree nodes have their own magic)
            start, size = first_zstd_block(data)
            middle = start + size // 2 - 32
            data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
            data_file.write_bytes(bytes(data))
            return data_file
    raise AssertionError(f"no zstd-compressed chunk in {step_dir}")


def plain_orbax_restore(directory, step):
    """Orbax alone, as the README's snippet reads a checkpoint: the arrays by name."""
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers) as manager:
        here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        arrays = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=here), manager.item_metadata(step)["state"].tree)
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=arrays)))
    return {".".join(path): np.asarray(a) for path, a in ocp.tree.to_flat_dict(restored.state).items()}


def test_a_byte_flip_that_orbax_restores_silently_is_caught_and_the_checkpoint_before_is_used(
    tiny_trainer_kwargs, tmp_path
):
    et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    intact = plain_orbax_restore(tmp_path, 4)
    flip_64_bytes_inside_an_array_chunk(tmp_path / "4")
    corrupt = plain_orbax_restore(tmp_path, 4)  # no error from Orbax: the corruption is silent to it
    (changed,) = [name for name in intact if not np.array_equal(intact[name], corrupt[name])]

    resumed = et.Trainer(**tiny_trainer_kwargs(steps=5, checkpointer=et.Checkpointer(tmp_path, period=10), resume=True))
    with pytest.warns(et.CheckpointWarning) as warned:
        state, report = resumed.fit()
    (warning,) = [str(w.message) for w in warned]
    assert warning.startswith(f"the checkpoint of step 4 in {tmp_path} is unreadable (array {changed} does not "
                              "match the checksum saved with it)")
    assert report["resumed_from"] == 2 and int(state.step) == 5
    assert (tmp_path / "5").is_dir()  # a new checkpoint; step 4's files stay as they were, marked unreadable


def test_checksums_are_the_same_on_any_mesh_and_a_checkpoint_without_them_still_restores(tiny_trainer_kwargs, tmp_path):
    state, _ = et.Trainer(**tiny_trainer_kwargs(steps=2, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    metadata_file = tmp_path / "2" / "metadata" / "metadata"
    metadata = json.loads(metadata_file.read_text())
    one_device = jax.device_put(eqx.filter(state, eqx.is_array), jax.devices()[0])
    assert checksums(one_device) == metadata[CHECKSUMS_KEY]  # saved from 4 slices of 2 devices

    del metadata[CHECKSUMS_KEY]  # as saved before checksums existed
    metadata_file.write_text(json.dumps(metadata))
    resumed = et.Trainer(**tiny_trainer_kwargs(
        steps=3, cluster=et.SimulatedCluster(2, 2), checkpointer=et.Checkpointer(tmp_path, period=10), resume=True,
    )).fit()
    assert resumed.report["resumed_from"] == 2


def test_compiled_checksum_programs_stay_bounded_however_many_layouts_are_saved():
    # one program per layout saved: a long elastic run visits many; evicted programs must free their executables
    live = lambda: (gc.collect(), len(jax.devices()[0].client.live_executables()))[1]  # noqa: E731
    before, values = live(), np.arange(48, dtype=np.float32)
    for devices in list(itertools.combinations(jax.devices(), 2))[: 2 * MAX_COMPILED]:
        mesh = jax.sharding.Mesh(devices, ("device",))
        array = jax.device_put(values, jax.sharding.NamedSharding(mesh, jax.P("device")))
        assert checksums({"a": array}) == checksums({"a": values})  # the same on any layout
    assert live() - before <= MAX_COMPILED + 1  # the programs kept, and the copy's (one for every layout)
