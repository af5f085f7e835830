"""Recovery time per strategy, early and late in a run, cold and warm compilation cache, against a MaxText-style loop.

Every run is a fresh process (``python -m elastic_trainer``, or
``benchmarks/maxtext_style.py``) that loses slice 1 during step ``--early``
or ``--late`` (back after ``--down-for-s`` seconds); all share one new JAX
persistent compilation cache, so the first run starts cold:

1. cold: ``scale_down``, early failure; prints how long the recovery waited
   for its compile and which layouts were ready when the slice was lost;
2. warm (the same job ran before): ``scale_down`` early and late,
   ``pause_resume`` late, ``full_restart`` early and late;
3. the MaxText-style loop (``maxtext_style.py``: donating step, Orbax
   checkpoint every ``--maxtext-checkpoint-period`` steps, ``elastic_retry``,
   restore onto the new mesh and recompile), once to warm its own cache
   entries, then early and late.

One row per run: ``recovery_s`` (failure raised to the end of the first step
after it) and its parts, the steps lost, and ``recovery_s`` in median step
times of that run. Then ``peer_ratio=...`` (MaxText-style ``recovery_s`` over
``scale_down``'s at the same step, the worse of early and late; a
MaxText-style loop also trains its lost steps again, listed but not in the
ratio) and, last, ``recovery_ratio=...`` (``full_restart`` over
``scale_down``, warm, the worse of early and late).

    python benchmarks/recovery.py [--steps 160] [--early 50] [--late 120] [--down-for-s 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MAXTEXT_STYLE = Path(__file__).with_name("maxtext_style.py")
COLUMNS = ("recovery_s", "detection", "waiting", "remesh", "restart", "compile", "restore")


def trainer_run(strategy: str, fail_at: int, run_dir: Path, args: argparse.Namespace, env: dict) -> dict:
    """Run the default job with ``strategy``, slice 1 lost during step ``fail_at``; the row of its failure."""
    failure = f"[{{at_step: {fail_at}, slice: 1, down_for_s: {args.down_for_s}}}]"
    subprocess.run([
        sys.executable, "-m", "elastic_trainer", f"+strategy={strategy}", "+chaos=schedule",
        f"chaos.failures={failure}", f"trainer.steps={args.steps}", f"checkpoint.period={args.checkpoint_period}",
        f"hydra.run.dir={run_dir}",
    ], check=True, stdout=subprocess.DEVNULL, env=env)
    report = json.loads((run_dir / "report.json").read_text())
    (failure_record,) = report["failures"]
    if strategy == "full_restart":  # the parts are the new worker's start-up
        worker = json.loads((run_dir / "report.worker1.json").read_text())["badput_s"]
        parts = {"restart": worker["startup"], "compile": worker["compile"], "restore": worker["checkpoint_restore"]}
    else:
        parts = {"restart": 0.0, "compile": failure_record["compile_s"], "restore": failure_record["restore_s"]}
    steps = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {
        "recovery_s": failure_record["recovery_s"], "detection": failure_record["detection_s"],
        "waiting": failure_record.get("waiting_s", 0.0), "remesh": failure_record.get("remesh_s", 0.0), **parts,
        "lost_steps": failure_record["lost_steps"], "restored_from": failure_record["restored_from"],
        "step_s": statistics.median(e["end"] - e["time"] for e in steps if e["event"] == "step"),
        "report": report,
    }


def maxtext_run(fail_at: int, run_dir: Path, args: argparse.Namespace, env: dict) -> dict:
    """Run the MaxText-style loop, slice 1 lost during step ``fail_at``; the row of its failure."""
    subprocess.run([
        sys.executable, str(MAXTEXT_STYLE), str(run_dir), f"--fail-at={fail_at}", f"--steps={args.steps}",
        f"--down-for-s={args.down_for_s}", f"--checkpoint-period={args.maxtext_checkpoint_period}",
    ], check=True, stdout=subprocess.DEVNULL, env=env)
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    log = json.loads((run_dir / "maxtext_style.json").read_text())
    return {
        "recovery_s": failure["recovery_s"], "detection": failure["detection_s"],
        "waiting": failure.get("waiting_s", 0.0), "remesh": 0.0, "restart": 0.0, "compile": float("nan"),
        "restore": float("nan"), "lost_steps": fail_at - log["started_from"][-1], "restored_from": "checkpoint",
        "step_s": statistics.median(end - began for _, began, end in log["steps"]),
    }


def ready_when_lost(report: dict) -> tuple[list[list[int]], int]:
    """The layouts whose step was ready when the slice was lost, and how many were asked for in the run."""
    lost_at = report["failures"][0]["failed_at"]
    layouts = report["compile_cache"]["layouts"]
    return [layout["slices"] for layout in layouts if layout["ready_at"] and layout["ready_at"] <= lost_at], len(layouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--early", type=int, default=50, help="the early failure's step")
    parser.add_argument("--late", type=int, default=120, help="the late failure's step")
    parser.add_argument("--down-for-s", type=float, default=5.0)
    parser.add_argument("--checkpoint-period", type=int, default=50, help="the trainer's checkpoint period")
    parser.add_argument("--maxtext-checkpoint-period", type=int, default=10)
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(Path(tmp) / "jax_cache")}  # new: the first run is cold
        cold = trainer_run("scale_down", args.early, Path(tmp) / "cold", args, env)
        ready, asked = ready_when_lost(cold["report"])
        print(f"cold cache, scale_down, failure at step {args.early}: recovery {cold['recovery_s']:.3f} s, of which "
              f"{cold['compile']:.3f} s waiting for its compile; ready when the slice was lost: {ready} "
              f"({len(ready)} of the {asked} layouts asked for in the run)", flush=True)
        runs = [("scale_down", args.early), ("scale_down", args.late), ("pause_resume", args.late),
                ("full_restart", args.early), ("full_restart", args.late)]
        for strategy, fail_at in runs:
            rows[f"{strategy}@{fail_at}"] = trainer_run(strategy, fail_at, Path(tmp) / f"{strategy}-{fail_at}", args, env)
        maxtext_run(args.early, Path(tmp) / "maxtext-warm-up", args, env)  # its own steps into the cache
        for fail_at in (args.early, args.late):
            rows[f"maxtext_style@{fail_at}"] = maxtext_run(fail_at, Path(tmp) / f"maxtext-{fail_at}", args, env)
    print("warm cache:")
    print(f"{'run':<20}" + "".join(f"{c:>12}" for c in COLUMNS) + f"{'lost_steps':>12}{'step_s':>9}"
          f"{'in steps':>10}  restored_from")
    for name, row in rows.items():
        print(f"{name:<20}" + "".join(f"{row[c]:>12.3f}" for c in COLUMNS) + f"{row['lost_steps']:>12}"
              f"{row['step_s']:>9.3f}{row['recovery_s'] / row['step_s']:>10.1f}  {row['restored_from']}")
    steps = (args.early, args.late)
    peer = min(rows[f"maxtext_style@{s}"]["recovery_s"] / rows[f"scale_down@{s}"]["recovery_s"] for s in steps)
    restart = min(rows[f"full_restart@{s}"]["recovery_s"] / rows[f"scale_down@{s}"]["recovery_s"] for s in steps)
    print(f"peer_ratio={peer:.1f}")
    print(f"recovery_ratio={restart:.1f}")


if __name__ == "__main__":
    main()
