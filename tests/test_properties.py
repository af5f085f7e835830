"""Property-based failure schedules: random failure times, slices and phases, and every invariant of the fault matrix.

Each example is a schedule of one to three failures (any step, any slice,
any phase, down for no time, briefly or for good; the first one in a train
step, so that one strikes for sure) under one strategy, run on the tiny
model exactly as a cell of tests/test_fault_matrix.py, and checked with the
same invariants against the same failure-free run. Hypothesis is
derandomized (the same examples in every run) and bounded to a few examples
without shrinking, so the test takes a bounded time in CI (about 30 s).
"""

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from test_fault_matrix import (  # noqa: F401 - the fixture: the failure-free run
    FOREVER,
    MAX_WORKERS,
    STEPS,
    check_invariants,
    failure_free,
    run_schedule,
)

from elastic_trainer_plugins.chaos import PHASES
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

EXAMPLES = 8
SYNCHRONOUS_PHASES = [phase for phase in PHASES if phase != "boundary"]  # no boundary work: chaos refuses one there
NEW_STRATEGY = {  # bounded in time: pause_resume gives up after 1 s without its slices
    "scale_down": lambda: ScaleDown(compile_ahead=False, timeout_s=0),  # the CLI tests cover compiling ahead
    "pause_resume": lambda: PauseResume(timeout_s=1.0),
    "full_restart": lambda: FullRestart(max_restarts=MAX_WORKERS),
}


@st.composite
def failures(draw, phases=SYNCHRONOUS_PHASES):
    """One scheduled failure; saves and restores happen at the checkpoint steps 2, 4 and 6."""
    phase = draw(st.sampled_from(phases))
    checkpoint_phase = phase in ("checkpoint_save", "checkpoint_restore")
    return {
        "at_step": draw(st.sampled_from([2, 4, 6]) if checkpoint_phase else st.integers(0, STEPS - 1)),
        "slice": draw(st.integers(0, 3)),
        "phase": phase,
        "down_for_s": draw(st.sampled_from([0.0, 0.2, FOREVER])),
    }


@settings(
    max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the falsifying schedule is printed as drawn
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    strategy=st.sampled_from(sorted(NEW_STRATEGY)),
    first=failures(phases=["train_step"]),  # strikes for sure: every schedule has a failure
    more=st.lists(failures(), max_size=2),
)
def test_random_failure_schedules_keep_every_invariant(tiny_trainer_kwargs, failure_free, tmp_path, strategy, first,
                                                       more):
    schedule = [first, *more]
    with tempfile.TemporaryDirectory(dir=tmp_path) as run_dir:
        cell = run_schedule(tiny_trainer_kwargs, Path(run_dir), new_strategy=NEW_STRATEGY[strategy], schedule=schedule)
        row = check_invariants(cell, failure_free)
    event(f"{strategy}: {row['outcome'].split(':')[0]}")  # shown by --hypothesis-show-statistics
    event(f"restored from: {row['restored_from']}")
