"""The committed steps' history: a long run keeps a float per step, not a device array, and a roll-back forgets
the steps it undoes wherever their losses are."""

import jax
import jax.numpy as jnp
import numpy as np

from elastic_trainer._ledger import SampleLedger
from elastic_trainer._records import LOSSES_ON_DEVICE, StepHistory


def test_only_the_newest_losses_stay_on_the_devices_and_a_roll_back_forgets_the_steps_it_undoes():
    history = StepHistory(SampleLedger(10_000, seed=0, start_position=0))
    steps = 3 * LOSSES_ON_DEVICE
    for step in range(steps):
        history.commit(step, np.arange(step * 2, step * 2 + 2), jnp.float32(step))
    on_device = [step for step, loss in history.losses.items() if isinstance(loss, jax.Array)]
    assert LOSSES_ON_DEVICE <= len(on_device) < 2 * LOSSES_ON_DEVICE and min(on_device) > steps - 2 * LOSSES_ON_DEVICE
    history.roll_back(LOSSES_ON_DEVICE // 2)  # into the steps whose losses are floats already
    for step in range(LOSSES_ON_DEVICE // 2, steps):  # trained again, each loss now 1000 more
        history.commit(step, np.arange(step * 2, step * 2 + 2), jnp.float32(1000 + step))
    kept = LOSSES_ON_DEVICE // 2
    assert history.ordered_losses() == [float(s) for s in range(kept)] + [1000.0 + s for s in range(kept, steps)]


def test_before_a_backend_restart_every_loss_comes_to_the_host_and_later_steps_go_on_as_before():
    # a rejoin restarts the backend (_take_back.py): the losses must not stay its arrays
    history = StepHistory(SampleLedger(10_000, seed=0, start_position=0))
    for step in range(LOSSES_ON_DEVICE + 3):
        history.commit(step, np.arange(step * 2, step * 2 + 2), jnp.float32(step))
    history.losses_to_host()
    assert all(type(loss) is float for loss in history.losses.values())
    for step in range(LOSSES_ON_DEVICE + 3, 3 * LOSSES_ON_DEVICE):
        history.commit(step, np.arange(step * 2, step * 2 + 2), jnp.float32(step))
    on_device = [step for step, loss in history.losses.items() if isinstance(loss, jax.Array)]
    assert LOSSES_ON_DEVICE <= len(on_device) < 2 * LOSSES_ON_DEVICE
    assert history.ordered_losses() == [float(s) for s in range(3 * LOSSES_ON_DEVICE)]
