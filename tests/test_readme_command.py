"""The README's first command shows the mission: a slice lost midway, training goes on with no step lost; and the
summary its quickstart prints is what a real run of that command prints, field by field."""

import json
import re
import shlex
from pathlib import Path

import pytest

from test_cli import run_cli
from test_cli_recovery import TINY

README = Path(__file__).parents[1] / "README.md"
LOSS_TOLERANCE = 0.01
"""How far a loss may differ from the README's: the same run on another CPU or XLA build adds its sums in another
order."""


def first_command():
    """The README's main-job command: the first line of its install block, without the install and the comment."""
    block = README.read_text().split("## Install")[1].split("```bash\n")[1]
    return block.splitlines()[0].split("#")[0].split("&&")[-1].strip()


def first_command_overrides():
    return shlex.split(first_command().split("python -m elastic_trainer")[1])


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


def quickstart_block() -> str:
    """The console block of the README's quickstart: the command and what it printed."""
    section = README.read_text().split("## Quickstart")[1]
    return section.split("```console\n")[1].split("```")[0]


def summary_rows(output: str) -> list[tuple[str, str]]:
    """The summary table's rows as (label, value), a cell wrapped over several lines joined into one."""
    rows: list[tuple[str, str]] = []
    for line in output.splitlines():
        if not line.startswith("│"):
            continue
        label, value = (cell.strip() for cell in line.strip("│").split("│"))
        if label:
            rows.append((label, value))
        else:
            rows[-1] = (rows[-1][0], f"{rows[-1][1]} {value}")
    return rows


TIMED = {
    "wall": r"[\d.]+ s",
    "goodput": r"[\d.]+% \([\d.]+ s productive\)",
}
"""The rows whose values are times: a run on another machine, or another hour of this one, prints other numbers."""
BADPUT_ROW = r"\s*[\d.]+ s\s+#*\s+[\d.]+%"
"""A badput category's row: shown when it took 0.05 s or more, so which of them appear depends on the machine."""


def losses(value: str) -> list[float]:
    return [float(number) for number in re.findall(r"\d+\.\d{4}", value)]


def assert_same_row(shown: tuple[str, str], printed: tuple[str, str]) -> None:
    (label, value), (printed_label, printed_value) = shown, printed
    assert label == printed_label, (shown, printed)
    if label in TIMED:
        assert re.fullmatch(TIMED[label], value) and re.fullmatch(TIMED[label], printed_value), (shown, printed)
    elif label == "loss":
        assert losses(value) == pytest.approx(losses(printed_value), abs=LOSS_TOLERANCE), (shown, printed)
    elif label.startswith("failure @"):
        recovered = r"recovered in [\d.]+ s"
        assert re.sub(recovered, "", value) == re.sub(recovered, "", printed_value), (shown, printed)
    else:
        assert value == printed_value, (shown, printed)


@pytest.mark.slow
def test_the_quickstart_shows_what_its_command_prints(tmp_path):
    """The README's quickstart block against a real run of its command (the default job, 300 steps): every row of
    the summary, in order; the steps, strategy, failure and samples as printed, the losses to LOSS_TOLERANCE, the
    times in their format; the badput rows (machine-dependent) in the format of one; the first and last progress
    lines."""
    block = quickstart_block()
    command = block.splitlines()[0].removeprefix("$ ")
    assert command == first_command()
    result = run_cli(*shlex.split(command.split("python -m elastic_trainer")[1]), f"hydra.run.dir={tmp_path}",
                     timeout=1200)
    assert result.returncode == 0, result.stderr
    shown = [row for row in summary_rows(block) if not re.fullmatch(BADPUT_ROW, row[1])]
    printed = summary_rows(result.stdout)
    assert all(re.fullmatch(BADPUT_ROW, value) for label, value in printed if label not in dict(shown)), printed
    printed = [row for row in printed if not re.fullmatch(BADPUT_ROW, row[1])]
    assert len(shown) == len(printed), (shown, printed)
    for row, printed_row in zip(shown, printed, strict=True):
        assert_same_row(row, printed_row)
    progress = [line for line in block.splitlines() if line.startswith("step ")]
    printed_progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    for line, printed_line in zip(progress, (printed_progress[0], printed_progress[-1]), strict=True):
        assert line.split("  ")[0] == printed_line.split("  ")[0]
        assert losses(line) == pytest.approx(losses(printed_line), abs=LOSS_TOLERANCE)
    assert block.splitlines()[-1].startswith("report: ") and f"report: {tmp_path}/report.json" in result.stdout


def test_the_docs_show_the_readme_command():
    """docs/index.md and docs/getting_started.md show the main-job command that the tests above run."""
    docs = README.parent / "docs"
    for page in ("index.md", "getting_started.md"):
        blocks = [part.split("```")[0] for part in (docs / page).read_text().split("```bash\n")[1:]]
        assert any(first_command() in block for block in blocks), page
