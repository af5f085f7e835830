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
from test_cli import TINY_MODEL, run_cli
from test_config import train_in_process


TINY = [*TINY_MODEL, "trainer.steps=20"]


def failure_at(step, slice_, down_for_s=1e9):
    return ["+chaos=schedule", f"chaos.failures=[{{at_step: {step}, slice: {slice_}, down_for_s: {down_for_s}}}]"]


def report_of(run_dir):
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def failure_free_dir(tmp_path_factory):
    """The run directory of :data:`TINY` without failures, trained in this process (the config the command line
    composes, on the same simulated cluster of 8 devices)."""
    run_dir = tmp_path_factory.mktemp("failure_free")
    train_in_process(*TINY, f"checkpoint.dir={run_dir / 'checkpoints'}")
    return run_dir


def saved_state(checkpoint_dir):
    """The arrays of a checkpoint, read with plain Orbax."""
    with ocp.CheckpointManager(checkpoint_dir) as manager:
        return manager.restore(manager.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore())).state


def save_under_way(directory, *, from_step: int) -> int | None:
    """The step of a save Orbax is writing in ``directory`` (its ``STEP.orbax-checkpoint-tmp``), ``from_step`` or
    later; None if there is none. A later one serves when the poll missed the first: a save takes milliseconds."""
    steps = [int(name.split(".")[0]) for name in (os.listdir(directory) if directory.is_dir() else ())
             if name.endswith(".orbax-checkpoint-tmp")]
    return next((step for step in sorted(steps) if step >= from_step), None)


def test_a_process_killed_during_a_save_resumes_from_the_previous_complete_checkpoint(tmp_path, failure_free_dir):
    command = [sys.executable, "-m", "elastic_trainer", *TINY, "checkpoint.period=2", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as training:
        deadline, killed_at = time.monotonic() + 240, None
        while killed_at is None and training.poll() is None and time.monotonic() < deadline:
            killed_at = save_under_way(tmp_path / "checkpoints", from_step=8)
            time.sleep(0.001)
        training.send_signal(signal.SIGKILL)
    in_progress = tmp_path / "checkpoints" / f"{killed_at}.orbax-checkpoint-tmp"  # Orbax renames it when done
    assert training.returncode == -signal.SIGKILL and in_progress.exists(), "the kill did not land during a save"
    assert not (tmp_path / "checkpoints" / str(killed_at)).exists()

    # resumed under the full_restart supervisor: the user's checkpoint.resume reaches its first worker
    result = run_cli(*TINY, "checkpoint.period=2", "checkpoint.resume=true", "+strategy=full_restart",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = report_of(tmp_path)
    complete = killed_at - 2  # the save before (checkpoint.period=2), committed before this one began
    assert report["resumed_from"] == complete and report["steps_completed"] == 20
    # the killed run's steps after the complete save were lost with it; the resumed run took each later sample once
    assert report["samples"] == {"consumed": (20 - complete) * 48, "duplicated": 0, "skipped": 0}
    assert report["data_position"] == 20 * 48
    resumed, uninterrupted = saved_state(tmp_path / "checkpoints"), saved_state(failure_free_dir / "checkpoints")
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_no_strategy_stops_and_names_the_option(tmp_path):
    result = run_cli(*TINY, *failure_at(5, 0), f"hydra.run.dir={tmp_path}")
    assert result.returncode == 3
    assert "select one with +strategy=NAME" in result.stderr
    assert report_of(tmp_path)["steps_completed"] == 5
