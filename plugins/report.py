"""Built-in reporter: ``report.json`` and ``samples.npz`` in the run directory, and a one-screen summary."""

from __future__ import annotations

import json

import numpy as np
from rich.console import Console

import elastic_trainer as et

REPORT_FILE = "report.json"
SAMPLES_FILE = "samples.npz"


@et.hookimpl
def et_run_end(trainer: et.Trainer, report: dict) -> None:
    """Write the report and the sample ledger (when the trainer has a run directory); print the summary."""
    if trainer.run_dir is not None:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        np.savez(trainer.run_dir / SAMPLES_FILE, **trainer.ledger.to_arrays())
    Console().print(et.summary_table(report))
    if trainer.run_dir is not None:
        print(f"report: {trainer.run_dir / REPORT_FILE}")
