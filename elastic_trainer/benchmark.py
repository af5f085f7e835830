"""Benchmark results: a Hydra callback that turns a sweep's reports into tables and plots.

Each job of a multirun sweep (``python -m elastic_trainer +benchmark=standard``)
writes its ``report.json`` and ``events.jsonl``; at the end of the sweep,
:class:`BenchmarkResults` gathers them into ``results.csv``, ``results.md``
and three plots (goodput per strategy, a timeline per strategy, the breakdown
of recovery time), and publishes each job's run files too (the measured costs
that ``python -m elastic_trainer.plan`` projects from). Any launcher works:
the callback reads only the files the jobs left in the sweep directory.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

RESULT_COLUMNS = (
    "strategy", "schedule", "seed", "steps", "goodput", "wall_s", "failures", "mean_recovery_s",
    "lost_steps", "final_loss", "samples_duplicated", "samples_skipped", "stopped", "job",
)
RECOVERY_PARTS = ("detection_s", "waiting_s", "startup_s", "remesh_s", "compile_s", "restore_s")
RESULTS_START, RESULTS_END = "<!-- benchmark-results:start -->", "<!-- benchmark-results:end -->"
PLOTS = ("goodput.png", "timeline.png", "recovery.png")
RUN_FILES = ("report.json", "events.jsonl", ".hydra/config.yaml", ".hydra/hydra.yaml")
"""What each job's published run directory keeps: enough for :func:`load_jobs` and the projection."""


class BenchmarkResults(Callback):
    """At the end of a multirun: results.csv, results.md and plots in the sweep directory.

    :param publish_dir: also copy the tables and plots here (a folder kept in
        the repository), with each job's run files under ``runs/``, or ``None``.
    :param page: a Markdown file whose text between ``<!-- benchmark-results:start -->``
        and ``<!-- benchmark-results:end -->`` is replaced by the table and the
        plots (from ``publish_dir``); files without the markers are left alone.
    :param timeline_schedule: the failure schedule whose jobs the timeline plot shows.
    """

    def __init__(self, publish_dir: str | None = None, page: str | None = None, timeline_schedule: str = "periodic"):
        self.publish_dir = publish_dir
        self.page = page
        self.timeline_schedule = timeline_schedule

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Gather the sweep's reports and write the results."""
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = load_jobs(sweep_dir)
        if not jobs:
            print(f"elastic_trainer: benchmark: no job of {sweep_dir} wrote a report.json; nothing to tabulate.")
            return
        rows = [result_row(job) for job in jobs]
        write_results(rows, sweep_dir)
        plot_goodput(rows, sweep_dir / "goodput.png")
        plot_timeline([j for j in jobs if j["schedule"] == self.timeline_schedule], sweep_dir / "timeline.png")
        plot_recovery(jobs, sweep_dir / "recovery.png")
        print((sweep_dir / "results.md").read_text())
        print(f"benchmark results: {sweep_dir}")
        if self.publish_dir:
            publish_dir = Path(self.publish_dir)
            publish_dir.mkdir(parents=True, exist_ok=True)
            for name in ("results.csv", "results.md", *PLOTS):
                if (sweep_dir / name).exists():
                    shutil.copy(sweep_dir / name, publish_dir / name)
            publish_runs(sweep_dir, jobs, publish_dir / "runs")
            if self.page and Path(self.page).exists():
                update_results_page(Path(self.page), publish_dir)


def load_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job of the sweep that wrote a report: its report, events, strategy, schedule and seed."""
    jobs = []
    for report_file in sorted(sweep_dir.glob("*/report.json"), key=lambda p: _job_order(p.parent.name)):
        job_dir = report_file.parent
        choices = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices
        events_file = job_dir / "events.jsonl"
        jobs.append({
            "job": job_dir.name,
            "report": json.loads(report_file.read_text()),
            "events": [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else [],
            "strategy": choices.get("strategy") or "none",
            "schedule": choices.get("chaos") or "none",
            "seed": OmegaConf.load(job_dir / ".hydra" / "config.yaml").get("seed"),
        })
    return jobs


def publish_runs(sweep_dir: Path, jobs: list[dict[str, Any]], runs_dir: Path) -> None:
    """Copy each job's :data:`RUN_FILES` into ``runs_dir/<schedule>-<strategy>-<seed>/``, replacing earlier ones."""
    shutil.rmtree(runs_dir, ignore_errors=True)
    for job in jobs:
        target = runs_dir / f"{job['schedule']}-{job['strategy']}-{job['seed']}"
        for name in RUN_FILES:
            if (sweep_dir / job["job"] / name).exists():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(sweep_dir / job["job"] / name, target / name)


def _job_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def result_row(job: dict[str, Any]) -> dict[str, Any]:
    """One line of the results table."""
    report = job["report"]
    recoveries = [f["recovery_s"] for f in report["failures"] if f["recovery_s"]]
    return {
        "strategy": job["strategy"],
        "schedule": job["schedule"],
        "seed": job["seed"],
        "steps": f"{report['steps_completed']}/{report['steps_target']}",
        "goodput": round(report["goodput"], 4),
        "wall_s": round(report["wall_s"], 2),
        "failures": len(report["failures"]),
        "mean_recovery_s": round(statistics.mean(recoveries), 2) if recoveries else 0.0,
        "lost_steps": sum(f["lost_steps"] for f in report["failures"]),
        "final_loss": None if report["final_loss"] is None else round(report["final_loss"], 4),
        "samples_duplicated": report["samples"]["duplicated"],
        "samples_skipped": report["samples"]["skipped"],
        "stopped": report.get("stopped") or "",
        "job": job["job"],
    }


def write_results(rows: list[dict[str, Any]], directory: Path) -> None:
    """``results.csv`` (every job) and ``results.md`` (the same, as a Markdown table)."""
    with open(directory / "results.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    columns = [c for c in RESULT_COLUMNS if c != "job"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in sorted(rows, key=lambda r: (r["schedule"], r["strategy"], r["seed"])):
        lines.append("| " + " | ".join("" if row[c] is None else str(row[c]) for c in columns) + " |")
    (directory / "results.md").write_text("\n".join(lines) + "\n")


def _strategy_colours(strategies: list[str]) -> dict[str, str]:
    """One colour per strategy, the same in every plot."""
    return {strategy: f"C{index}" for index, strategy in enumerate(sorted(strategies))}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_goodput(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: goodput (mean over seeds) per failure schedule, one bar per strategy."""
    plt = _pyplot()
    schedules = sorted({r["schedule"] for r in rows})
    strategies = sorted({r["strategy"] for r in rows})
    colours = _strategy_colours(strategies)
    width = 0.8 / len(strategies)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for index, strategy in enumerate(strategies):
        for position, schedule in enumerate(schedules):
            values = [r["goodput"] for r in rows if r["strategy"] == strategy and r["schedule"] == schedule]
            if values:
                axes.bar(position + (index - (len(strategies) - 1) / 2) * width, statistics.mean(values), width,
                         color=colours[strategy], label=strategy if position == 0 else None)
    axes.set_xticks(range(len(schedules)), schedules)
    axes.set_xlabel("failure schedule")
    axes.set_ylabel("goodput (productive time / wall time)")
    axes.set_ylim(0, 1)
    axes.set_title("Goodput per strategy")
    axes.legend(title="strategy", loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_timeline(jobs: list[dict[str, Any]], path: Path) -> None:
    """One panel per strategy: slices in use and step throughput over time, failures and recoveries marked."""
    if not jobs:
        return
    plt = _pyplot()
    colours = _strategy_colours([j["strategy"] for j in jobs])
    figure, panels = plt.subplots(len(jobs), 1, figsize=(9, 2.4 * len(jobs)), sharex=True, squeeze=False)
    for job, axes in zip(jobs, panels[:, 0], strict=True):
        started_at = job["report"]["started_at"]
        steps = [e for e in job["events"] if e["event"] == "step"]
        axes.hlines([len(e["slices"]) for e in steps], [e["time"] - started_at for e in steps],
                    [e["end"] - started_at for e in steps], color=colours[job["strategy"]], linewidth=3)
        axes.set_ylabel("slices in use")
        axes.set_ylim(0, 1 + max((len(e["slices"]) for e in steps), default=1))
        for event in job["events"]:
            if event["event"] == "failure":
                axes.axvline(event["time"] - started_at, color="red", linestyle="--", linewidth=1)
            elif event["event"] == "recovery":
                axes.axvspan(event["time"] - started_at, event["end"] - started_at, color="red", alpha=0.12)
        rate = axes.twinx()
        bins, counts = _steps_per_second([e["end"] - started_at for e in steps], job["report"]["wall_s"])
        rate.step(bins, counts, where="post", color="grey", linewidth=0.8)
        rate.set_ylabel("steps/s", color="grey")
        rate.set_ylim(bottom=0)
        axes.set_title(f"{job['strategy']} ({job['schedule']}, seed {job['seed']})", fontsize=10)
    panels[0, 0].set_title(panels[0, 0].get_title() + ": red line = failure, red band = recovery", fontsize=10)
    panels[-1, 0].set_xlabel("seconds since the job started")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _steps_per_second(step_ends: list[float], wall_s: float, bins: int = 100) -> tuple[list[float], list[float]]:
    """Steps completed per second in ``bins`` equal bins of the job's wall time (0 while none completes)."""
    width = max(wall_s, 1e-9) / bins
    counts = [0] * bins
    for end in step_ends:
        counts[min(bins - 1, max(0, int(end / width)))] += 1
    return [i * width for i in range(bins)], [c / width for c in counts]


def plot_recovery(jobs: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars: the mean recovery time per strategy, split into its parts."""
    plt = _pyplot()
    parts: dict[str, list[dict[str, float]]] = {}
    for job in jobs:
        for failure in job["report"]["failures"]:
            if failure["recovery_s"]:
                measured = {part: failure.get(part, 0.0) for part in RECOVERY_PARTS}
                measured["other_s"] = max(0.0, failure["recovery_s"] - sum(measured.values()))
                parts.setdefault(job["strategy"], []).append(measured)
    if not parts:
        return
    strategies = sorted(parts)
    figure, axes = plt.subplots(figsize=(8, 4))
    left = [0.0] * len(strategies)
    for index, part in enumerate((*RECOVERY_PARTS, "other_s")):
        means = [statistics.mean(p[part] for p in parts[s]) for s in strategies]
        label = {"other_s": "other (first step, exit)", "startup_s": "new process"}.get(part, part.removesuffix("_s"))
        axes.barh(strategies, means, left=left, color=f"C{index}", label=label)
        left = [a + b for a, b in zip(left, means, strict=True)]
    axes.set_xlabel("mean recovery time per failure (s)")
    axes.set_ylabel("strategy")
    axes.set_title("Where recovery time goes")
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def update_results_page(page: Path, publish_dir: Path) -> None:
    """Replace the benchmark block of the Markdown file ``page`` with the published table and plots.

    Image links are relative to ``page`` without resolving symbolic links, so a docs folder can reach the
    results through one (``docs/results`` links to ``benchmarks/results``)."""
    text = page.read_text()
    if RESULTS_START not in text or RESULTS_END not in text:
        return
    relative = Path(os.path.relpath(publish_dir.absolute(), page.parent.absolute()))
    block = [RESULTS_START, "", (publish_dir / "results.md").read_text().rstrip(), ""]
    block += [f"![{name.removesuffix('.png')}]({(relative / name).as_posix()})" for name in PLOTS
              if (publish_dir / name).exists()]
    block += ["", RESULTS_END]
    head, rest = text.split(RESULTS_START, 1)
    page.write_text(head + "\n".join(block) + rest.split(RESULTS_END, 1)[1])
