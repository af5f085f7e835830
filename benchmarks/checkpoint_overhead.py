"""Checkpoint overhead: the default run with Orbax checkpoints on, against off.

Both runs are the default job (``python -m elastic_trainer``: 300 steps,
a checkpoint every 100 steps and at the last step, asynchronous saves),
built from the same Hydra config, side by side in this process, for several
rounds with the order alternating. Start-up and step compilation are the same
work in both runs and their noise on a shared machine is larger than the
effect measured, so they are left out of the difference: the overhead of a
round is (training time with checkpoints - training time without) / wall time
without, where training time is wall time less start-up and compile. It
includes the time the step loop blocked on saves, the final wait for the last
commit, and steps slowed by Orbax's background writes. Prints the median over
the rounds as the last line: ``checkpoint_overhead=0.021``.

    python benchmarks/checkpoint_overhead.py [--rounds 5] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

from hydra import compose, initialize_config_module  # noqa: E402

from elastic_trainer.launch._cli import CONFIG_MODULE  # noqa: E402
from elastic_trainer.config._build import build_trainer  # noqa: E402
from elastic_trainer.config._schemas import register_configs  # noqa: E402


def run(overrides: list[str], *, checkpoints: bool) -> dict:
    """One default run; returns its report."""
    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            cfg = compose("config", overrides=[*overrides, f"checkpoint.enabled={str(checkpoints).lower()}"])
        return build_trainer(cfg, run_dir=run_dir).fit().report


def training_s(report: dict) -> float:
    return report["wall_s"] - report["badput_s"]["startup"] - report["badput_s"]["compile"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs, e.g. trainer.steps=200")
    args = parser.parse_args()
    register_configs()
    overheads = []
    for round_ in range(args.rounds):
        order = (True, False) if round_ % 2 else (False, True)  # alternate, so drift on a shared machine cancels
        reports = {checkpoints: run(args.overrides, checkpoints=checkpoints) for checkpoints in order}
        on, off = reports[True], reports[False]
        overheads.append((training_s(on) - training_s(off)) / off["wall_s"])
        print(
            f"round {round_ + 1}: off {off['wall_s']:.1f} s wall ({training_s(off):.1f} s training), "
            f"on {on['wall_s']:.1f} s wall ({training_s(on):.1f} s training, {on['badput_s']['checkpoint_save']:.2f} s "
            f"blocked on saves), overhead {overheads[-1]:.3f}",
            flush=True,
        )
    print(f"checkpoint_overhead={statistics.median(overheads):.3f}")


if __name__ == "__main__":
    main()
