from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import elastic_trainer as et
from elastic_trainer.config._build import build_trainer
from elastic_trainer.config._schemas import Config, register_configs

CONF_DIR = Path(__file__).parents[1] / "conf"
# benchmark options are multirun sweeps that read Hydra's own config: tests/test_benchmark.py runs them
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml")) and p.name != "benchmark")
APPENDED_GROUPS = {"strategy", "chaos", "logger"}  # not in the defaults list: selected with +group=option


def compose_config(*overrides):
    register_configs()
    with initialize_config_module("elastic_trainer_conf", version_base=None):
        return compose("config", overrides=list(overrides))


def train_in_process(*overrides) -> dict:
    """The report of a run of the config ``overrides`` compose, trained in this process (on the session's 8
    devices), its checkpointer closed after."""
    trainer = build_trainer(compose_config(*overrides))
    try:
        return trainer.fit().report
    finally:
        trainer.checkpointer.close()


@pytest.mark.parametrize(
    "override",
    [
        f"{'+' if group in APPENDED_GROUPS else ''}{group}={path.stem}"
        for group in GROUPS
        for path in sorted((CONF_DIR / group).glob("*.yaml"))
    ],
)
def test_every_config_option_composes_validates_and_builds(override):
    cfg = compose_config(override, "trainer.steps=20")
    assert isinstance(OmegaConf.to_object(cfg), Config)
    if override == "cluster=multiprocess":  # it joins a job of processes: tests/test_multiprocess.py trains on it
        with pytest.raises(et.ConfigError, match="before any JAX operation runs in this process"):
            build_trainer(cfg)
        return
    assert isinstance(build_trainer(cfg), et.Trainer)


def test_defaults_are_four_slices_of_two_devices():
    cfg = compose_config()
    assert (cfg.cluster.slices, cfg.cluster.devices_per_slice) == (4, 2)
    assert cfg.strategy is None and cfg.chaos is None


def test_build_trainer_builds_the_default_workload():
    trainer = build_trainer(compose_config("trainer.steps=17"))
    assert isinstance(trainer.model, et.Transformer)
    assert isinstance(trainer.data, et.StdlibText)
    assert trainer.steps == 17 and trainer.global_batch_size == 48
    assert trainer.cluster.describe() == {"kind": "simulated", "slices": 4, "devices_per_slice": 2, "spare_slices": 0}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cluster.slices=0", "cluster.slices must be at least 1, got 0."),
        ("cluster.devices_per_slice=-2", "cluster.devices_per_slice must be at least 1, got -2."),
        ("trainer.steps=0", "trainer.steps must be at least 1, got 0."),
        ("trainer.global_batch_size=0", "trainer.global_batch_size must be at least 1, got 0."),
        ("trainer.within_slice=diagonal", "trainer.within_slice must be 'replicated' or 'sharded', got 'diagonal'."),
        ("model.d_model=0", "model.d_model must be at least 1, got 0."),
        ("model.num_heads=3", "model.num_heads (3) must divide model.d_model (128)."),
        ("model.num_layers=0", "model.num_layers must be at least 1, got 0."),
        ("model.vocab_size=0", "model.vocab_size must be at least 1, got 0."),
        ("model.mlp_ratio=0", "model.mlp_ratio must be at least 1, got 0."),
        ("data.seq_len=0", "data.seq_len must be at least 1, got 0."),
        ("data.max_bytes=10", "data.max_bytes must be at least 65, got 10."),
        ("optimizer.b1=1.5", "optimizer.b1 must be in [0, 1), got 1.5."),
        ("optimizer.b2=-0.1", "optimizer.b2 must be in [0, 1), got -0.1."),
        ("optimizer.weight_decay=-1", "optimizer.weight_decay must be at least 0, got -1.0."),
        ("optimizer.learning_rate.peak_value=-3", "optimizer.learning_rate.peak_value must be at least 0, got -3.0."),
        ("checkpoint.period=0", "checkpoint.period must be at least 1, got 0."),
        ("checkpoint.period=often", "checkpoint.period must be a whole number of steps or 'auto', got 'often'."),
        ("checkpoint.mtbf_s=0", "checkpoint.mtbf_s must be a positive number of seconds or null, got 0.0."),
        ("trainer.steps=5", "optimizer.learning_rate.decay_steps (5, trainer.steps by default) must exceed"),
    ],
)
def test_each_bad_value_fails_with_one_sentence(override, message):
    with pytest.raises(et.ConfigError) as error:
        build_trainer(compose_config(override))
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_batch_must_divide_over_the_mesh(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(global_batch_size=12))
    with pytest.raises(et.ConfigError, match=r"global_batch_size \(12\) must be divisible by the 8 devices"):
        trainer.fit()


def test_model_from_any_target_with_its_own_arguments():
    cfg = compose_config(
        "~model", "+model._target_=elastic_trainer.Transformer", "+model.seq_len=64", "+model.d_model=32",
        "+model.num_heads=2", "+model.num_layers=1", "trainer.steps=20",
    )
    trainer = build_trainer(cfg)
    assert trainer.model.token_embedding.weight.shape == (256, 32)


def test_target_that_does_not_exist_is_a_config_error():
    with pytest.raises(et.ConfigError, match=r"could not build loss from its config \(nowhere.loss\)"):
        build_trainer(compose_config("loss._target_=nowhere.loss"))
