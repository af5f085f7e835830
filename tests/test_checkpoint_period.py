import pytest

import elastic_trainer as et
from elastic_trainer.checkpoints._young_daly import YoungDalyPeriod


def saved_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_young_daly_period_from_the_measured_costs():
    period = YoungDalyPeriod(mtbf_s=60)
    # sqrt(2 x 0.1 s x 60 s) = 3.46 s between saves = 69 steps of 0.05 s
    assert period.choose(save_cost_s=0.1, step_times_s=[0.05, 0.05, 0.2], elapsed_s=10, failures=0) == 69
    assert period.choice["mtbf_source"] == "from checkpoint.mtbf_s"
    assert period.choice["why"].startswith("Young/Daly: sqrt(2 x 0.100 s save x 60 s MTBF")


@pytest.mark.parametrize(("frequent", "rare"), [(dict(mtbf_s=30), dict(mtbf_s=3000)), (dict(failures=9), dict(failures=1))])
def test_more_frequent_failures_give_a_shorter_period(frequent, rare):
    def choose(mtbf_s=None, failures=0):
        return YoungDalyPeriod(mtbf_s).choose(save_cost_s=0.2, step_times_s=[0.1], elapsed_s=900, failures=failures)

    assert choose(**frequent) < choose(**rare)


def test_without_failures_the_observed_run_time_bounds_the_mtbf():
    period = YoungDalyPeriod()
    period.choose(save_cost_s=0.5, step_times_s=[1.0], elapsed_s=400, failures=0)
    assert period.choice["mtbf_s"] == 400 and "no failure in 400 s" in period.choice["mtbf_source"]


def test_auto_period_in_training_saves_more_often_when_failures_are_expected_more_often(tiny_trainer_kwargs, tmp_path):
    reports = {}
    for mtbf_s in (1e-3, 1e6):  # a failure every millisecond against one in eleven days
        checkpointer = et.Checkpointer(tmp_path / str(mtbf_s), period="auto", mtbf_s=mtbf_s, max_to_keep=10)
        reports[mtbf_s] = et.Trainer(**tiny_trainer_kwargs(steps=5, checkpointer=checkpointer)).fit().report
    frequent, rare = reports[1e-3]["checkpoint"]["auto"], reports[1e6]["checkpoint"]["auto"]
    assert frequent["period_steps"] == 1 < rare["period_steps"]
    assert frequent["save_cost_s"] > 0 and frequent["step_time_s"] > 0
    assert saved_steps(tmp_path / "0.001") == list(range(1, 6))
    assert saved_steps(tmp_path / "1000000.0") == [1, 5]  # the first save measures the cost; the last step is always saved


def test_the_steps_to_save_are_orbaxs_save_decision_a_period_and_the_last_step(tmp_path):
    from orbax.checkpoint.checkpoint_managers import SaveDecisionPolicy

    fixed = et.Checkpointer(tmp_path / "fixed", period=10)
    assert isinstance(fixed.schedule.policy, SaveDecisionPolicy)
    assert [s for s in range(1, 31) if fixed.schedule.due(s, last_step=25)] == [10, 20, 25, 30]
    auto = et.Checkpointer(tmp_path / "auto", period="auto", mtbf_s=100)
    assert isinstance(auto.schedule.policy, SaveDecisionPolicy)
    assert auto.schedule.due(1)  # the first save measures what a save costs
    auto.schedule.saved(1, blocked_s=0.5, step_times_s=[1.0], elapsed_s=10, failures=0)  # sqrt(2 x 0.5 x 100) = 10 steps
    assert [s for s in range(2, 16) if auto.schedule.due(s, last_step=15)] == [11, 12, 13, 14, 15]
