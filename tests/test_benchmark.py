"""Benchmarks as Hydra multiruns: every strategy under one failure, gathered into tables and plots."""

import csv
import json

import pytest
from test_cli import run_cli
from test_cli_recovery import TINY, failure_at, report_of

from elastic_trainer.benchmark import RESULTS_END, RESULTS_START


def jobs_of(sweep_dir):
    return {report_of(d)["strategy"]: d for d in sorted(sweep_dir.iterdir()) if (d / "report.json").exists()}


def test_benchmark_sweep_runs_every_strategy_and_writes_tables_and_plots(tmp_path):
    sweep_dir, published = tmp_path / "sweep", tmp_path / "published"
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n{RESULTS_START}\nstale\n{RESULTS_END}\nafter\n")
    result = run_cli(
        "-m", "+benchmark=standard", "+strategy=pause_resume,scale_down,full_restart", *TINY, "checkpoint.period=5",
        *failure_at(12, 1, down_for_s=1), f"hydra.sweep.dir={sweep_dir}",
        f"hydra.callbacks.results.publish_dir={published}", f"hydra.callbacks.results.page={page}",
        "hydra.callbacks.results.timeline_schedule=schedule", timeout=600,
    )
    assert result.returncode == 0, result.stderr
    job_dirs = jobs_of(sweep_dir)
    assert set(job_dirs) == {"pause_resume", "scale_down", "full_restart"}
    for strategy, job_dir in job_dirs.items():
        report = report_of(job_dir)
        assert report["steps_completed"] == 20, strategy
        assert len(report["failures"]) == 1, strategy
        assert report["samples"] == {"consumed": 20 * 48, "duplicated": 0, "skipped": 0}, strategy
        accounted = report["productive_s"] + sum(report["badput_s"].values())
        assert accounted == pytest.approx(report["wall_s"], rel=0.01), strategy
    kept = [report_of(job_dirs[s])["failures"][0] for s in ("pause_resume", "scale_down")]
    assert [(f["restored_from"], f["lost_steps"]) for f in kept] == [("replica", 0), ("replica", 0)]
    assert report_of(job_dirs["scale_down"])["failures"][0]["slices_after"] == 3
    # the same global batches in the same order under every strategy: the same training
    final_losses = [report_of(job_dir)["final_loss"] for job_dir in job_dirs.values()]
    assert final_losses == pytest.approx([final_losses[0]] * 3, rel=1e-4)

    # full_restart really ran a second worker process, restored the checkpoint of step 10 and lost 2 steps
    restarted = report_of(job_dirs["full_restart"])
    first, second = (json.loads(p.read_text()) for p in sorted(job_dirs["full_restart"].glob("report.worker*.json")))
    assert restarted["workers"] == 2
    # in order, by what each worker did rather than by timestamps taken in two processes: the second one
    # started from the checkpoint the first one wrote before it failed at step 12
    assert (first["resumed_from"], first["failures"][0]["step"], second["resumed_from"]) == (None, 12, 10)
    (failure,) = restarted["failures"]
    assert (failure["action"], failure["restored_from"], failure["lost_steps"]) == ("full_restart", "checkpoint", 2)
    parts = [failure[part] for part in ("detection_s", "startup_s", "compile_s", "restore_s")]  # the plot's split
    assert min(parts) > 0 and sum(parts) < failure["recovery_s"]
    assert restarted["badput_s"]["wasted_progress"] > 0
    events = [json.loads(line) for line in (job_dirs["full_restart"] / "events.jsonl").read_text().splitlines()]
    assert {event["worker"] for event in events if event["event"] == "step"} == {0, 1}
    (recovery,) = [event for event in events if event["event"] == "recovery"]  # from one worker into the next
    assert recovery["end"] - recovery["time"] == pytest.approx(failure["recovery_s"])

    # the callback's tables and plots, in the sweep directory and published
    with open(sweep_dir / "results.csv") as file:
        rows = {row["strategy"]: row for row in csv.DictReader(file)}
    assert set(rows) == set(job_dirs)
    for strategy, row in rows.items():
        report = report_of(job_dirs[strategy])
        assert float(row["goodput"]) == pytest.approx(report["goodput"], abs=1e-4)
        assert float(row["mean_recovery_s"]) == pytest.approx(report["failures"][0]["recovery_s"], abs=0.01)
        assert (row["schedule"], row["failures"], row["samples_duplicated"], row["samples_skipped"]) == ("schedule", "1", "0", "0")
    assert rows["full_restart"]["lost_steps"] == "2" and rows["scale_down"]["lost_steps"] == "0"
    table = (sweep_dir / "results.md").read_text()
    assert table.startswith("| strategy | schedule | seed | steps | goodput |") and table.count("\n") == 2 + 3
    for name in ("results.csv", "results.md", "goodput.png", "timeline.png", "recovery.png"):
        assert (published / name).read_bytes() == (sweep_dir / name).read_bytes(), name
    assert (sweep_dir / "goodput.png").read_bytes().startswith(b"\x89PNG")
    updated = page.read_text()
    assert "stale" not in updated and table.strip() in updated and "![goodput](published/goodput.png)" in updated
    assert updated.startswith("# Results\n") and updated.endswith(f"{RESULTS_END}\nafter\n")


def test_the_sweep_runs_unchanged_under_the_joblib_launcher(tmp_path):
    result = run_cli(
        "-m", "+benchmark=standard", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+chaos=no_failures",
        "+strategy=scale_down,pause_resume", *TINY, f"hydra.sweep.dir={tmp_path}",
        "hydra.callbacks.results.publish_dir=null", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert set(jobs_of(tmp_path)) == {"scale_down", "pause_resume"}
    with open(tmp_path / "results.csv") as file:
        assert sorted(row["strategy"] for row in csv.DictReader(file)) == ["pause_resume", "scale_down"]
