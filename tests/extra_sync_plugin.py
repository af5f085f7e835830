"""A plugin that breaks the same-calls-in-the-same-order rule on purpose, for tests/test_call_order.py: process 1
makes one synchronization call more than the others. Built as ``+logger=tensorboard`` with its ``_target_``
replaced (the logger group is one the command line instantiates from a ``_target_``), so it takes that schema's
fields."""

import jax

import elastic_trainer as et
from elastic_trainer.clusters import SyncCall

EXTRA_CALL_AT_STEP = 4


class ExtraSyncOnProcess1:
    """At the end of step :data:`EXTRA_CALL_AT_STEP`, process 1 alone synchronizes as if waiting for slices."""

    def __init__(self, every: int = 1, log_dir: str | None = None):
        del every, log_dir  # the tensorboard schema's fields, unused

    @et.hookimpl
    def et_step_end(self, trainer, step, metrics):
        if step == EXTRA_CALL_AT_STEP and jax.process_index() == 1:
            trainer.cluster.synchronize(SyncCall.AWAIT_RETURNS, trainer.slices,
                                        since=trainer.cluster.incarnations())
