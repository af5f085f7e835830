"""A plugin that makes one process late to a step's collectives, for tests/test_slow_peer.py: as a host whose
compilation cache missed, or whose cores are busy, reaches the first step's collective seconds after the others.
Built as ``+logger=tensorboard`` with its ``_target_`` replaced (the logger group is one the command line
instantiates from a ``_target_``), so it takes that schema's fields; what it delays comes from the environment,
which the launcher hands every worker."""

import os
import time

import jax

from elastic_trainer.hookspecs import hookimpl

DELAY_ENV = "ELASTIC_TRAINER_TEST_DELAY"
"""``"<process>:<step>:<seconds>"``: that process sleeps that long before it starts that step (0-based: the
number of steps completed before it), once."""


def delay(process: int, step: int, seconds: float) -> dict[str, str]:
    """The environment that delays ``process`` by ``seconds`` before step ``step``."""
    return {DELAY_ENV: f"{process}:{step}:{seconds}"}


class DelayedProcess:
    """Sleeps before one step in one process (:data:`DELAY_ENV`), the first time that step starts there."""

    def __init__(self, every: int = 1, log_dir: str | None = None):
        del every, log_dir  # the tensorboard schema's fields, unused
        process, step, seconds = os.environ[DELAY_ENV].split(":")
        self._process, self._step, self._seconds = int(process), int(step), float(seconds)
        self._done = False

    @hookimpl
    def et_step_start(self, trainer, step):
        if step == self._step and jax.process_index() == self._process and not self._done:
            self._done = True
            time.sleep(self._seconds)
