"""Preemption: a real SIGTERM or Ctrl-C (os.kill) sent to a running command-line run stops it at a step
boundary with a checkpoint of that step and one sentence; a resume from it loses no step and ends as a run
without the signal does (and a resume tried while the run runs is refused: its lock). In-process: the
configured signal, and the stop signals' exit statuses."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_bad_input import one_sentence
from test_cli import run_cli
from test_cli_recovery import TINY
from test_config import train_in_process

import elastic_trainer as et
from elastic_trainer._preemption import exit_status, parse_signal, stop_signals
from elastic_trainer.launch._launcher import _job_status as launcher_status
from elastic_trainer.launch._supervisor import restart_until_done

# a long run whose training does not depend on trainer.steps (a fixed decay), so that it can be stopped
# anywhere and resumed to any step, and compared with a run of that many steps
LONG = [o for o in TINY if not o.startswith("trainer.steps=")] + [
    "trainer.steps=100000", "optimizer.learning_rate.decay_steps=1000", "checkpoint.period=5"]
SENTENCE = re.compile(r"elastic_trainer: stopped by (SIG\w+) after step (\d+), saved as a checkpoint in "
                      r"(\S+); continue with checkpoint\.resume=true\.")


def start_cli(*args):
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.Popen([sys.executable, "-m", "elastic_trainer", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop_mid_run(run_dir, signum, *, meanwhile=lambda pid: None):
    """Run LONG in ``run_dir``; once its checkpoint of step 5 is committed, call ``meanwhile(pid)`` and send
    ``signum``; its exit status, stderr and report."""
    process = start_cli(*LONG, f"hydra.run.dir={run_dir}")
    while not (run_dir / "checkpoints" / "5").is_dir():  # Orbax renames a step's folder to "5" once committed
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.05)
    meanwhile(process.pid)
    os.kill(process.pid, signum)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr, json.loads((run_dir / "report.json").read_text())


def committed_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_sigterm_saves_the_last_step_and_a_resume_ends_as_a_run_without_it(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"

    def resume_meanwhile(pid):  # refused before any work: the run holds checkpoint.dir
        refused = run_cli(*TINY, f"checkpoint.dir={checkpoints}", "checkpoint.resume=true",
                          f"hydra.run.dir={tmp_path / 'refused'}", timeout=120)
        assert refused.returncode == 2, refused.stderr
        message = refused.stderr.strip().splitlines()[-1].removeprefix("elastic_trainer: error: ")
        assert message.startswith(f"checkpoint.dir {checkpoints} is in use by another run (process {pid} on "
                                  f"{socket.gethostname()}, since ")
        assert message.endswith("); wait for that run to end or stop it, or give this run another directory.")
        one_sentence(message)
        assert not (tmp_path / "refused" / "report.json").exists()

    status, stderr, report = stop_mid_run(tmp_path / "run", signal.SIGTERM, meanwhile=resume_meanwhile)
    assert status == 143, stderr
    last_line = stderr.strip().splitlines()[-1]
    name, step, directory = SENTENCE.fullmatch(last_line).groups()
    step = int(step)
    assert (name, directory) == ("SIGTERM", str(tmp_path / "run" / "checkpoints"))
    one_sentence(last_line.removeprefix("elastic_trainer: "))
    assert report["steps_completed"] == step and report["stopped"] == last_line.removeprefix("elastic_trainer: ")
    assert committed_steps(tmp_path / "run" / "checkpoints")[-1] == step
    assert report["samples"]["duplicated"] == report["samples"]["skipped"] == 0

    end = step + 3  # the resume trains 3 more steps, the reference run all of them (in-process, cheaper)
    steps = [o if not o.startswith("trainer.steps=") else f"trainer.steps={end}" for o in LONG]
    after, expected = (
        train_in_process(*steps, f"checkpoint.dir={directory}", *resume)
        for directory, resume in [(checkpoints, ["checkpoint.resume=true"]), (tmp_path / "reference", [])])
    assert (after["resumed_from"], after["steps_completed"]) == (step, end)  # 0 steps lost
    assert after["final_loss"] == pytest.approx(expected["final_loss"], rel=1e-6)
    assert expected["samples"] == {"consumed": end * 48, "duplicated": 0, "skipped": 0}


def test_ctrl_c_saves_the_last_step_with_no_traceback(tmp_path):
    status, stderr, report = stop_mid_run(tmp_path, signal.SIGINT)
    assert status == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    name, step, _ = SENTENCE.fullmatch(stderr.strip().splitlines()[-1]).groups()
    assert name == "SIGINT" and committed_steps(tmp_path / "checkpoints")[-1] == int(step) == report["steps_completed"]


def test_the_configured_signal_stops_a_run_in_process_at_a_step_boundary(tiny_trainer_kwargs, tmp_path):
    stopped_at = []

    class SendSignal:
        @et.hookimpl
        def et_step_end(self, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # handled at the boundary after step 2: step 3 never starts
            stopped_at.append(step)

    trainer = et.Trainer(**tiny_trainer_kwargs(steps=6, plugins=[SendSignal()], preemption_signal="USR1",
                                               checkpointer=et.Checkpointer(tmp_path, period=4)))
    try:
        with pytest.raises(et.Preempted) as preempted:
            trainer.fit()
    finally:
        trainer.checkpointer.close()
    assert stopped_at == [1, 2] and preempted.value.exit_status == 128 + signal.SIGUSR1
    assert str(preempted.value).startswith("stopped by SIGUSR1 after step 2, saved as a checkpoint in")
    assert committed_steps(tmp_path) == [2] and preempted.value.report["steps_completed"] == 2
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handlers are gone with the run


def test_stop_signals_and_their_exit_statuses():
    assert stop_signals() == (signal.SIGTERM, signal.SIGINT)
    assert stop_signals("SIGUSR1")[-1] == stop_signals(10)[-1] == parse_signal("usr1") == signal.SIGUSR1
    assert (exit_status(signal.SIGTERM), exit_status(signal.SIGINT)) == (143, 130)
    for bad, message in [("SIGFOO", "trainer.preemption_signal 'SIGFOO' is not a signal"),
                         ("KILL", "trainer.preemption_signal SIGKILL cannot be caught")]:
        with pytest.raises(et.ConfigError, match=message) as error:
            stop_signals(bad)
        one_sentence(str(error.value))


@pytest.mark.parametrize(("codes", "trained", "status"), [
    ([143, 143, 0], [0, 1], 143),  # preempted with a spare never taken in, which ended 0 ("not needed")
    ([1, 1, 0], [0, 1], 1),  # stopped for a reason of the job's, the same spare
    ([-signal.SIGKILL, 0, 0], [0, 1, 2], 0),  # process 0 lost, the spare took its place and finished
    ([0, 1], [0, 1], 0),  # a lost slice's partner left the job (1), the other finished
])
def test_the_job_status_comes_from_the_processes_that_trained(codes, trained, status):
    assert launcher_status(codes, trained=trained) == status


@pytest.mark.parametrize("codes", [[-signal.SIGTERM, 3], [3, -signal.SIGTERM], [143, 3]])
def test_a_job_stopped_by_a_signal_ends_with_its_status_whatever_its_processes_said(tmp_path, codes):
    # A SIGTERM that reaches one process while it still starts (before it handles signals) kills it; the other
    # then fails for the loss (3). The job was stopped all the same: 143, not 3, and no attempt follows.
    attempts = []

    def run_attempt(overrides, attempt, stop):
        attempts.append(attempt)
        os.kill(os.getpid(), signal.SIGTERM)  # the stop request's handler notes it
        return launcher_status(codes, trained=range(len(codes))), False

    status = restart_until_done(
        run_attempt, overrides=[], run_dir=tmp_path, max_restarts=3, started_at=time.time(),
        restarting="all processes", giving_up="the group", stop_signals=[signal.SIGTERM],
    )
    assert (status, attempts) == (143, [0])
