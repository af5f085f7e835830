"""A strategy that restarts the process without declaring it: docs/plugins.md's example, through the command line."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_cli_recovery import TINY

DOC = Path(__file__).parents[1] / "docs" / "plugins.md"
SECTION = "## A strategy that restarts the process\n"


def blocks(language):
    """The page's ``language`` code blocks in the section of the restarting strategy."""
    section = DOC.read_text().split(SECTION)[1].split("\n## ")[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture
def project(tmp_path):
    """A folder holding the page's module and config, as a user would write them."""
    (module,) = blocks("python")
    (tmp_path / "my_strategies.py").write_text(module)
    (config,) = blocks("yaml")
    path = tmp_path / config.splitlines()[0].removeprefix("# ")
    path.parent.mkdir(parents=True)
    path.write_text(config)
    return tmp_path


def run_command(project, *more):
    """The page's command, in ``project``, on the tiny model (the page's own 60 steps), with ``more``."""
    (command,) = blocks("bash")
    model = " ".join(o for o in TINY if not o.startswith("trainer.steps="))
    line = f"{command.replace(chr(92) + chr(10), ' ').strip()} {model} hydra.run.dir=run {' '.join(more)}"
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(["bash", "-c", line], cwd=project, capture_output=True, text=True, timeout=600, env=env)


def report_of(path):
    return json.loads(path.read_text())


def test_scale_down_then_an_undeclared_restart_finishes_every_step_in_a_second_worker(project):
    result = run_command(project)
    assert result.returncode == 0, result.stderr
    run_dir = project / "run"
    report = report_of(run_dir / "report.json")
    assert (report["strategy"], report["steps_completed"], report["workers"]) == ("scale_then_restart", 60, 2)
    scaled, restarted = report["failures"]
    assert (scaled["step"], scaled["action"], scaled["slices_before"], scaled["slices_after"]) == (
        20, "scale_down", 4, 3)
    assert (restarted["step"], restarted["action"], restarted["restored_from"], restarted["lost_steps"]) == (
        35, "restart", "checkpoint", 5)
    assert (restarted["slices_before"], restarted["slices_after"]) == (3, 4)  # the new worker trains on 4
    assert report["samples"] == {"consumed": 60 * 48, "duplicated": 0, "skipped": 0}
    # the command's own process trained the first attempt, and a worker it started resumed from step 30
    first, second = (report_of(run_dir / f"report.worker{n}.json") for n in (0, 1))
    assert (first["resumed_from"], first["steps_completed"], second["resumed_from"]) == (None, 30, 30)
    assert second["cluster"]["slices"] == 4 and second["failures"] == []
    assert "restarting the worker (restart 1)" in result.stdout


def test_the_strategys_max_restarts_bounds_the_restarts(project):
    result = run_command(project, "strategy.max_restarts=0")
    assert result.returncode == 3, result.stderr
    report = report_of(project / "run" / "report.json")
    assert report["stopped"] == "scale_then_restart gave up after 0 restarts (strategy.max_restarts)."
    assert report["workers"] == 1 and not (project / "run" / "report.worker1.json").exists()
