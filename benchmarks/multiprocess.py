"""Detection of a killed process on ``cluster=multiprocess``, and no false detection on a loaded machine.

Every run is a fresh ``python -m elastic_trainer cluster=multiprocess`` of
``--processes`` processes (the tiny model, ``scale_down``):

1. failure-free, ``--steps`` steps, while another job (the default model on
   the simulated cluster, started again whenever it ends) loads the machine:
   it must record no failure at all, not even a retried collective timeout;
2. process 1 killed during step ``--kill-at``, with the defaults
   (``cluster.collective_timeout_s`` unset: 2 s), and then with the former
   fixed default, ``collective_timeout_s=10``, side by side.

One row per run. The last line is ``mp_detection_s=...``: the defaults'
``detection_s`` (from the moment the process went down to the end of the
survivors' classification of the failure).

    python benchmarks/multiprocess.py [--processes 3] [--steps 300] [--kill-at 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

TINY = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "data.max_bytes=200000",
        "checkpoint.period=10"]


def run(run_dir: Path, args: argparse.Namespace, *overrides: str) -> dict:
    """One multiprocess run of the tiny model under ``scale_down``; its report."""
    subprocess.run([
        sys.executable, "-m", "elastic_trainer", "cluster=multiprocess", f"cluster.num_processes={args.processes}",
        "+strategy=scale_down", *TINY, f"hydra.run.dir={run_dir}", *overrides,
    ], check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "report.json").read_text())


def load_machine(until: threading.Event, run_dir: Path) -> None:
    """Run the default job on the simulated cluster, again and again, until ``until`` is set."""
    runs = 0
    while not until.is_set():
        runs += 1
        subprocess.run([sys.executable, "-m", "elastic_trainer", "trainer.steps=100", f"hydra.run.dir={run_dir / str(runs)}"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="et_mp_bench_"))

    done = threading.Event()
    loader = threading.Thread(target=load_machine, args=(done, work / "load"), daemon=True)
    loader.start()
    try:
        quiet = run(work / "loaded", args, f"trainer.steps={args.steps}")
    finally:
        done.set()
        loader.join()
    step_s = quiet["productive_s"] / quiet["steps_completed"]
    print(f"failure-free under load: {quiet['steps_completed']}/{args.steps} steps, mean step {step_s:.3f} s, "
          f"failures recorded: {len(quiet['failures'])}", flush=True)

    kill = f"chaos.failures=[{{at_step: {args.kill_at}, slice: 1, down_for_s: 1e9}}]"
    rows = {}
    for name, overrides in {"defaults (2 s)": [], "collective_timeout_s=10": ["cluster.collective_timeout_s=10"]}.items():
        report = run(work / f"kill{len(rows)}", args, f"trainer.steps={args.kill_at + 10}", "+chaos=schedule", kill,
                     *overrides)
        (failure,) = report["failures"]
        rows[name] = failure
        print(f"{name:>24}: detection_s {failure['detection_s']:.2f}, recovery_s {failure['recovery_s']:.2f}, "
              f"restored_from {failure['restored_from']}, lost_steps {failure['lost_steps']}", flush=True)
    if quiet["failures"]:
        sys.exit(f"a failure-free run recorded failures: {quiet['failures']}")
    print(f"mp_detection_s={rows['defaults (2 s)']['detection_s']:.2f}")


if __name__ == "__main__":
    main()
