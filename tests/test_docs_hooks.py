"""docs/hooks.md documents exactly the hooks of hookspecs.py, with their parameters and call semantics."""

import re
from pathlib import Path

import pluggy
import pytest

from elastic_trainer import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
HEADING = re.compile(r"^### `(et_\w+)\(([\w, ]*)\)`$", re.MULTILINE)


def hook_specs():
    """Each hookspec, from pluggy itself: name -> (argument names, spec options)."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    callers = (getattr(manager.hook, name) for name in vars(manager.hook) if not name.startswith("_"))
    return {caller.name: (caller.spec.argnames, caller.spec.opts) for caller in callers}


def documented_sections():
    """Each ``### `et_x(args)``` section of the doc: name -> (argument names, section text)."""
    text = DOC.read_text()
    headings = list(HEADING.finditer(text))
    sections = {}
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        body = text[heading.end(): following.start() if following else len(text)]
        args = tuple(a.strip() for a in heading.group(2).split(",") if a.strip())
        sections[heading.group(1)] = (args, body)
    return sections


SPECS = hook_specs()
SECTIONS = documented_sections()


def test_every_hookspec_is_documented_and_every_documented_hook_exists():
    assert SPECS, "no hookspecs found"
    assert sorted(SPECS) == sorted(SECTIONS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_hook_section_has_its_parameters_and_call_semantics(name):
    assert name in SECTIONS, f"{name} has no section in docs/hooks.md"
    argnames, opts = SPECS[name]
    args, body = SECTIONS[name]
    assert args == argnames, "the heading's parameters differ from the hookspec's"
    for arg in argnames:
        assert f"- `{arg}`:" in body, f"parameter {arg} is not described"
    for part in ("**When:**", "**Returns:**", "**Semantics:**", "```python"):
        assert part in body, f"{part} is missing"
    semantics = body.split("**Semantics:**")[1].split(".")[0].strip()
    assert semantics.startswith("firstresult") == bool(opts.get("firstresult")), semantics
    assert ("historic" in semantics) == bool(opts.get("historic")), semantics
