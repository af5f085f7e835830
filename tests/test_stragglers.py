"""Stragglers: a slice alive but slow (chaos ``slow: FACTOR``) is found, reported, and dropped by scale_down when asked.

The same on cluster=multiprocess, with real processes: tests/test_multiprocess.py.
"""

import json
from types import SimpleNamespace

import equinox as eqx
import jax
import numpy as np
import pytest

import elastic_trainer as et
from elastic_trainer.clusters import AbstractInjectableCluster
from elastic_trainer._stragglers import StragglerRule, StragglerWatch
from elastic_trainer.chaos import Chaos
from elastic_trainer_plugins.fallback import Fallback
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

STEPS, BATCH = 30, 24
RULE = StragglerRule(factor=2.0, steps=3)
SLOW_FROM = 2  # slice 2 is slow from the step that starts with 2 steps completed: steps 3, 4, 5 by steps completed


def observe_all(watch, per_step):
    """Feed ``watch`` one step's times after another; the stragglers after each step."""
    after = []
    for step, seconds in enumerate(per_step, start=1):
        watch.observe(step, seconds)
        after.append(set(watch.current))
    return after


def test_a_slice_is_a_straggler_after_the_rules_steps_and_recovers_after_as_many_not_slow():
    watch = StragglerWatch(RULE)
    slow, fast = {0: 1.0, 1: 1.1, 2: 3.0}, {0: 1.0, 1: 1.1, 2: 1.2}
    # one fast step between slow ones starts the count again
    after = observe_all(watch, [slow, slow, fast, slow, slow, slow, fast, fast, slow, fast, fast, fast])
    assert after == [set()] * 5 + [{2}] * 6 + [set()]
    [record] = watch.to_json()
    assert (record["slice"], record["slow_since_step"], record["detected_at_step"]) == (2, 4, 6)
    assert record["ratio"] == pytest.approx(3.0 / 1.05)
    assert record["recovered_at_step"] == 12  # steps 10-12 were not slow; 7, 8 were, but step 9 broke that run


def test_a_dropped_straggler_back_in_use_is_on_trial_and_is_one_again_only_once_slow_for_the_rules_steps():
    watch = StragglerWatch(RULE)
    slow, out = {0: 1.0, 1: 1.0, 2: 3.0}, {0: 1.0, 1: 1.0}
    after = observe_all(watch, [slow] * 3 + [out] * 2 + [slow] * 3)
    assert after == [set(), set(), {2}, {2}, {2}, set(), set(), {2}]
    assert len(watch.records) == 1 and watch.records[0].recovered_at_step is None  # the same straggler all along


def test_steps_with_no_times_between_measured_ones_change_nothing():
    """Semi-synchronous training on cluster=multiprocess measures only the steps that end with an agreement (its
    outer steps): the steps between say nothing, and three slow outer steps make a straggler."""
    watch = StragglerWatch(RULE)
    slow = {0: 1.0, 1: 1.1, 2: 3.0}
    after = observe_all(watch, [slow, {}, {}, slow, {}, {}, slow, {}])
    assert after == [set()] * 6 + [{2}] * 2
    assert watch.records[0].detected_at_step == 7


def test_one_slice_or_equal_times_make_no_straggler():
    watch = StragglerWatch(RULE)
    assert observe_all(watch, [{0: 5.0}] * 4 + [{0: 1.0, 1: 1.0}] * 4) == [set()] * 8
    assert watch.records == []


@pytest.mark.parametrize("bad", [dict(factor=1.0), dict(steps=0)])
def test_a_bad_rule_is_one_sentence(bad):
    with pytest.raises(et.ConfigError, match=r"^trainer\.straggler_(factor|steps) must be .*\.$"):
        StragglerRule(**bad)


def test_a_bad_slow_entry_is_one_sentence():
    with pytest.raises(et.ConfigError, match="slow must be above 1"):
        Chaos(failures=[{"at_step": 1, "slice": 1, "slow": 1.0}])
    with pytest.raises(et.ConfigError, match="slow must be above 1"):
        Chaos(failures=[{"at_step": 1, "slice": 1, "slow": 3, "hang": True}])


# ------------------------------------------------------------------ on the simulated cluster


@pytest.fixture
def make(tiny_trainer_kwargs):
    def make_trainer(**overrides):
        return et.Trainer(**tiny_trainer_kwargs(steps=STEPS, global_batch_size=BATCH, straggler_rule=RULE,
                                                snapshot_period=0, **overrides))
    return make_trainer


_failure_free = {}


@pytest.fixture
def failure_free(make):
    """The final state of the run without slow slices (once per session)."""
    if "state" not in _failure_free:
        _failure_free["state"], report = make().fit()
        assert report["stragglers"] == []  # every slice as fast as the others: none
    return _failure_free["state"]


def assert_same_state(actual, expected):
    for a, b in zip(jax.tree.leaves(eqx.filter(actual, eqx.is_array)), jax.tree.leaves(eqx.filter(expected, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_slow_slice_is_reported_as_a_straggler_within_straggler_steps(make, failure_free, tmp_path):
    slow = Chaos(failures=[{"at_step": SLOW_FROM, "slice": 2, "slow": 3}])
    state, report = make(plugins=[slow], run_dir=tmp_path).fit()
    [straggler] = report["stragglers"]
    assert (straggler["slice"], straggler["slow_since_step"]) == (2, SLOW_FROM + 1)
    assert straggler["detected_at_step"] == SLOW_FROM + RULE.steps  # within straggler_steps steps
    assert straggler["ratio"] == pytest.approx(3.0) and straggler["recovered_at_step"] is None
    assert report["failures"] == [] and report["resizes"] == []  # reported only: no strategy acts on it
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["event"] == "straggler"]
    assert event["slice"] == 2 and event["time"] == straggler["detected_at"] and "end" not in event
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(1, STEPS + 1)) and events.index(event) == steps.index(straggler["detected_at_step"]) + 1
    assert_same_state(state, failure_free)  # slowness changes no number


class EndSlowness:
    """Ends slice 2's slowness when scale_down has dropped it ``after_drops`` times (on the run's steps, not a clock)."""

    def __init__(self, after_drops):
        self.after_drops, self.drops, self.in_use = after_drops, 0, True

    @et.hookimpl
    def et_step_start(self, trainer):
        if self.in_use and 2 not in trainer.slices:
            self.drops += 1
            if self.drops == self.after_drops:
                trainer.cluster.slow_slice(2, factor=3, for_s=0)
        self.in_use = 2 in trainer.slices


def test_scale_down_drops_a_straggler_tries_it_again_later_and_keeps_it_once_it_recovered(make, failure_free):
    strategy = ScaleDown(drop_stragglers=True, drop_for_steps=5, compile_ahead=False)
    plugins = [Chaos(failures=[{"at_step": SLOW_FROM, "slice": 2, "slow": 3}]), EndSlowness(after_drops=2)]
    state, report = make(strategy=strategy, plugins=plugins).fit()
    found = SLOW_FROM + RULE.steps
    # dropped once found; back after 5 steps and slow still: dropped again after 3 more, out for 10 steps this time;
    # back once more, not slow now: kept, and recovered after 3 steps
    assert [(r["step"], r["reason"], r["slices"]) for r in report["resizes"]] == [
        (found, "dropped", [0, 1, 3]), (found + 5, "scale_up", [0, 1, 2, 3]),
        (found + 5 + RULE.steps, "dropped", [0, 1, 3]), (found + 5 + RULE.steps + 10, "scale_up", [0, 1, 2, 3]),
    ]
    [straggler] = report["stragglers"]
    assert straggler["detected_at_step"] == found
    assert straggler["recovered_at_step"] == found + 5 + RULE.steps + 10 + RULE.steps
    assert report["failures"] == [] and report["steps_completed"] == STEPS
    assert report["samples"] == {"consumed": STEPS * BATCH, "duplicated": 0, "skipped": 0}
    assert_same_state(state, failure_free)  # the global batch and sample order are kept over 3 and 4 slices


def test_scale_down_never_drops_below_min_slice_count(make):
    strategy = ScaleDown(drop_stragglers=True, min_slice_count=4, compile_ahead=False)
    _, report = make(strategy=strategy, plugins=[Chaos(failures=[{"at_step": SLOW_FROM, "slice": 2, "slow": 3}])]).fit()
    assert [s["slice"] for s in report["stragglers"]] == [2] and report["resizes"] == []


class OlderCluster(AbstractInjectableCluster):
    """A third party's injectable cluster written before slices could be slowed: it has no slow_slice."""

    kind = "older"

    def configure_jax(self) -> None:
        pass

    def slice_devices(self):
        return [jax.devices()[:2]]

    def describe(self) -> dict:
        return {"kind": self.kind}

    def healthy_slices(self) -> list[int]:
        return [0]

    def fail_slice(self, index: int, *, down_for_s: float) -> None:
        pass

    def hang_slice(self, index: int, *, down_for_s: float) -> None:
        pass


def test_an_injectable_cluster_without_slow_slice_still_builds_and_refuses_to_slow_a_slice():
    cluster = OlderCluster()
    with pytest.raises(et.ConfigError, match="OlderCluster cannot slow a slice down; drop the chaos entry's slow key"):
        cluster.slow_slice(0, factor=3, for_s=1)


def test_a_dropped_straggler_comes_back_when_scale_down_is_a_member_of_a_fallback_chain():
    """The chain tells its members every step's end, so scale_down counts the steps a dropped straggler is out
    (before, a member never heard of them, and a straggler it dropped stayed out for good)."""
    scale_down = ScaleDown(drop_stragglers=True, drop_for_steps=5)
    chain = Fallback([PauseResume(), scale_down])
    cluster = et.SimulatedCluster(slices=4, devices_per_slice=2)
    slow = SimpleNamespace(slices=(0, 1, 2, 3), stragglers=frozenset({2}), cluster=cluster)
    chain.et_step_end(trainer=slow, step=10, metrics={})
    assert chain.et_propose_resize(trainer=slow, healthy_slices=[0, 1, 2, 3]) == [0, 1, 3]  # out until step 15
    without = SimpleNamespace(slices=(0, 1, 3), stragglers=frozenset(), cluster=cluster)
    chain.et_step_end(trainer=without, step=14, metrics={})
    assert chain.et_propose_resize(trainer=without, healthy_slices=[0, 1, 2, 3]) is None
    chain.et_step_end(trainer=without, step=15, metrics={})
    assert chain.et_propose_resize(trainer=without, healthy_slices=[0, 1, 2, 3]) == [0, 1, 2, 3]
