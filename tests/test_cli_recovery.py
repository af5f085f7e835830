"""Strategies from the command line, as a user runs them: real subprocesses, real restarts."""

import json

import pytest
from test_cli import run_cli

TINY = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "data.max_bytes=200000", "trainer.steps=20"]


def failure_at(step, slice_, down_for_s=1e9):
    return ["+chaos=schedule", f"chaos.failures=[{{at_step: {step}, slice: {slice_}, down_for_s: {down_for_s}}}]"]


def report_of(run_dir):
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("failure_free")
    result = run_cli(*TINY, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return report_of(run_dir)


def test_scale_down_finishes_on_the_live_slices_on_the_same_trajectory(tmp_path, failure_free):
    result = run_cli(*TINY, "+strategy=scale_down", *failure_at(10, 1), f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = report_of(tmp_path)
    assert report["strategy"] == "scale_down"
    assert report["steps_completed"] == 20
    (failure,) = report["failures"]
    assert (failure["restored_from"], failure["lost_steps"]) == ("replica", 0)
    assert (failure["slices_before"], failure["slices_after"]) == (4, 3)
    assert report["samples"] == {"consumed": 20 * 48, "duplicated": 0, "skipped": 0}
    assert report["final_loss"] == pytest.approx(failure_free["final_loss"], rel=0.02)


def test_multirun_runs_every_strategy_under_the_same_failure(tmp_path):
    result = run_cli(
        "-m", "+strategy=pause_resume,scale_down,full_restart", *TINY, "checkpoint.period=5",
        *failure_at(12, 1, down_for_s=1), f"hydra.sweep.dir={tmp_path}", timeout=600,
    )
    assert result.returncode == 0, result.stderr
    job_dirs = {report_of(d)["strategy"]: d for d in sorted(tmp_path.iterdir()) if d.is_dir()}
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

    # full_restart really ran a second worker process, restored the checkpoint of step 10 and lost 2 steps
    restarted = report_of(job_dirs["full_restart"])
    first, second = (json.loads(p.read_text()) for p in sorted(job_dirs["full_restart"].glob("report.worker*.json")))
    assert restarted["workers"] == 2
    assert first["started_at"] < first["ended_at"] < second["started_at"]
    (failure,) = restarted["failures"]
    assert (failure["action"], failure["restored_from"], failure["lost_steps"]) == ("full_restart", "checkpoint", 2)
    assert failure["recovery_s"] > second["badput_s"]["startup"]
    assert restarted["badput_s"]["wasted_progress"] > 0


def test_no_strategy_stops_and_names_the_option(tmp_path):
    result = run_cli(*TINY, *failure_at(5, 0), f"hydra.run.dir={tmp_path}")
    assert result.returncode == 3
    assert "select one with +strategy=NAME" in result.stderr
    assert report_of(tmp_path)["steps_completed"] == 5
