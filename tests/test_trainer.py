import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import CountingData

import elastic_trainer as et


class Regression(et.AbstractDataset):
    """y = x @ w_true: a user's own dataset, rows of [x..., y]."""

    num_samples = 256

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(self.num_samples, 4)).astype(np.float32)
        self.y = self.x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)

    def get_batch(self, sample_ids):
        return np.concatenate([self.x[sample_ids], self.y[sample_ids, None]], axis=1)


def mse(model, batch, *, key):
    return jnp.mean((jax.vmap(model)(batch[:, :4])[:, 0] - batch[:, 4]) ** 2)


def test_user_model_loss_and_optimizer_from_python():
    model = eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(1))
    trainer = et.Trainer(
        model=model, loss_fn=mse, optimizer=optax.sgd(0.05), data=Regression(), steps=60, global_batch_size=32,
        cluster=et.SimulatedCluster(slices=2, devices_per_slice=2),
    )
    state, report = trainer.fit()
    assert isinstance(state.params, eqx.nn.MLP)
    assert int(state.step) == 60
    assert int(state.data_position) == 60 * 32 == report["samples"]["consumed"]
    assert report["final_loss"] < 0.2 * report["loss_first"]
    assert trainer.mesh.shape == {"slice": 2, "device": 2}
    assert report["cluster"] == {"kind": "simulated", "slices": 2, "devices_per_slice": 2, "spare_slices": 0}


def params_of(state):
    return jax.tree.leaves(eqx.filter(state.params, eqx.is_array))


def test_replicated_and_sharded_within_slice_train_the_same(tiny_trainer_kwargs):
    replicated = et.Trainer(**tiny_trainer_kwargs(within_slice="replicated")).fit().state
    sharded_trainer = et.Trainer(**tiny_trainer_kwargs(within_slice="sharded"))
    sharded = sharded_trainer.fit().state
    for a, b in zip(params_of(replicated), params_of(sharded), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    specs = {leaf.sharding.spec for leaf in params_of(sharded)}
    assert any("device" in spec for spec in specs), specs
    assert {leaf.sharding.spec for leaf in params_of(replicated)} == {jax.sharding.PartitionSpec()}


def test_same_seed_same_run_other_seed_other_data(tiny_trainer_kwargs):
    a = et.Trainer(**tiny_trainer_kwargs()).fit()
    b = et.Trainer(**tiny_trainer_kwargs()).fit()
    c = et.Trainer(**tiny_trainer_kwargs(seed=1)).fit()
    for x, y in zip(params_of(a.state), params_of(b.state), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.report["loss_first"] == b.report["loss_first"]
    assert not np.array_equal(params_of(a.state)[0], params_of(c.state)[0])


def test_step_consumes_exactly_the_scheduled_samples(tiny_trainer_kwargs):
    seen = []

    class Logged(CountingData):
        def get_batch(self, sample_ids):
            if len(sample_ids) > 1:
                seen.append(sample_ids.copy())
            return super().get_batch(sample_ids)

    data = Logged(num_samples=40)
    et.Trainer(**tiny_trainer_kwargs(data=data, steps=5, global_batch_size=16)).fit()
    consumed = np.concatenate(seen)
    assert len(consumed) == 80  # two epochs of 40 samples
    np.testing.assert_array_equal(consumed, et.sample_ids(40, seed=0, start=0, count=80))
    assert sorted(consumed[:40]) == sorted(consumed[40:]) == list(range(40))


def test_fatal_error_stops_with_the_error_named(tiny_trainer_kwargs):
    class Broken(CountingData):
        def get_batch(self, sample_ids):
            if len(sample_ids) > 1:
                raise OSError("disk on fire")
            return super().get_batch(sample_ids)

    with pytest.raises(et.TrainingStopped, match="step 1 failed with a fatal error: disk on fire") as stopped:
        et.Trainer(**tiny_trainer_kwargs(data=Broken())).fit()
    assert stopped.value.report["failures"][0]["kind"] == "fatal"
    assert stopped.value.report["steps_completed"] == 0


def test_report_is_written_to_the_run_directory(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(run_dir=tmp_path / "run")).fit()
    assert (tmp_path / "run" / "report.json").is_file()
