"""NnxModel: a Flax NNX model trains through et.Trainer, survives a lost slice and resumes from a checkpoint."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.scale_down import ScaleDown

STEPS, BATCH, FAIL_AT = 6, 24, 3  # BATCH divides over 8 and 6 devices
FEATURES, CLASSES = 4, 3
FOREVER = 1e9
DOC = Path(__file__).parents[1] / "docs" / "your_model.md"

_cache: dict = {}


class Mlp(nnx.Module):
    """Layers in an ``nnx.List``: its integer keys go into the checkpoints too."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(FEATURES, 16, rngs=rngs), nnx.Linear(16, CLASSES, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


class Points(et.AbstractDataset):
    def __init__(self, num_samples: int = 200):
        rng = np.random.default_rng(0)
        self.num_samples = num_samples
        self.x = rng.normal(size=(num_samples, FEATURES)).astype(np.float32)
        self.y = np.argmax(self.x[:, :CLASSES], axis=1).astype(np.int32)

    def get_batch(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        return {"x": self.x[sample_ids], "y": self.y[sample_ids]}


def cross_entropy(model: et.NnxModel, batch: dict[str, jax.Array], *, key: jax.Array) -> jax.Array:
    del key
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def trainer(**overrides) -> et.Trainer:
    kwargs = dict(
        model=et.NnxModel(Mlp(rngs=nnx.Rngs(0))), loss_fn=cross_entropy, optimizer=optax.adam(1e-2), data=Points(),
        steps=STEPS, global_batch_size=BATCH, snapshot_period=0,
        cluster=et.SimulatedCluster(slices=4, devices_per_slice=2),
    )
    return et.Trainer(**(kwargs | overrides))


def named(model: et.NnxModel) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]}


def params_of(state: etp.TrainState) -> dict[str, np.ndarray]:
    return named(state.params)


def assert_params_close(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def failure_free() -> tuple[dict[str, np.ndarray], etp.TrainState]:
    if "run" not in _cache:
        state, _ = trainer().fit()
        _cache["run"] = params_of(state), state
    return _cache["run"]


def test_the_model_trains_its_params_and_merges_back_into_the_nnx_module():
    expected, state = failure_free()
    initial = named(et.NnxModel(Mlp(rngs=nnx.Rngs(0))))
    assert set(expected) == {f"['layers'][{i}]['{name}']" for i in (0, 1) for name in ("bias", "kernel")}
    assert all(not np.allclose(expected[name], initial[name]) for name in expected)  # every Param was trained
    module = state.params.to_module()
    assert isinstance(module, Mlp)
    x = jnp.ones((2, FEATURES))
    np.testing.assert_allclose(module(x), state.params(x), rtol=1e-6)


def test_a_lost_slice_under_scale_down_is_restored_from_a_replica_and_ends_as_a_failure_free_run():
    chaos = Chaos(failures=[{"at_step": FAIL_AT, "slice": 1, "down_for_s": FOREVER}])
    state, report = trainer(strategy=ScaleDown(compile_ahead=False), plugins=[chaos]).fit()
    (failure,) = report["failures"]
    assert (failure["step"], failure["slices"], failure["action"]) == (FAIL_AT, [1], "scale_down")
    assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("replica", 0, 3)
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_params_close(params_of(state), failure_free()[0])


def test_a_run_resumed_from_its_checkpoint_ends_as_an_uninterrupted_run(tmp_path):
    first = trainer(steps=FAIL_AT, checkpointer=et.Checkpointer(tmp_path, period=FAIL_AT, async_save=False))
    first.fit()
    first.checkpointer.close()
    resumed = trainer(resume=True, checkpointer=et.Checkpointer(tmp_path, period=FAIL_AT, async_save=False))
    state, report = resumed.fit()
    resumed.checkpointer.close()
    assert report["resumed_from"] == FAIL_AT and int(state.data_position) == STEPS * BATCH
    assert_params_close(params_of(state), failure_free()[0])


@pytest.mark.parametrize(
    ("module", "held"),
    [
        (lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(0)), "RngCount, RngKey"),
        (lambda: nnx.BatchNorm(FEATURES, rngs=nnx.Rngs(0)), "BatchStat"),
    ],
)
def test_state_beyond_params_is_refused_in_one_sentence(module, held):
    with pytest.raises(et.ConfigError, match=f"trains nnx.Param variables only, but the \\w+ also holds {held};"):
        et.NnxModel(module())


def test_without_flax_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flax.nnx", None)  # import flax.nnx now raises ImportError
    with pytest.raises(et.ConfigError, match=r"NnxModel needs Flax .*pip install 'elastic-trainer\[flax\]'\.$"):
        et.NnxModel(Mlp(rngs=nnx.Rngs(0)))


def test_the_example_of_docs_your_model_trains_an_nnx_model_through_a_lost_slice(tmp_path):
    page = DOC.read_text()
    module = re.findall(r"```python\n(.*?)```", page, flags=re.S)[0]  # my_classifier.py, the page's first block
    (example,) = re.findall(r"```py\n(.*?)```", page.split("## A Flax NNX model", 1)[1], flags=re.S)
    (tmp_path / "my_classifier.py").write_text(module)
    (tmp_path / "train_nnx.py").write_text(example)
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "train_nnx.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    module_name, restored_from, lost_steps, final_loss = result.stdout.split()[-4:]
    assert (module_name, restored_from, lost_steps) == ("NnxClassifier", "replica", "0")
    assert float(final_loss) < 1.0  # 4 classes: chance is ln 4 = 1.39
    assert (tmp_path / "nnx_checkpoints" / "40").is_dir()
