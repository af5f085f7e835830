"""The README's first command shows the mission: a slice lost midway, training goes on with no step lost."""

import json
import shlex
from pathlib import Path

from test_cli import run_cli
from test_cli_recovery import TINY

README = Path(__file__).parents[1] / "README.md"


def first_command_overrides():
    """The overrides of the README's main-job command (the first line of its set-up block)."""
    setup = README.read_text().split("## Set-up")[1].split("```bash\n")[1]
    command = setup.splitlines()[0].split("#")[0]
    return shlex.split(command.split("python -m elastic_trainer")[1])


def test_the_first_command_survives_a_lost_slice(tmp_path):
    overrides = first_command_overrides()
    assert overrides  # it is not plain training
    steps = [o for o in TINY if not o.startswith("trainer.steps=")]  # the same job on the tiny model, past step 150
    result = run_cli(*overrides, *steps, "trainer.steps=160", f"hydra.run.dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (failure,) = report["failures"]
    assert (failure["step"], failure["restored_from"], failure["lost_steps"]) == (150, "replica", 0)
    assert report["steps_completed"] == 160
    assert report["samples"] == {"consumed": 160 * 48, "duplicated": 0, "skipped": 0}
    assert "failure @ 150" in result.stdout
