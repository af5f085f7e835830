"""Built-in reporter: ``report.json`` in the run directory and a one-screen summary."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

import elastic_trainer as et

REPORT_FILE = "report.json"


@et.hookimpl
def et_run_end(trainer: et.Trainer, report: dict) -> None:
    """Write ``report.json`` (when the trainer has a run directory) and print the summary."""
    if trainer.run_dir is not None:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    Console().print(summary_table(report))
    if trainer.run_dir is not None:
        print(f"report: {trainer.run_dir / REPORT_FILE}")


def summary_table(report: dict) -> Table:
    """The run at a glance: progress, loss, and where the wall time went."""
    table = Table(title="elastic_trainer run", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("steps", f"{report['steps_completed']} / {report['steps_target']}")
    if report["loss_first"] is not None:
        table.add_row("loss", f"{report['loss_first']:.4f} -> {report['final_loss']:.4f}")
    table.add_row("wall", f"{report['wall_s']:.1f} s")
    table.add_row("goodput", f"{report['goodput']:.1%} ({report['productive_s']:.1f} s productive)")
    for category, seconds in report["badput_s"].items():
        if seconds >= 0.05:
            share = seconds / report["wall_s"]
            table.add_row(f"  {category}", f"{seconds:6.1f} s  {'#' * round(40 * share):<40} {share:.1%}")
    table.add_row("failures", str(len(report["failures"])))
    if report.get("stopped"):
        table.add_row("stopped", report["stopped"])
    return table
