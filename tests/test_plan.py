"""The projection (python -m elastic_trainer.plan): validated on the committed sweep, checked against
Young/Daly's closed form, and its inputs refused like every other config's."""

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastic_trainer._failures import ConfigError
from elastic_trainer.benchmark import load_jobs, publish_runs
from elastic_trainer.plan import (
    SINGLE_CONTROLLER,
    Failure,
    FailureModel,
    Horizon,
    RecoveryCost,
    Scenario,
    ScheduledFailure,
    StrategyCosts,
    choose_period,
    failure_trace,
    load_run,
    project,
    recommend_spares,
    replay,
    restart_goodput,
    run_dirs,
    scaling,
    scenarios,
    simulate,
    spare_scaling,
    strategy_costs,
    swap_cost,
    validate,
)
from elastic_trainer.plan.__main__ import main
from elastic_trainer.plan._model import MULTI_CONTROLLER, Linear
from elastic_trainer.plan._output import block_markers, scaling_table
from elastic_trainer.plan._runs import SWAPPING
from elastic_trainer.plan._simulate import SWAP_THEN_SCALE_DOWN

ROOT = Path(__file__).resolve().parents[1]
SWEEP_RUNS = ROOT / "benchmarks" / "results" / "standard" / "runs"
SPARE_RUNS = ROOT / "benchmarks" / "results" / "spares" / "runs"
STRATEGIES = {"scale_down", "pause_resume", "full_restart"}
SCHEDULES = {"no_failures", "one_failure", "periodic", "during_save"}


@pytest.fixture(scope="module")
def sweep():
    runs = [load_run(run_dir) for run_dir in run_dirs([SWEEP_RUNS])]
    return runs, strategy_costs(runs)


def test_the_projection_predicts_every_run_of_the_committed_sweep_within_0_03(sweep):
    runs, costs = sweep
    validations = validate(runs, costs)
    assert {(v.strategy, v.schedule) for v in validations} == {(s, c) for s in STRATEGIES for c in SCHEDULES}
    for v in validations:
        assert abs(v.error) < 0.03, v
    # the failures cost something that the replay reproduced: full_restart measured far below the others
    periodic = {v.strategy: v for v in validations if v.schedule == "periodic"}
    assert periodic["full_restart"].measured < periodic["scale_down"].measured - 0.2


def costs(**changes):
    """Round numbers: 1 s steps, a 0.5 s save, a 3 s restart."""
    base = StrategyCosts(strategy="full_restart", step_s=1.0, gap_s=0.0, save_s=0.5, start_s=2.0, end_s=0.0,
                         layout_compile_s=4.0, recovery=RecoveryCost(restart_s=3.0), scale_up_s=0.25, runs=1,
                         failures=1)
    return dataclasses.replace(base, **changes)


def scenario(strategy, **changes):
    own = costs(strategy=strategy, **changes)
    return Scenario(strategy, 4, own, own.recovery, SINGLE_CONTROLLER, period=10)


def test_a_replayed_schedule_adds_up_step_by_step():
    quiet = replay(scenario("full_restart"), 20, [])
    assert (quiet.wall_s, quiet.productive_s, quiet.saves) == pytest.approx((2 + 20 + 2 * 0.5, 20, 2))
    # lost during the step after step 15: that step, a 3 s restart and steps 11-15 again (the checkpoint is 10)
    restarted = replay(scenario("full_restart"), 20, [ScheduledFailure(15, "train_step", (1,), 0.0)])
    assert restarted.lost_steps == 5 and restarted.productive_s == pytest.approx(20)
    assert restarted.wall_s == pytest.approx(2 + 15 + 0.5 + 1 + 3 + 5 + 5 + 0.5, abs=1e-5)
    # lost while step 10 is saved: that save is discarded, so the restart starts over from step 0
    discarded = replay(scenario("full_restart"), 20, [ScheduledFailure(10, "checkpoint_save", (1,), 0.0)])
    assert discarded.lost_steps == 10
    # pause_resume waits for the slice (down 6 s from the start of its step), then goes on from a replica
    paused = replay(scenario("pause_resume", recovery=RecoveryCost(restore_s=0.5)), 20,
                    [ScheduledFailure(15, "train_step", (1,), 6.0)])
    assert paused.lost_steps == 0
    assert paused.wall_s == pytest.approx(2 + 15 + 0.5 + 6 + 0.5 + 5 + 0.5, abs=1e-5)


def test_scale_down_waits_for_a_compile_under_way_compiles_a_queued_one_at_once_and_runs_slower_on_fewer_slices():
    backlog = scenario("scale_down", recovery=RecoveryCost())  # compiles 4 layouts of 4 s, one at a time, from 2 s
    instant = scenario("scale_down", recovery=RecoveryCost(), layout_compile_s=0.0)
    early = [Failure(3.0, 3, 1e9)]  # slice 3 lost for good while its layout is queued (its turn: 14 s to 18 s)
    waited, not_waited = simulate(backlog, early, 100.0), simulate(instant, early, 100.0)
    assert waited.wall_s == not_waited.wall_s == 100.0
    # the same run on 3 slices of 4 (steps 4/3 as long) after the failure, less 4 s compiling its layout at once
    assert not_waited.steps - waited.steps == pytest.approx(4 * 3 / 4, abs=1)
    under_way = simulate(backlog, [Failure(15.0, 3, 1e9)], 100.0)  # its compile started at 14 s: 3 s left
    assert simulate(instant, [Failure(15.0, 3, 1e9)], 100.0).steps - under_way.steps == pytest.approx(3 * 3 / 4, abs=1)
    assert waited.progress < waited.goodput  # productive time counts the slower steps in full
    late = simulate(backlog, [Failure(50.0, 3, 1e9)], 100.0)
    assert late.steps > not_waited.steps  # compiled by then, and 47 s more on 4 slices
    back = simulate(backlog, [Failure(50.0, 3, 10.0)], 100.0)  # back after 10 s: scaled up again
    assert back.steps > late.steps and back.goodput - back.progress < late.goodput - late.progress


def test_a_slice_lost_while_a_step_runs_rolls_an_elastic_strategy_back_to_its_host_snapshot():
    # one controller: the step had taken the state, which comes back from the snapshot of step 10 (every 10 steps)
    own = costs(strategy="scale_down", recovery=RecoveryCost())
    lost_in_step_14 = [Failure(2 + 13.5, 2, 1e9)]  # 2 s start, 1 s steps: halfway through the step after 13
    single = simulate(Scenario("scale_down", 4, own, own.recovery, SINGLE_CONTROLLER, period=100), lost_in_step_14, 60)
    assert single.lost_steps == 3
    # each process runs its own part of the update: the others keep the state, nothing is lost
    multi = simulate(Scenario("scale_down", 4, own, own.recovery, MULTI_CONTROLLER, period=100), lost_in_step_14, 60)
    assert multi.lost_steps == 0
    # without snapshots, back to the last checkpoint (none yet: the start)
    bare = simulate(Scenario("scale_down", 4, own, own.recovery, SINGLE_CONTROLLER, period=100, snapshot_period=0),
                    lost_in_step_14, 60)
    assert bare.lost_steps == 13


def test_on_the_multi_controller_runtime_a_lost_process_comes_back_at_the_measured_rejoin_cost():
    own = costs(strategy="scale_down", recovery=RecoveryCost(), layout_compile_s=0.0)  # 1 s steps, no saves in 600 s
    multi = Scenario("scale_down", 4, own, own.recovery, MULTI_CONTROLLER, period=1000)
    gone = simulate(multi, [Failure(100.0, 3, 1e9)], 600.0)
    back = simulate(multi, [Failure(100.0, 3, 50.0)], 600.0)  # its replacement is back 50 s later: taken back in
    assert back.steps > gone.steps and back.progress > gone.progress
    # taking it back in costs the runtime's fitted rejoin at 4 processes, not the single controller's scale-up
    free = dataclasses.replace(multi, runtime=dataclasses.replace(MULTI_CONTROLLER, rejoin_s=Linear(0.0, 0.0)))
    rejoin_s = MULTI_CONTROLLER.rejoin_s.at(4)
    assert rejoin_s > own.scale_up_s
    assert simulate(free, [Failure(100.0, 3, 50.0)], 600.0).steps - back.steps == pytest.approx(rejoin_s, abs=1)


def test_the_bare_loop_row_steps_at_the_measured_ratio_and_restarts_on_every_failure(sweep):
    _, measured = sweep
    model, horizon = FailureModel(), Horizon(min_failures=100)
    chosen = {s.strategy: s for s in scenarios(measured, 1024, model, SINGLE_CONTROLLER, overhead_ratio=0.9)}
    bare, full_restart = chosen["bare_loop"], chosen["full_restart"]
    assert bare.restarts_on_every_failure and bare.costs.recovery == full_restart.costs.recovery
    assert bare.costs.step_s == pytest.approx(0.9 * full_restart.costs.step_s)
    projected = {p.strategy: p for p in project(list(chosen.values()), model, horizon)}
    assert projected["bare_loop"].throughput == pytest.approx(projected["bare_loop"].progress)
    # the trainer's rows count its tax: throughput in the bare loop's steps
    for strategy in ("scale_down", "full_restart"):
        assert projected[strategy].throughput == pytest.approx(0.9 * projected[strategy].progress, rel=1e-6)
    # a trainer no slower than the loop: its full_restart gets exactly as far as the loop restarting alike
    level = {p.strategy: p for p in project(scenarios(measured, 1024, model, SINGLE_CONTROLLER, overhead_ratio=1.0),
                                             model, horizon)}
    assert level["bare_loop"].throughput == pytest.approx(level["full_restart"].throughput)


def test_beyond_the_layouts_the_step_cache_holds_scale_down_compiles_on_the_spot():
    own = costs(strategy="scale_down", recovery=RecoveryCost())  # layouts of 4 s, 7 compiled ahead from 2 s
    wide = Scenario("scale_down", 16, own, own.recovery, SINGLE_CONTROLLER, period=10)
    ahead = simulate(wide, [Failure(500.0, 2, 1e9)], 600.0)  # slice 2's layout was compiled ahead long before
    beyond = simulate(wide, [Failure(500.0, 12, 1e9)], 600.0)  # slice 12's never is: 4 s compiling it then
    assert ahead.steps - beyond.steps == pytest.approx(4 * 15 / 16, abs=1)


def test_young_daly_closed_form_agrees_with_the_simulation_and_its_period_is_the_best(sweep):
    _, measured = sweep
    model = FailureModel(repair="fixed")
    (full_restart,) = [s for s in scenarios(measured, 1024, model, SINGLE_CONTROLLER) if s.strategy == "full_restart"]
    horizon = Horizon(min_failures=3000)
    (simulated,) = project([full_restart], model, horizon)
    assert simulated.closed_form == pytest.approx(restart_goodput(full_restart, model))
    assert simulated.goodput == pytest.approx(simulated.closed_form, abs=0.003)
    chosen = full_restart.period
    goodput = {}
    for factor in (0.25, 1, 4):
        other = dataclasses.replace(full_restart, period=max(1, round(chosen * factor)))
        goodput[factor] = project([other], model, horizon)[0].goodput  # the same failures (same seed)
    assert goodput[1] > goodput[0.25] and goodput[1] > goodput[4]


def test_a_higher_failure_rate_gives_a_shorter_period_and_a_lower_goodput(sweep):
    _, measured = sweep
    horizon = Horizon(min_failures=200)
    low, high = (FailureModel(failures_per_chip_hour=rate) for rate in (2e-5, 2e-3))
    for slow, fast in zip(scenarios(measured, 256, low, SINGLE_CONTROLLER), scenarios(measured, 256, high, SINGLE_CONTROLLER)):
        assert fast.period < slow.period, slow.strategy
        assert choose_period(fast, high).mtbf_s == pytest.approx(choose_period(slow, low).mtbf_s / 100)
    for slow, fast in zip(project(scenarios(measured, 256, low, SINGLE_CONTROLLER), low, horizon),
                          project(scenarios(measured, 256, high, SINGLE_CONTROLLER), high, horizon)):
        assert fast.goodput < slow.goodput, slow.strategy
        assert fast.failures_per_day == pytest.approx(100 * slow.failures_per_day)


def test_failures_are_drawn_at_the_models_rate():
    model = FailureModel(failures_per_chip_hour=1e-3, chips_per_slice=10, repair_s=60)
    trace = failure_trace(model, 100, controller=False, horizon_s=86400 * 1000, rng=np.random.default_rng(0))
    assert len(trace) == pytest.approx(model.failures_per_day(100) * 1000, rel=0.05)
    assert [f.time for f in trace] == sorted(f.time for f in trace)
    assert np.mean([f.repair_s for f in trace]) == pytest.approx(60, rel=0.1)


@pytest.fixture(scope="module")
def swap():
    return swap_cost([load_run(run_dir, SWAPPING) for run_dir in run_dirs([SPARE_RUNS])])


def test_a_swaps_cost_is_measured_by_the_committed_spare_runs(swap):
    runs = [load_run(run_dir, SWAPPING) for run_dir in run_dirs([SPARE_RUNS])]
    assert {run.schedule for run in runs} == SCHEDULES
    swaps = [f for run in runs for f in run.failures if f.action == "hot_swap"]
    assert swaps and all(f.lost_steps == 0 for f in swaps)
    assert 0 < swap.total_s < min(f.recovery_s for f in swaps)  # the first good step after it is not a cost
    assert swap.restore_s == pytest.approx(statistics.median(f.restore_s for f in swaps))
    with pytest.raises(ConfigError, match="hot_swap->scale_down"):
        load_run(SPARE_RUNS / "periodic-swap_then_scale_down-0")  # not a strategy the projection models
    with pytest.raises(ConfigError, match="so a swap's cost is unmeasured"):
        swap_cost([run for run in runs if run.schedule == "no_failures"])
    assert swap_cost(runs, {"restore_s": 9.0, "step_s": 1.0}) == dataclasses.replace(swap, restore_s=9.0)  # a what-if


def test_the_projection_predicts_every_spare_run_within_0_05(sweep):
    runs = [load_run(run_dir, SWAPPING) for run_dir in run_dirs([SPARE_RUNS])]
    validations = validate(runs, {**sweep[1], **strategy_costs(runs)})  # replayed with spares, each recovery a swap
    assert {v.schedule for v in validations} == SCHEDULES
    for v in validations:
        assert abs(v.error) < 0.05, v
    assert all(run.spares == 1 for run in runs)  # cluster.spare_slices=1, as conf/benchmark/spares.yaml sets


def test_a_spare_takes_a_lost_slices_place_until_none_is_free_and_a_repaired_slice_is_a_spare_again():
    own = costs(strategy=SWAP_THEN_SCALE_DOWN, recovery=RecoveryCost(), layout_compile_s=0.0)  # 1 s steps
    swap = RecoveryCost(restore_s=2.0)
    state_kept = dataclasses.replace(SINGLE_CONTROLLER, step_takes_state=False)  # no roll-back to a snapshot
    spared = Scenario(SWAP_THEN_SCALE_DOWN, 4, own, own.recovery, state_kept, period=1000, spares=1, swap=swap)
    quiet = simulate(spared, [], 100.0)
    # slice 1 lost between two steps: the spare (slice 4) in its place, 2 s, and on at 4 slices
    swapped = simulate(spared, [Failure(50.0, 1, 1e9)], 100.0)
    assert swapped.swaps == 1 and quiet.steps - swapped.steps == 2
    # a second one with no spare free: scale_down, on 3 slices of 4 (steps 4/3 as long) from then
    both = simulate(spared, [Failure(50.0, 1, 1e9), Failure(60.0, 2, 1e9)], 100.0)
    assert both.swaps == 1 and swapped.steps - both.steps == pytest.approx(40 / 4, abs=1)
    # slice 1 back at 55 s is the spare for slice 2's failure
    repaired = simulate(spared, [Failure(50.0, 1, 5.0), Failure(60.0, 2, 1e9)], 100.0)
    assert repaired.swaps == 2 and quiet.steps - repaired.steps == 4
    # a spare lost costs nothing but the spare: back at 45 s, it takes slice 1's place at 50 s
    assert simulate(spared, [Failure(40.0, 4, 5.0), Failure(50.0, 1, 1e9)], 100.0) == swapped
    assert simulate(spared, [Failure(40.0, 4, 1e9), Failure(50.0, 1, 1e9)], 100.0).swaps == 0


def test_a_higher_failure_rate_recommends_more_spares(sweep, swap):
    _, measured = sweep
    horizon = Horizon(days=1, min_failures=50)
    recommended = {}
    for rate in (2e-4, 2e-3):
        by_slices = spare_scaling(measured, swap, FailureModel(failures_per_chip_hour=rate), SINGLE_CONTROLLER, horizon,
                                  (16, 1024, 4096))
        recommended[rate] = {n: recommend_spares(projections).spares for n, projections in by_slices.items()}
        for projections in by_slices.values():  # a spare is a slice that does not train
            for p in projections:
                assert p.per_chip_goodput == pytest.approx(p.progress * p.slices / (p.slices + p.spares))
    assert all(recommended[2e-3][n] >= recommended[2e-4][n] for n in recommended[2e-4]), recommended
    assert any(recommended[2e-3][n] > recommended[2e-4][n] for n in recommended[2e-4]), recommended
    assert recommended[2e-3][4096] > 1, recommended


def test_the_benchmarks_page_shows_the_generated_projection(sweep, swap):
    _, measured = sweep
    readme = (ROOT / "docs" / "benchmarks.md").read_text()
    start, end = block_markers("projection-single")
    block = readme.split(start, 1)[1].split(end, 1)[0]
    model, horizon = FailureModel(), Horizon()
    expected = scaling_table(scaling(measured, model, SINGLE_CONTROLLER, horizon), 8,
                             spare_scaling(measured, swap, model, SINGLE_CONTROLLER, horizon))
    assert expected in block, "regenerate it: see docs/projection.md"
    assert "python -m elastic_trainer.plan" in block and "projection.png" in block


def test_the_plan_prints_a_table_per_strategy_and_regenerates_blocks_and_the_plot(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# Page\n<!-- projection-single:start -->\nstale\n<!-- projection-single:end -->\nafter\n")
    plot = tmp_path / "plot.png"
    assert main([str(SWEEP_RUNS), "--slices", "64", "--min-failures", "50", "--plot", str(plot),
                 "--markdown", str(page)]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "| scale_down |" in out and "| full_restart |" in out and "| bare_loop |" in out
    assert plot.read_bytes().startswith(b"\x89PNG")
    text = page.read_text()
    assert "stale" not in text and "![plot](plot.png)" in text and text.endswith("<!-- projection-single:end -->\nafter\n")
    assert "| 4,096 | 32,768 |" in text and "| spares | goodput per provisioned chip (with no spare) |" in text


def test_the_plan_models_two_spares():
    result = run_plan("--spares", "2", "--slices", "64", "--min-failures", "50")
    assert result.returncode == 0, result.stderr
    assert "a swap (a spare in a lost slice's place), medians over the swaps of 4 runs: " in result.stdout
    assert "| swap_then_scale_down, 2 spares |" in result.stdout and "\nspares: " in result.stdout


def test_the_sweep_publishes_each_jobs_run_files_for_the_projection(tmp_path):
    sweep_dir, runs_dir = tmp_path / "sweep", tmp_path / "published" / "runs"
    shutil.copytree(SWEEP_RUNS / "periodic-scale_down-0", sweep_dir / "0")
    (runs_dir / "stale").mkdir(parents=True)
    publish_runs(sweep_dir, load_jobs(sweep_dir), runs_dir)
    assert [p.name for p in runs_dir.iterdir()] == ["periodic-scale_down-0"]
    assert load_run(runs_dir / "periodic-scale_down-0") == dataclasses.replace(
        load_run(sweep_dir / "0"), name="periodic-scale_down-0")


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "elastic_trainer.plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)


def test_bad_input_is_one_sentence_and_exit_status_2(tmp_path, capsys):
    result = run_plan("--failures-per-chip-hour", "-1")
    assert result.returncode == 2 and result.stderr == (
        "elastic_trainer: error: the failure rate must be a positive number per chip-hour, got -1.0.\n")
    broken = tmp_path / "broken"
    shutil.copytree(SWEEP_RUNS / "periodic-full_restart-0", broken)
    report = json.loads((broken / "report.json").read_text())
    del report["badput_s"]
    (broken / "report.json").write_text(json.dumps(report))
    no_timeline = tmp_path / "no_timeline"
    shutil.copytree(SWEEP_RUNS / "periodic-full_restart-0", no_timeline)
    (no_timeline / "events.jsonl").unlink()
    plain = tmp_path / "plain.md"
    plain.write_text("# No blocks\n")
    cases = {
        ("--slices", "0"): "the number of slices must be at least 1, got 0.",
        ("--chips-per-slice", "0"): "chips per slice must be a whole number of at least 1, got 0.",
        ("--repair-s", "-5"): "the repair time must be a number of seconds, at least 0, got -5.0.",
        ("--days", "0"): "the job length must be a positive number of days, got 0.0.",
        ("--slices", "many"): "argument --slices: invalid int value: 'many'.",
        ("--cost", "step_s=-1"): "the cost step_s must be a number of seconds, at least 0, got -1.0.",
        ("--cost", "overhead_ratio=1.5"): "the cost overhead_ratio must be above 0 and at most 1 (the trainer's "
                                          "steps/s over a bare loop's), got 1.5.",
        (str(broken),): f"{broken / 'report.json'} lacks badput_s, which the projection needs.",
        (str(tmp_path / "nowhere"),): f"{tmp_path / 'nowhere'} is not a run directory (no report.json) and holds none.",
        ("--markdown", str(plain)): f"{plain} has no <!-- projection-single:start --> "
                                    "or <!-- projection-validation:start --> block to regenerate.",
        ("--spares", "-1"): "the number of spare slices must be at least 0, got -1.",
        ("--spares", "1", "--runtime", "multi"): "spares are modelled on one controller only; "
                                                 "drop --spares or use --runtime single.",
        ("--spares", "1", "--spare-runs", str(SWEEP_RUNS)): "the projection models hot_swap, hot_swap->scale_down from "
                                                            f"these runs; {SWEEP_RUNS / 'during_save-full_restart-0'} "
                                                            "ran 'full_restart'.",
    }
    for args, message in cases.items():
        assert main(list(args)) == 2, args
        assert capsys.readouterr().err == f"elastic_trainer: error: {message}\n", args
    assert main([str(no_timeline)]) == 2
    assert "events.jsonl (the run's timeline, which the projection needs) cannot be read" in capsys.readouterr().err
