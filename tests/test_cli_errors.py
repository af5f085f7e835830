"""Where a user goes wrong, one sentence: a search path of one's own, a typo in a key, a batch or a failure
that the run cannot reach. Through the real command line (exit status 2, nothing trained), and in-process."""

import pytest
from test_bad_input import TINY, assert_fails_with, one_sentence
from test_cli import run_cli
from test_config import train_in_process

import elastic_trainer as et
from elastic_trainer.config._schemas import register_configs
from elastic_trainer.launch._cli import check_values


@pytest.fixture(scope="module")
def search_path(tmp_path_factory):
    """``hydra.searchpath=[...]`` naming a config folder of one's own, with a model option."""
    conf = tmp_path_factory.mktemp("conf")
    (conf / "model").mkdir()
    (conf / "model" / "my_mlp.yaml").write_text("_target_: my_models.MLP\nwidth: 8\n")
    return f"hydra.searchpath=[file://{conf}]"


@pytest.mark.parametrize(("case", "message"), [
    ("cluster=simulatd", "there is no cluster 'simulatd' (did you mean cluster=simulated?)"),
    ("model=my_mpl", "there is no model 'my_mpl' (did you mean model=my_mlp?); choose one of: my_mlp, transformer."),
    ("trainer.stepz=12", "trainer has no key 'stepz' (did you mean trainer.steps?)"),
    ("trainer.steps=ten", "trainer.steps: value 'ten' of type 'str' could not be converted to Integer."),
])
def test_a_search_path_on_the_command_line_keeps_every_error_one_sentence(search_path, tmp_path, case, message):
    result = run_cli(search_path, case, f"hydra.run.dir={tmp_path}", timeout=120)
    assert_fails_with(result, message)
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize(("case", "message"), [
    (["+chaos=schedule", "chaos.failures=[{at_stpe: 3, slice: 1}]"],
     "a chaos.failures entry has no key 'at_stpe' (did you mean at_step?); its keys are: at_step, slice, phase, "
     "down_for_s, hang, process, slow."),
    (["trainer.global_batch_size=40", "+strategy=scale_down"],
     "trainer.global_batch_size (40) must be divisible by the 6 devices of 3 slices, and by every device count "
     "scale_down may scale to (strategy.min_slice_count=1 to 4 slices); choose a multiple of 24, raise "
     "strategy.min_slice_count or set strategy.batch_policy=keep_per_device."),
    (["+chaos=schedule", "chaos.failures=[{at_step: 12, slice: 1}]"],
     "chaos failure at step 12 (train_step) would never strike: with trainer.steps=12 the last train_step is at "
     "step 11; schedule it earlier or raise trainer.steps."),
], ids=["chaos key typo", "batch over 3 slices", "failure after the last step"])
def test_what_the_run_could_not_do_is_refused_before_training(tmp_path, case, message):
    result = run_cli(*TINY, *case, f"hydra.run.dir={tmp_path}", timeout=120)
    assert_fails_with(result, message)
    assert not (tmp_path / "report.json").exists() and not any((tmp_path / "checkpoints").glob("*"))


@pytest.mark.parametrize(("case", "message"), [
    (["trainer.stepz=12"], "trainer has no key 'stepz' (did you mean trainer.steps?); its keys are: steps, "),
    (["optimizer.learning_rate.peek_value=1"],
     "optimizer.learning_rate has no key 'peek_value' (did you mean optimizer.learning_rate.peak_value?)"),
    (["clusterr.slices=3"], "the config has no key 'clusterr' (did you mean cluster?)"),
    (["+strategy=scale_down", "strategy.min_slices=2"],
     "strategy has no key 'min_slices' (did you mean strategy.min_slice_count?)"),
    (["+strategy=pause_then_scale_down", "strategy.strategies.0.timeout=2"],  # a plain config takes new keys
     "strategy.strategies.0 has no key 'timeout' (did you mean strategy.strategies.0.timeout_s?); its keys are: "
     "timeout_s, max_retries, retry_reset_steps, or add it with +strategy.strategies.0.timeout=<value>."),
    (["trainer.xyz=3"], "trainer has no key 'xyz'; its keys are: steps, "),
])
def test_a_key_that_does_not_exist_gets_the_closest_one_suggested(case, message):
    register_configs()
    with pytest.raises(et.ConfigError) as error:
        check_values(case)
    assert str(error.value).startswith(message)
    one_sentence(str(error.value))


@pytest.mark.parametrize(("case", "failures"), [
    (["trainer.global_batch_size=40", "+strategy=scale_down", "strategy.min_slice_count=4"], 0),  # never 6 devices
    (["trainer.global_batch_size=40", "+strategy=scale_down", "strategy.batch_policy=keep_per_device",
      "+chaos=schedule", "chaos.failures=[{at_step: 5, slice: 1}]"], 1),  # 30 samples over 6 devices
    (["+strategy=scale_down", "+chaos=schedule", "chaos.failures=[{at_step: 11, slice: 1}]"], 1),  # the last step
    (["+strategy=scale_down", "+chaos=schedule", "chaos.failures=[{at_step: 12, slice: 1, phase: checkpoint_save}]"],
     1),  # the last save
], ids=["batch above min_slice_count", "keep_per_device", "last train step", "last save"])
def test_what_the_run_can_reach_is_accepted(tmp_path, case, failures):
    report = train_in_process(*TINY, *case, f"checkpoint.dir={tmp_path}")
    assert report["steps_completed"] == 12 and len(report["failures"]) == failures
