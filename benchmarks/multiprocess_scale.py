"""The multi-controller runtime from 2 to 16 processes: the same failure at every size, and what grows with the count.

Every run is a fresh ``python -m elastic_trainer cluster=multiprocess`` of N
processes, one CPU device each (the tiny model, ``scale_down``, the same batch
per process at every size: ``keep_per_device``): process 1 is
SIGKILLed during step ``--kill-at`` by failure injection, its replacement
starts ``--down-for`` seconds later, and ``scale_down`` takes it back in.
From each run's ``report.json`` and ``events.jsonl``:

- start-up: the report's ``startup`` badput (from the launcher's start to the
  trainer's first work: N interpreters, JAX and the coordination service);
- the failure-free step: the median step before the failure (the first 5 left
  out), against the median step of one process alone (a run of
  ``cluster.num_processes=1``);
- a save's blocking time: the median of the saves before the failure, the
  first (which compiles the checksums) left out;
- detection and recovery: the failure's ``detection_s`` and ``recovery_s``
  (from the kill to the end of the first step after it: the detection is
  part of it);
- the rejoin: the ``rejoined`` resize's ``seconds`` (new backends, compile,
  the state from a peer).

A run that fails, or ends before its replacement is taken back in, is run
again with process 1 down for good: its row has the rest, and its rejoin is
reported as failed, with the error and the log to read. The collective
timeout is the same at every size (``--collective-timeout``), so that a
16-process step on 2 cores does not time out while every process lives. With
``--work DIR`` the runs go to DIR, and those already there are read, not run
again. One row per size, written to ``benchmarks/results/multiprocess_scale/``
(``results.json`` and ``scale.png``). The last line is
``mp_scale_exponent=...``: the slope of the least-squares line through
log(recovery + rejoin), what one failure costs, against log(processes).

    python benchmarks/multiprocess_scale.py [--sizes 2 4 8 16] [--kill-at 62] [--steps-after 800] [--work DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TINY = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "data.max_bytes=200000"]
"""The tiny test model, as ``benchmarks/multiprocess.py`` runs it."""
WARM_UP = 5
"""Steps left out of a median step: the first compiles, and the next few still share the machine with the
start-up of the others."""
RESULTS = Path(__file__).parent / "results" / "multiprocess_scale"


@dataclass(frozen=True)
class SizeResult:
    """What one run of ``processes`` processes measured (seconds)."""

    processes: int
    startup_s: float
    step_s: float
    step_ratio: float
    save_s: float
    detection_s: float
    recovery_s: float
    rejoin_s: float | None
    rejoined_at_step: int | None
    compiled_ahead: bool
    wall_s: float
    rejoin_failed: str | None = None

    @property
    def failure_s(self) -> float | None:
        """What one failure cost the job: its recovery (the detection included) and taking the replacement back in
        (``None`` when the replacement could not be taken back in)."""
        return None if self.rejoin_s is None else self.recovery_s + self.rejoin_s


def run(run_dir: Path, processes: int, args: argparse.Namespace, *overrides: str) -> tuple[dict, list[dict]]:
    """One multiprocess run of the tiny model under ``scale_down``; its report and its events. A run already in
    ``run_dir`` (``--work``) is read, not run again; one that failed there fails again."""
    log_path = Path(f"{run_dir}.log")
    if log_path.exists():
        if not (run_dir / "report.json").exists():
            raise subprocess.CalledProcessError(1, f"the earlier run in {run_dir}")
        return read_run(run_dir)
    started = time.monotonic()
    with open(log_path, "w") as log:  # the launcher's own output: what ended a process, and why
        subprocess.run([
            sys.executable, "-m", "elastic_trainer", "cluster=multiprocess", f"cluster.num_processes={processes}",
            "cluster.devices_per_process=1", f"cluster.collective_timeout_s={args.collective_timeout}",
            f"cluster.initialization_timeout_s={args.patience}", f"cluster.barrier_timeout_s={args.patience}",
            "+strategy=scale_down", "strategy.batch_policy=keep_per_device",
            f"trainer.global_batch_size={args.batch_per_process * processes}", *TINY,
            f"checkpoint.period={args.period}", f"hydra.run.dir={run_dir}", *overrides,
        ], check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"  {processes} process(es): {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return read_run(run_dir)


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """The report and the events of the run in ``run_dir``."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((run_dir / "report.json").read_text()), events


def spans(events: list[dict], kind: str, before: float = float("inf")) -> list[float]:
    """The durations of the ``kind`` events that began before ``before``."""
    return [e["end"] - e["time"] for e in events if e["event"] == kind and e["time"] < before]


def median_step_s(events: list[dict], before: float = float("inf")) -> float:
    """The median step that began before ``before``, the first :data:`WARM_UP` left out."""
    return statistics.median(spans(events, "step", before)[WARM_UP:])


def one_process_step_s(work: Path, args: argparse.Namespace) -> float:
    """The median step of the tiny model on one process of one device."""
    _, events = run(work / "one", 1, args, f"trainer.steps={args.kill_at}")
    return median_step_s(events)


def killed(work: Path, processes: int, args: argparse.Namespace, down_for_s: float) -> tuple[dict, list[dict]]:
    """Process 1 of ``processes`` killed during step ``--kill-at`` and down for ``down_for_s``: the run's report and
    events."""
    kill = f"chaos.failures=[{{at_step: {args.kill_at}, slice: 1, down_for_s: {down_for_s}}}]"
    steps = args.kill_at + max(60, args.steps_after // processes)
    return run(work / f"p{processes}-down{down_for_s:g}", processes, args, f"trainer.steps={steps}", "+chaos=schedule",
               kill)


def first_error(log: Path) -> str:
    """The first error a failed run's launcher output shows, and where that output is."""
    errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("jax.errors.")]
    return f"the run failed: {errors[0][:240] if errors else 'no JAX error'} ({log})"


def measure(work: Path, processes: int, one_step_s: float, args: argparse.Namespace) -> SizeResult:
    """Kill process 1 of ``processes`` and take its replacement back in; what the run measured. When that run fails
    or takes no replacement back, the same run with process 1 down for good measures the rest."""
    rejoin_failed = None
    try:
        report, events = killed(work, processes, args, args.down_for)
        rejoined = [r for r in report["resizes"] if r.get("reason") == "rejoined"]
        if len(rejoined) != 1:
            rejoin_failed = f"{len(rejoined)} rejoins in {report['steps_completed']} steps; raise --steps-after"
    except subprocess.CalledProcessError:
        rejoin_failed = first_error(Path(f"{work}/p{processes}-down{args.down_for:g}.log"))
    if rejoin_failed is not None:
        print(f"  {processes} processes: no rejoin measured ({rejoin_failed}); again with process 1 down for good",
              file=sys.stderr, flush=True)
        report, events = killed(work, processes, args, 1e9)
        rejoined = [{"seconds": None, "step": None}]
    (failure,) = report["failures"]
    step_s = median_step_s(events, before=failure["failed_at"])
    return SizeResult(
        processes=processes,
        startup_s=report["badput_s"]["startup"],
        step_s=step_s,
        step_ratio=step_s / one_step_s,
        save_s=statistics.median(spans(events, "checkpoint_save", before=failure["failed_at"])[1:]),
        detection_s=failure["detection_s"],
        recovery_s=failure["recovery_s"],
        rejoin_s=rejoined[0]["seconds"],
        rejoined_at_step=rejoined[0]["step"],
        compiled_ahead=failure["compile_cached"],
        wall_s=report["wall_s"],
        rejoin_failed=rejoin_failed,
    )


def exponent(results: list[SizeResult]) -> float:
    """The slope of the least-squares line through log(per-failure cost) against log(processes), over the sizes
    whose replacement was taken back in."""
    measured = [r for r in results if r.failure_s is not None]
    x = np.log([r.processes for r in measured])
    y = np.log([r.failure_s for r in measured])
    return float(np.polyfit(x, y, 1)[0])


def rejoin_cells(result: SizeResult) -> str:
    """The table's last two cells: the rejoin (and its step) and the per-failure cost."""
    if result.failure_s is None:
        return "failed ** | |"
    return f"{result.rejoin_s:.2f} ({result.rejoined_at_step}) | {result.failure_s:.2f} |"


def table(results: list[SizeResult], one_step_s: float) -> str:
    """The rows as a markdown table."""
    lines = [f"one process alone: a step of {one_step_s:.3f} s", "",
             "| processes | start-up s | step s (x one process) | save s | detection s | recovery s | rejoin s "
             "(at step) | per failure s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.processes} | {r.startup_s:.1f} | {r.step_s:.3f} ({r.step_ratio:.1f}x) | {r.save_s:.3f} | "
              f"{r.detection_s:.2f} | {r.recovery_s:.2f}{'' if r.compiled_ahead else ' *'} | {rejoin_cells(r)}"
              for r in results]
    if not all(r.compiled_ahead for r in results):
        lines += ["", "* the survivors' layout was compiled during the recovery, not ahead"]
    lines += [f"** {r.processes} processes: {r.rejoin_failed}" for r in results if r.rejoin_failed]
    return "\n".join(lines)


def plot(results: list[SizeResult], path: Path) -> None:
    """Each cost against the process count, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.processes for r in results]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name in ("startup_s", "detection_s", "recovery_s", "rejoin_s", "failure_s", "step_s", "save_s"):
        points = [(r.processes, getattr(r, name)) for r in results if getattr(r, name) is not None]
        label = "per failure (recovery + rejoin)" if name == "failure_s" else name.removesuffix("_s")
        axes.plot(*zip(*points), marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(sizes, [str(n) for n in sizes])
    axes.set_xlabel("processes (one CPU device each)")
    axes.set_ylabel("seconds")
    fitted = ", ".join(str(r.processes) for r in results if r.failure_s is not None)
    axes.set_title(f"cluster=multiprocess, one process killed and back\n"
                   f"per failure ~ processes^{exponent(results):.2f} (fitted over {fitted})", fontsize=10)
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--kill-at", type=int, default=62,
                        help="the step during which process 1 is killed: after the compiles ahead, not after a save")
    parser.add_argument("--steps-after", type=int, default=800,
                        help="steps after the failure, over the process count (at least 60): time for the replacement "
                             "to start and be taken back in, which steps of more processes fill sooner")
    parser.add_argument("--down-for", type=float, default=1.0)
    parser.add_argument("--batch-per-process", type=int, default=8, help="samples per process a step")
    parser.add_argument("--period", type=int, default=5, help="checkpoint period (steps)")
    parser.add_argument("--collective-timeout", type=int, default=10)
    parser.add_argument("--patience", type=int, default=600, help="initialization and barrier timeouts (s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, help="where the runs go; runs already there are read, not run again")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="et_mp_scale_"))

    one_step_s = one_process_step_s(work, args)
    results = [measure(work, n, one_step_s, args) for n in args.sizes]
    print(table(results, one_step_s))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/multiprocess_scale.py", *sys.argv[1:]]),
        "one_process_step_s": one_step_s,
        "exponent": exponent(results) if len(results) > 1 else None,
        "rows": [{**dataclasses.asdict(r), "failure_s": r.failure_s} for r in results],
    }, indent=2) + "\n")
    if len(results) > 1:
        plot(results, args.out / "scale.png")
        print(f"mp_scale_exponent={exponent(results):.3f}")


if __name__ == "__main__":
    main()
