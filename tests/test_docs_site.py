"""The documentation site builds with ``mkdocs build --strict`` (a broken link or reference fails it), and its
generated reference follows the code: a key added to a config schema appears with no page edited."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def gen_reference():
    """docs/gen_reference.py, the generator that the site's MkDocs hook runs."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses find their module
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_with_its_generated_reference(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr
    pages = {name: (site / "reference" / name / "index.html").read_text()
             for name in ("configuration", "report", "hooks", "cli", "api")}
    assert "trainer.steps" in pages["configuration"] and "strategy.min_slice_count" in pages["configuration"]
    assert "failures[].recovery_s" in pages["report"]
    assert 'id="elastic_trainer.hookspecs.et_step_end"' in pages["hooks"]
    assert "<td>75</td>" in pages["cli"]
    assert 'id="elastic_trainer.Trainer"' in pages["api"]
    assert "<!-- generated:" not in "".join(pages.values())


def test_a_key_added_to_a_schema_appears_in_the_configuration_reference(gen_reference):
    base, schemas = gen_reference.config_schemas()
    chosen, options = gen_reference.config_options()
    help_text = "how long to wait for a straggler before dropping it."
    extended = dataclasses.make_dataclass(
        "ScaleDownConfig", [("patience_s", float, dataclasses.field(default=1.5, metadata={"help": help_text}))],
        bases=(schemas["strategy"]["scale_down"],),
    )
    before = gen_reference.configuration_markdown(base, schemas, chosen, options)
    page = gen_reference.configuration_markdown(base, {**schemas, "strategy": {**schemas["strategy"],
                                                                               "scale_down": extended}},
                                                chosen, options)
    assert "strategy.patience_s" not in before
    assert f"| `strategy.patience_s` | float | `1.5` | {help_text} |" in page
    # the rest of the schema's keys are still there, in source order, the new one last
    keys = re.findall(r"\| `(strategy\.[a-z_]+)` \|", page.split("{#schema-strategy-scale_down}")[1].split("###")[0])
    assert keys[-1] == "strategy.patience_s" and "strategy.min_slice_count" in keys


def test_every_configuration_key_and_report_key_has_a_description(gen_reference):
    undocumented = [line for page in (gen_reference.configuration(), gen_reference.report())
                    for line in page.splitlines() if line.startswith("| `") and line.endswith("| — |")]
    assert not undocumented, ("these keys have no description: give the field a docstring under it, or a "
                              ":param in the docstring of the class it configures:\n" + "\n".join(undocumented))


def test_the_hooks_reference_renders_every_hookspec_once_under_its_group(gen_reference):
    from elastic_trainer import hookspecs

    page = gen_reference.hooks()
    specs = [name for name in dir(hookspecs) if name.startswith("et_")]
    rendered = re.findall(r"^::: elastic_trainer\.hookspecs\.(\w+)$", page, flags=re.MULTILINE)
    assert sorted(rendered) == sorted(specs)
    groups = re.findall(r"^## (.+)$", page, flags=re.MULTILINE)
    assert groups[0] == "Run lifecycle" and len(groups) >= 3
    assert page.index("## Run lifecycle") < page.index("hookspecs.et_run_start") < page.index(f"## {groups[1]}")
