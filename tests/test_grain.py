"""GrainDataset: a grain MapDataset pipeline trains exactly once per sample through a lost slice and a full restart.

The pipeline (shuffle, map to dict samples, a seeded random augmentation) is
read by the indices the trainer draws, so a recovered run must end with the
state of a failure-free run of the same pipeline, with every sample counted
once by the sample ledger over every worker.
"""

import sys
from pathlib import Path

import equinox as eqx
import grain
import jax
import numpy as np
import optax
import pytest

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer._report import merge_worker_reports
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.scale_down import ScaleDown

STEPS, BATCH, FAIL_AT, PERIOD = 6, 24, 3, 2  # BATCH divides over 8 and 6 devices
NUM_SAMPLES, FEATURES, CLASSES = 100, 4, 3  # 100 is not a multiple of 24: the run crosses an epoch mid-batch
FOREVER = 1e9

_cache: dict = {}


def sample(index: int) -> dict[str, np.ndarray]:
    """Sample ``index``: features drawn from the index, labelled by their largest projection."""
    x = np.random.default_rng(index).normal(size=FEATURES).astype(np.float32)
    return {"x": x, "y": np.int32(np.argmax(x[:CLASSES]))}


def jitter(element: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random augmentation: grain seeds ``rng`` by the element's index, so it is the same on every read."""
    return {"x": element["x"] + rng.normal(scale=0.1, size=FEATURES).astype(np.float32), "y": element["y"]}


def pipeline() -> grain.MapDataset:
    return grain.MapDataset.range(NUM_SAMPLES).shuffle(seed=7).map(sample).random_map(jitter, seed=3)


class Classifier(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, *, key: jax.Array):
        self.mlp = eqx.nn.MLP(FEATURES, CLASSES, width_size=16, depth=1, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.mlp(x)


def cross_entropy(model: Classifier, batch: dict[str, jax.Array], *, key: jax.Array) -> jax.Array:
    del key
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(batch["x"]), batch["y"]).mean()


def trainer(**overrides) -> et.Trainer:
    kwargs = dict(
        model=Classifier(key=jax.random.key(0)), loss_fn=cross_entropy, optimizer=optax.adam(1e-2),
        data=et.GrainDataset(pipeline()), steps=STEPS, global_batch_size=BATCH, snapshot_period=0,
        cluster=et.SimulatedCluster(slices=4, devices_per_slice=2),
    )
    return et.Trainer(**(kwargs | overrides))


def params_of(state: etp.TrainState) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(state.params, eqx.is_array))]


def assert_params_close(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def failure_free() -> list[np.ndarray]:
    if "params" not in _cache:
        _cache["params"] = params_of(trainer().fit().state)
    return _cache["params"]


def lose_slice_1() -> Chaos:
    return Chaos(failures=[{"at_step": FAIL_AT, "slice": 1, "down_for_s": FOREVER}])


def test_the_batches_are_the_pipelines_samples_at_the_drawn_indices():
    ids = np.array([5, 0, 99, 5])
    batch = et.GrainDataset(pipeline()).get_batch(ids)
    ds = pipeline()
    np.testing.assert_array_equal(batch["x"], np.stack([ds[int(i)]["x"] for i in ids]))
    np.testing.assert_array_equal(batch["y"], np.stack([ds[int(i)]["y"] for i in ids]))
    assert batch["x"].shape == (4, FEATURES) and batch["y"].dtype == np.int32


def test_a_lost_slice_under_scale_down_trains_every_sample_once_and_ends_as_a_failure_free_run():
    state, report = trainer(strategy=ScaleDown(compile_ahead=False), plugins=[lose_slice_1()]).fit()
    (failure,) = report["failures"]
    assert (failure["step"], failure["slices"], failure["action"]) == (FAIL_AT, [1], "scale_down")
    assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("replica", 0, 3)
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert int(state.data_position) == STEPS * BATCH
    assert_params_close(params_of(state), failure_free())


def worker(run_dir: Path, *, resume: bool) -> tuple[et.Trainer, etp.TrainState | None, dict]:
    """One worker process of a full restart, as the supervisor runs it: the same run directory and checkpoints."""
    run = trainer(strategy=FullRestart(max_restarts=1), plugins=[lose_slice_1()], run_dir=run_dir, resume=resume,
                  checkpointer=et.Checkpointer(run_dir / "checkpoints", period=PERIOD, async_save=False))
    try:
        state, report = run.fit()
    except etp.RestartRequested as restart:
        state, report = None, restart.report
    finally:
        run.checkpointer.close()
    return run, state, report


def test_a_full_restart_resumes_at_the_exact_sample_and_ends_as_a_failure_free_run(tmp_path):
    first, unfinished, first_report = worker(tmp_path, resume=False)
    assert unfinished is None and first_report["failures"][0]["action"] == "full_restart"
    second, state, second_report = worker(tmp_path, resume=True)  # the slice struck once: chaos wrote it down
    assert second_report["resumed_from"] == FAIL_AT - FAIL_AT % PERIOD and second_report["failures"] == []
    merged = merge_worker_reports([first_report, second_report],
                                  [first.ledger.to_arrays(), second.ledger.to_arrays()],
                                  started_at=first_report["started_at"])
    assert merged["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert int(state.data_position) == STEPS * BATCH
    assert_params_close(params_of(state), failure_free())


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        (pipeline().batch(8), r"is batched \(\.batch\(\)\); drop \.batch\(\)"),
        (pipeline().batch(8).map(lambda batch: batch), r"is batched"),
        (pipeline().repeat(), r"is infinite \(\.repeat\(\) without num_epochs\)"),
        (pipeline().to_iter_dataset(), r"needs a grain\.MapDataset \(random access\), got \w*IterDataset"),
    ],
)
def test_a_pipeline_the_trainer_cannot_index_is_refused_in_one_sentence(dataset, message):
    with pytest.raises(et.ConfigError, match=message) as refused:
        et.GrainDataset(dataset)
    assert str(refused.value).endswith(".") and "\n" not in str(refused.value)


def test_a_finite_repeat_is_an_epoch_longer_dataset():
    assert et.GrainDataset(pipeline().repeat(2)).num_samples == 2 * NUM_SAMPLES


def test_a_filtered_out_sample_is_named_when_it_is_read():
    dataset = et.GrainDataset(grain.MapDataset.range(10).filter(lambda i: i != 4))
    np.testing.assert_array_equal(dataset.get_batch(np.array([3, 5])), [3, 5])
    with pytest.raises(et.ConfigError, match="no sample at index 4 \\(a .filter\\(\\) dropped it\\)"):
        dataset.get_batch(np.array([3, 4]))


def test_without_grain_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "grain", None)  # import grain now raises ImportError
    with pytest.raises(et.ConfigError, match=r"GrainDataset needs grain .*pip install 'elastic-trainer\[grain\]'\.$"):
        et.GrainDataset(pipeline())
