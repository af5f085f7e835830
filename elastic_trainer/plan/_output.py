"""The projection's tables (Markdown, which reads as well in a terminal), its plot and its generated blocks."""

from __future__ import annotations

import os
from pathlib import Path

from ..benchmark import _pyplot, _strategy_colours
from ._costs import StrategyCosts
from ._project import Projection, recommend
from ._validate import Validation


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def _period(projection: Projection) -> str:
    return f"{projection.period_steps} steps ({projection.period_s / 60:.1f} min)"


THROUGHPUT = ("throughput: the steps done, each timed as the bare loop's step, over wall time (the trainer's "
              "goodput less its overhead against a bare donating loop); bare_loop is that loop restarting from its "
              "checkpoints on every failure")
"""What the tables' throughput is, in a sentence."""


def plan_table(projections: list[Projection]) -> str:
    """One cluster: a line per strategy and the bare loop, and the recommendation."""
    rows = [[
        p.strategy, f"{p.throughput:.4f}", f"{p.goodput:.4f}", f"{p.progress:.4f}", f"{p.failures_per_day:.2f}",
        _period(p), f"{p.lost_steps_per_day:.1f}", "" if p.closed_form is None else f"{p.closed_form:.4f}",
    ] for p in projections]
    table = _table(["strategy", "throughput", "goodput", "progress", "failures/day", "checkpoint period",
                    "lost steps/day", "Young/Daly goodput"], rows)
    best = recommend(projections)
    simulated = f"(simulated: {best.jobs} jobs, {best.failures} failures)"
    return (f"{table}\n\n{THROUGHPUT}.\n\nrecommended: {best.strategy}, a checkpoint every {_period(best)} "
            f"{simulated}")


def scaling_table(by_slices: dict[int, list[Projection]], chips_per_slice: int) -> str:
    """Every slice count: each strategy's throughput (and the bare loop's), and the recommendation."""
    strategies = [p.strategy for p in next(iter(by_slices.values()))]
    rows = []
    for slices, projections in by_slices.items():
        best = recommend(projections)
        rows.append([f"{slices:,}", f"{slices * chips_per_slice:,}", f"{projections[0].failures_per_day:.2f}",
                     *(f"{p.throughput:.4f}" for p in projections), f"{best.strategy}, every {_period(best)}"])
    return _table(["slices", "chips", "failures/day", *strategies, "recommended, checkpoint period"], rows)


def validation_table(validations: list[Validation]) -> str:
    """Measured against predicted goodput, run by run."""
    rows = [[v.strategy, v.schedule, f"{v.measured:.4f}", f"{v.predicted:.4f}", f"{v.error:+.4f}"]
            for v in sorted(validations, key=lambda v: (v.schedule, v.strategy))]
    return _table(["strategy", "schedule", "measured goodput", "predicted", "error"], rows)


def costs_table(costs: dict[str, StrategyCosts]) -> str:
    """The measured per-event costs the projection uses (medians over each strategy's runs)."""
    rows = []
    for c in costs.values():
        r = c.recovery
        parts = "" if r is None else (f"{r.total_s:.2f} (detection {r.detection_s:.2f}, restart {r.restart_s:.2f}, "
                                      f"compile {r.compile_s:.2f}, restore {r.restore_s:.2f}, other {r.other_s:.2f})")
        rows.append([c.strategy, str(c.runs), str(c.failures), f"{c.step_s:.3f}", f"{c.save_s:.3f}", f"{c.start_s:.2f}",
                     f"{c.layout_compile_s:.2f}", parts])
    return _table(["strategy", "runs", "failures", "step_s", "save_s", "start_s", "layout compile_s",
                   "recovery_s without waiting (parts)"], rows)


def plot_scaling(by_slices: dict[int, list[Projection]], validations: list[Validation], path: Path,
                 *, measured_schedule: str, title: str) -> None:
    """Goodput against slice count (log axis), a line per strategy, and the measured runs of
    ``measured_schedule`` (filled) with their predictions (hollow) at their slice count."""
    plt = _pyplot()
    slice_counts = list(by_slices)
    strategies = [p.strategy for p in by_slices[slice_counts[0]]]
    colours = _strategy_colours(strategies)
    figure, axes = plt.subplots(figsize=(10, 4.5))
    for strategy in strategies:
        throughput = [next(p.throughput for p in by_slices[n] if p.strategy == strategy) for n in slice_counts]
        axes.plot(slice_counts, throughput, marker=".", color=colours[strategy], label=f"{strategy}, projected")
    measured = [v for v in validations if v.schedule == measured_schedule and v.strategy in colours]
    for v in measured:
        slices = slice_counts[0]
        axes.scatter([slices], [v.measured], s=60, color=colours[v.strategy], zorder=3)
        axes.scatter([slices], [v.predicted], s=120, facecolors="none", edgecolors=colours[v.strategy], zorder=3)
    if measured:
        axes.scatter([], [], s=60, color="grey", label=f"measured: {slice_counts[0]} slices,\nthe sweep's '{measured_schedule}' schedule")
        axes.scatter([], [], s=120, facecolors="none", edgecolors="grey", label="predicted for it (replayed)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(slice_counts, [f"{n:,}" for n in slice_counts])
    axes.set_xlabel("slices")
    axes.set_ylabel("throughput (bare-loop steps x step time / wall time)")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def block_markers(name: str) -> tuple[str, str]:
    """The comments that delimit the generated block ``name`` in a Markdown file."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def update_blocks(path: Path, blocks: dict[str, str]) -> list[str]:
    """Replace, in ``path``, every block of ``blocks`` whose markers it has; the names replaced."""
    text = path.read_text()
    replaced = []
    for name, body in blocks.items():
        start, end = block_markers(name)
        if start in text and end in text:
            head, rest = text.split(start, 1)
            text = f"{head}{start}\n\n{body.strip()}\n\n{end}{rest.split(end, 1)[1]}"
            replaced.append(name)
    if replaced:
        path.write_text(text)
    return replaced


def image_link(image: Path, markdown_file: Path) -> str:
    """A Markdown image of ``image``, relative to ``markdown_file``."""
    relative = Path(os.path.relpath(image.resolve(), markdown_file.parent.resolve())).as_posix()
    return f"![{image.stem}]({relative})"
