"""``python -m elastic_trainer.plan``: which strategy and checkpoint period for a cluster, from measured costs.

Reads the run directories given (a benchmark sweep's, by default the
committed one, or your own runs'), takes each strategy's per-event costs from
them, and simulates each strategy on the cluster described by the options.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .._failures import ConfigError, check_at_least
from ..launch._cli import EXIT_BAD_INPUT
from ._costs import StrategyCosts, strategy_costs, swap_cost, with_costs
from ._model import (
    LLAMA3_CHIPS_PER_SLICE,
    LLAMA3_DAYS,
    LLAMA3_FAILURES_PER_CHIP_HOUR,
    MEASURED_OVERHEAD_RATIO,
    REPAIR_DISTRIBUTIONS,
    REPAIR_S,
    RUNTIMES,
    SINGLE_CONTROLLER,
    FailureModel,
    Runtime,
)
from ._output import (
    THROUGHPUT,
    block_markers,
    costs_table,
    image_link,
    plan_table,
    plot_scaling,
    recovery_parts,
    scaling_table,
    spares_line,
    update_blocks,
    validation_table,
)
from ._project import Horizon, Projection, project, scaling, scenarios, spare_counts, spare_scaling, spare_scenario
from ._runs import SWAPPING, load_run, run_dirs
from ._validate import Validation, validate

DEFAULT_RUNS = Path("benchmarks/results/standard/runs")
DEFAULT_SPARE_RUNS = Path("benchmarks/results/spares/runs")
PLOTTED_SCHEDULE = "periodic"
"""The sweep's schedule whose measured runs the plot marks: the one most like failures that keep coming."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own complaints, as one sentence and exit status 2
        raise ConfigError(f"{message}.")


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line; :class:`ConfigError` for anything argparse refuses."""
    parser = _Parser(prog="python -m elastic_trainer.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, default=[DEFAULT_RUNS],
                        help=f"run directories, or folders of them (default: {DEFAULT_RUNS})")
    parser.add_argument("--slices", type=int, default=1024, help="slices of the cluster to plan for (1024)")
    parser.add_argument("--chips-per-slice", type=int, default=LLAMA3_CHIPS_PER_SLICE,
                        help=f"chips in a slice ({LLAMA3_CHIPS_PER_SLICE}: a Llama 3 server)")
    parser.add_argument("--failures-per-chip-hour", type=float, default=LLAMA3_FAILURES_PER_CHIP_HOUR,
                        help=f"each chip's failure rate ({LLAMA3_FAILURES_PER_CHIP_HOUR:.3g}: Llama 3's)")
    parser.add_argument("--repair-s", type=float, default=REPAIR_S,
                        help=f"mean seconds until a lost slice is back ({REPAIR_S:g})")
    parser.add_argument("--repair", choices=REPAIR_DISTRIBUTIONS, default="exponential",
                        help="distribution of the repair time (exponential)")
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default="single",
                        help="single: one controller (Pathways, the simulated cluster); multi: JAX's "
                             "multi-controller runtime (cluster=multiprocess)")
    parser.add_argument("--days", type=float, default=LLAMA3_DAYS, help=f"length of one simulated job ({LLAMA3_DAYS:g})")
    parser.add_argument("--min-failures", type=int, default=Horizon.min_failures,
                        help=f"simulate jobs until this many failures ({Horizon.min_failures})")
    parser.add_argument("--seed", type=int, default=0, help="seeds the simulated failures (0)")
    parser.add_argument("--spares", type=int, metavar="K",
                        help="also model swap_then_scale_down with K spare slices besides --slices, and recommend "
                             "a spare count")
    parser.add_argument("--spare-runs", nargs="+", type=Path, default=[DEFAULT_SPARE_RUNS], metavar="RUN",
                        help=f"runs that swapped spares in, where a swap's cost is measured (default: {DEFAULT_SPARE_RUNS})")
    parser.add_argument("--cost", action="append", default=[], metavar="NAME=SECONDS", type=_cost,
                        help="a what-if: this cost for every strategy instead of the measured one "
                             "(layout_compile_s=120, restart_s=60, ...), or overhead_ratio=0.95: the trainer's "
                             f"steps/s over a bare loop's (measured: {MEASURED_OVERHEAD_RATIO:g})")
    parser.add_argument("--validate", action="store_true", help="also replay every run and compare its goodput")
    parser.add_argument("--plot", type=Path, help="write goodput against slice count, 4 to 4,096, to this PNG")
    parser.add_argument("--markdown", type=Path, nargs="+", default=[],
                        help="regenerate the projection's blocks in these Markdown files")
    return parser.parse_args(argv)


def _cost(setting: str) -> tuple[str, float]:
    name, _, seconds = setting.partition("=")
    try:
        return name, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cost is NAME=SECONDS, got {setting!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Run the command; its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        _plan(parse(argv), command=shlex.join(["python", "-m", "elastic_trainer.plan", *argv]))
    except ConfigError as error:
        print(f"elastic_trainer: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _plan(args: argparse.Namespace, *, command: str) -> None:
    model = FailureModel(args.failures_per_chip_hour, args.chips_per_slice, args.repair_s, args.repair)
    horizon = Horizon(days=args.days, min_failures=args.min_failures, seed=args.seed)
    runtime = RUNTIMES[args.runtime]
    if args.spares is not None:
        check_at_least("the number of spare slices", args.spares, 0)
        if runtime is not SINGLE_CONTROLLER:
            raise ConfigError("spares are modelled on one controller only; drop --spares or use --runtime single.")
    block_names = (f"projection-{runtime.name}", "projection-validation")
    for path in args.markdown:
        if not path.is_file():
            raise ConfigError(f"{path} is not a Markdown file to regenerate blocks in.")
        if not any(block_markers(name)[0] in path.read_text() for name in block_names):
            names = " or ".join(block_markers(name)[0] for name in block_names)
            raise ConfigError(f"{path} has no {names} block to regenerate.")
    runs = [load_run(run_dir) for run_dir in run_dirs(args.runs)]
    settings = dict(args.cost)
    overhead_ratio = settings.pop("overhead_ratio", MEASURED_OVERHEAD_RATIO)
    costs = with_costs(strategy_costs(runs), settings)
    with_spares = args.spares is not None or (runtime is SINGLE_CONTROLLER and bool(args.plot or args.markdown))
    spare_runs = [load_run(run_dir, SWAPPING) for run_dir in run_dirs(args.spare_runs)] if with_spares else []
    swap = swap_cost(spare_runs, settings) if with_spares else None
    chosen = scenarios(costs, args.slices, model, runtime, overhead_ratio=overhead_ratio, spares=args.spares, swap=swap)
    print(f"measured costs (seconds, medians over {len(runs)} runs):\n\n{costs_table(costs)}\n")
    if swap is not None:
        print(f"a swap (a spare in a lost slice's place), medians over the swaps of {len(spare_runs)} runs: "
              f"{recovery_parts(swap)}\n")
    print(f"{args.slices:,} slices of {args.chips_per_slice} chips, {_assumptions(model, runtime, horizon)}:\n")
    tried = [] if args.spares is None else [
        spare_scenario(costs, args.slices, model, runtime, k, swap, overhead_ratio=overhead_ratio)
        for k in spare_counts(args.slices, model)]
    projections = project(chosen + tried, model, horizon)  # all through the same failures
    print(plan_table(projections[: len(chosen)]))
    if tried:
        print(spares_line(projections[len(chosen):]))
    all_costs = {**costs, **with_costs(strategy_costs(spare_runs), settings)}  # the spare runs' own, for their replay
    validations = validate(runs + spare_runs, all_costs) if args.validate or args.plot or args.markdown else []
    if args.validate:
        print(f"\nreplayed runs:\n\n{validation_table(validations)}")
    if not (args.plot or args.markdown):
        return
    by_slices = scaling(costs, model, runtime, horizon, overhead_ratio=overhead_ratio)
    spared = None if swap is None else spare_scaling(costs, swap, model, runtime, horizon, overhead_ratio=overhead_ratio)
    if args.plot:
        plot_scaling(by_slices, validations, args.plot, measured_schedule=PLOTTED_SCHEDULE, spares=spared,
                     title=f"Projected goodput: {args.chips_per_slice} chips per slice,\n"
                           f"{_assumptions(model, runtime, horizon)}")
        print(f"\nplot: {args.plot}")
    for path in args.markdown:
        replaced = update_blocks(path, dict(zip(block_names, (
            _projection_block(by_slices, spared, validations, args, model, horizon, path, command, overhead_ratio),
            _validation_block(validations, all_costs, command),
        ))))
        print(f"{path}: regenerated {', '.join(replaced)}")


def _assumptions(model: FailureModel, runtime: Runtime, horizon: Horizon) -> str:
    return (f"{model.failures_per_chip_hour:.3g} failures per chip-hour, {model.repair} repairs of {model.repair_s:g} s, "
            f"{runtime.name} controller, jobs of {horizon.days:g} days")


def _projection_block(by_slices: dict[int, list[Projection]], spared: dict[int, list[Projection]] | None,
                      validations: list[Validation], args: argparse.Namespace, model: FailureModel, horizon: Horizon,
                      path: Path, command: str, overhead_ratio: float) -> str:
    worst = max((abs(v.error) for v in validations), default=float("nan"))
    lines = [
        (f"Generated by `{command}`: {args.chips_per_slice} chips per slice, "
         f"{_assumptions(model, RUNTIMES[args.runtime], horizon)}, from the runs' measured costs."),
        "",
        scaling_table(by_slices, args.chips_per_slice, spared),
        "",
        f"Each cell is a {THROUGHPUT}; the trainer's step at {overhead_ratio:g} of the bare loop's steps/s "
        "(`benchmarks/overhead.py`).",
    ]
    if spared is not None:
        lines[-1] += (" Spares: the count, of those tried, that gives `swap_then_scale_down` the most goodput per "
                      "provisioned chip (productive chip-time over the time of every chip, spares included), a swap "
                      "at its measured cost.")
    if args.plot:
        lines += ["", image_link(args.plot, path)]
    lines += ["", (f"The same simulation, replaying each of the {len(validations)} runs' own failure schedule, "
                   f"predicts its measured goodput within {worst:.3f}.")]
    return "\n".join(lines)


def _validation_block(validations: list[Validation], costs: dict[str, StrategyCosts], command: str) -> str:
    return "\n".join([f"Generated by `{command}`.", "", validation_table(validations), "",
                      "The measured costs behind it (medians over each strategy's runs):", "", costs_table(costs)])


if __name__ == "__main__":
    sys.exit(main())
