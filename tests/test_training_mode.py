"""The step seam: a plugin's training mode compiles every layout's step and the loop runs it; with none, the
step is synchronous data parallel. docs/plugins.md's example mode, run as written."""

import dataclasses
import json
import re
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from test_fault_matrix import named_arrays

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

DOC = Path(__file__).parents[1] / "docs" / "plugins.md"


def documented(name: str):
    """The class ``name`` of docs/plugins.md's section "A training mode", from the page's code as written."""
    section = DOC.read_text().split("## A training mode\n")[1].split("\n## ")[0]
    for code in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        namespace = {}
        exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the page's own example
        if name in namespace:
            return namespace[name]
    raise LookupError(f"docs/plugins.md's section has no {name}")


def documented_plugin():
    """A new instance of docs/plugins.md's ``UseCountingMode``."""
    return documented("UseCountingMode")()


class ChoosesMode:
    def __init__(self, mode):
        self.mode = mode

    @et.hookimpl
    def et_training_mode(self, trainer):
        return self.mode


@dataclasses.dataclass
class CountedStep:
    """A compiled step that notes the global batch of each step it runs."""

    inner: etp.CompiledStep
    runs: list

    @property
    def executables(self):
        return self.inner.executables

    def run(self, leaves, batch, *, lr_scale, batch_size, monitor):
        self.runs.append(batch_size)
        return self.inner.run(leaves, batch, lr_scale=lr_scale, batch_size=batch_size, monitor=monitor)


@dataclasses.dataclass(eq=False)
class RunCountingMode(etp.AbstractTrainingMode):
    name = "run_counting"
    runs: list = dataclasses.field(default_factory=list)

    def compile(self, functions, abstract, batch, mesh, *, within_slice):
        step, shardings = etp.SynchronousMode().compile(functions, abstract, batch, mesh, within_slice=within_slice)
        return CountedStep(step, self.runs), shardings


def lose_slice_1(tiny_trainer_kwargs, *plugins):
    """6 steps on 4 slices, slice 1 lost for good during step 3: scale_down goes on with 3."""
    chaos = Chaos(failures=[{"at_step": 2, "slice": 1, "down_for_s": 1e9}])
    return et.Trainer(**tiny_trainer_kwargs(steps=6, global_batch_size=24, strategy=ScaleDown(),
                                            plugins=[chaos, *plugins]))


def test_without_a_plugin_the_step_is_synchronous_and_one_program(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=1))
    trainer.fit()
    assert trainer._ctx.step_cache.mode == etp.SynchronousMode(split=False)


def test_the_documented_mode_compiles_every_layout_of_a_run_that_loses_a_slice_and_ends_as_the_default(
        tiny_trainer_kwargs):
    plugin = documented_plugin()
    state, report = lose_slice_1(tiny_trainer_kwargs, plugin).fit()
    assert report["steps_completed"] == 6 and [f["slices_after"] for f in report["failures"]] == [3]
    records = report["compile_cache"]["layouts"]
    ready, started = (sum(bool(r[when]) for r in records) for when in ("ready_at", "started_at"))
    assert 2 <= ready <= plugin.mode.layouts <= started  # a compile ahead may still run on its thread
    default_state, _ = lose_slice_1(tiny_trainer_kwargs).fit()  # the synchronous mode's own run
    for name, array in named_arrays(default_state).items():
        np.testing.assert_array_equal(named_arrays(state)[name], array, err_msg=name)


def test_the_loop_runs_the_modes_compiled_step_for_every_step(tiny_trainer_kwargs):
    mode = RunCountingMode()
    et.Trainer(**tiny_trainer_kwargs(steps=3, plugins=[ChoosesMode(mode)])).fit()
    assert mode.runs == [16] * 3


def test_an_answer_that_is_no_mode_is_a_plugin_error_naming_the_plugin(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=1, plugins=[ChoosesMode("fused")]))
    with pytest.raises(et.PluginError, match=r"returned 'fused' from et_training_mode; a plugin must return an "
                                             r"elastic_trainer\.plugin\.AbstractTrainingMode"):
        trainer.fit()


def ema_run(tiny_trainer_kwargs, *plugins, split=None, **overrides):
    """A run of docs/plugins.md's ``EmaMode`` (chosen by its ``UseEmaMode``, or with ``split`` given, split or
    fused whatever the cluster): the mode's whole state at the end (the train state and the average of the
    parameters), and the report."""
    chooses = documented("UseEmaMode")() if split is None else ChoosesMode(documented("EmaMode")(split=split))
    trainer = et.Trainer(**tiny_trainer_kwargs(plugins=[chooses, *plugins], **overrides))
    _, report = trainer.fit()
    return trainer.mode_state, report


def assert_same_mode_state(arrays, expected):
    for name, array in named_arrays(expected).items():
        np.testing.assert_array_equal(named_arrays(arrays)[name], array, err_msg=name)


@pytest.mark.parametrize(("split", "second_failure"), [(False, (3, "snapshot")), (True, (4, "replica"))],
                         ids=["fused", "split"])
def test_a_modes_own_state_comes_back_from_a_replica_and_a_snapshot_as_an_uninterrupted_run_keeps_it(
        tiny_trainer_kwargs, split, second_failure):
    """Slice 1 lost while step 2 runs (the replica on the other slices restores the whole mode state), then
    slice 2 lost during step 4's update (a fused step took the state: the host snapshot restores it; a split
    one's update ended on the other slices, step 4 committed: their replica); both come back, and pause_resume goes on with 4
    slices. The average ends as an uninterrupted run's, bit for bit."""
    expected, _ = ema_run(tiny_trainer_kwargs, steps=6, split=split)
    assert set(named_arrays(expected)) > set(named_arrays(documented("EmaMode")().train_state(expected)))
    averaged = eqx.combine(expected.ema, tiny_trainer_kwargs()["model"])  # as docs/plugins.md says to evaluate it
    assert np.isfinite(float(et.next_token_loss(averaged, jnp.arange(18).reshape(2, 9) % 16, key=None)))
    ema, params = named_arrays(expected.ema), named_arrays(expected.params)
    assert any(not np.array_equal(ema[name], params[name]) for name in params), "the average is the parameters"
    chaos = Chaos(failures=[{"at_step": 1, "slice": 1, "down_for_s": 0.2},
                            {"at_step": 3, "slice": 2, "down_for_s": 0.2, "phase": "update"}])
    arrays, report = ema_run(tiny_trainer_kwargs, chaos, steps=6, snapshot_period=1, split=split,
                             strategy=PauseResume(timeout_s=30))
    assert [(f["step"], f["restored_from"], f["lost_steps"]) for f in report["failures"]] == [
        (1, "replica", 0), (*second_failure, 0)]
    assert report["steps_completed"] == 6 and report["samples"]["duplicated"] == 0
    assert_same_mode_state(arrays, expected)


def test_a_modes_own_state_is_checkpointed_and_a_resume_ends_as_an_uninterrupted_run(tiny_trainer_kwargs,
                                                                                     tmp_path):
    expected, _ = ema_run(tiny_trainer_kwargs, steps=6)
    ema_run(tiny_trainer_kwargs, steps=4, checkpointer=et.Checkpointer(tmp_path, period=2))
    assert json.loads((tmp_path / "4" / "metadata" / "metadata").read_text())["training_mode"] == "ema"
    arrays, report = ema_run(tiny_trainer_kwargs, steps=6, checkpointer=et.Checkpointer(tmp_path, period=2),
                             resume=True)
    assert report["samples"] == {"consumed": 2 * 16, "duplicated": 0, "skipped": 0}
    assert_same_mode_state(arrays, expected)


def test_a_checkpoint_without_the_modes_state_is_refused_in_one_sentence(tiny_trainer_kwargs, tmp_path):
    et.Trainer(**tiny_trainer_kwargs(steps=2, checkpointer=et.Checkpointer(tmp_path, period=2))).fit()
    with pytest.raises(et.ConfigError, match=r"holds another model's state \(ema\..* is in this run but not in the "
                                             r"checkpoint\); resume with the model and optimizer it was saved with "
                                             r"\(and its training mode"):
        ema_run(tiny_trainer_kwargs, steps=4, checkpointer=et.Checkpointer(tmp_path, period=2), resume=True)
