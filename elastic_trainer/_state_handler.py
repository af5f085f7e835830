"""How Orbax writes the train state: each array by one replica, numpy arrays by the group's primary."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils


class PrimaryNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's handler of numpy arrays, written by the saving group's primary process, not by process 0.

    Orbax's own writes a numpy array only in process 0
    (``orbax/checkpoint/_src/serialization/type_handlers.py``, 0.12.8:
    ``if multihost.process_index() == 0``), whatever the primary host of the
    save. Numpy arrays are what the last live process of several saves
    (Orbax refuses a ``jax.Array`` held whole by one process of several):
    once process 0 was lost, Orbax committed those checkpoints with no array
    in them. Process 0 writes through Orbax's own code; any other primary
    opens and writes each array with the spec Orbax builds for it.

    :param primary_host: the process that writes.
    """

    def __init__(self, *, primary_host: int):
        super().__init__()
        self.primary_host = primary_host

    async def _background_serialize(
        self, values: Sequence[np.ndarray], infos: Sequence, args: Sequence | None = None
    ) -> None:
        if jax.process_index() != self.primary_host or self.primary_host == 0:
            return await super()._background_serialize(values, infos, args)
        for value, info, arg in zip(values, infos, args or [ocp.SaveArgs()] * len(values)):
            await info.await_path_creation()
            spec = ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=self._metadata_key,
                process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
            )
            await self._open_and_write(value, spec.json, info.ts_context)


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
