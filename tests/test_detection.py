"""How fast the multi-controller runtime finds a lost process: the chosen collective timeout and its check.

The detection itself is measured in benchmarks/multiprocess.py and run for real in tests/test_multiprocess.py.
"""

import itertools
import types

import pytest

import elastic_trainer as et
from elastic_trainer.clusters.multicontroller import _step_times


def dispatch_every(seconds, monkeypatch, cluster, steps):
    """Dispatch ``steps`` steps on ``cluster``'s step clock, ``seconds`` apart (no JAX job: the clock only)."""
    ticks = itertools.count()
    monkeypatch.setattr(_step_times, "time", types.SimpleNamespace(monotonic=lambda: next(ticks) * seconds))
    for _ in range(steps):
        cluster._timeout_check.dispatched()


def test_an_unset_collective_timeout_is_two_seconds_and_warns_when_steps_are_too_slow_for_it(monkeypatch):
    cluster = et.MultiprocessCluster(num_processes=3)
    assert cluster.collective_timeout_s == 2 and cluster.describe()["collective_timeout_s"] == 2
    with pytest.warns(UserWarning, match=r"a step takes 0\.75 s, .* \(2 s\) is under 4 steps: .* set "
                                         r"cluster\.collective_timeout_s=3 or more\.") as warned:
        dispatch_every(0.75, monkeypatch, cluster, steps=60)
    assert len(warned) == 1  # once, after the first 20 steps


def test_steps_well_under_the_timeout_do_not_warn(monkeypatch):
    cluster = et.MultiprocessCluster(num_processes=3)
    dispatch_every(0.4, monkeypatch, cluster, steps=60)  # 4 steps take 1.6 s: within 2 s (warnings are errors here)


def test_a_collective_timeout_the_user_set_is_kept_and_not_checked():
    cluster = et.MultiprocessCluster(num_processes=3, collective_timeout_s=7)
    assert cluster.collective_timeout_s == 7 and cluster._timeout_check is None
