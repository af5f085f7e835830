"""docs/your_model.md runs as printed: a dict-batch classifier of one's own, from Python and from the command line."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

DOC = Path(__file__).parents[1] / "docs" / "your_model.md"
SAVE_PARAMS = """
import equinox as eqx, numpy as np
np.save("params.npy", np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(eqx.filter(state.params, eqx.is_array))]))
"""


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def run(command, cwd, timeout=300):
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(cwd)}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def project(tmp_path):
    """A folder holding the page's module, script and configs, as a user would write them."""
    module, script = blocks("python")[:2]  # the module and the script; the page's later blocks are variants
    (tmp_path / "my_classifier.py").write_text(module)
    (tmp_path / "train.py").write_text(script + SAVE_PARAMS)
    failure_free = script.replace('[{"at_step": 20, "slice": 1}]', "[]").split("(failure,) =")[0]
    (tmp_path / "failure_free.py").write_text(failure_free + 'print(report["final_loss"])\n' + SAVE_PARAMS)
    for config in blocks("yaml"):
        path = tmp_path / config.splitlines()[0].removeprefix("# ")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config)
    return tmp_path


def test_the_python_example_survives_a_lost_slice_and_ends_as_a_failure_free_run(project):
    result = run([sys.executable, "train.py"], project)
    assert result.returncode == 0, result.stderr
    restored_from, lost_steps, slices_after, final_loss = result.stdout.split()[-4:]
    assert (restored_from, lost_steps, slices_after) == ("replica", "0", "3")
    recovered = np.load(project / "params.npy")
    result = run([sys.executable, "failure_free.py"], project)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) == pytest.approx(float(final_loss), rel=1e-5)
    np.testing.assert_allclose(recovered, np.load(project / "params.npy"), rtol=1e-5, atol=1e-6)


def test_the_command_line_example_trains_the_same_pieces_through_target_configs(project):
    (command,) = blocks("bash")
    result = run(["bash", "-c", command.replace("\\\n", " ").strip() + " hydra.run.dir=run"], project)
    assert result.returncode == 0, result.stderr
    report = json.loads((project / "run" / "report.json").read_text())
    assert report["steps_completed"] == 40
    (failure,) = report["failures"]
    assert (failure["slices"], failure["restored_from"], failure["lost_steps"]) == ([1], "replica", 0)
    assert report["samples"] == {"consumed": 40 * 48, "duplicated": 0, "skipped": 0}


def test_a_model_that_does_not_fit_the_data_is_one_sentence_and_exit_2(project):
    (command,) = blocks("bash")
    result = run(["bash", "-c", command.replace("\\\n", " ").strip() + " model.features=16 hydra.run.dir=run"], project)
    assert result.returncode == 2
    assert result.stderr.startswith("elastic_trainer: error: the loss cannot be computed on a batch of the data")
    assert "'x': float32[1, 8]" in result.stderr and result.stderr.count("\n") == 1
    assert not (project / "run" / "checkpoints").exists() or not any((project / "run" / "checkpoints").iterdir())
