"""The retry budget counts failures without progress: ``max_retries`` of them in a row, each fewer than
``retry_reset_steps`` steps past the one before, stop the run; a failure far enough past the previous one starts
the count again. MaxText's ``elastic_max_retries`` counts every failure of the run (``retry_reset_steps=0``)."""

import types

import pytest

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer_plugins.fallback import Fallback
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown


def failures_survived(budget: etp.RetryBudget, steps: list[int]) -> int:
    """How many of the failures at ``steps`` the budget lets the run recover from before it stops."""
    for survived, step in enumerate(steps):
        try:
            budget.spend(step)
        except et.TrainingStopped:
            return survived
    return len(steps)


def test_failures_far_apart_never_exhaust_the_budget():
    assert failures_survived(etp.RetryBudget("s", max_retries=2, retry_reset_steps=10), list(range(0, 1000, 10))) == 100


def test_failures_without_progress_stop_the_run_after_max_retries():
    budget = etp.RetryBudget("scale_down", max_retries=2, retry_reset_steps=10)
    assert failures_survived(budget, [50, 51, 59]) == 2  # the third in a row under 10 steps apart stops
    with pytest.raises(et.TrainingStopped, match=r"^scale_down gave up after 2 recoveries with fewer than 10 steps "
                                                 r"of progress between failures \(strategy.max_retries, "
                                                 r"strategy.retry_reset_steps\)\.$"):
        budget.spend(61)  # still without progress: stopped again


def test_progress_starts_the_count_again():
    budget = etp.RetryBudget("s", max_retries=2, retry_reset_steps=10)
    assert failures_survived(budget, [5, 6, 16, 17, 27, 28]) == 6  # each pair's first is 10 steps on: count 1, 2
    assert budget.used == 2


def test_a_run_rolled_back_that_fails_again_before_the_last_failure_made_no_progress():
    # a failure at 40, restored from the checkpoint of step 30, fails again at 38, then at 45: 5 steps past 40
    assert failures_survived(etp.RetryBudget("s", max_retries=2, retry_reset_steps=10), [40, 38, 45]) == 2


def test_zero_reset_steps_counts_every_failure_of_the_run_as_maxtext_does():
    budget = etp.RetryBudget("pause_resume", max_retries=3, retry_reset_steps=0)
    assert failures_survived(budget, [0, 1000, 2000, 3000, 4000]) == 3
    with pytest.raises(et.TrainingStopped, match=r"^pause_resume gave up after 3 recoveries \(strategy.max_retries\)\.$"):
        budget.spend(5000)


def test_a_failure_without_a_step_counts_as_one_without_progress():
    assert failures_survived(etp.RetryBudget("s", max_retries=1, retry_reset_steps=10), [0, None, 100]) == 1


@pytest.mark.parametrize("make", [
    lambda: ScaleDown(retry_reset_steps=-1),
    lambda: PauseResume(retry_reset_steps=-1),
    lambda: etp.RetryBudget("s", max_retries=1, retry_reset_steps=-1),
])
def test_negative_reset_steps_are_refused(make):
    with pytest.raises(et.ConfigError, match=r"^strategy.retry_reset_steps must be at least 0, got -1\.$"):
        make()


def test_the_strategies_default_to_the_same_reset_steps():
    assert ScaleDown().retries.retry_reset_steps == PauseResume().retries.retry_reset_steps == 10
    assert etp.RetryBudget("s", 1).retry_reset_steps == etp.RetryBudget.DEFAULT_RESET_STEPS == 10


def slice_lost_at(step: int) -> etp.Failure:
    return etp.Failure(error=RuntimeError("DATA_LOSS"), step=step, phase="train_step", elastic=True,
                      kind="slice_lost", slices=(1,))


def test_each_member_of_a_fallback_chain_counts_with_its_own_budget():
    chain = Fallback([PauseResume(timeout_s=1, max_retries=1, retry_reset_steps=5), ScaleDown(max_retries=3)])
    run = types.SimpleNamespace(cluster=et.SimulatedCluster(slices=4, devices_per_slice=2))
    for step in (10, 20, 30):  # 10 steps apart: pause_resume's count starts again each time
        plan = chain.et_choose_recovery(trainer=run, failure=slice_lost_at(step))
        assert (plan.action, plan.otherwise.action) == ("pause_resume", "scale_down")
    with pytest.raises(et.TrainingStopped, match="^pause_resume gave up after 1 recoveries"):
        chain.et_choose_recovery(trainer=run, failure=slice_lost_at(32))  # 2 steps on: the second in a row
