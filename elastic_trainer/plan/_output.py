"""The projection's tables (Markdown, which reads as well in a terminal), its plot and its generated blocks."""

from __future__ import annotations

import os
from pathlib import Path

from ..benchmark import _pyplot, _strategy_colours
from ._costs import RecoveryCost, StrategyCosts
from ._project import Projection, recommend, recommend_spares
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


def _name(projection: Projection) -> str:
    return f"{projection.strategy}, {projection.spares} spares" if projection.spares else projection.strategy


def plan_table(projections: list[Projection]) -> str:
    """One cluster: a line per strategy and the bare loop, and the recommendation."""
    rows = [[
        _name(p), f"{p.throughput:.4f}", f"{p.goodput:.4f}", f"{p.per_chip_goodput:.4f}", f"{p.progress:.4f}",
        f"{p.failures_per_day:.2f}", _period(p), f"{p.lost_steps_per_day:.1f}",
        "" if p.closed_form is None else f"{p.closed_form:.4f}",
    ] for p in projections]
    table = _table(["strategy", "throughput", "goodput", "goodput per provisioned chip", "progress", "failures/day",
                    "checkpoint period", "lost steps/day", "Young/Daly goodput"], rows)
    best = recommend(projections)
    simulated = f"(simulated: {best.jobs} jobs, {best.failures} failures)"
    return (f"{table}\n\n{THROUGHPUT}; goodput per provisioned chip: productive chip-time over the time of every "
            f"chip, spares included.\n\nrecommended: {_name(best)}, a checkpoint every {_period(best)} {simulated}")


def spares_line(projections: list[Projection]) -> str:
    """The spare count recommended for one cluster, against none."""
    best, none = recommend_spares(projections), projections[0]
    return (f"spares: {best.spares} recommended of {none.spares} to {projections[-1].spares} tried, goodput per "
            f"provisioned chip {best.per_chip_goodput:.4f} ({none.per_chip_goodput:.4f} with none; "
            f"{best.swaps_per_day:.2f} swaps a day)")


def scaling_table(by_slices: dict[int, list[Projection]], chips_per_slice: int,
                  spares: dict[int, list[Projection]] | None = None) -> str:
    """Every slice count: each strategy's throughput (and the bare loop's), and the recommendation; with
    ``spares`` (:func:`spare_scaling`), the spare count recommended and its goodput per provisioned chip."""
    strategies = [p.strategy for p in next(iter(by_slices.values()))]
    rows = []
    for slices, projections in by_slices.items():
        best = recommend(projections)
        rows.append([f"{slices:,}", f"{slices * chips_per_slice:,}", f"{projections[0].failures_per_day:.2f}",
                     *(f"{p.throughput:.4f}" for p in projections), f"{best.strategy}, every {_period(best)}"])
        if spares is not None:
            spared = recommend_spares(spares[slices])
            rows[-1] += [str(spared.spares), f"{spared.per_chip_goodput:.4f} ({spares[slices][0].per_chip_goodput:.4f})"]
    extra = ["spares", "goodput per provisioned chip (with no spare)"] if spares is not None else []
    return _table(["slices", "chips", "failures/day", *strategies, "recommended, checkpoint period", *extra], rows)


def validation_table(validations: list[Validation]) -> str:
    """Measured against predicted goodput, run by run."""
    rows = [[v.strategy, v.schedule, f"{v.measured:.4f}", f"{v.predicted:.4f}", f"{v.error:+.4f}"]
            for v in sorted(validations, key=lambda v: (v.schedule, v.strategy))]
    return _table(["strategy", "schedule", "measured goodput", "predicted", "error"], rows)


def recovery_parts(r: RecoveryCost) -> str:
    """A recovery's cost and its parts, in a line."""
    return (f"{r.total_s:.2f} (detection {r.detection_s:.2f}, restart {r.restart_s:.2f}, compile {r.compile_s:.2f}, "
            f"restore {r.restore_s:.2f}, other {r.other_s:.2f})")


def costs_table(costs: dict[str, StrategyCosts]) -> str:
    """The measured per-event costs the projection uses (medians over each strategy's runs)."""
    rows = []
    for c in costs.values():
        parts = "" if c.recovery is None else recovery_parts(c.recovery)
        rows.append([c.strategy, str(c.runs), str(c.failures), f"{c.step_s:.3f}", f"{c.save_s:.3f}", f"{c.start_s:.2f}",
                     f"{c.layout_compile_s:.2f}", parts])
    return _table(["strategy", "runs", "failures", "step_s", "save_s", "start_s", "layout compile_s",
                   "recovery_s without waiting (parts)"], rows)


def plot_scaling(by_slices: dict[int, list[Projection]], validations: list[Validation], path: Path,
                 *, measured_schedule: str, title: str, spares: dict[int, list[Projection]] | None = None) -> None:
    """Goodput against slice count (log axis), a line per strategy, and the measured runs of
    ``measured_schedule`` (filled) with their predictions (hollow) at their slice count; with ``spares``, the
    goodput per provisioned chip of the spare count recommended, each point labelled with it."""
    plt = _pyplot()
    slice_counts = list(by_slices)
    strategies = [p.strategy for p in by_slices[slice_counts[0]]]
    colours = _strategy_colours(strategies)
    figure, axes = plt.subplots(figsize=(10, 4.5))
    for strategy in strategies:
        throughput = [next(p.throughput for p in by_slices[n] if p.strategy == strategy) for n in slice_counts]
        axes.plot(slice_counts, throughput, marker=".", color=colours[strategy], label=f"{strategy}, projected")
    if spares is not None:
        best = [recommend_spares(spares[n]) for n in slice_counts]
        axes.plot(slice_counts, [p.per_chip_goodput for p in best], marker="s", color="black", linestyle="--",
                  label="swap_then_scale_down, recommended\nspares K: per provisioned chip")
        for n, p in zip(slice_counts, best):
            axes.annotate(f"K={p.spares}", (n, p.per_chip_goodput), textcoords="offset points", xytext=(0, -12),
                          ha="center", fontsize=7)
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
    """A Markdown image of ``image``, relative to ``markdown_file`` (symbolic links kept, as a docs folder uses one)."""
    relative = Path(os.path.relpath(image.absolute(), markdown_file.parent.absolute())).as_posix()
    return f"![{image.stem}]({relative})"
