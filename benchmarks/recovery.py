"""Recovery time per strategy, with its breakdown and the steps lost.

Runs ``python -m elastic_trainer`` once per strategy, each a fresh process,
with the same failure (slice 1 lost at step ``--fail-at``, back after
``--down-for-s`` seconds), then prints one row per strategy and, as the last
line, ``recovery_ratio=12.3``: full_restart's recovery_s over scale_down's.

    python benchmarks/recovery.py [--steps 160] [--fail-at 120] [--down-for-s 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = ("scale_down", "pause_resume", "full_restart")


def run(strategy: str, run_dir: Path, args: argparse.Namespace) -> dict:
    failure = f"[{{at_step: {args.fail_at}, slice: 1, down_for_s: {args.down_for_s}}}]"
    command = [
        sys.executable, "-m", "elastic_trainer", f"+strategy={strategy}", "+chaos=schedule",
        f"chaos.failures={failure}", f"trainer.steps={args.steps}", f"checkpoint.period={args.checkpoint_period}",
        f"hydra.run.dir={run_dir}",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "report.json").read_text())


def breakdown(strategy: str, report: dict, run_dir: Path) -> dict:
    (failure,) = report["failures"]
    if strategy == "full_restart":  # the parts are the new worker's start-up
        worker = json.loads((run_dir / "report.worker1.json").read_text())["badput_s"]
        parts = {"restart": worker["startup"], "compile": worker["compile"], "restore": worker["checkpoint_restore"]}
    else:
        parts = {"compile": failure["compile_s"], "restore": failure["restore_s"]}
    return {
        "recovery_s": failure["recovery_s"], "detection": failure["detection_s"],
        "waiting": failure.get("waiting_s", 0.0), "remesh": failure.get("remesh_s", 0.0),
        "restart": 0.0, **parts, "lost_steps": failure["lost_steps"], "restored_from": failure["restored_from"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--fail-at", type=int, default=120)
    parser.add_argument("--down-for-s", type=float, default=5.0)
    parser.add_argument("--checkpoint-period", type=int, default=50)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            run_dir = Path(tmp) / strategy
            rows[strategy] = breakdown(strategy, run(strategy, run_dir, args), run_dir)
    columns = ("recovery_s", "detection", "waiting", "remesh", "restart", "compile", "restore")
    print(f"{'strategy':<14}" + "".join(f"{c:>12}" for c in columns) + f"{'lost_steps':>12}  restored_from")
    for strategy, row in rows.items():
        print(f"{strategy:<14}" + "".join(f"{row[c]:>12.3f}" for c in columns)
              + f"{row['lost_steps']:>12}  {row['restored_from']}")
    print(f"recovery_ratio={rows['full_restart']['recovery_s'] / rows['scale_down']['recovery_s']:.1f}")


if __name__ == "__main__":
    main()
