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
the rounds: ``checkpoint_overhead=0.021`` (``--rounds 0`` skips it).

Then what the arrays' checksums cost: the default model's train state (on
the default mesh, after a few steps) is saved to commit and restored again
and again, with checksums and with the checksums left out (the same
Checkpointer with its checksum functions replaced by no-ops), alternating.
Prints the median ratios, with / without, for a save and for a restore, and
as the last line the larger of the two: ``checksum_overhead=1.03``.

    python benchmarks/checkpoint_overhead.py [--rounds 5] [--checksum-rounds 10] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from unittest import mock

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402

import elastic_trainer as et  # noqa: E402
from elastic_trainer.launch._cli import CONFIG_MODULE  # noqa: E402
from elastic_trainer.config._build import build_trainer  # noqa: E402
from elastic_trainer.config._schemas import register_configs  # noqa: E402


def run(overrides: list[str], *, checkpoints: bool) -> et.FitResult:
    """One default run; returns its state and report."""
    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            cfg = compose("config", overrides=[*overrides, f"checkpoint.enabled={str(checkpoints).lower()}"])
        return build_trainer(cfg, run_dir=run_dir).fit()


def save_and_restore_s(checkpointer: et.Checkpointer, step: int, arrays) -> tuple[float, float]:
    """Seconds to save ``arrays`` as ``step`` until committed, and to restore them onto the same shardings."""
    began = time.perf_counter()
    checkpointer.save(step, arrays, {"step": step})
    checkpointer.wait()
    saved = time.perf_counter()
    restored, _ = checkpointer.restore(step, like=arrays)
    jax.block_until_ready(restored)
    return saved - began, time.perf_counter() - saved


def checksum_ratios(overrides: list[str], rounds: int) -> tuple[float, float]:
    """The median ratios of a save's and a restore's seconds with checksums to without, alternating."""
    state = run([*overrides, "trainer.steps=12"], checkpoints=False).state
    arrays = eqx.filter(state, eqx.is_array)
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as directory:
        checkpointer = et.Checkpointer(directory, max_to_keep=2)
        save_and_restore_s(checkpointer, 0, arrays)  # compiles the checksums; warms Orbax
        for round_ in range(2 * rounds):
            with_checksums = bool(round_ % 2)
            if with_checksums:
                times[True].append(save_and_restore_s(checkpointer, round_ + 1, arrays))
            else:
                with mock.patch("elastic_trainer.checkpoints._checkpointer.checksums", lambda arrays: {}), \
                        mock.patch("elastic_trainer.checkpoints._checkpointer.verify_checksums", lambda arrays, saved: None):
                    times[False].append(save_and_restore_s(checkpointer, round_ + 1, arrays))
        checkpointer.close()
    save = statistics.median(w[0] / wo[0] for w, wo in zip(times[True], times[False]))
    restore = statistics.median(w[1] / wo[1] for w, wo in zip(times[True], times[False]))
    return save, restore


def training_s(report: et.RunReport) -> float:
    return report.wall_s - report.badput_s.startup - report.badput_s.compile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checksum-rounds", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs, e.g. trainer.steps=200")
    args = parser.parse_args()
    register_configs()
    overheads = []
    for round_ in range(args.rounds):
        order = (True, False) if round_ % 2 else (False, True)  # alternate, so drift on a shared machine cancels
        reports = {checkpoints: run(args.overrides, checkpoints=checkpoints).report for checkpoints in order}
        on, off = reports[True], reports[False]
        overheads.append((training_s(on) - training_s(off)) / off.wall_s)
        print(
            f"round {round_ + 1}: off {off.wall_s:.1f} s wall ({training_s(off):.1f} s training), "
            f"on {on.wall_s:.1f} s wall ({training_s(on):.1f} s training, {on.badput_s.checkpoint_save:.2f} s "
            f"blocked on saves), overhead {overheads[-1]:.3f}",
            flush=True,
        )
    if overheads:
        print(f"checkpoint_overhead={statistics.median(overheads):.3f}")
    save, restore = checksum_ratios(args.overrides, args.checksum_rounds)
    print(f"checksum_save_ratio={save:.3f}  checksum_restore_ratio={restore:.3f}  (with / without checksums)")
    print(f"checksum_overhead={max(save, restore):.3f}")


if __name__ == "__main__":
    main()
