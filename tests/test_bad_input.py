"""Bad input never hurts: each case gets one clear sentence, a non-zero exit, and leaves every checkpoint as it was.

Every field of every config schema has an out-of-bounds value here (checked
in-process: ``build_trainer`` raises :class:`ConfigError`, which the CLI turns
into exit status 2; a test keeps the list complete). Checkpoint directories
that are a file, unwritable, of another model or with corrupt metadata, a
strategy name with a typo, a plugin that fails to import, and a bad value of
the multi-process cluster (which must stop before the launcher starts a
process) each run through the real command line, and the checksums of every
file of the checkpoints involved are compared before and after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from test_cli import TINY_MODEL, run_cli
from test_config import compose_config, train_in_process

import elastic_trainer as et
from elastic_trainer.launch._cli import EXIT_BAD_INPUT, check_group_choices, check_values
from elastic_trainer.config._build import build_trainer
from elastic_trainer.config._schemas import register_configs

TINY = [*TINY_MODEL, "trainer.steps=12"]


def overrides(*case: str, base=TINY) -> list[str]:
    """``case`` on top of ``base``, dropping the base values that ``case`` sets itself."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in case}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(case)


LONGER = overrides("trainer.steps=16")  # resumes the existing run (12 steps) for 4 more


# ------------------------------------------------------------------ every config field out of bounds

# (schema field covered, overrides, the message's start); "{file}" is replaced by the path of an existing file
BAD_VALUES = [
    ("config.seed", ["seed=-1"], "seed must be at least 0, got -1."),
    ("trainer.steps", ["trainer.steps=0"], "trainer.steps must be at least 1, got 0."),
    ("trainer.steps", ["trainer.steps=ten"], "trainer.steps: value 'ten' of type 'str' could not be converted to Integer."),
    ("trainer.global_batch_size", ["trainer.global_batch_size=0"], "trainer.global_batch_size must be at least 1, got 0."),
    ("trainer.global_batch_size", ["trainer.global_batch_size=47"],
     "trainer.global_batch_size (47) must be divisible by the 8 devices of slices [0, 1, 2, 3]"),
    ("trainer.within_slice", ["trainer.within_slice=diagonal"],
     "trainer.within_slice must be 'replicated' or 'sharded', got 'diagonal'."),
    ("trainer.snapshot_period", ["trainer.snapshot_period=-1"], "trainer.snapshot_period must be at least 0, got -1."),
    ("trainer.step_timeout_s", ["trainer.step_timeout_s=-1"], "trainer.step_timeout_s must be at least 0, got -1.0."),
    ("trainer.max_cached_layouts", ["trainer.max_cached_layouts=0"], "trainer.max_cached_layouts must be at least 1, got 0."),
    ("trainer.straggler_factor", ["trainer.straggler_factor=1"], "trainer.straggler_factor must be above 1, got 1.0."),
    ("trainer.straggler_steps", ["trainer.straggler_steps=0"], "trainer.straggler_steps must be at least 1, got 0."),
    ("trainer.preemption_signal", ["trainer.preemption_signal=SIGFOO"],
     "trainer.preemption_signal 'SIGFOO' is not a signal; give a name such as SIGUSR1 or its number."),
    ("trainer.preemption_signal", ["trainer.preemption_signal=SIGKILL"],
     "trainer.preemption_signal SIGKILL cannot be caught; choose another, such as SIGUSR1."),
    ("trainer.compilation_cache_dir", ["trainer.compilation_cache_dir={file}"],
     "trainer.compilation_cache_dir {file} is a file, not a directory;"),
    ("checkpoint.enabled", ["checkpoint.enabled=maybe"], "checkpoint.enabled: value 'maybe' is not a valid bool"),
    ("checkpoint.period", ["checkpoint.period=0"], "checkpoint.period must be at least 1, got 0."),
    ("checkpoint.period", ["checkpoint.period=often"],
     "checkpoint.period must be a whole number of steps or 'auto', got 'often'."),
    ("checkpoint.mtbf_s", ["checkpoint.mtbf_s=0"], "checkpoint.mtbf_s must be a positive number of seconds or null, got 0.0."),
    ("checkpoint.max_to_keep", ["checkpoint.max_to_keep=0"], "checkpoint.max_to_keep must be at least 1, got 0."),
    ("checkpoint.max_failed_saves", ["checkpoint.max_failed_saves=0"],
     "checkpoint.max_failed_saves must be a whole number of saves, at least 1"),
    ("checkpoint.dir", ["checkpoint.dir={file}"], "checkpoint.dir {file} is a file, not a directory;"),
    ("checkpoint.dir", ["checkpoint.dir={file}/checkpoints"], "checkpoint.dir {file}/checkpoints cannot be created (Not a directory);"),
    ("checkpoint.resume", ["checkpoint.resume=true", "checkpoint.enabled=false"], "checkpoint.resume needs checkpoint.enabled=true."),
    ("checkpoint.resume", ["checkpoint.resume=true", "checkpoint.dir={empty}"],
     "checkpoint.resume is set but {empty} holds no complete, readable checkpoint;"),
    ("checkpoint.async_save", ["checkpoint.async_save=maybe"], "checkpoint.async_save: value 'maybe' is not a valid bool"),
    ("cluster/simulated.slices", ["cluster.slices=0"], "cluster.slices must be at least 1, got 0."),
    ("cluster/simulated.devices_per_slice", ["cluster.devices_per_slice=-2"],
     "cluster.devices_per_slice must be at least 1, got -2."),
    ("cluster/simulated.spare_slices", ["cluster.spare_slices=-1"], "cluster.spare_slices must be at least 0, got -1."),
    ("cluster/multiprocess.num_processes", ["cluster=multiprocess", "cluster.num_processes=0"],
     "cluster.num_processes must be at least 1, got 0."),
    ("cluster/multiprocess.num_processes", ["cluster=multiprocess", "cluster.num_processes=5"],
     "trainer.global_batch_size (48) must be divisible by the job's 10 devices (cluster.num_processes=5 x "
     "cluster.devices_per_process=2); change one of them."),
    ("cluster/multiprocess.spare_slices", ["cluster=multiprocess", "cluster.spare_slices=-1"],
     "cluster.spare_slices must be at least 0, got -1."),
    ("loss/function.has_aux", ["loss.has_aux=maybe"], "loss.has_aux: value 'maybe' is not a valid bool (type str)."),
    ("cluster/pathways.spare_slices", ["cluster=pathways", "cluster.spare_slices=-1"],
     "cluster.spare_slices must be at least 0, got -1."),
    ("cluster/multiprocess.devices_per_process", ["cluster=multiprocess", "cluster.devices_per_process=0"],
     "cluster.devices_per_process must be at least 1, got 0."),
    ("cluster/multiprocess.processes_per_slice", ["cluster=multiprocess", "cluster.processes_per_slice=0"],
     "cluster.processes_per_slice must be at least 1, got 0."),
    ("cluster/multiprocess.processes_per_slice", ["cluster=multiprocess", "cluster.processes_per_slice=3"],
     "cluster.processes_per_slice (3) must divide cluster.num_processes (2); a slice is that many whole processes."),
    ("cluster/multiprocess.heartbeat_timeout_s", ["cluster=multiprocess", "cluster.heartbeat_timeout_s=0"],
     "cluster.heartbeat_timeout_s must be at least 1, got 0."),
    ("cluster/multiprocess.collective_timeout_s", ["cluster=multiprocess", "cluster.collective_timeout_s=-1"],
     "cluster.collective_timeout_s must be at least 1, got -1."),
    ("cluster/multiprocess.initialization_timeout_s", ["cluster=multiprocess", "cluster.initialization_timeout_s=0"],
     "cluster.initialization_timeout_s must be at least 1, got 0."),
    ("cluster/multiprocess.platform", ["cluster=multiprocess", "cluster.platform=gpu"],
     "cluster.platform must be 'cpu' (gloo collectives between processes on CPU) or null (JAX's default platform "
     "and its collectives), got 'gpu'."),
    ("cluster/multiprocess.launcher", ["cluster=multiprocess", "cluster.launcher=slurm"],
     "cluster.launcher must be 'local' (the command starts the processes here) or 'none' (a scheduler started "
     "them), got 'slurm'."),
    ("cluster/multiprocess.barrier_timeout_s", ["cluster=multiprocess", "cluster.barrier_timeout_s=0"],
     "cluster.barrier_timeout_s must be at least 1, got 0."),
    ("cluster/multiprocess.coordinator", ["cluster=multiprocess", "cluster.coordinator=process1"],
     "cluster.coordinator must be 'separate' (JAX's coordination service in a process of its own) or 'process0' "
     "(process 0 hosts it, and may not be lost), got 'process1'."),
    ("cluster/pathways.health_checker", ["cluster=pathways", "cluster.health_checker=MyChecker"],
     "cluster.health_checker must be 'module:Class' (a subclass of pathwaysutils' SliceHealthChecker) or null for "
     "pathwaysutils' default, got 'MyChecker'."),
    ("cluster/pathways.health_checker", ["cluster=pathways", "cluster.health_checker=no_such_module:Checker"],
     "cluster.health_checker 'no_such_module:Checker' cannot be loaded (ModuleNotFoundError: No module named "
     "'no_such_module'); name an importable 'module:Class', or null for pathwaysutils' default."),
    ("cluster/pathways.health_checker", ["cluster=pathways", "cluster.health_checker=pathwaysutils.elastic.elastic:Nope"],
     "cluster.health_checker 'pathwaysutils.elastic.elastic:Nope' cannot be loaded (AttributeError: module "
     "'pathwaysutils.elastic.elastic' has no attribute 'Nope');"),
    ("cluster/pathways.health_checker", ["cluster=pathways", "cluster.health_checker=collections:OrderedDict"],
     "cluster.health_checker 'collections:OrderedDict' is not a subclass of pathwaysutils' SliceHealthChecker; "
     "name one, or null for pathwaysutils' default."),
    ("model/transformer.vocab_size", ["model.vocab_size=0"], "model.vocab_size must be at least 1, got 0."),
    ("model/transformer.vocab_size", ["model.vocab_size=100"],
     "model.vocab_size (100) must be at least the data's 256 tokens;"),
    ("model/transformer.seq_len", ["model.seq_len=0"], "model.seq_len must be at least 1, got 0."),
    ("model/transformer.seq_len", ["model.seq_len=4"], "model.seq_len (4) must be at least data.seq_len (8);"),
    ("model/transformer.d_model", ["model.d_model=0"], "model.d_model must be at least 1, got 0."),
    ("model/transformer.num_heads", ["model.num_heads=3"], "model.num_heads (3) must divide model.d_model (32)."),
    ("model/transformer.num_layers", ["model.num_layers=0"], "model.num_layers must be at least 1, got 0."),
    ("model/transformer.mlp_ratio", ["model.mlp_ratio=0"], "model.mlp_ratio must be at least 1, got 0."),
    ("data/stdlib_text.seq_len", ["data.seq_len=0"], "data.seq_len must be at least 1, got 0."),
    ("data/stdlib_text.max_bytes", ["data.max_bytes=5"], "data.max_bytes must be at least 9, got 5."),
    ("optimizer/adamw.b1", ["optimizer.b1=1.5"], "optimizer.b1 must be in [0, 1), got 1.5."),
    ("optimizer/adamw.b2", ["optimizer.b2=-0.1"], "optimizer.b2 must be in [0, 1), got -0.1."),
    ("optimizer/adamw.weight_decay", ["optimizer.weight_decay=-1"], "optimizer.weight_decay must be at least 0, got -1.0."),
    ("optimizer/adamw.learning_rate.init_value", ["optimizer.learning_rate.init_value=-1"],
     "optimizer.learning_rate.init_value must be at least 0, got -1.0."),
    ("optimizer/adamw.learning_rate.peak_value", ["optimizer.learning_rate.peak_value=-3"],
     "optimizer.learning_rate.peak_value must be at least 0, got -3.0."),
    ("optimizer/adamw.learning_rate.warmup_steps", ["optimizer.learning_rate.warmup_steps=-1"],
     "optimizer.learning_rate.warmup_steps must be at least 0, got -1."),
    ("optimizer/adamw.learning_rate.decay_steps", ["optimizer.learning_rate.decay_steps=5"],
     "optimizer.learning_rate.decay_steps (5, trainer.steps by default) must exceed warmup_steps (10);"),
    ("optimizer/adamw.learning_rate.end_value", ["optimizer.learning_rate.end_value=-1"],
     "optimizer.learning_rate.end_value must be at least 0, got -1.0."),
    ("strategy/scale_down.min_slice_count", ["+strategy=scale_down", "strategy.min_slice_count=0"],
     "strategy.min_slice_count must be at least 1, got 0."),
    ("strategy/scale_down.min_slice_count", ["+strategy=scale_down", "strategy.min_slice_count=5"],
     "strategy.min_slice_count (5) is above the cluster's 4 slices."),
    ("strategy/scale_down.compile_ahead", ["+strategy=scale_down", "strategy.compile_ahead=maybe"],
     "strategy.compile_ahead: value 'maybe' is not a valid bool"),
    ("strategy/scale_down.scale_up", ["+strategy=scale_down", "strategy.scale_up=maybe"], "strategy.scale_up: value 'maybe' is not a valid bool"),
    ("strategy/scale_down.drop_stragglers", ["+strategy=scale_down", "strategy.drop_stragglers=maybe"],
     "strategy.drop_stragglers: value 'maybe' is not a valid bool"),
    ("strategy/scale_down.drop_for_steps", ["+strategy=scale_down", "strategy.drop_for_steps=0"],
     "strategy.drop_for_steps must be at least 1, got 0."),
    ("strategy/diloco.drop_stragglers", ["+strategy=diloco", "strategy.drop_stragglers=maybe"],
     "strategy.drop_stragglers: value 'maybe' is not a valid bool"),
    ("strategy/diloco.drop_for_steps", ["+strategy=diloco", "strategy.drop_for_steps=0"],
     "strategy.drop_for_steps must be at least 1, got 0."),
    ("strategy/scale_down.batch_policy", ["+strategy=scale_down", "strategy.batch_policy=keep_all"],
     "strategy.batch_policy must be one of ('keep_global', 'keep_per_device'), got 'keep_all'."),
    ("strategy/scale_down.lr_scaling", ["+strategy=scale_down", "strategy.lr_scaling=cubic"],
     "strategy.lr_scaling must be one of ('linear', 'sqrt', 'none'), got 'cubic'."),
    ("strategy/scale_down.max_retries", ["+strategy=scale_down", "strategy.max_retries=-1"],
     "strategy.max_retries must be at least 0, got -1."),
    ("strategy/scale_down.timeout_s", ["+strategy=scale_down", "strategy.timeout_s=-1"],
     "strategy.timeout_s must be at least 0, got -1.0."),
    ("strategy/scale_down.retry_reset_steps", ["+strategy=scale_down", "strategy.retry_reset_steps=-1"],
     "strategy.retry_reset_steps must be at least 0, got -1."),
    ("strategy/pause_resume.retry_reset_steps", ["+strategy=pause_resume", "strategy.retry_reset_steps=-1"],
     "strategy.retry_reset_steps must be at least 0, got -1."),
    ("strategy/pause_resume.timeout_s", ["+strategy=pause_resume", "strategy.timeout_s=-1"],
     "strategy.timeout_s must be at least 0, got -1.0."),
    ("strategy/pause_resume.max_retries", ["+strategy=pause_resume", "strategy.max_retries=-1"],
     "strategy.max_retries must be at least 0, got -1."),
    ("strategy/full_restart.max_restarts", ["+strategy=full_restart", "strategy.max_restarts=-1"],
     "strategy.max_restarts must be at least 0, got -1."),
    ("strategy/hot_swap.max_retries", ["+strategy=hot_swap", "strategy.max_retries=-1"],
     "strategy.max_retries must be at least 0, got -1."),
    ("strategy/hot_swap.retry_reset_steps", ["+strategy=hot_swap", "strategy.retry_reset_steps=-1"],
     "strategy.retry_reset_steps must be at least 0, got -1."),
    ("strategy/hot_swap.compile_ahead", ["+strategy=hot_swap", "strategy.compile_ahead=maybe"],
     "strategy.compile_ahead: value 'maybe' is not a valid bool"),
    ("strategy/diloco.inner_steps", ["+strategy=diloco", "strategy.inner_steps=0"],
     "strategy.inner_steps must be at least 1, got 0."),
    ("strategy/diloco.outer_lr", ["+strategy=diloco", "strategy.outer_lr=0"], "strategy.outer_lr must be above 0, got 0.0."),
    ("strategy/diloco.outer_momentum", ["+strategy=diloco", "strategy.outer_momentum=1"],
     "strategy.outer_momentum must be at least 0 and below 1, got 1.0."),
    ("strategy/diloco.nesterov", ["+strategy=diloco", "strategy.nesterov=maybe"],
     "strategy.nesterov: value 'maybe' is not a valid bool"),
    ("strategy/diloco.min_slice_count", ["+strategy=diloco", "strategy.min_slice_count=5"],
     "strategy.min_slice_count (5) is above the cluster's 4 slices."),
    ("strategy/diloco.timeout_s", ["+strategy=diloco", "strategy.timeout_s=-1"],
     "strategy.timeout_s must be at least 0, got -1.0."),
    ("strategy/diloco.scale_up", ["+strategy=diloco", "strategy.scale_up=maybe"],
     "strategy.scale_up: value 'maybe' is not a valid bool"),
    ("strategy/diloco.compile_ahead", ["+strategy=diloco", "strategy.compile_ahead=maybe"],
     "strategy.compile_ahead: value 'maybe' is not a valid bool"),
    ("strategy/diloco.max_retries", ["+strategy=diloco", "strategy.max_retries=-1"],
     "strategy.max_retries must be at least 0, got -1."),
    ("strategy/diloco.retry_reset_steps", ["+strategy=diloco", "strategy.retry_reset_steps=-1"],
     "strategy.retry_reset_steps must be at least 0, got -1."),
    ("strategy/fallback.strategies", ["+strategy=pause_then_scale_down", "strategy.strategies=[]"],
     "strategy.strategies must name at least two strategies to fall back between."),
    ("chaos/chaos.mean_steps_between_failures", ["+chaos=random", "chaos.mean_steps_between_failures=-1"],
     "chaos.mean_steps_between_failures, chaos.steps_per_failure and chaos.random_down_for_s must not be negative."),
    ("chaos/chaos.random_down_for_s", ["+chaos=random", "chaos.random_down_for_s=-1"],
     "chaos.mean_steps_between_failures, chaos.steps_per_failure and chaos.random_down_for_s must not be negative."),
    ("chaos/chaos.steps_per_failure", ["+chaos=periodic", "chaos.steps_per_failure=-1"],
     "chaos.mean_steps_between_failures, chaos.steps_per_failure and chaos.random_down_for_s must not be negative."),
    ("chaos/chaos.seed", ["+chaos=random", "chaos.seed=-1"], "chaos.seed must be at least 0, got -1."),
    ("logger/tensorboard.every", ["+logger=tensorboard", "logger.every=0"], "logger.every must be at least 1, got 0."),
    ("logger/tensorboard.log_dir", ["+logger=tensorboard", "logger.log_dir={file}"],
     "logger.log_dir {file} is a file, not a directory; point it at a directory."),
    ("chaos/chaos.failures[].at_step", ["+chaos=schedule", "chaos.failures=[{at_step: -1, slice: 0}]"],
     "chaos failure ScheduledFailure(at_step=-1,"),
    ("chaos/chaos.failures[].at_step", ["+chaos=schedule", "chaos.failures=[{slice: 0}]"], "chaos.failures[0].at_step has no value; give it one."),
    ("chaos/chaos.failures[].slice", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: -1}]"],
     "chaos failure ScheduledFailure(at_step=1, slice=-1,"),
    ("chaos/chaos.failures[].slice", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: 9}]"],
     "chaos failure at step 1 names slice 9, but the cluster has slices 0 to 3."),
    ("chaos/chaos.failures[].phase", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: 0, phase: lunch}]"],
     "chaos failure phase must be one of ('train_step', 'update', 'boundary', 'checkpoint_save', 'checkpoint_restore', "
     "'recovery'), got 'lunch'."),
    ("chaos/chaos.failures[].down_for_s", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: 0, down_for_s: -1}]"],
     "chaos failure ScheduledFailure(at_step=1, slice=0, phase='train_step', down_for_s=-1.0"),
    ("chaos/chaos.failures[].process", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: 0, process: -1}]"],
     "chaos failure ScheduledFailure(at_step=1, slice=0, phase='train_step', down_for_s=1000000000.0, hang=False, "
     "process=-1, slow=None): process must not be negative"),
    ("chaos/chaos.failures[].slow", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: 0, slow: 0.5}]"],
     "chaos failure ScheduledFailure(at_step=1, slice=0, phase='train_step', down_for_s=1000000000.0, hang=False, "
     "process=None, slow=0.5): slow must be above 1"),
    ("chaos/chaos.failures[].hang", ["+chaos=schedule", "chaos.failures=[{at_step: 1, slice: 0, hang: maybe}]"],
     "chaos.failures (hang): value 'maybe' is not a valid bool"),
]
# A group option that does not exist: caught by the command line before Hydra composes anything.
BAD_GROUP_OPTIONS = [
    ("config.cluster", "cluster=simulatd", "there is no cluster 'simulatd' (did you mean cluster=simulated?)"),
    ("config.model", "model=transfomer", "there is no model 'transfomer' (did you mean model=transformer?)"),
    ("config.data", "data=stdlib", "there is no data 'stdlib' (did you mean data=stdlib_text?)"),
    ("config.optimizer", "optimizer=adam", "there is no optimizer 'adam' (did you mean optimizer=adamw?)"),
    ("config.loss", "loss=next_tokens", "there is no loss 'next_tokens' (did you mean loss=next_token?)"),
    ("config.strategy", "+strategy=scale_dwon", "there is no strategy 'scale_dwon' (did you mean +strategy=scale_down?)"),
    ("config.chaos", "+chaos=schedul", "there is no chaos 'schedul' (did you mean +chaos=schedule?)"),
    ("config.logger", "+logger=tensorbord", "there is no logger 'tensorbord' (did you mean +logger=tensorboard?)"),
]

def schema_fields() -> set[str]:
    """Every value field of every schema in Hydra's ConfigStore: ``trainer.steps``, ``strategy/scale_down.max_retries``.

    Nested schemas are walked (``optimizer/adamw.learning_rate.warmup_steps``,
    ``chaos/chaos.failures[].slice``); ``_target_``-style fields are not values.
    """
    register_configs()
    store = ConfigStore.instance()
    schemas = {"config": OmegaConf.get_type(store.load("base_config.yaml").node)}
    for group in store.list("schema"):
        for name in store.list(f"schema/{group}"):
            schemas[f"{group}/{name.removesuffix('.yaml')}"] = OmegaConf.get_type(store.load(f"schema/{group}/{name}").node)
    fields: set[str] = set()

    def walk(prefix: str, schema: type) -> None:
        hints = typing.get_type_hints(schema)
        for field in dataclasses.fields(schema):
            hint = hints[field.name]
            element = typing.get_args(hint)[0] if typing.get_origin(hint) is list and typing.get_args(hint) else None
            if field.name.startswith("_"):
                continue
            if dataclasses.is_dataclass(hint):
                walk(f"{prefix}.{field.name}", hint)
            elif dataclasses.is_dataclass(element):
                walk(f"{prefix}.{field.name}[]", element)
            else:
                fields.add(f"{prefix}.{field.name}")

    for option, schema in schemas.items():
        walk(option, schema)
    # the base config's nested sections read as their keys: config.trainer.steps -> trainer.steps
    return {f.removeprefix("config.") if f.count(".") > 1 else f for f in fields}


def test_every_config_field_has_an_out_of_bounds_case():
    covered = {field for field, _, _ in BAD_VALUES} | {field for field, _, _ in BAD_GROUP_OPTIONS}
    missing = schema_fields() - covered
    assert not missing, f"add an out-of-bounds value for {sorted(missing)} to BAD_VALUES in tests/test_bad_input.py"
    assert not covered - schema_fields(), "BAD_VALUES names fields that no schema has"


def one_sentence(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message
    assert message[0].islower() and message.rstrip(")").endswith((".", "?")), message


@pytest.mark.parametrize(("field", "case", "message"), BAD_VALUES, ids=[" ".join(c) for _, c, _ in BAD_VALUES])
def test_each_out_of_bounds_value_is_one_sentence(tmp_path, field, case, message):
    a_file, empty = tmp_path / "a_file", tmp_path / "empty"
    a_file.write_text("not a directory\n")
    empty.mkdir()
    paths = {"{file}": str(a_file), "{empty}": str(empty)}
    for placeholder, path in paths.items():
        case = [o.replace(placeholder, path) for o in case]
        message = message.replace(placeholder, path)
    with pytest.raises(et.ConfigError) as error:
        cfg = check_values(overrides(*case))  # what the command line checks before Hydra composes (types)
        trainer = build_trainer(cfg)  # the config Hydra then composes, as check_values did
        trainer.fit()  # some values are checked when the run starts, before its first step
    assert str(error.value).startswith(message)
    one_sentence(str(error.value))
    assert a_file.read_text() == "not a directory\n" and list(empty.iterdir()) == []


@pytest.mark.parametrize(("field", "override", "message"), BAD_GROUP_OPTIONS)
def test_each_group_option_that_does_not_exist_is_one_sentence(field, override, message):
    with pytest.raises(et.ConfigError) as error:
        check_group_choices([override])
    assert str(error.value).startswith(message)
    one_sentence(str(error.value))


# ------------------------------------------------------------------ an existing run's checkpoints


def checksums(path: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``path`` (or of ``path`` itself), by relative path."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)) if p != path else p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> Path:
    """The checkpoints (steps 4, 8 and 12) of a finished run of the TINY configuration."""
    directory = tmp_path_factory.mktemp("existing") / "checkpoints"
    train_in_process(*TINY, "checkpoint.period=4", f"checkpoint.dir={directory}")
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["12", "4", "8"]
    return directory


@pytest.fixture
def checkpoints(existing_run, tmp_path) -> Path:
    """A copy of the existing run's checkpoints, for one test to point at."""
    return Path(shutil.copytree(existing_run, tmp_path / "checkpoints"))


def resume_cli(checkpoints: Path, run_dir: Path, *case: str, env: dict | None = None):
    """Run the command line on ``checkpoints`` with ``checkpoint.resume=true`` and ``case``."""
    args = [*overrides(*case, base=LONGER), f"checkpoint.dir={checkpoints}", "checkpoint.resume=true",
            f"hydra.run.dir={run_dir}"]
    if env is None:
        return run_cli(*args, timeout=120)
    return subprocess.run([sys.executable, "-m", "elastic_trainer", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1", **env})


def assert_fails_with(result, message: str) -> None:
    """Exit status 2 and exactly one line on stderr: ``elastic_trainer: error: <message...>``."""
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.startswith(f"elastic_trainer: error: {message}"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    one_sentence(result.stderr.removeprefix("elastic_trainer: error: ").strip())


@pytest.mark.parametrize(("case", "message"), [
    (["cluster.slices=0"], "cluster.slices must be at least 1, got 0."),
    (["trainer.steps=ten"], "trainer.steps: value 'ten' of type 'str' could not be converted to Integer."),
    # the multi-process launcher checks the config before it starts any process (each would say it again)
    (["cluster=multiprocess", "cluster.heartbeat_timeout_s=0"], "cluster.heartbeat_timeout_s must be at least 1, got 0."),
    (["cluster=pathways", "cluster.spare_slices=-1"], "cluster.spare_slices must be at least 0, got -1."),
], ids=["slices", "steps", "multiprocess", "pathways"])
def test_a_bad_value_through_the_cli_touches_no_checkpoint(checkpoints, tmp_path, case, message):
    before = checksums(checkpoints)
    result = resume_cli(checkpoints, tmp_path / "run", *case)
    assert_fails_with(result, message)
    assert checksums(checkpoints) == before
    assert not list((tmp_path / "run").glob("process*")), "a worker process was started"


def test_a_strategy_name_with_a_typo_suggests_the_closest_and_touches_no_checkpoint(checkpoints, tmp_path):
    before = checksums(checkpoints)
    result = resume_cli(checkpoints, tmp_path / "run", "+strategy=pause_resum")
    assert_fails_with(result, "there is no strategy 'pause_resum' (did you mean +strategy=pause_resume?)")
    assert checksums(checkpoints) == before


def test_a_checkpoint_dir_that_is_a_file_is_refused_and_left_alone(tmp_path):
    a_file = tmp_path / "checkpoints"
    a_file.write_bytes(b"some user's file, not checkpoints\n")
    before = checksums(a_file)
    result = resume_cli(a_file, tmp_path / "run")
    assert_fails_with(result, f"checkpoint.dir {a_file} is a file, not a directory; point checkpoint.dir at a directory.")
    assert checksums(a_file) == before


def make_unwritable(directory: Path) -> list[str]:
    """Make ``directory`` unwritable; returns the command that undoes it.

    Root writes through permission bits, so as root the directory is made
    immutable (``chattr +i``: no entry can be added, removed or renamed, even by root).
    """
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return ["chmod", "755", str(directory)]
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a directory unwritable for root here: {made.stderr.strip()}")
    return ["chattr", "-i", str(directory)]


def test_an_unwritable_checkpoint_dir_is_refused_before_any_work(checkpoints, tmp_path):
    undo = make_unwritable(checkpoints)
    try:
        assert not os.access(checkpoints, os.W_OK)
        before = checksums(checkpoints)
        result = resume_cli(checkpoints, tmp_path / "run")
        assert_fails_with(result, f"checkpoint.dir {checkpoints} is not writable; fix its permissions or choose "
                                  "another checkpoint.dir.")
        assert checksums(checkpoints) == before
    finally:
        subprocess.run(undo, check=True)


def test_checkpoints_of_another_model_are_refused_with_the_difference(checkpoints, tmp_path):
    before = checksums(checkpoints)
    result = resume_cli(checkpoints, tmp_path / "run", "model.d_model=64")
    assert_fails_with(result, f"the checkpoint of step 12 in {checkpoints} holds another model's state "
                              "(params.")
    assert "has shape" in result.stderr and "in this run); resume with the model and optimizer" in result.stderr
    assert checksums(checkpoints) == before


METADATA_FILES = {
    "ours": "metadata/metadata",          # the JSON metadata item: step, data position, layout
    "orbax_tree": "state/_METADATA",      # Orbax's tree metadata of the state: names, shapes, dtypes
    "orbax_step": "_CHECKPOINT_METADATA",  # Orbax's record of the step: timestamps, handlers; not needed to restore
}


def corrupt(step_dir: Path, relative: str) -> None:
    path = step_dir / relative
    assert path.is_file(), f"{path} is not in Orbax's layout any more"
    path.write_bytes(b"{ this is not json")


def step_dirs(checkpoints: Path) -> list[Path]:
    return sorted(p for p in checkpoints.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("which", ["ours", "orbax_tree"])
def test_checkpoints_with_corrupt_metadata_are_refused_and_left_alone(checkpoints, tmp_path, which):
    for step_dir in step_dirs(checkpoints):
        corrupt(step_dir, METADATA_FILES[which])
    before = checksums(checkpoints)
    if which == "ours":  # one case through the command line; the other in this process
        result = resume_cli(checkpoints, tmp_path / "run")
        why = "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 3 (char 2)"
        assert_fails_with(result, f"checkpoint.resume is set but {checkpoints} holds no complete, readable "
                                  f"checkpoint (unreadable: step 12 ({why}), step 8 ({why}), step 4 ({why})); "
                                  "point checkpoint.dir at a run's checkpoints")
    else:
        trainer = build_trainer(compose_config(*LONGER, f"checkpoint.dir={checkpoints}", "checkpoint.resume=true"))
        with pytest.raises(et.ConfigError) as error:
            trainer.fit()
        trainer.checkpointer.close()
        assert str(error.value).startswith(
            f"checkpoint.resume is set but {checkpoints} holds no complete, readable checkpoint (unreadable: step 12 (")
        one_sentence(str(error.value))
    assert checksums(checkpoints) == before


def test_corrupt_orbax_step_metadata_is_not_needed_and_is_left_alone(checkpoints):
    # Orbax reads only timestamps from it: the state and our metadata are whole, so the run resumes from step 12
    for step_dir in step_dirs(checkpoints):
        corrupt(step_dir, METADATA_FILES["orbax_step"])
    before = {p.name: checksums(p) for p in step_dirs(checkpoints)}
    trainer = build_trainer(compose_config(*LONGER, f"checkpoint.dir={checkpoints}", "checkpoint.resume=true",
                                           "checkpoint.max_to_keep=10"))
    state, report = trainer.fit()
    trainer.checkpointer.close()
    assert report["resumed_from"] == 12 and int(state.step) == 16
    assert {name: checksums(checkpoints / name) for name in before} == before


def test_corrupt_metadata_in_the_newest_checkpoint_only_resumes_from_the_one_before_and_keeps_it(checkpoints):
    corrupt(checkpoints / "12", METADATA_FILES["ours"])
    damaged = checksums(checkpoints / "12")
    intact = {step: checksums(checkpoints / step) for step in ("4", "8")}
    trainer = build_trainer(compose_config(*LONGER, f"checkpoint.dir={checkpoints}",
                                           "checkpoint.resume=true", "checkpoint.period=4", "checkpoint.max_to_keep=10"))
    with pytest.warns(et.CheckpointWarning) as warned:
        state, report = trainer.fit()  # trains steps 9 to 16, saving 12 and 16 on the way
    trainer.checkpointer.close()
    messages = [str(w.message) for w in warned]
    assert messages[0] == (f"the checkpoint of step 12 in {checkpoints} is unreadable (JSONDecodeError: Expecting "
                           "property name enclosed in double quotes: line 1 column 3 (char 2)); skipping it for the "
                           "one before.")
    assert messages[1] == (f"the unreadable checkpoint of step 12 was moved aside to {checkpoints}/12.unreadable, "
                           "untouched, to save step 12 anew.")
    assert report["resumed_from"] == 8 and int(state.step) == 16
    assert report["samples"] == {"consumed": 8 * 48, "duplicated": 0, "skipped": 0}
    assert checksums(checkpoints / "12.unreadable") == damaged  # kept, byte for byte
    assert {step: checksums(checkpoints / step) for step in ("4", "8")} == intact
    assert json.loads((checkpoints / "12" / "metadata" / "metadata").read_text())["step"] == 12


@pytest.mark.parametrize(("case", "message"), [
    (["seed=1"], "was trained with seed=0 and this run has seed=1, which changes the order of the samples;"),
    (["data.max_bytes=100000"], "was trained with num_samples=22222 and this run has num_samples=11111,"),
    (["~optimizer", "+optimizer._target_=optax.sgd", "+optimizer.learning_rate=0.1"],
     "holds another model's state (opt_state."),
])
def test_checkpoints_of_another_data_order_or_optimizer_are_refused(checkpoints, case, message):
    before = checksums(checkpoints)
    trainer = build_trainer(compose_config(*overrides(*case, base=LONGER),
                                           f"checkpoint.dir={checkpoints}", "checkpoint.resume=true"))
    with pytest.raises(et.ConfigError) as error:
        trainer.fit()
    trainer.checkpointer.close()
    assert str(error.value).startswith(f"the checkpoint of step 12 in {checkpoints} ")
    assert message in str(error.value)
    one_sentence(str(error.value))
    assert checksums(checkpoints) == before


# ------------------------------------------------------------------ plugins that fail to import


def broken_plugin_site(directory: Path) -> Path:
    """A directory that, on PYTHONPATH, installs an entry-point plugin whose module does not exist."""
    dist_info = directory / "broken_plugin-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[elastic_trainer]\nbroken = broken_plugin_that_is_not_there\n")
    return directory


def test_a_plugin_that_fails_to_import_is_named_and_touches_no_checkpoint(checkpoints, tmp_path):
    site = broken_plugin_site(tmp_path / "site")
    before = checksums(checkpoints)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "ELASTIC_TRAINER_LOAD_PLUGINS": "broken"}
    result = resume_cli(checkpoints, tmp_path / "run", env={**env, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": ""})
    assert_fails_with(result, "plugin 'broken' (broken_plugin_that_is_not_there) failed to import: No module named "
                              "'broken_plugin_that_is_not_there'; fix or uninstall it")
    assert checksums(checkpoints) == before


@pytest.mark.parametrize("case", [[], ["cluster.health_checker=pathwaysutils.elastic.elastic:DefaultSliceHealthChecker"]],
                         ids=["default", "health_checker"])
def test_pathways_without_pathwaysutils_says_how_to_install_it(monkeypatch, case):
    for module in ("pathwaysutils", "pathwaysutils.elastic", "pathwaysutils.elastic.elastic"):
        monkeypatch.setitem(sys.modules, module, None)  # as if the `pathways` extra were not installed
    with pytest.raises(et.ConfigError) as error:
        build_trainer(compose_config(*TINY, "cluster=pathways", *case))
    assert str(error.value).startswith("cluster=pathways needs pathwaysutils (")
    assert str(error.value).endswith("; install it with pip install 'elastic-trainer[pathways]'.")
    one_sentence(str(error.value))


def test_a_strategy_whose_module_fails_to_import_is_one_sentence():
    with pytest.raises(et.ConfigError) as error:
        build_trainer(compose_config(*TINY, "+strategy=scale_down", "strategy._target_=no_such_package.Strategy"))
    assert str(error.value) == ("could not build strategy from its config (no_such_package.Strategy): "
                                "ModuleNotFoundError: No module named 'no_such_package'.")
    one_sentence(str(error.value))
