import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import elastic_trainer as et


_baseline: dict = {}


def params_of(state):
    return jax.tree.leaves(eqx.filter(state.params, eqx.is_array))


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"),
    [((4, 2), (2, 2)), ((4, 2), (3, 2)), ((4, 2), (2, 4)), ((2, 2), (4, 2))],
    ids=["fewer_slices", "three_slices", "other_devices_per_slice", "more_slices"],
)
def test_a_checkpoint_resumes_on_another_mesh_and_continues_the_same_run(tiny_trainer_kwargs, tmp_path, saved_on, resumed_on):
    if "uninterrupted" not in _baseline:  # the failure-free run every case is compared with, trained once
        _baseline["uninterrupted"] = params_of(et.Trainer(**tiny_trainer_kwargs(steps=6, global_batch_size=24)).fit().state)
    et.Trainer(**tiny_trainer_kwargs(
        steps=4, global_batch_size=24, cluster=et.SimulatedCluster(*saved_on), checkpointer=et.Checkpointer(tmp_path, period=2),
    )).fit()
    resumed = et.Trainer(
        **tiny_trainer_kwargs(
            steps=6, global_batch_size=24, cluster=et.SimulatedCluster(*resumed_on),
            checkpointer=et.Checkpointer(tmp_path, period=2), resume=True,
        )
    ).fit()
    assert int(resumed.state.step) == 6
    assert int(resumed.state.data_position) == 6 * 24
    assert resumed.report["samples"] == {"consumed": 2 * 24, "duplicated": 0, "skipped": 0}
    assert resumed.report["badput_s"]["checkpoint_restore"] > 0
    for a, b in zip(_baseline["uninterrupted"], params_of(resumed.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_metadata_is_json_with_the_layout(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(steps=2, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    metadata = json.loads((tmp_path / "2" / "metadata" / "metadata").read_text())
    assert metadata["step"] == 2 and metadata["data_position"] == 32
    assert metadata["cluster"] == {"kind": "simulated", "slices": 4, "devices_per_slice": 2, "spare_slices": 0}
    assert metadata["mesh"] == {"slice": 4, "device": 2}


def test_saves_every_period_and_at_the_end(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(steps=5, checkpointer=et.Checkpointer(tmp_path, period=2, max_to_keep=5))).fit()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 4, 5]


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_trainer_kwargs, tmp_path):
    trainer = et.Trainer(**tiny_trainer_kwargs(checkpointer=et.Checkpointer(tmp_path / "empty"), resume=True))
    with pytest.raises(et.ConfigError, match="holds no complete, readable checkpoint"):
        trainer.fit()


# Orbax's failed read of the truncated step leaves tensorstore callbacks aimed at its closed asyncio
# loop; they surface as "unraisable" RuntimeErrors after the restore already failed and was handled.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    for data_file in (tmp_path / "4" / "state").rglob("d/*"):
        data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    resumed = et.Trainer(**tiny_trainer_kwargs(steps=5, checkpointer=et.Checkpointer(tmp_path, period=10), resume=True))
    with pytest.warns(et.CheckpointWarning, match="the checkpoint of step 4 in .* is unreadable"):
        state, report = resumed.fit()
    assert report["samples"]["consumed"] == 3 * 16  # resumed from step 2, trained steps 3 to 5
    assert int(state.step) == 5


def test_the_docs_snippet_loads_a_checkpoint_with_plain_orbax(tiny_trainer_kwargs, tmp_path):
    checkpoints = tmp_path / "runs" / "a" / "checkpoints"
    state, _ = et.Trainer(**tiny_trainer_kwargs(steps=2, checkpointer=et.Checkpointer(checkpoints, period=2))).fit()
    page = (Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text()
    section = page.split("## Reading a checkpoint without elastic_trainer")[1]
    snippet = section.split("```python")[1].split("```")[0]
    report = "\nimport numpy as np\nnp.save('embedding.npy', state['params']['token_embedding']['weight'])\n"
    report += "print(step, metadata['data_position'])\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}  # a fresh process with one device
    result = subprocess.run([sys.executable, "-c", snippet + report], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "32"]
    embedding = np.load(tmp_path / "embedding.npy")
    np.testing.assert_array_equal(embedding, np.asarray(state.params.token_embedding.weight))


def test_a_checkpoint_of_numpy_arrays_resumes_like_any_other(tiny_trainer_kwargs, tmp_path):
    # The last process of a multi-process job saves the state as numpy arrays (Orbax refuses a jax.Array that
    # one process of several holds whole); a resume reads them onto its own mesh like any other checkpoint.
    if "uninterrupted" not in _baseline:
        _baseline["uninterrupted"] = params_of(et.Trainer(**tiny_trainer_kwargs(steps=6, global_batch_size=24)).fit().state)
    trained = et.Trainer(**tiny_trainer_kwargs(
        steps=4, global_batch_size=24, checkpointer=et.Checkpointer(tmp_path / "jax", period=4),
    ))
    state, _ = trained.fit()
    metadata = json.loads((tmp_path / "jax" / "4" / "metadata" / "metadata").read_text())
    as_numpy = et.Checkpointer(tmp_path / "numpy")
    as_numpy.save(4, jax.tree.map(np.asarray, eqx.filter(state, eqx.is_array)), metadata)
    as_numpy.close()
    resumed = et.Trainer(**tiny_trainer_kwargs(
        steps=6, global_batch_size=24, cluster=et.SimulatedCluster(2, 2),
        checkpointer=et.Checkpointer(tmp_path / "numpy", period=10), resume=True,
    )).fit()
    assert resumed.report["resumed_from"] == 4
    for a, b in zip(_baseline["uninterrupted"], params_of(resumed.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
