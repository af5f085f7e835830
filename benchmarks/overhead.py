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

    python benchmarks/overhead.py [--devices N] [--steps 100] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="the small model on this many simulated devices (even); default: the default job")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
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
