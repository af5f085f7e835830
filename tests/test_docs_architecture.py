"""docs/architecture.md follows one failure through the code: every file it links and every function it names exist."""

import importlib
import inspect
import re
from pathlib import Path

import elastic_trainer as et
from elastic_trainer import _recovery

DOC = Path(__file__).parents[1] / "docs" / "architecture.md"


def test_every_linked_file_exists():
    links = re.findall(r"\]\((\.\./[^)]+)\)", DOC.read_text())
    assert len(links) > 20
    assert [link for link in links if not (DOC.parent / link).exists()] == []


def test_every_method_named_in_the_path_exists_on_its_class():
    named = set(re.findall(r"`([A-Z]\w+)\.(\w+)`", DOC.read_text()))
    assert len(named) > 10
    classes = {name: obj for module in (et, _recovery, importlib.import_module("elastic_trainer._layouts"),
                                        importlib.import_module("elastic_trainer.checkpoints._run_checkpoints"),
                                        importlib.import_module("elastic_trainer.checkpoints._save_schedule"),
                                        importlib.import_module("elastic_trainer._step_runner"),
                                        importlib.import_module("elastic_trainer._compiled_step"))
               for name, obj in vars(module).items() if inspect.isclass(obj)}
    unknown = [f"{cls}.{attr}" for cls, attr in named if cls in classes and not hasattr(classes[cls], attr)
               and attr not in {field for field in getattr(classes[cls], "__dataclass_fields__", {})}]
    assert unknown == []
    assert {cls for cls, _ in named} - set(classes) == set()


def test_every_recovery_function_named_exists():
    text = DOC.read_text()
    for name in ("survive", "recover", "classify", "choose_plan", "carry_out", "restore", "restart",
                 "finish_recovery", "lost_slices", "wait_for_slices"):
        assert f"`{name}`" in text, name
        assert inspect.isfunction(getattr(_recovery, name)), name
