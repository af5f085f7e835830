"""Framework overhead: trainer steps/s against a bare donating Equinox + optax loop, side by side.

By default both train the default job (the default model and data, global
batch 48, 4 slices of 2 CPU devices); with ``--devices N`` the small model
(``d_model=64``, 2 layers, 2 samples per device) on N simulated devices in
slices of 2, where the host's share of a step is largest. The bare loop is
what a user writes (``_loops.bare_intervals``: the state donated, the next
batch put on the devices while the step runs); the trainer runs with its
built-in plugins and defaults. Steady state only: compile time is excluded
from both, and each round's rate is one over its median step interval, so a
stall of the shared machine in one step does not decide the round; the order
alternates from round to round. Prints the median ratio (trainer / bare)
over the rounds as the last line: ``overhead_ratio=0.99``.

With ``--processes N`` the multi-controller step instead: the trainer as
``python -m elastic_trainer cluster=multiprocess`` on N processes of one CPU
device each, against the loop a user writes on ``jax.distributed``
(``_bare_multiprocess.py``, started N times: gloo collectives, the step jitted
with the state donated, each process's rows put with
``jax.make_array_from_process_local_data``, one step in flight), both the
small model (``d_model=64``, 2 layers) on a global batch of 2 per process,
one slice per process, no strategy, no checkpoints. Each is a fresh job of
``--warm-up`` steps and then ``--steps`` timed ones. Both are timed the same
way, in process 0: the intervals between consecutive step ends (the
trainer's from the ``step`` events of its ``events.jsonl``, the bare loop's
from ``perf_counter`` once the step's new state is ready); a round's rate is
one over its median interval. Prints each round's rates, the medians over the
rounds, and as the last line the ratio of the median rates:
``overhead_ratio=<trainer steps/s / bare steps/s>``.

    python benchmarks/overhead.py [--devices N] [--steps 100] [--rounds 7]
    python benchmarks/overhead.py --processes N [--steps 60] [--warm-up 10] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
SMALL = {"d_model": 64, "num_layers": 2}
"""The small model's overrides (``_loops.small``): steps short enough that the host's share is large."""
RUN_TIMEOUT_S = 300
"""A job that has not ended after this long fails the benchmark."""


def _env() -> dict[str, str]:
    """The environment of every job: no plugins but the built-in ones, on either side."""
    return {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}


def trainer_mp_intervals(processes: int, steps: int, warm_up: int, run_dir: Path) -> list[float]:
    """The trainer on ``cluster=multiprocess``: the intervals between the step ends of its events, after ``warm_up``
    steps."""
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run([
            sys.executable, "-m", "elastic_trainer", "cluster=multiprocess", f"cluster.num_processes={processes}",
            "cluster.devices_per_process=1", *(f"model.{k}={v}" for k, v in SMALL.items()),
            f"trainer.global_batch_size={2 * processes}", f"trainer.steps={warm_up + steps}",
            "checkpoint.enabled=false", f"hydra.run.dir={run_dir}",
        ], check=True, timeout=RUN_TIMEOUT_S, stdout=log, stderr=subprocess.STDOUT, env=_env())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    ends = [e["end"] for e in events if e["event"] == "step"]
    return list(np.diff(ends)[warm_up - 1:])  # the intervals ending at steps warm_up + 1 .. warm_up + steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bare_mp_intervals(processes: int, steps: int, warm_up: int, run_dir: Path) -> list[float]:
    """The bare ``jax.distributed`` loop on ``processes`` processes: process 0's intervals between step ends, after
    ``warm_up`` steps."""
    run_dir.mkdir()
    out, coordinator = run_dir / "intervals.json", f"127.0.0.1:{_free_port()}"
    logs = [open(run_dir / f"process{i}.log", "w") for i in range(processes)]
    workers = [subprocess.Popen([
        sys.executable, str(HERE / "_bare_multiprocess.py"), "--coordinator", coordinator,
        "--processes", str(processes), "--process-id", str(i), "--global-batch", str(2 * processes),
        "--d-model", str(SMALL["d_model"]), "--layers", str(SMALL["num_layers"]),
        "--steps", str(steps), "--warm-up", str(warm_up), "--out", str(out),
    ], cwd=HERE, stdout=log, stderr=subprocess.STDOUT, env=_env()) for i, log in enumerate(logs)]
    try:
        codes = [worker.wait(timeout=RUN_TIMEOUT_S) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        for log in logs:
            log.close()
    if any(codes):
        sys.exit(f"the bare loop failed (exit codes {codes}); see {run_dir}/process*.log")
    return json.loads(out.read_text())


def main_processes(processes: int, steps: int, warm_up: int, rounds: int) -> None:
    """The trainer on ``cluster=multiprocess`` against the bare ``jax.distributed`` loop, in alternating rounds."""
    work = Path(tempfile.mkdtemp(prefix="et_overhead_mp_"))
    print(f"small model (d_model 64, 2 layers, batch {2 * processes}), {processes} processes x 1 CPU device, "
          f"{steps} steps after {warm_up}; runs in {work}", flush=True)
    rates: dict[str, list[float]] = {"bare": [], "trainer": []}
    for round_ in range(rounds):
        runs = [("bare", bare_mp_intervals), ("trainer", trainer_mp_intervals)]
        for name, run in runs[::-1] if round_ % 2 else runs:
            rates[name].append(1 / statistics.median(run(processes, steps, warm_up, work / f"{name}{round_}")))
        print(f"round {round_ + 1}: bare {rates['bare'][-1]:.2f} steps/s, trainer {rates['trainer'][-1]:.2f} "
              f"steps/s, ratio {rates['trainer'][-1] / rates['bare'][-1]:.3f}", flush=True)
    bare, trainer = statistics.median(rates["bare"]), statistics.median(rates["trainer"])
    print(f"median: bare {bare:.2f} steps/s ({1e3 / bare:.1f} ms/step), trainer {trainer:.2f} steps/s "
          f"({1e3 / trainer:.1f} ms/step)")
    print(f"overhead_ratio={trainer / bare:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="the small model on this many simulated devices (even); default: the default job")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a run: default 100, or 60 with --processes")
    parser.add_argument("--rounds", type=int, default=None, help="default: 7, or 5 with --processes")
    parser.add_argument("--processes", type=int, default=None,
                        help="the trainer on cluster=multiprocess against a bare jax.distributed loop, N processes")
    parser.add_argument("--warm-up", type=int, default=10, help="with --processes: steps left out of each run")
    args = parser.parse_args()
    if args.processes is not None:
        if args.processes < 2:
            parser.error(f"--processes must be at least 2, got {args.processes}")
        if args.devices is not None:
            parser.error("--devices is for the simulated cluster; leave it out with --processes")
        if args.warm_up < 1:
            parser.error(f"--warm-up must be at least 1 (the first step compiles), got {args.warm_up}")
        main_processes(args.processes, 60 if args.steps is None else args.steps, args.warm_up, args.rounds or 5)
        return
    args.steps, args.rounds = args.steps or 100, args.rounds or 7
    if args.devices is not None and (args.devices < 2 or args.devices % 2):
        parser.error(f"--devices must be an even number of at least 2, got {args.devices}")
    import _loops

    _loops.configure(args.devices or _loops.DEFAULT_JOB.devices)
    work = _loops.DEFAULT_JOB if args.devices is None else _loops.small(args.devices)
    print(work.name, flush=True)
    ratios = []
    for round_ in range(args.rounds):
        runs = [("bare", _loops.bare_intervals), ("trainer", _loops.trainer_intervals)]
        ms = {name: _loops.median_ms(run(work, args.steps)) for name, run in (runs[::-1] if round_ % 2 else runs)}
        ratios.append(ms["bare"] / ms["trainer"])
        print(f"round {round_ + 1}: bare {ms['bare']:.2f} ms/step, trainer {ms['trainer']:.2f} ms/step, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"overhead_ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
