"""How Orbax writes the train state: each array by one replica, numpy arrays by the group's primary."""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._private_apis import PrimaryNumpyHandler


def state_handler(multiprocessing: ocp.options.MultiprocessingOptions) -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler, with each array written by one replica only.

    Orbax's default (replica-parallel saving) cuts every replicated array
    into one slice per replica with eager ``lax.slice`` calls; each new slice
    shape compiles on first use, so the first save of a run blocked the step
    loop for seconds (1.4 s against 0.09 s for a 94-array state on 8 CPU
    devices). The registry is our own, so Orbax's global one is untouched.
    The files are the same format: plain Orbax restores them. Numpy arrays
    (the state of a group of one process in a job of several) are written by
    the group's primary (:class:`PrimaryNumpyHandler`).
    """
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=multiprocessing.primary_host,
                                                   use_replica_parallel=False)),
        (np.ndarray, PrimaryNumpyHandler(primary_host=multiprocessing.primary_host)),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, multiprocessing_options=multiprocessing)
