"""The command line as a user runs it: a real subprocess each time."""

import gc
import json
import os
import subprocess
import sys

import pytest

from elastic_trainer.launch import _cli
from elastic_trainer.launch._cli import check_group_choices
from elastic_trainer._failures import ConfigError

REPORT_FIELDS = {
    "strategy", "cluster", "steps_target", "steps_completed", "loss_first", "final_loss",
    "wall_s", "productive_s", "goodput", "badput_s", "failures", "samples",
}


TINY_MODEL = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "data.seq_len=8", "data.max_bytes=200000"]
"""The default job's model and data made as small as the tests can use: the command-line tests start dozens of
runs, and each step of one with the data's own 64 tokens a sample took 76 ms of CPU on 8 devices, with 8 tokens
20 ms (2 cores, XLA at -O0, 150 steps timed)."""


def run_cli(*args, timeout=300):
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(
        [sys.executable, "-m", "elastic_trainer", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


STEPS = 12
"""The default job's shortest run: its learning rate warms up over 10 steps, and the decay must be longer."""


def test_a_short_run_of_the_default_job_writes_a_complete_report(tmp_path):
    result = run_cli(f"trainer.steps={STEPS}", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert REPORT_FIELDS <= set(report)
    assert report["steps_completed"] == report["steps_target"] == STEPS
    assert report["cluster"] == {"kind": "simulated", "slices": 4, "devices_per_slice": 2, "spare_slices": 0}
    assert report["final_loss"] < report["loss_first"]
    assert report["samples"]["consumed"] == STEPS * 48
    assert report["badput_s"]["startup"] > 0 and report["badput_s"]["compile"] > 0
    accounted = report["productive_s"] + sum(report["badput_s"].values())
    assert accounted == pytest.approx(report["wall_s"], rel=0.01)
    assert report["goodput"] == pytest.approx(report["productive_s"] / report["wall_s"])
    assert f"step {STEPS}/{STEPS}" in result.stdout  # plain progress lines when stdout is not a terminal
    assert "goodput" in result.stdout  # the human summary
    assert (tmp_path / "checkpoints" / str(STEPS)).is_dir()  # the last step is always saved


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cluster.slices=0", "elastic_trainer: error: cluster.slices must be at least 1, got 0.\n"),
        ("+strategy=nope", "elastic_trainer: error: there is no strategy 'nope'"),
        ("cluster=simulatd", "elastic_trainer: error: there is no cluster 'simulatd' (did you mean cluster=simulated?)"),
        ("checkpoint.resume=true", "elastic_trainer: error: checkpoint.resume is set but "),
    ],
)
def test_bad_input_fails_fast_with_one_sentence(tmp_path, override, message):
    result = run_cli(override, f"hydra.run.dir={tmp_path}", timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "report.json").exists()


def test_group_check_leaves_key_overrides_alone_and_sees_the_command_lines_search_path(tmp_path):
    check_group_choices(["cluster.slices=3", "trainer.steps=5", "hydra.run.dir=x"])
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "theirs.yaml").write_text("_target_: theirs.Strategy\n")
    check_group_choices([f"hydra.searchpath=[file://{tmp_path}]", "+strategy=theirs"])
    with pytest.raises(ConfigError, match="there is no strategy 'theirs'"):
        check_group_choices(["+strategy=theirs"])
    with pytest.raises(ConfigError, match="there is no cluster 'nowhere'; choose one of: .*simulated"):
        check_group_choices(["-m", "cluster=simulated,nowhere"])


def test_the_command_line_freezes_what_its_imports_made_once_per_process():
    # a multirun's jobs run one after another in one process: the second must not freeze the first one's garbage.
    # Which objects are frozen, not how many: other threads of this process may free frozen objects meanwhile.
    _cli._exempt_imports_from_collection.cache_clear()
    made_by_imports = [[] for _ in range(1000)]
    try:
        _cli._exempt_imports_from_collection()
        first_jobs_garbage = [[] for _ in range(1000)]
        _cli._exempt_imports_from_collection()
        collectable = {id(o) for o in gc.get_objects()}  # every object the collector tracks, none of the frozen
        assert not any(id(o) in collectable for o in made_by_imports)
        assert all(id(o) in collectable for o in first_jobs_garbage)
    finally:
        gc.unfreeze()
