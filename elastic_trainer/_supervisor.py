"""Full restarts done honestly: the CLI process supervises worker processes and restarts them."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from ._processes import POLL_S, ProcessGroup, terminate_on_sigterm
from ._report import merge_worker_reports, report_events, summary_table

EVENTS = "events.jsonl"

RESTART_EXIT_CODE = 75
"""A worker's exit status when its strategy asks for a fresh process (EX_TEMPFAIL)."""

WORKER_ENV = "ELASTIC_TRAINER_WORKER"
"""Set in a worker's environment to its attempt number; a worker never supervises."""


def is_worker() -> bool:
    """Whether this process is a worker started by a supervisor."""
    return WORKER_ENV in os.environ


def supervise(*, overrides: list[str], run_dir: Path, max_restarts: int, started_at: float) -> int:
    """Run workers with ``overrides`` until one ends other than by asking for a restart.

    Each restarted worker is a new interpreter that starts JAX, compiles and
    restores the last complete checkpoint (``checkpoint.resume=true``), so a
    restart costs what it costs. A worker runs in a process group of its own,
    killed when the supervisor ends for any reason (SIGTERM and Ctrl-C
    included), so no worker outlives it. The workers' reports are kept as
    ``report.worker<N>.json`` (and ``events.worker<N>.jsonl``) and merged into
    one ``report.json`` (and ``events.jsonl``). Returns the
    exit status for the command line.
    """
    kept = [o for o in overrides if not o.startswith(("hydra.run.dir=", "checkpoint.resume="))]
    resume = [o for o in overrides if o.startswith("checkpoint.resume=")]  # the first worker does as asked
    reports, ledgers = [], []
    while True:
        attempt = len(reports)
        # a worker is one run, even when its supervisor is one job of a multirun
        command = [sys.executable, "-m", "elastic_trainer", *kept, f"hydra.run.dir={run_dir}", "hydra.mode=RUN", *resume]
        launched_at = time.time()
        status = run_worker(command, env={**os.environ, WORKER_ENV: str(attempt)})
        report_file, samples_file, events_file = (run_dir / name for name in ("report.json", "samples.npz", EVENTS))
        if not report_file.exists() or report_file.stat().st_mtime < launched_at:  # none, or an earlier run's
            return status  # the worker failed before training (bad input): it said why
        reports.append(json.loads(report_file.read_text()))
        report_file.rename(run_dir / f"report.worker{attempt}.json")
        with np.load(samples_file) as samples:
            ledgers.append(dict(samples))
        samples_file.rename(run_dir / f"samples.worker{attempt}.npz")
        events_file.rename(run_dir / f"events.worker{attempt}.jsonl")
        if status != RESTART_EXIT_CODE:
            break
        if attempt >= max_restarts:
            reports[-1]["stopped"] = f"full_restart gave up after {max_restarts} restarts (strategy.max_restarts)."
            status = 3
            break
        print(f"elastic_trainer: supervisor: restarting the worker (restart {attempt + 1})", flush=True)
        # from the last complete checkpoint; a failure before the first one starts over from step 0
        resume = ["checkpoint.resume=true"] if reports[-1]["failures"][-1]["restored_from"] == "checkpoint" else []
    report = merge_worker_reports(reports, ledgers, started_at=started_at)
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    merge_worker_events(run_dir, report, workers=len(reports))
    Console().print(summary_table(report))
    print(f"report: {report_file}")
    return status


def run_worker(command: list[str], *, env: dict[str, str]) -> int:
    """Run one worker to its end in a process group of its own; its exit status."""
    with terminate_on_sigterm(), ProcessGroup() as group:
        worker = group.start(command, env=env)
        while worker.poll() is None:
            time.sleep(POLL_S)
        return worker.returncode


def merge_worker_events(run_dir: Path, report: dict, *, workers: int) -> None:
    """One ``events.jsonl`` for the run: every worker's steps, saves and restores,
    each marked with its ``worker``, and the failures, recoveries and resizes of
    the merged report (a restart's recovery spans two workers)."""
    events = [
        {**event, "worker": worker}
        for worker in range(workers)
        for event in map(json.loads, (run_dir / f"events.worker{worker}.jsonl").read_text().splitlines())
        if event["event"] not in ("failure", "recovery", "resize")
    ]
    events = sorted(events + report_events(report), key=lambda event: event["time"])
    (run_dir / EVENTS).write_text("".join(json.dumps(event) + "\n" for event in events))
