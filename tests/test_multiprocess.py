"""cluster=multiprocess from the command line: real JAX processes, really killed.

Each run starts several interpreters on a tiny model, so there are few of them;
the fault matrix (tests/test_fault_matrix.py) runs more, one per strategy.
Every test checks that no process it started outlives it.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_cli import TINY_MODEL, run_cli
from test_config import train_in_process
from test_fault_matrix import (CLI_TINY, GLOO_ABORT, assert_same_arrays, processes, processes_of,
                               reference_checkpoints, reference_states, saved_states)

from elastic_trainer.launch._launcher import free_port

THREE = processes(3)
HANG_GUARD_S = 300
"""How long a test waits for processes to start or end before it calls that a hang: long enough for a machine
loaded many times over (one run under load 30 took over 30 s to end two workers on SIGTERM)."""


@pytest.fixture
def run_dir(tmp_path):
    """The run's directory; after the test, no process of the run may be left (they are killed if they are)."""
    yield tmp_path
    deadline = time.monotonic() + HANG_GUARD_S  # a process killed at the very end may take a moment to be reaped
    while processes_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_of(tmp_path)
    for process in left:
        process.kill()
    assert not left, f"orphan processes left behind: {[p.info['cmdline'] for p in left]}"


def run_job(run_dir, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m elastic_trainer ARGS`` with ``run_dir`` as its run directory; emptied and run once more only if
    gloo itself aborted a process (see GLOO_ABORT), as the fault matrix's command-line cells do."""
    for attempt in range(2):
        if attempt:
            shutil.rmtree(run_dir)
            run_dir.mkdir()
        result = run_cli(*args, f"hydra.run.dir={run_dir}", **kwargs)
        if GLOO_ABORT not in result.stderr:
            break
    return result


def report_of(run_dir):
    return json.loads((run_dir / "report.json").read_text())


def slices_lost(report: dict) -> list[dict]:
    """The report's failures that lost slices: on a busy machine a slow peer can also time a collective out, and
    that step is retried with no slice lost."""
    return [failure for failure in report["failures"] if failure["slices"]]


def test_scale_down_survives_a_stuck_process_and_a_kill_between_agreement_and_save(run_dir):
    """Process 2 stuck at step 4 (killed, lost); then process 1 killed at step 6 after the processes agreed on who
    lives and before the save (chaos's checkpoint_save phase): process 0 waits at Orbax's barrier of that save,
    which a dead process never fails, for cluster.barrier_timeout_s, not Orbax's 300 s; the save is discarded and
    the loss recovered from like any other."""
    step_timeout_s, barrier_timeout_s = 12, 8
    result = run_job(
        run_dir, *CLI_TINY, *THREE, f"trainer.step_timeout_s={step_timeout_s}",
        f"cluster.barrier_timeout_s={barrier_timeout_s}",
        "+strategy=scale_down", "+chaos=schedule",
        "chaos.failures=[{at_step: 4, slice: 2, hang: true}, {at_step: 6, slice: 1, phase: checkpoint_save}]",
    )
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    assert report["steps_completed"] == 12
    assert report["cluster"]["kind"] == "multiprocess" and report["cluster"]["processes"] == 3
    stuck, killed = slices_lost(report)
    assert (stuck["step"], stuck["slices"], stuck["kind"]) == (4, [2], "slice_hung")
    assert (killed["step"], killed["slices"], killed["kind"], killed["phase"]) == (6, [1], "slice_lost",
                                                                                   "checkpoint_save")
    for failure, slices_after in ((stuck, 2), (killed, 1)):
        assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("replica", 0, slices_after)
    # The survivor waited at the save's barrier for cluster.barrier_timeout_s, not Orbax's 300 s (detection_s
    # holds that wait; how long it takes is benchmarks' business, the bound only tells the two apart), and went
    # on with the one-slice layout compiled ahead after the first recovery (its compile was asked for then)
    assert killed["detection_s"] < 300
    assert killed["compile_cached"] is True
    assert report["samples"] == {"consumed": 12 * 48, "duplicated": 0, "skipped": 0}
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, -signal.SIGKILL, -signal.SIGKILL]
    # Saves go on after each loss: step 3 by all 3 processes, 9 and 12 by process 0 alone; step 6's was
    # discarded (process 1 died as it began).
    on_disk = saved_states(run_dir / "checkpoints")
    assert set(on_disk) == {3, 9, 12}
    # each holds the state of its step in a failure-free run (in this process, as many slices and devices)
    expected = reference_states(reference_checkpoints(THREE))
    for step in on_disk:
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")


@pytest.mark.slow  # python -m pytest -m slow
def test_scale_down_drops_a_slow_process_found_a_straggler_and_goes_on_without_it(run_dir):
    """Process 1 of 2 slowed 3 times from step 2 (it really takes that long, after its part of each step): found a
    straggler from the times the processes exchange, within trainer.straggler_steps steps; scale_down drops it at
    that step boundary once the save under way has committed, its process leaves the job, and process 0 goes on
    alone, with every checkpoint the failure-free run's."""
    result = run_job(run_dir, *CLI_TINY, *processes(2), "trainer.straggler_steps=3", "+strategy=scale_down",
                     "strategy.drop_stragglers=true", "+chaos=schedule",
                     "chaos.failures=[{at_step: 1, slice: 1, slow: 3}]")
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    assert report["steps_completed"] == 12 and slices_lost(report) == []
    [straggler] = report["stragglers"]
    # which step is first seen slow depends on how busy the cores are (step 3 in one CI run, beside another test's
    # processes), never before the slowing began
    assert straggler["slice"] == 1 and straggler["slow_since_step"] >= 2
    assert straggler["ratio"] > 2 and straggler["recovered_at_step"] is None
    detected = straggler["detected_at_step"]
    assert [(r["step"], r["reason"], r["slices"]) for r in report["resizes"]] == [(detected, "dropped", [0])]
    assert report["samples"] == {"consumed": 12 * 48, "duplicated": 0, "skipped": 0}
    (attempt,) = report["process_exits"]
    # it left as a lost slice's live processes leave; its replacement waited to be wanted back (after
    # strategy.drop_for_steps, 20) until the job ended, and ended saying so
    assert attempt["exit_codes"] == [0, 1] and attempt["replaced_exit_codes"] == [[], [-signal.SIGKILL]]
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events.index("straggler") < events.index("resize")
    on_disk = saved_states(run_dir / "checkpoints")
    expected = reference_states(reference_checkpoints(processes(2)))
    assert set(on_disk) == {3, 6, 9, 12}  # step 3's by both processes, the later ones by process 0 alone
    for step in on_disk:
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_launcher_ended_by_a_signal_takes_every_worker_with_it(run_dir, signum):
    """1 process and a spare: a SIGTERM stops the job (143, not the 0 of the spare that was not needed), a SIGKILL
    takes every process with the launcher."""
    command = [sys.executable, "-m", "elastic_trainer", *TINY_MODEL, "cluster=multiprocess", "cluster.num_processes=1",
               "cluster.spare_slices=1", "+strategy=hot_swap", "trainer.steps=1000", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as launcher:
        started = [run_dir / f"process{i}" / ".hydra" for i in range(2)]  # the workers run their Hydra job
        deadline = time.monotonic() + HANG_GUARD_S
        while not all(path.exists() for path in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(processes_of(run_dir)) == 3, "the launcher did not start its 2 workers"
        time.sleep(0.5)
        launcher.send_signal(signum)
        assert launcher.wait(timeout=HANG_GUARD_S) == (143 if signum == signal.SIGTERM else -signal.SIGKILL)
    deadline = time.monotonic() + HANG_GUARD_S  # SIGKILL: the kernel kills the workers (PR_SET_PDEATHSIG)
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_of(run_dir)


def test_sigterm_to_the_full_restart_supervisor_kills_its_worker(run_dir):
    command = [sys.executable, "-m", "elastic_trainer", *TINY_MODEL, "trainer.steps=1000", "+strategy=full_restart",
               f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as supervisor:
        deadline = time.monotonic() + HANG_GUARD_S
        while len(processes_of(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(processes_of(run_dir)) == 2, "the supervisor did not start its worker"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=HANG_GUARD_S) == 143
    assert not processes_of(run_dir)


def run_like_srun(job_dir, overrides: list[str], tasks: int = 4) -> tuple[list[int], list[str]]:
    """The coordinator as a task of its own, then ``tasks`` tasks of ``python -m elastic_trainer`` with
    ``overrides``, started as srun starts them (every task on node 127.0.0.1); each task's exit status and
    standard error."""
    port = free_port()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": str(tasks),
             "SLURM_STEP_NUM_NODES": "1", "JAX_COORDINATOR_PORT": str(port)}
    env = {**os.environ, **slurm, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "elastic_trainer", *overrides]
    with subprocess.Popen([sys.executable, "-m", "elastic_trainer.coordinator", "--num-processes", str(tasks),
                           "--port", str(port), "--heartbeat-timeout-s", "3"]) as coordinator:
        started = [subprocess.Popen([*command, f"hydra.run.dir={job_dir / f'task{i}'}"],
                                    env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(tasks)]
        errors = [task.communicate(timeout=300)[1] for task in started]
        coordinator.terminate()
        assert coordinator.wait(timeout=HANG_GUARD_S) == 0
    return [task.returncode for task in started], errors


def test_a_job_started_the_way_srun_starts_it_loses_task_0_and_its_slice_goes_down_whole(run_dir):
    """cluster.launcher=none under a simulated Slurm allocation, as the sbatch script of docs/multiprocess.md runs it: the
    coordinator (python -m elastic_trainer.coordinator) as a task of its own, then 4 tasks started as srun starts
    them (the SLURM_* variables JAX's cluster detection reads, every task on node 127.0.0.1,
    JAX_COORDINATOR_PORT naming the coordinator's port), no launcher of ours, 2 slices of 2 processes of 1
    device (cluster.processes_per_slice=2). Task 0 alone is SIGKILLed during step 10 (chaos): its partner, task
    1, leaves the job with it, and tasks 2 and 3 finish on slice 1 with every invariant of the fault matrix."""
    for attempt in range(2):  # once more only if gloo itself aborted a process (see GLOO_ABORT)
        job_dir = run_dir / f"job{attempt}"
        checkpoints = job_dir / "checkpoints"
        exits, errors = run_like_srun(job_dir, [
            *CLI_TINY, *processes(4), "cluster.processes_per_slice=2", "cluster.devices_per_process=1",
            "cluster.launcher=none", "+strategy=scale_down", "+chaos=schedule",
            "chaos.failures=[{at_step: 9, slice: 0, process: 0}]", f"checkpoint.dir={checkpoints}"])
        if not any(GLOO_ABORT in error for error in errors):
            break
    assert exits == [-signal.SIGKILL, -signal.SIGKILL, 0, 0], [error[-2000:] for error in errors]
    assert "process 1 leaves the job: DATA_LOSS: process(es) [0] of slice(s) [0] died" in errors[1]
    report = report_of(job_dir / "task2")
    assert report["steps_completed"] == 12 and report["cluster"]["processes"] == 4
    assert (report["cluster"]["slices"], report["cluster"]["processes_per_slice"]) == (2, 2)
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["slices"], failure["processes"], failure["kind"]) == (9, [0], [0, 1], "slice_lost")
    assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("replica", 0, 1)
    assert report["samples"] == {"consumed": 12 * 48, "duplicated": 0, "skipped": 0}
    on_disk = saved_states(checkpoints)  # step 9's save was under way when task 0 died: on disk if it completed
    assert {3, 6, 12} <= set(on_disk) <= {3, 6, 9, 12}
    expected = reference_states(reference_checkpoints(processes(2)))  # 2 slices of 2 devices
    for step in on_disk:
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")


def events_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_pause_resume_waits_for_the_replacement_of_a_killed_process_which_gets_its_state_from_a_peer(run_dir):
    """Process 1 of 2 killed during step 6 and back 1 s later (chaos's down_for_s: the launcher starts a
    replacement with the same process id once the survivor has found the death): pause_resume waits for it
    instead of re-forming the job. The survivor and the replacement start a new backend together, the
    replacement gets the state of step 5 from the survivor (no checkpoint read), and both go on to step 12:
    process 0 is never restarted, and every checkpoint holds the failure-free state of its step."""
    result = run_job(run_dir, *CLI_TINY, *processes(2), "+strategy=pause_resume", "+chaos=schedule",
                     "chaos.failures=[{at_step: 5, slice: 1, down_for_s: 1}]")
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    assert report["steps_completed"] == 12 and report.get("workers", 1) == 1
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["slices"], failure["action"]) == (5, [1], "pause_resume")
    assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("replica", 0, 2)
    assert "regrouped" not in failure
    assert [(r["step"], r["reason"], r["slices"], r.get("state_from_peer")) for r in report["resizes"]] == [
        (5, "failure", [0], None), (5, "rejoined", [0, 1], [1])]
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, 0]
    assert len(attempt["pids"][0]) == 1, "process 0 was restarted"
    assert len(attempt["pids"][1]) == 2 and attempt["replaced_exit_codes"] == [[], [-signal.SIGKILL]]
    assert report["samples"] == {"consumed": 12 * 48, "duplicated": 0, "skipped": 0}
    # the only restore is the survivor's, from its own replica; the replacement restored nothing
    assert [(e["step"], e["source"]) for e in events_of(run_dir) if e["event"] == "restore"] == [(5, "replica")]
    replacement = json.loads((run_dir / "process1" / "report.attempt0.json").read_text())
    assert replacement["resumed_from"] is None and replacement["samples"]["consumed"] == (12 - 5) * 48
    on_disk = saved_states(run_dir / "checkpoints")
    assert set(on_disk) == {3, 6, 9, 12}  # 6, 9 and 12 saved by both processes again
    expected = reference_states(reference_checkpoints(processes(2)))
    for step in on_disk:
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")


def assert_lost_at_20_and_taken_back(report: dict, *, lost: int, slices: int, steps: int, batch: int) -> None:
    """Slice ``lost`` of ``slices`` (a process each) lost at step 20, the others going on at once from a replica,
    and its replacement taken back in before the end with its state from a peer: no step lost, every sample once,
    no other process restarted."""
    assert report["steps_completed"] == steps
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["slices"], failure["restored_from"], failure["lost_steps"]) == (20, [lost], "replica", 0)
    (shrink, grow) = report["resizes"]
    assert (shrink["step"], shrink["reason"], shrink["slices"]) == (20, "failure", [s for s in range(slices) if s != lost])
    assert (grow["reason"], grow["slices"], grow["state_from_peer"]) == ("rejoined", list(range(slices)), [lost])
    assert 20 < grow["step"] < steps, "the replacement came back after the run ended"
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0] * slices
    assert attempt["replaced_exit_codes"] == [[-signal.SIGKILL] if p == lost else [] for p in range(slices)]
    assert report["samples"] == {"consumed": steps * batch, "duplicated": 0, "skipped": 0}


def assert_ends_as_failure_free(run_dir, overrides: list[str], tmp_path_factory) -> None:
    """The run's one checkpoint, its last step's, holds the state a failure-free run of ``overrides`` on a
    simulated cluster ends with (trained in this process)."""
    directory = tmp_path_factory.mktemp("failure_free") / "checkpoints"
    report = train_in_process(*overrides, f"checkpoint.dir={directory}")
    (final,) = saved_states(run_dir / "checkpoints").values()
    assert_same_arrays(final, saved_states(directory)[report["steps_completed"]], "the final state")


REJOIN_STEPS = 300


@pytest.mark.slow  # python -m pytest -m slow
def test_scale_down_takes_a_returning_process_back_in_and_ends_with_the_failure_free_state(run_dir, tmp_path_factory):
    """3 processes, process 1 killed at step 20 and back after 10 s: scale_down goes on with 2 at once, and takes
    the replacement back in at the step boundary after it asked (3 -> 2 -> 3), its state from a peer; the final
    parameters equal a failure-free run's on 3 slices (rtol 1e-5), every sample once."""
    steps = [f"trainer.steps={REJOIN_STEPS}", f"checkpoint.period={REJOIN_STEPS}"]
    result = run_job(run_dir, *CLI_TINY, *steps, *THREE, "+strategy=scale_down", "+chaos=schedule",
                     "chaos.failures=[{at_step: 20, slice: 1, down_for_s: 10}]")
    assert result.returncode == 0, result.stderr
    assert_lost_at_20_and_taken_back(report_of(run_dir), lost=1, slices=3, steps=REJOIN_STEPS, batch=48)
    assert_ends_as_failure_free(run_dir, [*CLI_TINY, *steps, "cluster.slices=3"], tmp_path_factory)


SPARE_STEPS = 40


@pytest.mark.slow  # python -m pytest -m slow
def test_a_spare_process_takes_a_killed_ones_place_with_its_state_from_a_peer(run_dir, tmp_path_factory):
    """3 processes and a spare (process 3, started with the job and waiting), process 1 SIGKILLed for good at step
    20: hot_swap takes the spare in at once with its state from a peer, 0 steps lost, and the job finishes at 3
    slices with the parameters of a failure-free 3-slice run (rtol 1e-5), every sample once, no process
    restarted."""
    steps = [f"trainer.steps={SPARE_STEPS}", f"checkpoint.period={SPARE_STEPS}"]
    result = run_job(run_dir, *CLI_TINY, *steps, *THREE, "cluster.spare_slices=1", "+strategy=hot_swap",
                     "+chaos=schedule", "chaos.failures=[{at_step: 20, slice: 1}]")
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    assert report["steps_completed"] == SPARE_STEPS and report["cluster"]["spare_slices"] == 1
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["slices"], failure["action"]) == (20, [1], "hot_swap")
    assert (failure["restored_from"], failure["lost_steps"], failure["slices_after"]) == ("replica", 0, 3)
    assert (failure["spares_taken"], failure["spares_left"]) == ([3], 0)
    assert [(r["step"], r["reason"], r["slices"], r.get("state_from_peer")) for r in report["resizes"]] == [
        (20, "failure", [0, 2], None), (20, "rejoined", [0, 2, 3], [3])]
    assert report["spares"] == {"in_use": [3], "left": 0}
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, -signal.SIGKILL, 0, 0]
    assert attempt["replaced_exit_codes"] == [[], [], [], []] and all(len(pids) == 1 for pids in attempt["pids"])
    assert report["samples"] == {"consumed": SPARE_STEPS * 48, "duplicated": 0, "skipped": 0}
    spare = json.loads((run_dir / "process3" / "report.attempt0.json").read_text())
    assert spare["resumed_from"] is None and spare["samples"]["consumed"] == (SPARE_STEPS - 20) * 48
    assert_ends_as_failure_free(run_dir, [*CLI_TINY, *steps, "cluster.slices=3"], tmp_path_factory)


EIGHT_STEPS = 120


@pytest.mark.slow  # python -m pytest -m slow
def test_eight_processes_lose_one_go_on_with_seven_and_take_its_replacement_back(run_dir, tmp_path_factory):
    """8 processes of 1 device, process 3 killed at step 20 and back after 1 s: scale_down goes on with 7 at once
    (a global batch of 56 divides over 7 and 8 devices), takes the replacement back in (8 -> 7 -> 8), its state
    from a peer, and ends with the parameters of a failure-free 8-slice run (rtol 1e-5), every sample once."""
    steps = [f"trainer.steps={EIGHT_STEPS}", f"checkpoint.period={EIGHT_STEPS}", "trainer.global_batch_size=56"]
    # 8 processes share 2 cores, each compiling its layouts ahead in the background: a peer can be late for the
    # first step's collectives by more than processes()' 6 s (seen in CI beside another slow test)
    eight = [*processes(8), "cluster.devices_per_process=1", "cluster.collective_timeout_s=30",
             "cluster.barrier_timeout_s=120", "strategy.min_slice_count=7"]
    result = run_job(run_dir, *CLI_TINY, *steps, *eight, "+strategy=scale_down", "+chaos=schedule",
                     "chaos.failures=[{at_step: 20, slice: 3, down_for_s: 1}]",
                     timeout=3 * HANG_GUARD_S)
    assert result.returncode == 0, result.stderr
    assert_lost_at_20_and_taken_back(report_of(run_dir), lost=3, slices=8, steps=EIGHT_STEPS, batch=56)
    assert_ends_as_failure_free(run_dir, [*CLI_TINY, *steps, "cluster.slices=8", "cluster.devices_per_slice=1"],
                                tmp_path_factory)


@pytest.mark.slow  # python -m pytest -m slow
def test_a_slice_of_two_processes_comes_back_whole_under_pause_resume(run_dir):
    """2 slices of 2 processes (1 device each): process 2 killed during step 6 and back after 1 s; its partner,
    process 3, leaves with it and comes back with it. pause_resume takes both replacements in, their state from
    slice 0, and every checkpoint holds the failure-free state of its step."""
    cluster = [*processes(4), "cluster.processes_per_slice=2", "cluster.devices_per_process=1"]
    result = run_job(run_dir, *CLI_TINY, *cluster, "+strategy=pause_resume", "+chaos=schedule",
                     "chaos.failures=[{at_step: 5, slice: 1, process: 0, down_for_s: 1}]")
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    (failure,) = slices_lost(report)
    assert (failure["slices"], failure["processes"], failure["restored_from"], failure["lost_steps"]) == \
        ([1], [2, 3], "replica", 0)
    assert [(r["reason"], r["slices"], r.get("state_from_peer")) for r in report["resizes"]] == [
        ("failure", [0], None), ("rejoined", [0, 1], [2, 3])]
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, 0, 0, 0]
    # Process 3 leaves with its slice (SIGKILL), unless gloo aborted it first in the collective its peer died in
    # (SIGABRT, once in CI): the survivors then note its return for it (Rejoin._slice_due_back), so it is replaced
    # either way, and the rejoin above took both in.
    killed, partner = attempt["replaced_exit_codes"][2:]
    assert attempt["replaced_exit_codes"][:2] == [[], []] and killed == [-signal.SIGKILL]
    assert partner in ([-signal.SIGKILL], [-signal.SIGABRT]), result.stderr[-3000:]
    assert report["samples"] == {"consumed": 12 * 48, "duplicated": 0, "skipped": 0}
    on_disk = saved_states(run_dir / "checkpoints")
    assert set(on_disk) == {3, 6, 9, 12}
    expected = reference_states(reference_checkpoints(processes(2)))  # 2 slices of 2 devices
    for step in on_disk:
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")


@pytest.mark.slow  # python -m pytest -m slow
def test_a_dropped_straggler_comes_back_as_a_replacement_after_drop_for_steps(run_dir, tmp_path_factory):
    """Process 1 of 2 slowed 3 times: dropped as a straggler, its process leaves and its replacement starts at
    once; scale_down takes it back in once strategy.drop_for_steps have passed and it asked, its state from
    process 0. It is not slow (the slowness was the old process's), so it stays; the final state is the
    failure-free run's."""
    steps = ["trainer.steps=150", "checkpoint.period=150"]
    result = run_job(run_dir, *CLI_TINY, *steps, *processes(2), "trainer.straggler_steps=3", "+strategy=scale_down",
                     "strategy.drop_stragglers=true", "strategy.drop_for_steps=5", "+chaos=schedule",
                     "chaos.failures=[{at_step: 1, slice: 1, slow: 3}]")
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    assert report["steps_completed"] == 150 and slices_lost(report) == []
    (drop, back) = report["resizes"]
    assert (drop["reason"], drop["slices"]) == ("dropped", [0])
    assert (back["reason"], back["slices"], back["state_from_peer"]) == ("rejoined", [0, 1], [1])
    assert drop["step"] + 5 <= back["step"] < 150
    [straggler] = report["stragglers"]
    assert straggler["recovered_at_step"] is not None
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, 0] and attempt["replaced_exit_codes"] == [[], [-signal.SIGKILL]]
    assert report["samples"] == {"consumed": 150 * 48, "duplicated": 0, "skipped": 0}
    assert_ends_as_failure_free(run_dir, [*CLI_TINY, *steps, "cluster.slices=2"], tmp_path_factory)


DILOCO_STEPS, INNER_STEPS = 300, 10


def diloco_run(run_dir, steps: int, *overrides: str) -> dict:
    """3 processes under diloco (H=10) for ``steps`` steps with ``overrides``: the report of a run that finished."""
    result = run_job(run_dir, *TINY_MODEL, f"trainer.steps={steps}", f"checkpoint.period={steps}", *THREE,
                     "+strategy=diloco", f"strategy.inner_steps={INNER_STEPS}", *overrides)
    assert result.returncode == 0, result.stderr
    report = report_of(run_dir)
    assert report["steps_completed"] == steps
    return report


@pytest.mark.slow  # python -m pytest -m slow
def test_diloco_runs_on_past_a_process_killed_mid_inner_phase_and_takes_its_replacement_in_at_an_outer_step(
        run_dir):
    """3 processes under diloco (H=10), process 1 SIGKILLed at step 15 and back 1 s after the others found it
    gone: their inner steps run on (they meet only at outer steps), they find it gone at the outer step that ends
    step 20 and drop its replica (its share of steps 11 to 20 skipped), the outer steps from there average over 2
    replicas, and its replacement takes part from a later outer step, its row from a peer; no other process is
    restarted, and every sample is trained once or counted as skipped."""
    report = diloco_run(run_dir, DILOCO_STEPS, "+chaos=schedule",
                        "chaos.failures=[{at_step: 15, slice: 1, down_for_s: 1}]")
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["phase"], failure["slices"], failure["action"], failure["lost_steps"]) == (
        19, "boundary", [1], "drop_replica", 0), "not found at the first outer step after the kill"
    share = 48 // 3
    assert failure["samples_skipped"] == INNER_STEPS * share
    (shrink, grow) = report["resizes"]
    assert (shrink["step"], shrink["reason"], shrink["slices"]) == (19, "replica_dropped", [0, 2])
    assert (grow["reason"], grow["slices"], grow["state_from_peer"]) == ("rejoined", [0, 1, 2], [1])
    assert grow["step"] % INNER_STEPS == 0 and 20 < grow["step"] < DILOCO_STEPS, "not taken in at an outer step"
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, 0, 0]
    assert attempt["replaced_exit_codes"] == [[], [-signal.SIGKILL], []]
    total = 20 * 48 + (grow["step"] - 20) * 2 * share + (DILOCO_STEPS - grow["step"]) * 48
    assert report["samples"] == {"consumed": total - INNER_STEPS * share, "duplicated": 0,
                                 "skipped": INNER_STEPS * share}


@pytest.mark.slow  # python -m pytest -m slow
def test_diloco_goes_on_without_a_process_that_misses_the_outer_step_by_more_than_the_grace_window(run_dir):
    """Process 1 of 3 hangs at step 15 for longer than the job runs: the others reach the outer step that ends step
    20 and wait for it no longer than cluster.collective_timeout_s (the grace window), then find it stuck (it had
    not dispatched its own step 20), kill it and drop its replica like a lost one's; the job finishes on 2."""
    report = diloco_run(run_dir, 60, "+chaos=schedule",
                        "chaos.failures=[{at_step: 15, slice: 1, hang: true, down_for_s: 1e9}]")
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["phase"], failure["slices"], failure["kind"], failure["action"]) == (
        19, "boundary", [1], "slice_hung", "drop_replica")
    assert [(r["step"], r["reason"], r["slices"]) for r in report["resizes"]] == [(19, "replica_dropped", [0, 2])]
    share = 48 // 3
    assert report["samples"] == {"consumed": 20 * 48 + 40 * 2 * share - INNER_STEPS * share, "duplicated": 0,
                                 "skipped": INNER_STEPS * share}
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, -signal.SIGKILL, 0]


@pytest.mark.slow  # python -m pytest -m slow
def test_diloco_that_needs_every_slice_restores_the_host_snapshot_and_takes_the_replacement_back_in(run_dir):
    """With strategy.min_slice_count=3, process 1 killed at step 15: dropping its replica at the outer step of step
    20 would leave too few slices, so the failure flow takes over: the strategy's plan waits for 3 slices (the
    replacement asks to join), each process restores its own rows from its host snapshot of step 10, the
    replacement is taken in with a peer's row, and steps 11 to 20 are trained again: no sample skipped."""
    report = diloco_run(run_dir, 60, "strategy.min_slice_count=3", "strategy.timeout_s=120", "+chaos=schedule",
                        "chaos.failures=[{at_step: 15, slice: 1, down_for_s: 1}]")
    (failure,) = slices_lost(report)
    assert (failure["step"], failure["phase"], failure["slices"], failure["action"], failure["restored_from"]) == (
        19, "boundary", [1], "diloco", "snapshot")
    assert [(r["step"], r["reason"], r["slices"]) for r in report["resizes"]] == [
        (19, "failure", [0, 2]), (10, "rejoined", [0, 1, 2])]
    assert report["samples"] == {"consumed": 60 * 48, "duplicated": 0, "skipped": 0}
    (attempt,) = report["process_exits"]
    assert attempt["exit_codes"] == [0, 0, 0] and attempt["replaced_exit_codes"] == [[], [-signal.SIGKILL], []]


@pytest.mark.slow  # python -m pytest -m slow
def test_diloco_resumed_from_a_checkpoint_taken_mid_inner_phase_ends_as_the_uninterrupted_run(run_dir):
    """2 slices of 2 processes under diloco (H=10), saved at steps 15, 30 and 40: a job started again from step 15
    alone (mid-inner-phase: every replica's own progress since step 10 is in it) saves steps 30 and 40 equal to
    the uninterrupted run's, every replica's row and the outer state."""
    job = [*TINY_MODEL, "trainer.steps=40", "checkpoint.period=15", *processes(4), "cluster.processes_per_slice=2",
           "+strategy=diloco", f"strategy.inner_steps={INNER_STEPS}"]
    result = run_cli(*job, f"hydra.run.dir={run_dir / 'whole'}")
    assert result.returncode == 0, result.stderr
    resumed = run_dir / "resumed"
    shutil.copytree(run_dir / "whole" / "checkpoints", resumed)
    for step in (30, 40):
        shutil.rmtree(resumed / str(step))
    result = run_cli(*job, f"checkpoint.dir={resumed}", "checkpoint.resume=true", f"hydra.run.dir={run_dir / 'again'}")
    assert result.returncode == 0, result.stderr
    expected = saved_states(run_dir / "whole" / "checkpoints", select=dict)  # every array: a mode's own too
    actual = saved_states(resumed, select=dict)
    assert set(actual) == set(expected) == {15, 30, 40}
    for step in (30, 40):
        assert_same_arrays(actual[step], expected[step], f"the checkpoint of step {step}")
