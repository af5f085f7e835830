import json

import equinox as eqx
import jax
import numpy as np
import pytest

import elastic_trainer as et


def params_of(state):
    return jax.tree.leaves(eqx.filter(state.params, eqx.is_array))


def test_resume_on_fewer_slices_continues_the_same_run(tiny_trainer_kwargs, tmp_path):
    uninterrupted = et.Trainer(**tiny_trainer_kwargs(steps=6)).fit()
    et.Trainer(**tiny_trainer_kwargs(steps=4, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    resumed = et.Trainer(
        **tiny_trainer_kwargs(
            steps=6, cluster=et.SimulatedCluster(slices=2, devices_per_slice=2),
            checkpointer=et.Checkpointer(tmp_path, period=2), resume=True,
        )
    ).fit()
    assert int(resumed.state.step) == 6
    assert int(resumed.state.data_position) == 6 * 16
    assert resumed.report["samples"]["consumed"] == 2 * 16
    assert resumed.report["badput_s"]["checkpoint_restore"] > 0
    for a, b in zip(params_of(uninterrupted.state), params_of(resumed.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_metadata_is_json_with_the_layout(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(steps=2, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    metadata = json.loads((tmp_path / "2" / "metadata" / "metadata").read_text())
    assert metadata["step"] == 2 and metadata["data_position"] == 32
    assert metadata["cluster"] == {"kind": "simulated", "slices": 4, "devices_per_slice": 2}
    assert metadata["mesh"] == {"slice": 4, "device": 2}


def test_saves_every_period_and_at_the_end(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(steps=5, checkpointer=et.Checkpointer(tmp_path, period=2, max_to_keep=5))).fit()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 4, 5]


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_trainer_kwargs, tmp_path):
    trainer = et.Trainer(**tiny_trainer_kwargs(checkpointer=et.Checkpointer(tmp_path / "empty"), resume=True))
    with pytest.raises(et.ConfigError, match="holds no complete checkpoint"):
        trainer.fit()
