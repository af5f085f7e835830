"""elastic_retry: our failure handling around a loop the user keeps; the example of docs/your_loop.md
(examples/elastic_retry_loop.py) runs as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import elastic_trainer as et
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.scale_down import ScaleDown

EXAMPLE = Path(__file__).parents[1] / "examples" / "elastic_retry_loop.py"


def run_example(run_dir, *args):
    result = subprocess.run([sys.executable, str(EXAMPLE), str(run_dir), *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def numbers(output):
    return [float(word) for word in output.split() if word[0].isdigit()]


def test_the_example_loop_recovers_from_a_lost_slice_and_ends_where_a_failure_free_run_ends(tmp_path):
    recovered = run_example(tmp_path / "failure", "--fail-at", "12")
    uninterrupted = run_example(tmp_path / "no_failure")
    assert numbers(recovered) == pytest.approx(numbers(uninterrupted), rel=1e-5)  # final loss and weights
    report = json.loads((tmp_path / "failure" / "report.json").read_text())
    assert report["attempts"] == 2
    [failure] = report["failures"]
    assert (failure["step"], failure["slices"], failure["action"], failure["slices_after"]) == (12, [1], "scale_down", 3)
    assert failure["recovery_s"] > 0


def test_without_a_strategy_the_failure_is_raised_as_it_is():
    @et.elastic_retry(cluster=et.SimulatedCluster(4, 2), plugins=[Chaos(failures=[{"at_step": 1, "slice": 2}])])
    def loop(run):
        for _ in run.steps(0, 3):
            pass

    with pytest.raises(et.SliceLostError):
        loop()


def test_a_strategy_that_restarts_the_process_is_a_clear_error():
    @et.elastic_retry(cluster=et.SimulatedCluster(4, 2), strategy=FullRestart(),
                      plugins=[Chaos(failures=[{"at_step": 1, "slice": 2}])])
    def loop(run):
        for _ in run.steps(0, 3):
            pass

    with pytest.raises(et.ConfigError, match="elastic_retry recovers inside this process"):
        loop()


def test_scale_down_waits_for_a_slice_when_every_slice_is_lost_and_a_stop_is_reported_as_the_end():
    every_slice = [{"at_step": 2, "slice": s, "down_for_s": 0.2} for s in range(4)]
    runs = []

    def loop(run):
        runs.append(run)
        for _ in run.steps(run.step, 4):
            pass

    et.elastic_retry(cluster=et.SimulatedCluster(4, 2), strategy=ScaleDown(timeout_s=60),
                     plugins=[Chaos(failures=every_slice)])(loop)()
    [failure] = runs[-1].failures
    assert (failure["step"], failure["slices"], failure["action"], failure["ended_run"]) == (2, [0, 1, 2, 3],
                                                                                             "scale_down", False)
    assert failure["waiting_s"] > 0 and failure["slices_after"] >= 1 and failure["recovery_s"] is not None

    runs.clear()
    with pytest.raises(et.TrainingStopped, match="^scale_down: 0 slice"):
        et.elastic_retry(cluster=et.SimulatedCluster(4, 2), strategy=ScaleDown(timeout_s=0),
                         plugins=[Chaos(failures=every_slice)])(loop)()
    [failure] = runs[-1].failures
    assert (failure["ended_run"], failure["recovery_s"]) == (True, None)
