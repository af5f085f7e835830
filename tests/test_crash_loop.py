"""A run SIGKILLed again and again at random moments, each time resumed: it ends as a failure-free run ends.

Each kill lands wherever the run happens to be (in a step, in a save, in its
asynchronous commit, in start-up), a random moment after the run committed a
checkpoint newer than the one it resumed from, so every attempt makes progress.
"""

import os
import random
import signal
import subprocess
import sys
import time

from test_cli import TINY_MODEL, run_cli
from test_cli_recovery import report_of
from test_config import train_in_process
from test_fault_matrix import assert_same_arrays, saved_states, saved_steps


STEPS, PERIOD, BATCH = 30, 3, 48
RUN = [*TINY_MODEL, f"trainer.steps={STEPS}", f"checkpoint.period={PERIOD}", "checkpoint.max_to_keep=20"]
KILLS = 3


def _newest_step(checkpoints):
    return max(saved_steps(checkpoints), default=0) if checkpoints.exists() else 0


def _kill_after_progress(command, checkpoints, *, delay_s):
    """Start ``command``; SIGKILL it ``delay_s`` after it committed a checkpoint newer than those it found.
    Returns its exit status (0 if it finished first)."""
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    found = _newest_step(checkpoints)
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as training:
        deadline = time.monotonic() + 240
        while _newest_step(checkpoints) <= found and training.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay_s)
        if training.poll() is None:
            training.send_signal(signal.SIGKILL)
        return training.wait()


def test_random_sigkills_then_a_resume_end_where_a_failure_free_run_ends(tmp_path, tmp_path_factory):
    choose = random.Random(19)
    base = [sys.executable, "-m", "elastic_trainer", *RUN, f"hydra.run.dir={tmp_path}"]
    checkpoints = tmp_path / "checkpoints"
    codes = [_kill_after_progress(base if kill == 0 else [*base, "checkpoint.resume=true"], checkpoints,
                                  delay_s=choose.uniform(0.0, 0.4))
             for kill in range(KILLS)]
    assert codes.count(-signal.SIGKILL) >= 2, f"the run finished before it could be killed: {codes}"

    result = run_cli(*RUN, "checkpoint.resume=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = report_of(tmp_path)
    assert report["steps_completed"] == STEPS and report["data_position"] == STEPS * BATCH
    resumed_from = report["resumed_from"]
    assert report["samples"] == {"consumed": (STEPS - resumed_from) * BATCH, "duplicated": 0, "skipped": 0}

    reference = tmp_path_factory.mktemp("failure_free") / "checkpoints"
    train_in_process(*RUN, f"checkpoint.dir={reference}")
    expected, on_disk = saved_states(reference), saved_states(checkpoints)
    assert STEPS in on_disk
    for step in on_disk:  # every committed checkpoint, from any attempt, holds its step of the failure-free run
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")
