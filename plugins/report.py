"""Built-in reporter: ``report.json`` and ``samples.npz`` in the run directory, and a one-screen summary."""

from __future__ import annotations

import numpy as np
from rich.console import Console

import elastic_trainer as et
import elastic_trainer.plugin as etp

SAMPLES_FILE = "samples.npz"


@et.hookimpl
def et_run_end(trainer: etp.TrainerView, report: et.RunReport) -> None:
    """Write the report and the sample ledger (when the trainer has a run directory); print the summary."""
    written = None
    if trainer.run_dir is not None:
        written = report.write(trainer.run_dir)
        np.savez(trainer.run_dir / SAMPLES_FILE, **trainer.ledger.to_arrays())
    Console().print(etp.summary_table(report))
    if written is not None:
        print(f"report: {written}")
