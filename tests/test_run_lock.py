"""One run per directory: a second run on a checkpoint directory in use is refused before any work, with one
sentence naming the owner, and the first finishes with only its own checkpoints (the command line's exit 2
for a resume refused so is in test_preemption.py, while the run it tries to resume runs); a lock left by a
killed owner is taken over with a warning naming it; a job's children do not contend for their parent's lock."""

import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from test_bad_input import one_sentence

import elastic_trainer as et
from elastic_trainer._run_lock import HOLDER_ENV, LOCK_FILE, hold_run_locks


def contents(directory):
    """Every file under ``directory`` with its SHA-256, the lock's file left out."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def committed_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_finishes(tiny_trainer_kwargs, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    owner = f"process {os.getpid()} on {socket.gethostname()}, since "
    refused = {}

    class SecondRuns:
        """At step 3 of the first run, the checkpoint of step 2 committed, another run tries the directory."""

        @et.hookimpl
        def et_step_end(self, step):
            if step != 3:
                return
            trainer.checkpointer.wait()
            before = contents(checkpoints)
            second = et.Trainer(**tiny_trainer_kwargs(checkpointer=et.Checkpointer(checkpoints, period=2)))
            with pytest.raises(et.RunLockedError) as error:
                second.fit()
            second.checkpointer.close()
            refused["in_process"] = str(error.value)
            refused["untouched"] = contents(checkpoints) == before

    trainer = et.Trainer(**tiny_trainer_kwargs(steps=4, plugins=[SecondRuns()], run_dir=tmp_path / "first",
                                               checkpointer=et.Checkpointer(checkpoints, period=2)))
    try:
        report = trainer.fit().report
    finally:
        trainer.checkpointer.close()

    message = refused["in_process"]
    assert message.startswith(f"the checkpoint directory {checkpoints} is in use by another run ({owner}")
    assert message.endswith("); wait for that run to end or stop it, or give this run another directory.")
    one_sentence(message)
    assert refused["untouched"]
    assert report["steps_completed"] == 4 and committed_steps(checkpoints) == [2, 4]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]  # the lock's file went with the run


def test_a_lock_left_by_a_killed_owner_is_taken_over_with_a_warning(tiny_trainer_kwargs, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; from elastic_trainer._run_lock import DirectoryLock; "
                                "DirectoryLock(sys.argv[1], name='x').acquire(); print('locked', flush=True); "
                                "time.sleep(600)"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    with holder.stdout:
        assert holder.stdout.readline() == "locked\n"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=2, checkpointer=et.Checkpointer(tmp_path, period=2)))
    try:
        with pytest.warns(et.StaleLockWarning) as warned:
            trainer.fit()
    finally:
        trainer.checkpointer.close()
    (warning,) = warned
    assert str(warning.message).startswith(
        f"taking over the lock of the checkpoint directory {tmp_path} from process {holder.pid} on "
        f"{socket.gethostname()}, since ")
    assert committed_steps(tmp_path) == [2] and not (tmp_path / LOCK_FILE).exists()


def test_a_job_does_not_contend_for_the_locks_its_top_process_holds(tmp_path, monkeypatch):
    with hold_run_locks([(tmp_path, "the run directory")]):
        held = json.loads(os.environ[HOLDER_ENV])
        assert held == {"pid": os.getpid(), "dirs": [str(tmp_path.resolve())]}
        with hold_run_locks([(tmp_path / "checkpoints", "checkpoint.dir")]):  # inside the run directory: held
            assert not (tmp_path / "checkpoints").exists()
    assert HOLDER_ENV not in os.environ and not (tmp_path / LOCK_FILE).exists()
    monkeypatch.setenv(HOLDER_ENV, json.dumps({"pid": 1, "dirs": [str(tmp_path.resolve())]}))  # not this job
    with hold_run_locks([(tmp_path, "the run directory")]):
        assert (tmp_path / LOCK_FILE).exists()


def test_a_run_ended_by_an_error_lets_its_save_in_flight_end_before_the_lock_goes(tiny_trainer_kwargs, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpointer = et.Checkpointer(checkpoints, period=2)
    held_while_waiting = []
    wait = checkpointer.wait

    def wait_and_check_the_lock():
        with open(checkpoints / LOCK_FILE) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held_while_waiting.append(False)
                fcntl.flock(lock, fcntl.LOCK_UN)
            except BlockingIOError:
                held_while_waiting.append(True)
        return wait()

    class FailsAfterASave:
        """A plugin whose bug ends the run right after step 2's save started."""

        @et.hookimpl
        def et_after_checkpoint_save(self, step):
            if step == 2:
                raise RuntimeError("a plugin's bug")

    checkpointer.wait = wait_and_check_the_lock
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=6), checkpointer=checkpointer, plugins=[FailsAfterASave()])
    with pytest.raises(et.PluginError, match="a plugin's bug"):
        trainer.fit()
    assert held_while_waiting and all(held_while_waiting)  # the save of step 2 ended, then the lock went
    assert committed_steps(checkpoints) == [2] and not checkpointer.saving
