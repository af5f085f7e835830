"""What a failure costs: recovery per strategy, and badput against a MaxText-style loop, by where the failure lands.

Every run is a fresh process (``python -m elastic_trainer``, or
``benchmarks/maxtext_style.py``) that loses slice 1 during a step (back after
``--down-for-s`` seconds); all share one new JAX persistent compilation cache,
so the first run starts cold:

1. cold: ``scale_down``, early failure; prints how long the recovery waited
   for its compile and which layouts were ready when the slice was lost;
2. warm (the same job ran before): ``scale_down`` early and late,
   ``pause_resume`` late, ``full_restart`` early and late, ``hot_swap`` early
   and late (``cluster.spare_slices=1``: a spare slice takes slice 1's place;
   after a warm-up run of its own, its layouts being other programs), and the
   MaxText-style
   loop (``maxtext_style.py``: donating step, Orbax checkpoint every
   ``--maxtext-checkpoint-period`` steps, ``elastic_retry``, restore onto the
   new mesh and recompile) early and late. One row per run: ``recovery_s``
   (failure raised to the end of the first step after it) and its parts, the
   steps lost, and ``recovery_s`` in median step times of that run;
3. badput per failure: the MaxText-style loop with a checkpoint every
   ``--badput-period`` steps (100, as the seed's demo ran MaxText) and
   ``scale_down``, each with the failure at the same 5 positions spread over one
   period (``--positions``), every run of the same length (the learning-rate
   schedule's decay is ``trainer.steps``, so each length is other programs) and
   after one warm-up run of each loop. ``scale_down`` twice: the slice lost before the
   step is launched (chaos's ``train_step`` phase: its state is whole on the
   other slices) and while the step runs (``update``: the step has taken the
   state, which comes back from the host snapshot, ``trainer.snapshot_period``).
   A failure's badput is the time from the failure until the run is back where
   it would have been: the end of the step it interrupted, done again, less one
   step time; restarts, restores, compiles and the steps trained again
   included.

Then ``swap_ratio=...`` (``hot_swap``'s ``recovery_s`` over ``scale_down``'s at
the same step, the worse of early and late; each of those four rows is the
run of median ``recovery_s`` of ``--swap-repeats`` runs, 5 by default, the two
strategies' runs taken in turn), ``peer_ratio=...`` (MaxText-style
``recovery_s`` over ``scale_down``'s at the same step, the worse of early and
late; a MaxText-style loop also trains
its lost steps again, listed but not in the ratio), ``recovery_ratio=...``
(``full_restart`` over ``scale_down``, warm, the worse of early and late) and,
last, ``badput_ratio=...``: the MaxText-style loop's mean badput over
``scale_down``'s, the worse of its two kinds of failure.

With ``--sizes``, only the badput comparison, for the default model, for
``model.d_model=512 model.num_layers=4`` and for the largest model measured
here at 1 step/s or more (``LARGEST``): a table of recovery and badput against
the state's bytes, and a plot (``--plot``).

    python benchmarks/recovery.py [--steps 160] [--early 50] [--late 120] [--positions 3 21 47 65 89] [--swap-repeats 5]
    python benchmarks/recovery.py --sizes [--plot benchmarks/results/recovery_sizes.png]
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
LARGEST = ["model.d_model=384", "model.num_layers=3"]
"""The largest model measured at 1 step/s or more on 2 cores, 8 simulated devices, global batch 48: 0.82 s a step
of the bare loop (``d_model=256``, 4 layers, as fast with a smaller state; ``d_model=384``, 4 layers, 1.24 s;
``d_model=512``, 4 layers, 1.97 s)."""
SIZES = {"default": [], "d384_l3": LARGEST, "d512_l4": ["model.d_model=512", "model.num_layers=4"]}
AFTER_LAST_FAILURE = 8
"""Steps a badput run trains after the last position's failure: enough to be back and to time its steps."""


def trainer_run(strategy: str, fail_at: int, run_dir: Path, steps: int, env: dict, *, down_for_s: float,
                checkpoint_period: int, phase: str = "train_step", overrides: tuple[str, ...] = ()) -> dict:
    """Run the default job with ``strategy``, slice 1 lost in ``phase`` of the step after ``fail_at``; the row of
    its failure."""
    failure = f"[{{at_step: {fail_at}, slice: 1, down_for_s: {down_for_s}, phase: {phase}}}]"
    subprocess.run([
        sys.executable, "-m", "elastic_trainer", f"+strategy={strategy}", "+chaos=schedule",
        f"chaos.failures={failure}", f"trainer.steps={steps}", f"checkpoint.period={checkpoint_period}",
        f"hydra.run.dir={run_dir}", *overrides,
    ], check=True, stdout=subprocess.DEVNULL, env=env)
    report = json.loads((run_dir / "report.json").read_text())
    (failure_record,) = report["failures"]
    if strategy == "full_restart":  # the parts are the new worker's start-up
        worker = json.loads((run_dir / "report.worker1.json").read_text())["badput_s"]
        parts = {"restart": worker["startup"], "compile": worker["compile"], "restore": worker["checkpoint_restore"]}
    else:
        parts = {"restart": 0.0, "compile": failure_record["compile_s"], "restore": failure_record["restore_s"]}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps_done = [(e["step"], e["end"]) for e in events if e["event"] == "step"]
    return {
        "recovery_s": failure_record["recovery_s"], "detection": failure_record["detection_s"],
        "waiting": failure_record.get("waiting_s", 0.0), "remesh": failure_record.get("remesh_s", 0.0), **parts,
        "lost_steps": failure_record["lost_steps"], "restored_from": failure_record["restored_from"],
        "step_s": statistics.median(e["end"] - e["time"] for e in events if e["event"] == "step"),
        "failed_at": failure_record["failed_at"], "fail_at": fail_at, "steps_done": steps_done, "report": report,
    }


def maxtext_run(fail_at: int, run_dir: Path, steps: int, env: dict, *, down_for_s: float, checkpoint_period: int,
                overrides: tuple[str, ...] = ()) -> dict:
    """Run the MaxText-style loop, slice 1 lost during the step after ``fail_at``; the row of its failure."""
    subprocess.run([
        sys.executable, str(MAXTEXT_STYLE), str(run_dir), f"--fail-at={fail_at}", f"--steps={steps}",
        f"--down-for-s={down_for_s}", f"--checkpoint-period={checkpoint_period}", *overrides,
    ], check=True, stdout=subprocess.DEVNULL, env=env)
    (failure,) = json.loads((run_dir / "report.json").read_text())["failures"]
    log = json.loads((run_dir / "maxtext_style.json").read_text())
    return {
        "recovery_s": failure["recovery_s"], "detection": failure["detection_s"],
        "waiting": failure.get("waiting_s", 0.0), "remesh": 0.0, "restart": 0.0, "compile": float("nan"),
        "restore": float("nan"), "lost_steps": fail_at - log["started_from"][-1], "restored_from": "checkpoint",
        "step_s": statistics.median(end - began for _, began, end in log["steps"]),
        "failed_at": failure["failed_at"], "fail_at": fail_at,
        "steps_done": [(step + 1, end) for step, _, end in log["steps"]],
    }


def badput_s(row: dict) -> float:
    """From the failure until the end of the step it interrupted, done again, less one step time."""
    back = min(end for done, end in row["steps_done"] if done == row["fail_at"] + 1 and end > row["failed_at"])
    return back - row["failed_at"] - row["step_s"]


def ready_when_lost(report: dict) -> tuple[list[list[int]], int]:
    """The layouts whose step was ready when the slice was lost, and how many were asked for in the run."""
    lost_at = report["failures"][0]["failed_at"]
    layouts = report["compile_cache"]["layouts"]
    return [layout["slices"] for layout in layouts if layout["ready_at"] and layout["ready_at"] <= lost_at], len(layouts)


SWAP_COMPARED = ("scale_down", "hot_swap")
"""The strategies whose rows ``swap_ratio`` compares: each row is the median of ``--swap-repeats`` runs, since a
recovery of 0.2 s varies by a tenth from run to run on shared cores (a background save, a collection); their runs
alternate, one of each in turn, at each failure step."""

BADPUT_KINDS = {"maxtext_style": None, "scale_down before launch": "train_step", "scale_down while running": "update"}


def badput_rows(tmp: Path, env: dict, args: argparse.Namespace, overrides: tuple[str, ...] = ()) -> dict[str, list]:
    """Every kind of :data:`BADPUT_KINDS` with its failure at each of ``args.positions``: the rows by kind."""
    rows: dict[str, list] = {kind: [] for kind in BADPUT_KINDS}
    tag = "-".join(o.replace("=", "") for o in overrides) or "default"
    steps = max(args.positions) + AFTER_LAST_FAILURE  # one length for every run: the learning-rate schedule
    # depends on it, so runs of other lengths compile other programs and would each recover on a cold cache
    first = args.positions[0]  # both loops' programs, the new layout's included, into the compilation cache first
    warm = {"down_for_s": args.down_for_s, "checkpoint_period": args.badput_period, "overrides": overrides}
    maxtext_run(first, tmp / f"warm-maxtext-{tag}", steps, env, **warm)
    trainer_run("scale_down", first, tmp / f"warm-trainer-{tag}", steps, env, **warm)
    for position in args.positions:
        for kind, phase in BADPUT_KINDS.items():
            run_dir = tmp / f"badput-{tag}-{kind.replace(' ', '_')}-{position}"
            if phase is None:
                row = maxtext_run(position, run_dir, steps, env, down_for_s=args.down_for_s,
                                  checkpoint_period=args.badput_period, overrides=overrides)
            else:
                row = trainer_run("scale_down", position, run_dir, steps, env, down_for_s=args.down_for_s,
                                  checkpoint_period=args.badput_period, phase=phase, overrides=overrides)
            rows[kind].append({**row, "badput_s": badput_s(row)})
        print(f"  failure at step {position}: " + ", ".join(
            f"{kind} {rows[kind][-1]['badput_s']:.2f} s ({rows[kind][-1]['lost_steps']} lost)" for kind in rows),
            flush=True)
    return rows


def print_badput(rows: dict[str, list]) -> float:
    """The badput table; returns the MaxText-style mean over the worse of scale_down's two kinds."""
    print(f"{'badput per failure':<28}{'mean s':>9}{'recovery s':>12}{'lost steps':>12}{'step s':>8}  by position (s)")
    for kind, runs in rows.items():
        print(f"{kind:<28}{statistics.mean(r['badput_s'] for r in runs):>9.2f}"
              f"{statistics.mean(r['recovery_s'] for r in runs):>12.2f}"
              f"{statistics.mean(r['lost_steps'] for r in runs):>12.1f}{statistics.median(r['step_s'] for r in runs):>8.3f}"
              "  " + ", ".join(f"{r['fail_at']}: {r['badput_s']:.2f}" for r in runs))
    ours = max(statistics.mean(r["badput_s"] for r in runs) for kind, runs in rows.items() if kind != "maxtext_style")
    return statistics.mean(r["badput_s"] for r in rows["maxtext_style"]) / ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--early", type=int, default=50, help="the early failure's step")
    parser.add_argument("--late", type=int, default=120, help="the late failure's step")
    parser.add_argument("--down-for-s", type=float, default=5.0)
    parser.add_argument("--checkpoint-period", type=int, default=50, help="the trainer's checkpoint period")
    parser.add_argument("--maxtext-checkpoint-period", type=int, default=10)
    parser.add_argument("--badput-period", type=int, default=100, help="both loops' checkpoint period for badput")
    parser.add_argument("--positions", type=int, nargs="+", default=[3, 21, 47, 65, 89],
                        help="the badput failures' steps, spread over one --badput-period")
    parser.add_argument("--swap-repeats", type=int, default=5,
                        help="runs of each row swap_ratio compares (the median's row is shown)")
    parser.add_argument("--sizes", action="store_true", help="only the badput comparison, for three model sizes")
    parser.add_argument("--plot", type=Path, default=None, help="with --sizes: write the plot here")
    args = parser.parse_args()
    if args.swap_repeats < 1:
        parser.error(f"--swap-repeats must be at least 1, got {args.swap_repeats}")
    if max(args.positions) >= args.badput_period:
        parser.error("--positions must fall within one --badput-period")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(Path(tmp) / "jax_cache")}  # new: the first run is cold
        if args.sizes:
            sizes(Path(tmp), env, args)
            return
        recovery(Path(tmp), env, args)


def recovery(tmp: Path, env: dict, args: argparse.Namespace) -> None:
    """Sections 1 to 3 of the docstring, and the three ratios."""
    run = {"down_for_s": args.down_for_s, "checkpoint_period": args.checkpoint_period}
    cold = trainer_run("scale_down", args.early, tmp / "cold", args.steps, env, **run)
    ready, asked = ready_when_lost(cold["report"])
    print(f"cold cache, scale_down, failure at step {args.early}: recovery {cold['recovery_s']:.3f} s, of which "
          f"{cold['compile']:.3f} s waiting for its compile; ready when the slice was lost: {ready} "
          f"({len(ready)} of the {asked} layouts asked for in the run)", flush=True)
    rows: dict[str, dict] = {}
    spares = ("cluster.spare_slices=1",)  # the swap's cluster: its layouts are other programs, warmed up as well
    trainer_run("hot_swap", args.early, tmp / "hot_swap-warm-up", args.steps, env, overrides=spares, **run)
    compared: dict[str, list[dict]] = {}
    for n in range(args.swap_repeats):  # interleaved: a drift of the machine's speed reaches both alike
        for fail_at in (args.early, args.late):
            for strategy in SWAP_COMPARED:
                compared.setdefault(f"{strategy}@{fail_at}", []).append(trainer_run(
                    strategy, fail_at, tmp / f"{strategy}-{fail_at}-{n}", args.steps, env,
                    overrides=spares if strategy == "hot_swap" else (), **run))
    for name, runs in compared.items():
        rows[name] = sorted(runs, key=lambda row: row["recovery_s"])[len(runs) // 2]
    for strategy, fail_at in [("pause_resume", args.late), ("full_restart", args.early), ("full_restart", args.late)]:
        rows[f"{strategy}@{fail_at}"] = trainer_run(strategy, fail_at, tmp / f"{strategy}-{fail_at}", args.steps, env,
                                                    **run)
    maxtext = {"down_for_s": args.down_for_s, "checkpoint_period": args.maxtext_checkpoint_period}
    maxtext_run(args.early, tmp / "maxtext-warm-up", args.steps, env, **maxtext)  # its own steps into the cache
    for fail_at in (args.early, args.late):
        rows[f"maxtext_style@{fail_at}"] = maxtext_run(fail_at, tmp / f"maxtext-{fail_at}", args.steps, env, **maxtext)
    print("warm cache:")
    print(f"{'run':<20}" + "".join(f"{c:>12}" for c in COLUMNS) + f"{'lost_steps':>12}{'step_s':>9}"
          f"{'in steps':>10}  restored_from")
    for name, row in rows.items():
        print(f"{name:<20}" + "".join(f"{row[c]:>12.3f}" for c in COLUMNS) + f"{row['lost_steps']:>12}"
              f"{row['step_s']:>9.3f}{row['recovery_s'] / row['step_s']:>10.1f}  {row['restored_from']}")
    print(f"badput, checkpoints every {args.badput_period} steps, failures at steps {args.positions}:", flush=True)
    badput = print_badput(badput_rows(tmp, env, args))
    steps = (args.early, args.late)
    swap = max(rows[f"hot_swap@{s}"]["recovery_s"] / rows[f"scale_down@{s}"]["recovery_s"] for s in steps)
    peer = min(rows[f"maxtext_style@{s}"]["recovery_s"] / rows[f"scale_down@{s}"]["recovery_s"] for s in steps)
    restart = min(rows[f"full_restart@{s}"]["recovery_s"] / rows[f"scale_down@{s}"]["recovery_s"] for s in steps)
    print(f"swap_ratio={swap:.2f}")
    print(f"peer_ratio={peer:.1f}")
    print(f"recovery_ratio={restart:.1f}")
    print(f"badput_ratio={badput:.1f}")


def state_bytes(overrides: list[str]) -> int:
    """The train state's bytes (parameters and optimizer state) of the default job with ``overrides``."""
    os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")
    import jax
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    import elastic_trainer.plugin as etp
    from elastic_trainer.config._schemas import register_configs
    from elastic_trainer.launch._cli import CONFIG_MODULE

    register_configs()
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        cfg = compose("config", overrides=overrides)
    optimizer = instantiate(cfg.optimizer)
    state = jax.eval_shape(lambda: etp.init_train_state(instantiate(cfg.model, key=jax.random.key(0)), optimizer,
                                                        key=jax.random.key(1)))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state) if hasattr(leaf, "dtype"))


def sizes(tmp: Path, env: dict, args: argparse.Namespace) -> None:
    """The badput comparison per model size: a table against the state's bytes, and the plot."""
    table = []
    for name, overrides in SIZES.items():
        print(f"{name} ({' '.join(overrides) or 'the default model'}):", flush=True)
        rows = badput_rows(tmp, env, args, tuple(overrides))
        print_badput(rows)
        table.append((name, state_bytes(overrides) / 1e6, rows))
    print("\n| model | state (MB) | step (s) | " + " | ".join(
        f"{kind}: badput s (recovery s, lost steps)" for kind in BADPUT_KINDS) + " | ratio |")
    print("|---|---|---|" + "---|" * len(BADPUT_KINDS) + "---|")
    for name, state_mb, rows in table:
        means = {kind: [statistics.mean(r[key] for r in runs) for key in ("badput_s", "recovery_s", "lost_steps")]
                 for kind, runs in rows.items()}
        ratio = means["maxtext_style"][0] / max(m[0] for kind, m in means.items() if kind != "maxtext_style")
        step_s = statistics.median(r["step_s"] for r in rows["scale_down before launch"])
        print(f"| {name} | {state_mb:.1f} | {step_s:.3f} | " + " | ".join(
            f"{b:.2f} ({r:.2f}, {lost:.1f})" for b, r, lost in means.values()) + f" | {ratio:.1f} |")
    if args.plot:
        plot_sizes(table, args.plot)
        print(f"plot: {args.plot}")


def plot_sizes(table: list, path: Path) -> None:
    """Badput and recovery per failure against the state's bytes, one line per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind in BADPUT_KINDS:
        x = [state_mb for _, state_mb, _ in table]
        for ax, key in zip(axes, ("badput_s", "recovery_s"), strict=True):
            ax.plot(x, [statistics.mean(r[key] for r in rows[kind]) for *_, rows in table], marker="o", label=kind)
    for ax, title in zip(axes, ("badput per failure (s)", "recovery per failure (s)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("train state (MB)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
