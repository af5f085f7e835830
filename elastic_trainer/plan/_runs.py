"""What the projection reads from a run directory: its report, its timeline and its failure schedule."""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .._failures import ConfigError

STRATEGIES = ("scale_down", "pause_resume", "full_restart")
"""The strategies the projection models."""
SWAPPING = ("hot_swap", "hot_swap->scale_down")
"""The strategies whose runs measure a swap (``+strategy=hot_swap``, ``+strategy=swap_then_scale_down``)."""
REPORT_FIELDS = ("strategy", "cluster", "steps_completed", "wall_s", "productive_s", "goodput", "badput_s",
                 "failures", "started_at", "ended_at")
FAILURE_FIELDS = ("step", "phase", "slices", "recovery_s", "lost_steps")


@dataclass(frozen=True)
class MeasuredFailure:
    """One failure of a run, as its report and timeline measured it (seconds).

    :param down_for_s: how long the lost slices stayed down (from the run's
        ``chaos`` config; ``None`` when the run has no such config).
    :param first_step_s: the first good step after it, which ``recovery_s`` includes.
    """

    step: int
    phase: str
    action: str
    slices: tuple[int, ...]
    down_for_s: float | None
    recovery_s: float
    first_step_s: float
    detection_s: float
    waiting_s: float
    remesh_s: float
    compile_s: float
    restore_s: float
    startup_s: float
    lost_steps: int

    @property
    def other_s(self) -> float:
        """The rest of the recovery: neither waiting, nor a named part, nor the first good step."""
        named = self.detection_s + self.remesh_s + self.compile_s + self.restore_s + self.startup_s
        return max(0.0, self.recovery_s - self.waiting_s - self.first_step_s - named)


@dataclass(frozen=True)
class MeasuredRun:
    """One run's measurements (seconds): the job-level ones and every event.

    :param step_s: productive time per committed step.
    :param gap_s: the time between two steps (median, where nothing else happened between them).
    :param start_s: from the job's start to its first step.
    :param end_s: from the end of its last step or save to the end of the job.
    :param saves_s: the time each checkpoint save blocked the step loop.
    :param scale_ups_s: each move back onto returned slices.
    :param spares: the cluster's spare slices (``cluster.spare_slices``).
    """

    name: str
    strategy: str
    schedule: str
    slices: int
    spares: int
    steps: int
    period: int
    goodput: float
    step_s: float
    gap_s: float
    start_s: float
    end_s: float
    layout_compile_s: float
    saves_s: tuple[float, ...]
    scale_ups_s: tuple[float, ...]
    failures: tuple[MeasuredFailure, ...]


def run_dirs(paths: list[Path]) -> list[Path]:
    """Each path that is a run directory (it holds ``report.json``), or else its subdirectories that are."""
    found = []
    for path in paths:
        if (path / "report.json").is_file():
            found.append(path)
            continue
        inner = sorted(p.parent for p in path.glob("*/report.json")) if path.is_dir() else []
        if not inner:
            raise ConfigError(f"{path} is not a run directory (no report.json) and holds none.")
        found += inner
    return found


def load_run(run_dir: Path, strategies: tuple[str, ...] = STRATEGIES) -> MeasuredRun:
    """Read one run directory of one of ``strategies``; :class:`ConfigError` when it lacks what the projection
    needs."""
    report = _read_report(run_dir)
    events = _read_events(run_dir)
    steps = [e for e in events if e["event"] == "step"]
    if not steps or not report["steps_completed"]:
        raise ConfigError(f"{run_dir} completed no step, so it measured no step time.")
    strategy = report["strategy"]
    if strategy not in strategies:
        raise ConfigError(f"the projection models {', '.join(strategies)} from these runs; {run_dir} ran {strategy!r}.")
    config = _read_config(run_dir)
    saves = [e for e in events if e["event"] == "checkpoint_save"]
    last_end = max(e.get("end", e["time"]) for e in events if e["event"] in ("step", "checkpoint_save"))
    checkpoint = report.get("checkpoint") or {}
    return MeasuredRun(
        name=run_dir.name,
        strategy=strategy,
        schedule=_schedule_name(run_dir),
        slices=int(report["cluster"].get("slices") or report["cluster"].get("num_processes") or 0),
        spares=int(report["cluster"].get("spare_slices") or 0),
        steps=int(report["steps_completed"]),
        period=_period(checkpoint, report["steps_completed"]),
        goodput=float(report["goodput"]),
        step_s=report["productive_s"] / report["steps_completed"],
        gap_s=_median_gap(events),
        start_s=steps[0]["time"] - report["started_at"],
        end_s=max(0.0, report["ended_at"] - last_end),
        layout_compile_s=float((report.get("badput_before_first_step_s") or {}).get("compile", 0.0)),
        saves_s=tuple(e["end"] - e["time"] for e in saves),
        scale_ups_s=tuple(r["seconds"] for r in report.get("resizes", []) if r.get("reason") == "scale_up"),
        failures=tuple(_failure(run_dir, f, steps, config) for f in report["failures"]),
    )


def _read_report(run_dir: Path) -> dict[str, Any]:
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{run_dir / 'report.json'} cannot be read as JSON ({error}).") from None
    missing = [field for field in REPORT_FIELDS if field not in report]
    if missing:
        raise ConfigError(f"{run_dir / 'report.json'} lacks {', '.join(missing)}, which the projection needs.")
    return report


def _read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} (the run's timeline, which the projection needs) cannot be read ({error}).") from None


def _read_config(run_dir: Path) -> Any:
    path = run_dir / ".hydra" / "config.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def _schedule_name(run_dir: Path) -> str:
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return "?"
    return OmegaConf.load(path).hydra.runtime.choices.get("chaos") or "none"


def _period(checkpoint: dict[str, Any], steps: int) -> int:
    """The run's checkpoint period in steps (an automatic one: the last it chose; none: beyond the run)."""
    auto = checkpoint.get("auto")
    if auto:
        return int(auto["period_steps"])
    period = checkpoint.get("period")
    return int(period) if isinstance(period, int) and period > 0 else steps + 1


def _median_gap(events: list[dict[str, Any]]) -> float:
    """The median time between the end of a step and the start of the next, when nothing came between them."""
    gaps = [b["time"] - a["end"] for a, b in itertools.pairwise(events) if a["event"] == b["event"] == "step"]
    return statistics.median(gaps) if gaps else 0.0


def _failure(run_dir: Path, failure: dict[str, Any], steps: list[dict[str, Any]], config: Any) -> MeasuredFailure:
    missing = [field for field in FAILURE_FIELDS if field not in failure]
    if missing:
        raise ConfigError(f"a failure in {run_dir / 'report.json'} lacks {', '.join(missing)}, which the projection needs.")
    recovered_at = failure.get("failed_at", 0.0) + (failure["recovery_s"] or 0.0)
    first = min(steps, key=lambda e: abs(e["end"] - recovered_at))
    return MeasuredFailure(
        step=int(failure["step"]),
        phase=failure["phase"],
        action=str(failure.get("action", "")),
        slices=tuple(int(s) for s in failure["slices"]),
        down_for_s=_down_for(failure, config),
        recovery_s=float(failure["recovery_s"] or 0.0),
        first_step_s=first["end"] - first["time"],
        lost_steps=int(failure["lost_steps"]),
        **{part: float(failure.get(part, 0.0)) for part in
           ("detection_s", "waiting_s", "remesh_s", "compile_s", "restore_s", "startup_s")},
    )


def _down_for(failure: dict[str, Any], config: Any) -> float | None:
    """How long the run's chaos config kept this failure's slices down."""
    chaos = None if config is None else config.get("chaos")
    if chaos is None:
        return None
    for scheduled in chaos.get("failures") or []:
        if scheduled.at_step == failure["step"] and scheduled.slice in failure["slices"]:
            return float(scheduled.get("down_for_s", 1e9))
    return float(chaos.get("random_down_for_s", 1e9))
