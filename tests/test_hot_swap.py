"""Spare slices: a spare takes a lost slice's place at the same slice count, on the failure-free trajectory.

Slices of one device each, so that 4 slices and a spare fit the tests' 8 CPU devices.
"""

import json
import warnings

import equinox as eqx
import jax
import numpy as np
import pytest
from test_logger import scalars

import elastic_trainer as et
from elastic_trainer.clusters import mesh_slice_count
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.fallback import Fallback
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.hot_swap import HotSwap
from elastic_trainer_plugins.metrics import TensorBoard
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

BATCH = 24  # divisible by 4, 3 and 2 devices
FOREVER = 1e9

_failure_free: dict = {}


def cluster(slices, spares=0):
    return et.SimulatedCluster(slices=slices, devices_per_slice=1, spare_slices=spares)


def lose(slice_, at_step):
    return {"at_step": at_step, "slice": slice_, "down_for_s": FOREVER}


def arrays_of(state):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(state, eqx.is_array))]


def failure_free(make, *, slices, steps):
    """Every array of a failure-free run's final state on ``slices`` slices without spares, computed once."""
    key = (slices, steps)
    if key not in _failure_free:
        _failure_free[key] = arrays_of(et.Trainer(**make(steps=steps, global_batch_size=BATCH,
                                                         cluster=cluster(slices))).fit().state)
    return _failure_free[key]


def assert_bit_identical(actual, expected):
    assert len(actual) == len(expected) > 0
    for a, b in zip(actual, expected, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


class BringBack:
    """After step ``after_step``, a lost slice comes back healthy (a new incarnation: its data is gone)."""

    def __init__(self, slice_, after_step):
        self.slice, self.after_step = slice_, after_step

    @et.hookimpl
    def et_step_end(self, trainer, step):
        if step == self.after_step:
            trainer.cluster.fail_slice(self.slice, down_for_s=0)


def test_a_spare_takes_the_lost_slice_s_place_with_no_step_lost_bit_identical_to_a_failure_free_run(
        tiny_trainer_kwargs):
    steps = 44
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=steps, global_batch_size=BATCH, cluster=cluster(4, spares=1),
                                               strategy=HotSwap(compile_ahead=False),
                                               plugins=[Chaos(failures=[lose(1, 40)])]))
    state, report = trainer.fit()
    [failure] = report["failures"]
    assert (failure["step"], failure["slices"], failure["action"]) == (40, [1], "hot_swap")
    assert (failure["restored_from"], failure["lost_steps"]) == ("replica", 0)
    assert (failure["slices_before"], failure["slices_after"]) == (4, 4)
    assert (failure["spares_taken"], failure["spares_left"]) == ([4], 0)
    assert [(r["step"], r["slices"]) for r in report["resizes"]] == [(40, [0, 2, 3, 4])]
    assert trainer.slices == (0, 2, 3, 4)
    assert report["samples"] == {"consumed": steps * BATCH, "duplicated": 0, "skipped": 0}
    assert report["cluster"]["spare_slices"] == 1
    assert report["spares"] == {"in_use": [4], "left": 0}
    assert_bit_identical(arrays_of(state), failure_free(tiny_trainer_kwargs, slices=4, steps=steps))


def test_the_swap_layouts_are_compiled_ahead(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=2, global_batch_size=BATCH, cluster=cluster(3, spares=1),
                                               strategy=HotSwap()))
    _, report = trainer.fit()
    ahead = [record["slices"] for record in report["compile_cache"]["layouts"] if record["ahead"]]
    assert sorted(ahead) == [[0, 1, 3], [0, 2, 3], [1, 2, 3]]


def test_a_lost_slice_that_comes_back_is_a_spare_for_the_next_failure(tiny_trainer_kwargs, tmp_path):
    steps = 8
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=steps, global_batch_size=BATCH, cluster=cluster(3, spares=1), strategy=HotSwap(compile_ahead=False),
        plugins=[Chaos(failures=[lose(1, 2), lose(2, 6)]), BringBack(1, after_step=4),
                 TensorBoard(log_dir=str(tmp_path / "tensorboard"))], run_dir=tmp_path))
    state, report = trainer.fit()
    swaps = [(f["step"], f["slices"], f["spares_taken"], f["spares_left"], f["slices_after"])
             for f in report["failures"]]
    assert swaps == [(2, [1], [3], 0, 3), (6, [2], [1], 0, 3)]
    assert trainer.slices == (0, 1, 3)
    assert report["spares"] == {"in_use": [3], "left": 0}  # slice 1 came back, and is in use as a spare
    assert report["samples"] == {"consumed": steps * BATCH, "duplicated": 0, "skipped": 0}
    assert_bit_identical(arrays_of(state), failure_free(tiny_trainer_kwargs, slices=3, steps=steps))
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["spares_taken"], e["spares_left"]) for e in events if e["event"] == "failure"] == [
        (2, [3], 0), (6, [1], 0)]
    written = scalars(tmp_path / "tensorboard")
    assert written["failures/spares_taken"] == [(2, 1), (6, 1)] and written["failures/spares_left"] == [(2, 0), (6, 0)]
    assert written["run/spares_in_use"] == [(steps, 1)] and written["run/spares_left"] == [(steps, 0)]


def test_with_the_last_spare_used_the_chain_falls_back_to_scale_down(tiny_trainer_kwargs):
    steps = 6
    strategy = Fallback([HotSwap(compile_ahead=False), ScaleDown(compile_ahead=False)])
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=steps, global_batch_size=BATCH, cluster=cluster(3, spares=1),
                                               strategy=strategy, plugins=[Chaos(failures=[lose(1, 2), lose(2, 4)])]))
    _, report = trainer.fit()
    first, second = report["failures"]
    assert (first["action"], first["spares_taken"], first["spares_left"], first["slices_after"]) == (
        "hot_swap", [3], 0, 3)
    assert (second["action"], second["fell_back_from"], second["spares_taken"], second["slices_after"]) == (
        "scale_down", ["hot_swap"], [], 2)
    assert second["lost_steps"] == 0 and trainer.slices == (0, 3)
    assert report["samples"] == {"consumed": steps * BATCH, "duplicated": 0, "skipped": 0}


def test_alone_with_no_spare_left_hot_swap_stops_saying_why(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=4, global_batch_size=BATCH, cluster=cluster(2, spares=0),
                                               strategy=HotSwap(), plugins=[Chaos(failures=[lose(1, 2)])]))
    with pytest.warns(et.SpareWarning, match="hot_swap on a cluster without spares"):
        with pytest.raises(et.TrainingStopped, match="hot_swap: 1 slice.* healthy .* fewer than the 2"):
            trainer.fit()


@pytest.mark.parametrize("strategy", [PauseResume(timeout_s=FOREVER), ScaleDown(compile_ahead=False)],
                         ids=["pause_resume", "scale_down"])
def test_other_strategies_take_a_spare_before_they_wait_or_shrink(tiny_trainer_kwargs, strategy):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=4, global_batch_size=BATCH, cluster=cluster(3, spares=1),
                                               strategy=strategy, plugins=[Chaos(failures=[lose(1, 2)])]))
    _, report = trainer.fit()  # pause_resume would wait for slice 1 for good without the spare
    [failure] = report["failures"]
    assert (failure["spares_taken"], failure["slices_after"], failure["lost_steps"]) == ([3], 3, 0)
    assert trainer.slices == (0, 2, 3)


def test_scale_down_never_scales_up_onto_a_spare(tiny_trainer_kwargs):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=3, global_batch_size=BATCH, cluster=cluster(3, spares=1),
                                               strategy=ScaleDown(compile_ahead=False)))
    _, report = trainer.fit()
    assert report["resizes"] == [] and trainer.slices == (0, 1, 2)


@pytest.mark.parametrize(("strategy", "match"), [
    (None, "no strategy is selected"),
    (FullRestart(), "full_restart never takes a spare slice in"),
], ids=["none", "full_restart"])
def test_spares_a_strategy_never_takes_in_are_said_once(tiny_trainer_kwargs, strategy, match):
    trainer = et.Trainer(**tiny_trainer_kwargs(steps=1, global_batch_size=BATCH, cluster=cluster(2, spares=1),
                                               strategy=strategy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    said = [str(w.message) for w in caught if issubclass(w.category, et.SpareWarning)]
    assert len(said) == 1 and match in said[0]


def test_spares_are_kept_out_of_the_first_mesh_and_named_in_the_report(tiny_trainer_kwargs):
    spares = cluster(2, spares=2)
    assert mesh_slice_count(spares) == 2 and len(spares.slice_devices()) == 4
    assert spares.describe() == {"kind": "simulated", "slices": 2, "devices_per_slice": 1, "spare_slices": 2}
    with pytest.raises(et.ConfigError, match="cluster.spare_slices must be at least 0, got -1"):
        cluster(2, spares=-1)
