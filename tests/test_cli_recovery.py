"""Strategies from the command line, as a user runs them: real subprocesses, real restarts."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_cli import run_cli

TINY = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "data.max_bytes=200000", "trainer.steps=20"]


def failure_at(step, slice_, down_for_s=1e9):
    return ["+chaos=schedule", f"chaos.failures=[{{at_step: {step}, slice: {slice_}, down_for_s: {down_for_s}}}]"]


def report_of(run_dir):
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def failure_free_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("failure_free")
    result = run_cli(*TINY, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return run_dir


def saved_state(checkpoint_dir):
    """The arrays of a checkpoint, read with plain Orbax."""
    with ocp.CheckpointManager(checkpoint_dir) as manager:
        return manager.restore(manager.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore())).state


def test_a_process_killed_during_a_save_resumes_from_the_previous_complete_checkpoint(tmp_path, failure_free_dir):
    command = [sys.executable, "-m", "elastic_trainer", *TINY, "checkpoint.period=2", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    in_progress = tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp"  # Orbax writes here, then renames to 8
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as training:
        deadline = time.monotonic() + 240
        while not in_progress.exists() and training.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        training.send_signal(signal.SIGKILL)
    assert training.returncode == -signal.SIGKILL and in_progress.exists(), "the kill did not land during the save"
    assert not (tmp_path / "checkpoints" / "8").exists()

    # resumed under the full_restart supervisor: the user's checkpoint.resume reaches its first worker
    result = run_cli(*TINY, "checkpoint.period=2", "checkpoint.resume=true", "+strategy=full_restart",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = report_of(tmp_path)
    assert report["resumed_from"] == 6 and report["steps_completed"] == 20
    # the killed run's steps after 6 were lost with it; the resumed run took each later sample once
    assert report["samples"] == {"consumed": (20 - 6) * 48, "duplicated": 0, "skipped": 0}
    assert report["data_position"] == 20 * 48
    resumed, uninterrupted = saved_state(tmp_path / "checkpoints"), saved_state(failure_free_dir / "checkpoints")
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_no_strategy_stops_and_names_the_option(tmp_path):
    result = run_cli(*TINY, *failure_at(5, 0), f"hydra.run.dir={tmp_path}")
    assert result.returncode == 3
    assert "select one with +strategy=NAME" in result.stderr
    assert report_of(tmp_path)["steps_completed"] == 5
