"""The README's Python example runs as printed, and the console blocks of docs/getting_started.md print what their
commands print."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import run_cli

ROOT = Path(__file__).parents[1]


def python_block(page: Path, section: str) -> str:
    return page.read_text().split(section)[1].split("```python\n")[1].split("```")[0]


@pytest.mark.slow
def test_the_readme_example_trains_through_a_lost_slice(tmp_path):
    """The README's "Your own model" block in a fresh Python process: slice 1 lost at step 20, survived from a
    replica with no sample trained twice, as its last line prints."""
    code = python_block(ROOT / "README.md", "## Your own model")
    env = {**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "replica 0"


def console_examples(page: Path, section: str) -> list[tuple[str, list[str]]]:
    """Each ``$ command`` of the section's console block with the lines printed after it."""
    block = page.read_text().split(section)[1].split("```console\n")[1].split("```")[0]
    examples: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            examples.append((line.removeprefix("$ "), []))
        else:
            examples[-1][1].append(line)
    return examples


def test_the_getting_started_errors_are_what_the_commands_print():
    examples = console_examples(ROOT / "docs" / "getting_started.md", "## Configuration")
    assert examples
    for command, shown in examples:
        result = run_cli(*shlex.split(command.removeprefix("python -m elastic_trainer")))
        assert result.returncode == 2, command
        assert (result.stdout + result.stderr).strip().splitlines() == shown, command
