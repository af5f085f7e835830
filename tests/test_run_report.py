"""The run report as a typed record: report.json is written from it and read back into it, field for field."""

import dataclasses
import json

import pytest
from test_cli import run_cli
from test_cli_recovery import TINY, failure_at

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer._run_report import Badput, History


@pytest.fixture(scope="module")
def run_with_a_failure(tmp_path_factory):
    """A real run from the command line that lost a slice and scaled down, with spares and checkpoints."""
    run_dir = tmp_path_factory.mktemp("run")
    result = run_cli(*TINY, "+strategy=scale_down", "cluster.spare_slices=1", *failure_at(8, 1),
                     f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return run_dir


def test_a_real_report_json_round_trips_through_the_record(run_with_a_failure):
    path = run_with_a_failure / "report.json"
    report = et.RunReport.load(path)
    assert report.to_json() == json.loads(path.read_text())
    copy = report.write(run_with_a_failure / "copy")
    assert copy.read_text() == path.read_text()


def test_the_record_reads_by_attribute_with_typed_parts(run_with_a_failure):
    report = et.RunReport.load(run_with_a_failure)
    assert report.strategy == "scale_down" and report.steps_completed == report.steps_target == 20
    assert report.cluster.kind == "simulated" and report.cluster.spare_slices == 1
    (failure,) = report.failures
    assert (failure.step, failure.slices, failure.action, failure.restored_from) == (8, (1,), "scale_down", "replica")
    assert failure.spares_taken == (4,) and report.spares.in_use == (4,)
    assert report.samples.consumed == report.data_position and report.samples.duplicated == 0
    assert report.badput_s.detection >= 0 and report.history.step[-1] == 20
    assert report.checkpoint.dir.endswith("checkpoints")
    assert report["failures"][0]["slice"] == 1  # the JSON view, for code written against the dict
    assert "workers" not in report and report.get("workers") is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.goodput = 1.0


def test_badput_has_a_field_per_category():
    assert [field.name for field in dataclasses.fields(Badput)] == list(etp.BADPUT_CATEGORIES)


def test_an_older_report_with_unknown_keys_and_without_newer_ones_loads(tmp_path, run_with_a_failure):
    older = json.loads((run_with_a_failure / "report.json").read_text())
    for newer in ("history", "training_mode", "stragglers", "spares", "compile_cache", "first_step_ended_at"):
        del older[newer]
    older["step_counter"] = {"step_ends": 20}  # a plugin's
    older["failures"][0]["retired_field"] = 1  # inside a nested part: ignored
    (tmp_path / "report.json").write_text(json.dumps(older))
    report = et.RunReport.load(tmp_path / "report.json")
    assert report.history == History() and report.training_mode == "synchronous" and report.spares is None
    assert report.extra == {"step_counter": {"step_ends": 20}}
    assert report.to_json()["step_counter"] == {"step_ends": 20}
    assert "retired_field" not in report.to_json()["failures"][0]


def test_a_file_that_is_no_run_report_is_one_sentence(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"strategy": None, "attempts": 2}))
    with pytest.raises(ValueError, match=r"report.json is not a run report: a RunReport needs cluster, steps_target, "):
        et.RunReport.load(tmp_path)


def test_a_plugin_that_adds_a_key_the_old_way_still_works_and_is_told_the_new_one(run_with_a_failure):
    report = et.RunReport.load(run_with_a_failure)
    with pytest.warns(DeprecationWarning, match=r"write report.extra\['mine'\] = value"):
        report["mine"] = {"slow_steps": 3}
    assert report.extra["mine"] == {"slow_steps": 3} and report.to_json()["mine"] == {"slow_steps": 3}
    with pytest.raises(TypeError, match=r"report\['goodput'\] is the core's and frozen"):
        report["goodput"] = 1.0
