"""Every Python and shell block of the README and the docs runs in the tests, or says why it is not run.

The line right before such a block is one of:

    <!-- tested: tests/test_x.py -->        (one or more test files, comma-separated)
    <!-- not run: REASON -->

A test file named must exist and name the page it runs (``your_model.md``), so that the link is real.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
CHECKED_LANGUAGES = {"python", "py", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^\s`{]*)")
TESTED = re.compile(r"^<!-- tested: (tests/\S+\.py(?:, tests/\S+\.py)*) -->$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """Each fenced block of a Markdown text: its fence's line number (1-based), its language, and the line
    before its fence."""
    blocks, lines, open_fence = [], text.splitlines(), None
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if open_fence is None and match:
            open_fence = match.group(1)
            before = lines[number - 2].strip() if number > 1 else ""
            blocks.append((number, match.group(2).lower(), before))
        elif open_fence is not None and match and match.group(1).startswith(open_fence) and not match.group(2):
            open_fence = None
    return blocks


def marker_problem(page: Path, before: str) -> str | None:
    """What is wrong with the marker line ``before`` of a checked block of ``page``, or ``None``."""
    if NOT_RUN.match(before):
        return None
    tested = TESTED.match(before)
    if tested is None:
        return ("has no marker line before it: add <!-- tested: tests/test_x.py --> (a test that runs it) or "
                "<!-- not run: the reason -->")
    for name in tested.group(1).split(", "):
        test = ROOT / name
        if not test.is_file():
            return f"names {name}, which does not exist"
        if page.name not in test.read_text():
            return f"names {name}, which never mentions {page.name}: name the test that runs this page's blocks"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_python_and_shell_block_is_tested_or_says_why_not(page):
    problems = [f"{page.relative_to(ROOT)}:{number}: a ```{language} block {problem}"
                for number, language, before in code_blocks(page.read_text())
                if language in CHECKED_LANGUAGES and (problem := marker_problem(page, before))]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_blocks_and_reads_markers(tmp_path):
    page = tmp_path / "page.md"
    text = "\n".join([
        "<!-- not run: needs a TPU -->", "```python", "x = 1", "```",
        "```bash", "echo unmarked", "```",
        "<!-- tested: tests/conftest.py -->", "````console", "```python", "inside", "```", "````",
        "```yaml", "a: 1", "```",
        "<!-- not run:  -->", "```sh", "true", "```",
    ])
    blocks = code_blocks(text)
    assert [(language, before) for _, language, before in blocks] == [
        ("python", "<!-- not run: needs a TPU -->"), ("bash", "```"),
        ("console", "<!-- tested: tests/conftest.py -->"), ("yaml", "````"), ("sh", "<!-- not run:  -->"),
    ]
    problems = [marker_problem(page, before) for _, _, before in blocks]
    assert problems[0] is None
    assert "no marker line" in problems[1] and "no marker line" in problems[4]  # an empty reason is no reason
    assert "never mentions page.md" in problems[2]  # conftest.py runs no page
