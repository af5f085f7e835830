"""Full restarts done honestly: the CLI process supervises worker processes and restarts them."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from ._processes import POLL_S, ProcessGroup, StopRequest
from .._preemption import exit_status
from .._report import RunReport, merge_worker_reports, report_events, summary_table
from .._run_report import CheckpointInfo
from ..checkpoints._storage import holds_committed_step

EVENTS = "events.jsonl"

RESTART_EXIT_CODE = 75
"""A worker's exit status when its strategy asks for a fresh process (EX_TEMPFAIL)."""

WORKER_ENV = "ELASTIC_TRAINER_WORKER"
"""Set in a worker's environment to its attempt number; a worker never supervises."""

RunAttempt = Callable[[list[str], int, StopRequest], tuple[int, bool]]
"""Runs attempt ``N`` with the given overrides, its processes getting the stop signals of the request; its exit
status, and whether it trained (then it left ``report.worker<N>.json``, ``samples.worker<N>.npz`` and
``events.worker<N>.jsonl`` in the run directory)."""


def is_worker() -> bool:
    """Whether this process is a worker started by a supervisor."""
    return WORKER_ENV in os.environ


def supervise(
    *, overrides: list[str], run_dir: Path, max_restarts: int, started_at: float, strategy: str,
    stop_signals: Sequence[int], first_attempt_ran_here: bool = False,
) -> int:
    """Run workers with ``overrides`` until one ends other than by asking for a restart.

    Each restarted worker is a new interpreter that starts JAX, compiles and
    restores the last complete checkpoint (``checkpoint.resume=true``), so a
    restart costs what it costs. A worker runs in a process group of its own,
    killed when the supervisor ends for any reason, so no worker outlives it.
    A stop signal (``stop_signals``: SIGTERM, Ctrl-C, a preemption signal) is
    passed on to the worker, which saves and ends; no worker is started after
    it (see :func:`restart_until_done`). With ``first_attempt_ran_here``, this
    process trained the first attempt itself and it asked for a restart (its
    ``report.json``, ``samples.npz`` and ``events.jsonl`` in ``run_dir``
    become worker 0's); the first worker started is then the first restart.
    ``strategy`` names who gives up after ``max_restarts``. Returns the exit
    status for the command line.
    """
    def run_attempt(worker_overrides: list[str], attempt: int, stop: StopRequest) -> tuple[int, bool]:
        if attempt == 0 and first_attempt_ran_here:
            status, launched_at = RESTART_EXIT_CODE, started_at
        else:  # a worker is one run, even when its supervisor is one job of a multirun
            command = [sys.executable, "-m", "elastic_trainer", *worker_overrides, f"hydra.run.dir={run_dir}",
                       "hydra.mode=RUN"]
            launched_at = time.time()
            status = run_worker(command, env={**os.environ, WORKER_ENV: str(attempt)}, stop=stop)
        report_file = run_dir / "report.json"
        if not report_file.exists() or report_file.stat().st_mtime < launched_at:  # none, or an earlier run's
            return status, False  # the worker failed before training (bad input): it said why
        for name in ("report.json", "samples.npz", EVENTS):
            (run_dir / name).rename(run_dir / worker_file(name, attempt))
        return status, True

    return restart_until_done(run_attempt, overrides=overrides, run_dir=run_dir, max_restarts=max_restarts,
                              started_at=started_at, restarting="the worker", giving_up=strategy,
                              stop_signals=stop_signals)


def restart_until_done(
    run_attempt: RunAttempt, *, overrides: list[str], run_dir: Path, max_restarts: int, started_at: float,
    restarting: str, giving_up: str, stop_signals: Sequence[int],
    report_extras: Callable[[], dict[str, Any]] = dict,
) -> int:
    """Run attempts until one ends other than by asking for a restart; merge their reports; the exit status.

    The first attempt does as the user asked (``checkpoint.resume=`` included);
    a restart resumes from the last complete checkpoint, or starts over from
    step 0 when there is none yet. The attempts' reports
    are kept as ``report.worker<N>.json`` (and ``events.worker<N>.jsonl``) and
    merged into one ``report.json`` (and ``events.jsonl``), with
    ``report_extras()`` added. Used by the ``full_restart`` supervisor and the
    multi-process launcher alike.

    A stop signal (one of ``stop_signals``) goes on to the attempt's
    processes (:class:`StopRequest`), which save their last committed step
    and end; no attempt starts after it, and unless they finished training
    the status is 128 + the signal's number (143 after SIGTERM), whatever
    theirs: a process that the signal reached before it could handle it (still
    starting) dies of it, and the others' failure that follows is the stop's too.
    """
    kept = [o for o in overrides if not o.startswith(("hydra.run.dir=", "checkpoint.resume="))]
    resume = [o for o in overrides if o.startswith("checkpoint.resume=")]
    reports, ledgers = [], []
    with StopRequest(stop_signals) as stop:
        while True:
            attempt = len(reports)
            status, trained = run_attempt(kept + resume, attempt, stop)
            if stop.signum is not None and status != 0:
                status = exit_status(stop.signum)  # stopped: never restarted
            if not trained:
                return status  # nothing trained (bad input, or stopped first): the attempt said why
            reports.append(RunReport.load(run_dir / worker_file("report.json", attempt)))
            with np.load(run_dir / worker_file("samples.npz", attempt)) as samples:
                ledgers.append(dict(samples))
            if status != RESTART_EXIT_CODE:
                break
            if attempt >= max_restarts:
                reports[-1] = dataclasses.replace(
                    reports[-1], stopped=f"{giving_up} gave up after {max_restarts} restarts (strategy.max_restarts).")
                status = 3
                break
            print(f"elastic_trainer: restarting {restarting} (restart {attempt + 1})", flush=True)
            resume = ["checkpoint.resume=true"] if _holds_checkpoints(reports[-1].checkpoint) else []
        report = dataclasses.replace(merge_worker_reports(reports, ledgers, started_at=started_at), **report_extras())
        report_file = report.write(run_dir)  # a stop signal now waits for the merged report
        merge_worker_events(run_dir, report, workers=len(reports))
    Console().print(summary_table(report))
    print(f"report: {report_file}")
    return status


def _holds_checkpoints(checkpoint: CheckpointInfo | None) -> bool:
    """Whether the run's checkpoint directory (``report.checkpoint``), local or ``gs://``, holds a committed step."""
    return checkpoint is not None and holds_committed_step(checkpoint.dir)


def worker_file(name: str, attempt: int) -> str:
    """What ``name`` (``report.json``) of attempt ``attempt`` is kept as (``report.worker<attempt>.json``)."""
    stem, _, suffix = name.partition(".")
    return f"{stem}.worker{attempt}.{suffix}"


def run_worker(command: list[str], *, env: dict[str, str], stop: StopRequest) -> int:
    """Run one worker to its end in a process group of its own, passing it the stop signals; its exit status
    (-9 when it was killed for not ending within the request's grace after one)."""
    with ProcessGroup(stop) as group:
        worker = group.start(command, env=env)
        while worker.poll() is None:
            if stop.overdue():
                print(f"elastic_trainer: the worker did not end {stop.grace_s:g} s after "
                      f"{signal.Signals(stop.signum).name}; killing it", file=sys.stderr, flush=True)
                break
            time.sleep(POLL_S)
    return worker.returncode


def merge_worker_events(run_dir: Path, report: RunReport, *, workers: int) -> None:
    """One ``events.jsonl`` for the run: every worker's steps, saves and restores,
    each marked with its ``worker``, and the failures, recoveries and resizes of
    the merged report (a restart's recovery spans two workers)."""
    events = [
        {**event, "worker": worker}
        for worker in range(workers)
        for event in map(json.loads, (run_dir / worker_file(EVENTS, worker)).read_text().splitlines())
        if event["event"] not in ("failure", "recovery", "resize")
    ]
    events = sorted(events + [event.to_json() for event in report_events(report)], key=lambda event: event["time"])
    (run_dir / EVENTS).write_text("".join(json.dumps(event) + "\n" for event in events))
