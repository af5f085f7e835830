"""Synchronous data parallel against DiLoCo under the same failures: loss at equal samples, goodput, wall time and
cross-slice collectives per step.

Every row is a fresh process training the default job (``python -m elastic_trainer``'s model, data and
optimizer; 4 simulated slices of 2 CPU devices, global batch 48) for ``--steps`` steps, under one failure
schedule:

- ``none``: no failure;
- ``one_lost``: slice 2 lost for good as step ``steps // 2`` starts;
- ``periodic``: ``+chaos=periodic`` (one failure in every 100 steps, at a seeded step, on a seeded slice, back
  0.5 s later).

The synchronous row is ``scale_down`` with ``batch_policy=keep_per_device`` and ``lr_scaling=none``: like
``diloco``, each slice keeps its share of the batch (12 samples) whatever slices are left, so both read the same
samples at the same steps and are compared at equal samples. ``diloco`` runs with ``inner_steps`` 10 and 50
(``--inner-steps``). Each row reports:

- ``eval_loss``: the final parameters' next-token loss on 512 held-out samples (positions 40,000 on of the data
  order's first epoch, which no run reaches: 300 steps read 14,400);
- ``consumed`` and ``skipped``: the report's samples (``diloco`` skips a dropped replica's samples since the last
  outer step);
- ``goodput``, ``wall_s``, ``pause_s`` (detection, waiting, restore and re-mesh badput: the time every slice
  stood still for a failure) and the median step time;
- ``cross_slice_per_step``: the collectives per step whose devices span several slices, counted in the compiled
  programs' HLO (``all-reduce``, ``all-gather``, ``reduce-scatter``, ``collective-permute``, ``all-to-all``):
  the synchronous step's every step; ``diloco``'s outer step's, once every ``inner_steps`` steps (each
  slice's own program has collectives within the slice only).

Writes ``benchmarks/results/diloco/results.json`` and ``loss.png`` (the training loss against samples, and the
held-out loss per row) and prints the table; the README's "Semi-synchronous training" shows them.

    python benchmarks/diloco.py [--steps 300] [--inner-steps 10 50] [--schedules none one_lost periodic]
    python benchmarks/diloco.py --replot   # the table and plot again from the results written
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "diloco"
HELD_OUT = (40_000, 512)
"""Where the held-out samples start in the data order, and how many."""
COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")
SYNCHRONOUS = ["+strategy=scale_down", "strategy.batch_policy=keep_per_device", "strategy.lr_scaling=none"]


def schedule_overrides(schedule: str, steps: int) -> list[str]:
    """The chaos overrides of ``schedule``."""
    return {
        "none": [],
        "one_lost": ["+chaos=schedule", f"chaos.failures=[{{at_step: {steps // 2}, slice: 2, down_for_s: 1e9}}]"],
        "periodic": ["+chaos=periodic"],
    }[schedule]


def cross_slice_collectives(executables, slice_of_device: dict[int, int]) -> int:
    """The collectives in ``executables``' HLO whose programs span devices of more than one slice."""
    count = 0
    for executable in executables:
        devices = {device.id for sharding in executable.input_shardings[0] for s in _leaves(sharding)
                   for device in s.device_set}
        if len({slice_of_device[d] for d in devices}) > 1:
            count += len(COLLECTIVE.findall(executable.as_text()))
    return count


def _leaves(tree):
    import jax  # noqa: PLC0415 - the row's process only

    return jax.tree.leaves(tree)


def run_row(strategy: str, inner_steps: int | None, schedule: str, steps: int) -> dict:
    """Train one row in this process; its results."""
    import equinox as eqx  # noqa: PLC0415 - only a row's process starts JAX
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from hydra import compose, initialize_config_module  # noqa: PLC0415

    import elastic_trainer as et  # noqa: PLC0415
    from elastic_trainer.config._build import build_trainer  # noqa: PLC0415
    from elastic_trainer.config._schemas import register_configs  # noqa: PLC0415

    strategy_overrides = SYNCHRONOUS if strategy == "scale_down" else [
        "+strategy=diloco", f"strategy.inner_steps={inner_steps}"]
    register_configs()
    with initialize_config_module("elastic_trainer_conf", version_base=None):
        cfg = compose("config", overrides=[f"trainer.steps={steps}", "checkpoint.enabled=false",
                                           *strategy_overrides, *schedule_overrides(schedule, steps)])
    trainer = build_trainer(cfg)
    state, report = trainer.fit()
    start, count = HELD_OUT
    ids = et.sample_ids(trainer.data.num_samples, seed=cfg.seed, start=start, count=count)
    batch = jax.numpy.asarray(trainer.data.get_batch(ids))
    model = eqx.nn.inference_mode(state.params)  # dropout off
    eval_loss = float(eqx.filter_jit(lambda m, b: trainer.loss_fn(m, b, key=None))(model, batch))
    slice_of = {d.id: s for s, devices in enumerate(trainer.cluster.slice_devices()) for d in devices}
    collectives = cross_slice_collectives(trainer._state.layout.compiled.executables, slice_of)
    per_step = collectives / inner_steps if inner_steps else collectives
    seconds = list(trainer._ctx.history.seconds.values())[5:]
    losses = list(report.history.metrics["loss"])
    sizes = [len(trainer.ledger.ids_of(step)) for step in sorted(trainer._ctx.history.slices)]
    badput = report.badput_s
    return {
        "strategy": strategy if strategy == "scale_down" else f"diloco H={inner_steps}", "schedule": schedule,
        "steps": report.steps_completed, "eval_loss": eval_loss, "final_train_loss": report.final_loss,
        "consumed": report.samples.consumed, "skipped": report.samples.skipped,
        "failures": len(report.failures), "goodput": report.goodput, "wall_s": report.wall_s,
        "pause_s": badput.detection + badput.waiting_for_slices + badput.checkpoint_restore + badput.remesh,
        "step_s": statistics.median(seconds), "cross_slice_per_step": per_step,
        "losses": losses, "samples_read": np.cumsum(sizes).tolist(),
    }


def table(rows: list[dict]) -> str:
    """The results as a Markdown table."""
    lines = ["| schedule | strategy | held-out loss | samples trained (skipped) | failures | pause s | goodput | "
             "wall s | median step s | cross-slice collectives / step |", "|---" * 10 + "|"]
    for row in rows:
        lines.append(
            f"| {row['schedule']} | {row['strategy']} | {row['eval_loss']:.3f} | {row['consumed']:,} "
            f"({row['skipped']}) | {row['failures']} | {row['pause_s']:.2f} | {row['goodput']:.3f} | "
            f"{row['wall_s']:.1f} | {row['step_s']:.3f} | {row['cross_slice_per_step']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """The training loss against samples read (``one_lost``, or the first schedule), and the held-out loss per
    row."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    shown = "one_lost" if any(r["schedule"] == "one_lost" for r in rows) else rows[0]["schedule"]
    for row in (r for r in rows if r["schedule"] == shown):
        window = 10
        smooth = [statistics.fmean(row["losses"][max(0, i - window + 1): i + 1]) for i in range(len(row["losses"]))]
        curves.plot(row["samples_read"], smooth, label=row["strategy"])
    curves.set(xlabel="samples read", ylabel=f"training loss (mean of {10} steps)",
               title=f"schedule {shown} (diloco: mean of the replicas' own losses)")
    curves.legend()
    labels = [f"{r['strategy'].replace('scale_down', 'sync')}\n{r['schedule']}" for r in rows]
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    bars.bar(range(len(rows)), [r["eval_loss"] for r in rows], color=[f"C{names.index(r['strategy'])}" for r in rows])
    bars.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
    low = min(r["eval_loss"] for r in rows)
    bars.set_ylim(low * 0.95, max(r["eval_loss"] for r in rows) * 1.02)
    bars.set(ylabel="held-out loss of the final parameters", title="held-out loss")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--schedules", nargs="+", default=["none", "one_lost", "periodic"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", action="store_true", help="the table and plot again from --out's results.json")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a JSON row to run in this process
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(**json.loads(args.row))))
        return
    if args.replot:
        rows = json.loads((args.out / "results.json").read_text())
        plot(rows, args.out / "loss.png")
        print(table(rows))
        return
    rows = []
    for schedule in args.schedules:
        for strategy, inner in [("scale_down", None), *(("diloco", h) for h in args.inner_steps)]:
            row = json.dumps({"strategy": strategy, "inner_steps": inner, "schedule": schedule, "steps": args.steps})
            print(f"running {row}", file=sys.stderr, flush=True)
            result = subprocess.run([sys.executable, __file__, "--row", row], capture_output=True, text=True,
                                    check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")  # a row a line
    plot(rows, args.out / "loss.png")
    print(table(rows))


if __name__ == "__main__":
    main()
