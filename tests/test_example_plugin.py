"""The third-party example in examples/, pip-installed as a user installs it, from the command line."""

import importlib.metadata
import logging
import os
import subprocess
import sys

import pytest
from test_cli_recovery import TINY, failure_at, report_of

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer import _plugins
from elastic_trainer.launch._cli import check_group_choices

DISTRIBUTION = "elastic-trainer-example-plugin"


@pytest.fixture(scope="module", autouse=True)
def example_installed():
    """The README's test command installs the example; say how when it is missing."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{DISTRIBUTION} is not installed; run: pip install -e examples/{DISTRIBUTION}")


def run_cli_with_entry_points(*args, timeout=300):
    """``python -m elastic_trainer`` with entry-point plugins loaded, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k not in (_plugins.DISABLE_AUTOLOAD_ENV, _plugins.LOAD_PLUGINS_ENV)}
    return subprocess.run(
        [sys.executable, "-m", "elastic_trainer", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_cli_trains_with_the_plugin_strategy_and_observer(tmp_path):
    result = run_cli_with_entry_points(*TINY, "+strategy=quorum", *failure_at(10, 1), f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = report_of(tmp_path)
    assert report["strategy"] == "quorum"
    assert report["steps_completed"] == 20
    (failure,) = report["failures"]
    assert (failure["action"], failure["slices_before"], failure["slices_after"]) == ("quorum", 4, 3)
    assert report["samples"] == {"consumed": 20 * 48, "duplicated": 0, "skipped": 0}
    # the observer came in through the entry point, counted, and wrote into the report before it was saved
    assert report["step_counter"] == {
        "step_ends": 20, "redone": 0, "restores": [{"step": 10, "source": "replica", "redone": 0}],
    }
    log = (tmp_path / "elastic_trainer.log").read_text()
    assert "quorum: step 11 lost slice(s) [1]; 3 of 4 slices healthy, quorum 2: going on with 3." in log
    assert "step_counter: 20 step ends, 1 restores, 0 steps redone." in log


def test_list_plugins_names_the_distribution_of_the_observer_and_the_strategy(example_installed):
    result = run_cli_with_entry_points("--list-plugins", timeout=120)
    assert result.returncode == 0, result.stderr
    origin = f"{DISTRIBUTION} {example_installed}"
    hooks = "et_run_start, et_step_end, et_run_end, et_after_restore"
    assert f"  step_counter ({origin})\n      {hooks}\n" in result.stdout
    strategies = result.stdout.split("strategies (+strategy=NAME):\n")[1].splitlines()
    assert [line.split(maxsplit=1) for line in strategies if line.split()[0] in ("quorum", "scale_down")] == [
        ["quorum", origin], ["scale_down", "built-in"],
    ]


def test_the_allow_list_selects_the_example_by_its_entry_point_name(monkeypatch):
    monkeypatch.setenv(_plugins.LOAD_PLUGINS_ENV, "step_counter")
    assert etp.make_plugin_manager(load_entry_points=True).get_plugin("step_counter") is not None
    monkeypatch.setenv(_plugins.LOAD_PLUGINS_ENV, "")
    assert etp.make_plugin_manager(load_entry_points=True).get_plugin("step_counter") is None


def test_the_plugin_strategy_is_a_group_option_and_a_misspelling_suggests_it():
    check_group_choices(["+strategy=quorum"])
    with pytest.raises(et.ConfigError, match=r"there is no strategy 'quorm' \(did you mean \+strategy=quorum\?\)"):
        check_group_choices(["+strategy=quorm"])


def test_quorum_follows_the_cluster_size_and_checks_its_value():
    from elastic_trainer_example_plugin.quorum import Quorum

    assert [Quorum(0.5).min_slices(n) for n in (1, 4, 5, 64)] == [1, 2, 3, 32]
    assert Quorum(1.0).min_slices(4) == 4
    for bad in (0, 1.5):
        with pytest.raises(et.ConfigError, match="strategy.quorum must be above 0 and at most 1"):
            Quorum(bad)


class FakeHook:
    def et_slice_health(self, trainer):
        return [0, 2, 3]


class FakeCluster:
    def slice_devices(self):
        return [["d0"], ["d1"], ["d2"], ["d3"]]


class FakeTrainer:
    """Four slices, of which slice 1 is down."""

    hook = FakeHook()
    cluster = FakeCluster()


@pytest.mark.parametrize(("quorum", "needed", "decision"), [(0.75, 3, "going on with 3"), (1.0, 4, "stopping")])
def test_quorum_plans_for_the_quorum_and_logs_its_decision(caplog, quorum, needed, decision):
    from elastic_trainer_example_plugin.quorum import Quorum

    failure = etp.Failure(
        error=RuntimeError("DATA_LOSS"), step=6, phase="train_step", elastic=True, kind="slice_lost", slices=(1,)
    )
    with caplog.at_level(logging.INFO):
        plan = Quorum(quorum).et_choose_recovery(trainer=FakeTrainer(), failure=failure)
    assert plan == etp.RecoveryPlan(action="quorum", min_slices=needed)
    assert f"quorum: step 7 lost slice(s) [1]; 3 of 4 slices healthy, quorum {needed}: {decision}." in caplog.text
