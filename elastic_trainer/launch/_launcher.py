"""The local launcher: runs the processes of a multi-process job on this machine and re-forms the group."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..clusters.multicontroller._coordinator import COORDINATOR_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S, serve
from ..clusters.multicontroller._multiprocess import PROCESS_ID_ENV
from ..clusters.multicontroller._rejoin import RETURNS_DIR_ENV
from ._processes import POLL_S, ProcessGroup, StopRequest
from ._supervisor import EVENTS, RESTART_EXIT_CODE, WORKER_ENV, restart_until_done, worker_file

FOLLOW_S = 120.0
"""Once a process ended by itself (done, stopped, or asking for a restart), the others must end within this."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(
    *, overrides: list[str], run_dir: Path, num_processes: int, max_restarts: int, started_at: float,
    stop_signals: Sequence[int], serves_coordinator: bool = True, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> int:
    """Run the job's ``num_processes`` processes with ``overrides`` until they end; the exit status.

    Process ``i`` runs in ``run_dir/process<i>`` (its own report and log;
    the output of all but process 0 goes to ``stdout.log`` there) and all
    share ``run_dir/checkpoints``. Every process is in a process group of
    its own, all killed when the launcher ends for any reason. A stop signal
    (``stop_signals``) is passed on to every process; they agree on a step
    (JAX's preemption sync), save it and end, and those still running after
    the grace are killed. When the processes ask for a restart (exit status 75:
    ``full_restart``, or a group that must be re-formed), every process is
    started again, with a new coordination service, and goes on as a full
    restart's worker does (:func:`restart_until_done`). With
    ``serves_coordinator`` the launcher hosts JAX's coordination service
    itself (``heartbeat_timeout_s``), so that any process may die; without,
    process 0 does. Each attempt's report
    is that of its lowest surviving process; the merged ``report.json`` adds
    ``process_exits``, every process's exit status per attempt.
    """
    if not any(o.startswith("checkpoint.dir=") for o in overrides):
        overrides = [*overrides, f"checkpoint.dir={run_dir / 'checkpoints'}"]
    exits: list[dict] = []

    def run_attempt(process_overrides: list[str], attempt: int, stop: StopRequest) -> tuple[int, bool]:
        address = f"127.0.0.1:{free_port()}"
        with serve(address, num_processes=num_processes, heartbeat_timeout_s=heartbeat_timeout_s) \
                if serves_coordinator else contextlib.nullcontext():
            ended = _run_processes(process_overrides, run_dir=run_dir, num_processes=num_processes,
                                   attempt=attempt, stop=stop, coordinator=address)
        exits.append({"attempt": attempt, **ended})
        codes = ended["exit_codes"]
        reported = [i for i in range(num_processes) if (run_dir / f"process{i}" / "report.json").exists()]
        # the job's report is the lowest surviving process's; a replacement's covers only its part of the run
        survivor = next((i for i in reported if not ended["replaced_exit_codes"][i]), reported[0] if reported else None)
        if survivor is None:
            return next((c for c in codes if c), 3), False  # no process got to train (bad input): they said why
        for i in range(num_processes):
            _keep_attempt(run_dir / f"process{i}", attempt, into=run_dir if i == survivor else None)
        return _job_status(codes, trained=reported), True

    return restart_until_done(
        run_attempt, overrides=overrides, run_dir=run_dir, max_restarts=max_restarts, started_at=started_at,
        restarting=f"all {num_processes} processes", giving_up="the group", stop_signals=stop_signals,
        report_extras=lambda: {"process_exits": tuple(exits)},
    )


def _run_processes(
    overrides: list[str], *, run_dir: Path, num_processes: int, attempt: int, stop: StopRequest, coordinator: str,
) -> dict:
    """Start every process, the coordination service at ``coordinator``, and wait for all of them; what
    ``process_exits`` lists of the attempt (without its number).

    A process that failure injection took down for a while said when it
    comes back (:data:`RETURNS_DIR_ENV`): it is started again then, with the
    same process id, and joins the running job (docs/multiprocess.md, "Rejoin").
    """
    env = {**os.environ, WORKER_ENV: str(attempt), COORDINATOR_ENV: coordinator, RETURNS_DIR_ENV: str(run_dir)}
    pids: list[list[int]] = [[] for _ in range(num_processes)]
    replaced: list[list[int]] = [[] for _ in range(num_processes)]  # the exit statuses of those replaced

    with ProcessGroup(stop) as group:
        def start(i: int) -> subprocess.Popen:
            process_dir = run_dir / f"process{i}"
            command = [
                sys.executable, "-m", "elastic_trainer", *overrides,
                f"hydra.run.dir={process_dir}", "hydra.mode=RUN",  # one run, even inside a multirun
            ]
            process_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.ExitStack() as files:  # process 0 shows its progress; the others' goes to a file
                stdout = files.enter_context(open(process_dir / "stdout.log", "a")) if i else None
                started = group.start(command, env={**env, PROCESS_ID_ENV: str(i)}, stdout=stdout)
            pids[i].append(started.pid)
            return started

        processes = [start(i) for i in range(num_processes)]
        first_end, seen, exited_at = None, [None] * num_processes, [None] * num_processes
        while None in (codes := [p.poll() for p in processes]):
            for i, code in enumerate(codes):
                if code is not None and exited_at[i] is None:
                    exited_at[i] = time.time()
            _say_who_ended(codes, seen, run_dir=run_dir)
            for i in [] if _job_ending(codes, replaced) else _due_to_return(codes, run_dir):
                replaced[i].append(codes[i])
                processes[i], seen[i], exited_at[i] = start(i), None, None
            if first_end is None and _job_ending(codes, replaced):
                first_end = time.monotonic()  # a process ended by itself: the others follow soon
            if first_end is not None and time.monotonic() - first_end > FOLLOW_S:
                print(f"elastic_trainer: launcher: processes still running {FOLLOW_S:g} s after another ended; "
                      "killing them", file=sys.stderr, flush=True)
                break
            if stop.overdue():
                print(f"elastic_trainer: launcher: processes still running {stop.grace_s:g} s after "
                      f"{signal.Signals(stop.signum).name}; killing them", file=sys.stderr, flush=True)
                break
            time.sleep(POLL_S)
    codes = [p.poll() for p in processes]
    exited_at = [t or time.time() for t in exited_at]
    for i in range(num_processes):  # notes of returns that did not come
        for note in (run_dir / f"process{i}.returns_at", run_dir / f"process{i}.lost"):
            note.unlink(missing_ok=True)
    return {"exit_codes": codes, "exited_at": exited_at, "pids": pids, "replaced_exit_codes": replaced}


def _job_ending(codes: list[int | None], replaced: list[list[int]]) -> bool:
    """Whether a process ended by itself (done, stopped, asking for a restart): the others follow. A replacement
    that ended without success was not taken back in (it says why), and the job goes on without it."""
    return any(c is not None and (c == 0 or c > 0 and not replaced[i]) for i, c in enumerate(codes))


def _due_to_return(codes: list[int | None], run_dir: Path) -> list[int]:
    """The processes taken down (killed) whose time to come back has come and whose loss the others have found
    (:data:`RETURNS_DIR_ENV`)."""
    due = []
    for i, code in enumerate(codes):
        back_at, lost = run_dir / f"process{i}.returns_at", run_dir / f"process{i}.lost"
        if code is not None and code < 0 and lost.exists() and back_at.exists() \
                and float(back_at.read_text()) <= time.time():
            back_at.unlink()
            lost.unlink()
            due.append(i)
    return due


def _say_who_ended(codes: list[int | None], seen: list[int | None], *, run_dir: Path) -> None:
    """Print a line for each process that ended unasked (killed, crashed) while others run; once process 0
    (the only one whose output shows here) is gone, say where the lowest running one's output goes."""
    for index, code in enumerate(codes):
        if code is None or seen[index] is not None:
            continue
        seen[index] = code
        running = [i for i, c in enumerate(codes) if c is None]
        if code in (0, RESTART_EXIT_CODE) or not running:
            continue
        output = "" if 0 in running else f" (output: {run_dir / f'process{running[0]}' / 'stdout.log'})"
        print(f"elastic_trainer: launcher: process {index} ended with status {code}; processes {running} go on"
              f"{output}", file=sys.stderr, flush=True)


def _job_status(codes: list[int], *, trained: Sequence[int]) -> int:
    """The job's status from its processes': a restart if any asked for one, else the best of those of
    ``trained`` (the processes that trained: a spare never taken in ends 0 whatever the job did, and says
    nothing of it) that ended by themselves."""
    if RESTART_EXIT_CODE in codes:
        return RESTART_EXIT_CODE
    ended = [codes[i] for i in trained if codes[i] >= 0]
    return min(ended) if ended else 3


def _keep_attempt(process_dir: Path, attempt: int, *, into: Path | None) -> None:
    """Rename a process's report, samples and events so the next attempt does not overwrite them;
    copy those of the attempt's chosen process to ``into`` as ``<name>.worker<attempt>``."""
    for name, suffix in (("report", ".json"), ("samples", ".npz"), (Path(EVENTS).stem, ".jsonl")):
        source = process_dir / f"{name}{suffix}"
        if not source.exists():
            continue
        kept = source.rename(process_dir / f"{name}.attempt{attempt}{suffix}")
        if into is not None:
            shutil.copyfile(kept, into / worker_file(source.name, attempt))
