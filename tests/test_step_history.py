"""The committed steps' history: a long run keeps a float per step, not a device array, and a roll-back forgets
the steps it undoes wherever their losses are."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_trainer._data import sample_ids
from elastic_trainer._ledger import SampleLedger
from elastic_trainer._records import LOSSES_ON_DEVICE, StepHistory


def test_only_the_newest_losses_stay_on_the_devices_and_a_roll_back_forgets_the_steps_it_undoes():
    history = StepHistory(SampleLedger(10_000, seed=0, start_position=0))
    steps = 3 * LOSSES_ON_DEVICE
    for step in range(steps):
        history.commit(step, np.arange(step * 2, step * 2 + 2), {"loss": jnp.float32(step)}, slices=(0,))
    on_device = [step for step, metrics in history.metrics.items() if isinstance(metrics["loss"], jax.Array)]
    assert LOSSES_ON_DEVICE <= len(on_device) < 2 * LOSSES_ON_DEVICE and min(on_device) > steps - 2 * LOSSES_ON_DEVICE
    history.roll_back(LOSSES_ON_DEVICE // 2)  # into the steps whose losses are floats already
    for step in range(LOSSES_ON_DEVICE // 2, steps):  # trained again, each loss now 1000 more
        history.commit(step, np.arange(step * 2, step * 2 + 2), {"loss": jnp.float32(1000 + step)}, slices=(0,))
    kept = LOSSES_ON_DEVICE // 2
    assert history.ordered_losses() == [float(s) for s in range(kept)] + [1000.0 + s for s in range(kept, steps)]


def test_before_a_backend_restart_every_loss_comes_to_the_host_and_later_steps_go_on_as_before():
    # a rejoin restarts the backend (_take_back.py): the losses must not stay its arrays
    history = StepHistory(SampleLedger(10_000, seed=0, start_position=0))
    for step in range(LOSSES_ON_DEVICE + 3):
        history.commit(step, np.arange(step * 2, step * 2 + 2), {"loss": jnp.float32(step)}, slices=(0,))
    history.losses_to_host()
    assert all(type(metrics["loss"]) is float for metrics in history.metrics.values())
    for step in range(LOSSES_ON_DEVICE + 3, 3 * LOSSES_ON_DEVICE):
        history.commit(step, np.arange(step * 2, step * 2 + 2), {"loss": jnp.float32(step)}, slices=(0,))
    on_device = [step for step, metrics in history.metrics.items() if isinstance(metrics["loss"], jax.Array)]
    assert LOSSES_ON_DEVICE <= len(on_device) < 2 * LOSSES_ON_DEVICE
    assert history.ordered_losses() == [float(s) for s in range(3 * LOSSES_ON_DEVICE)]


def test_a_dropped_slice_skips_its_share_of_each_step_since_and_a_roll_back_to_before_the_drop_undoes_it():
    """Steps 0 to 3 split over slices (0, 1, 2), 4 and 5 over (0, 2): slice 2 dropped during step 5, unsynced
    since step 2, skips rows 8 to 11 of steps 2 and 3 and rows 4 to 7 of steps 4 and 5 (its share, by its place in
    each step's slices), and its share of their time; the data position still counts every row read. A saved
    ledger keeps the skip; a roll-back to a state from before the drop (step 4's) undoes it and gives the time
    of the steps it keeps back."""
    history = StepHistory(SampleLedger(10_000, seed=0, start_position=0))
    position = 0
    for step, slices in enumerate([(0, 1, 2)] * 4 + [(0, 2)] * 2):
        ids = sample_ids(10_000, seed=0, start=position, count=4 * len(slices))  # the data order's
        history.commit(step, ids, {"loss": jnp.float32(step)}, slices=slices)
        history.time_step(step, 1.0)
        position += len(ids)
    skipped, seconds = history.drop_slice(2, since=2, until=6, at=5)
    assert (skipped, seconds) == (4 * 4, pytest.approx(2 * (1 / 3) + 2 * (1 / 2)))
    assert history.seconds[2] == pytest.approx(2 / 3) and history.ledger.end_position() == position == 64
    ledger = SampleLedger.from_arrays(history.ledger.to_arrays())
    for kept in (history.ledger, ledger):
        assert kept.counts(position) == {"consumed": 64 - 16, "duplicated": 0, "skipped": 16}
    assert history.drop_slice(2, since=2, until=6, at=5) == (0, 0.0)  # forgotten once: nothing more, no time
    wasted = history.roll_back(4)  # steps 4 and 5 go (1 s less their drop's share each); 2 and 3 get theirs back
    assert wasted == pytest.approx(2 * (1 / 2) - 2 * (1 / 3)) and history.seconds[2] == pytest.approx(1.0)
    assert history.ledger.counts(4 * 12) == {"consumed": 4 * 12, "duplicated": 0, "skipped": 0}
