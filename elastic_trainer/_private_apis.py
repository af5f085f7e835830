"""Every private JAX and Orbax API the package uses, in one place, each with a check that names it when an upgrade
changes it.

Nothing else in the package imports ``jax._src`` or ``orbax.checkpoint._src``
or touches a private member of theirs. A use is here only because no public
API does the job (each says what it is for); when one appears, the use goes.
``tests/test_private_apis.py`` runs :func:`check_all` against the installed
versions: an upgrade that removes or reshapes one of these fails there with
the API's name and the versions it was written for, not deep in a
multi-process run.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

WRITTEN_FOR = "jax 0.10.2 and 0.12.0.1, orbax-checkpoint 0.12.8"
"""The versions every API below was read and checked on."""


class PrivateApiChanged(RuntimeError):
    """A private API this package relies on is gone or has another shape in the installed version."""


@dataclasses.dataclass(frozen=True)
class PrivateApi:
    """One private object, at ``module:attribute.path``, with what the package relies on of it.

    :param path: where it lives, ``"jax._src.distributed:global_state"``.
    :param used_for: why the package needs it, in a few words.
    :param parameters: the parameter names the package passes (a function's).
    :param attributes: the attributes the package reads or sets (an object's).
    :param instance_attributes: the attributes it uses of an instance (a class's, built with no arguments).
    """

    path: str
    used_for: str
    parameters: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    instance_attributes: tuple[str, ...] = ()

    def resolve(self) -> Any:
        """The object itself."""
        module, _, attributes = self.path.partition(":")
        found: Any = importlib.import_module(module)
        for name in attributes.split(".") if attributes else ():
            found = getattr(found, name)
        return found

    def check(self) -> None:
        """Raise :class:`PrivateApiChanged` when the installed version lacks the object, a parameter the package
        passes, or an attribute it uses."""
        try:
            found = self.resolve()
        except (ImportError, AttributeError) as error:
            raise self._changed(f"it is not there ({type(error).__name__}: {error})") from error
        if missing := [name for name in self.parameters if name not in _parameter_names(found)]:
            raise self._changed(f"it takes no parameter {', '.join(missing)}")
        if missing := [name for name in self.attributes if not hasattr(found, name)]:
            raise self._changed(f"it has no attribute {', '.join(missing)}")
        if self.instance_attributes and (missing := [n for n in self.instance_attributes if not hasattr(found(), n)]):
            raise self._changed(f"its instances have no attribute {', '.join(missing)}")

    def _changed(self, detail: str) -> PrivateApiChanged:
        return PrivateApiChanged(
            f"{self.path} (used for {self.used_for}; written for {WRITTEN_FOR}) changed in jax {jax.__version__}, "
            f"orbax-checkpoint {ocp.__version__}: {detail}."
        )


def _parameter_names(function: Any) -> set[str]:
    """The parameter names of a Python function, or of a compiled one from the signature in its docstring."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # nanobind functions: "name(a: int, b: str | None = None) -> ..."
        first_line = (function.__doc__ or "").strip().splitlines()[:1]
        return set(re.findall(r"[(,]\s*(\w+)\s*:", first_line[0])) if first_line else set()


DISTRIBUTED_STATE = PrivateApi(
    "jax._src.distributed:global_state", "the coordination client, process id and preemption service JAX keeps",
    attributes=("client", "process_id", "num_processes", "coordinator_address", "preemption_sync_manager",
                "initialize_preemption_sync_manager"),
)
CLUSTER_DETECTION = PrivateApi(
    "jax._src.clusters:ClusterEnv.auto_detect_unset_distributed_params",
    "the coordinator address, process count and id from Slurm, Kubernetes or Cloud TPU",
    parameters=("coordinator_address", "num_processes", "process_id", "local_device_ids", "cluster_detection_method",
                "initialization_timeout"),
)
COORDINATION_SERVICE = PrivateApi(
    "jax._src.lib:_jax.get_distributed_runtime_service", "hosting the coordination service in a process of its own",
    parameters=("address", "num_nodes", "heartbeat_timeout", "shutdown_timeout", "recoverable"),
)
COORDINATION_CLIENT = PrivateApi(
    "jax._src.lib:_jax.get_distributed_runtime_client", "joining the coordination service as a client only",
    parameters=("address", "node_id", "init_timeout", "heartbeat_timeout", "use_compression"),
)
BACKENDS_STARTED = PrivateApi(
    "jax._src.xla_bridge:backends_are_initialized", "refusing to configure collectives after a backend started",
)
NVIDIA_GPU_PROBE = PrivateApi(
    "jax._src.hardware_utils:has_visible_nvidia_gpu", "whether an NVIDIA GPU is here, as JAX looks, without a backend",
)
AMD_GPU_PROBE = PrivateApi(
    "jax._src.hardware_utils:num_available_amd_gpus", "whether an AMD GPU is here, as JAX looks, without a backend",
    parameters=("stop_at",),
)
TPU_PROBE = PrivateApi(
    "jax._src.hardware_utils:num_available_tpu_chips_and_device_id",
    "whether TPU chips are here, as JAX looks, without a backend",
)
LIVE_DEVICES_CACHE = PrivateApi(
    "jax.experimental.multihost_utils:live_devices", "forgetting the devices of a backend dropped at a rejoin",
    attributes=("devices",),
)
ORBAX_BARRIER_TIMEOUT = PrivateApi(
    "orbax.checkpoint._src.multihost.multihost:_DEFAULT_BARRIER_TIMEOUT", "bounding Orbax's 300 s barrier waits",
)
ORBAX_WRITE_SPEC = PrivateApi(
    "orbax.checkpoint._src.serialization.tensorstore_utils:build_array_write_spec",
    "writing a numpy array from a primary process other than 0",
    parameters=("info", "arg", "global_shape", "local_shape", "dtype", "use_ocdbt", "metadata_key", "process_index"),
)
ORBAX_OCDBT_SUBDIR = PrivateApi(
    "orbax.checkpoint._src.serialization.ocdbt_utils:get_process_index_for_subdir",
    "the OCDBT subdirectory of the process that writes", parameters=("use_ocdbt",),
)
ORBAX_NUMPY_SERIALIZE = PrivateApi(
    "orbax.checkpoint:type_handlers.NumpyHandler._background_serialize",
    "the numpy handler's write, overridden by PrimaryNumpyHandler", parameters=("values", "infos", "args"),
)
ORBAX_NUMPY_WRITE = PrivateApi(
    "orbax.checkpoint:type_handlers.NumpyHandler._open_and_write", "writing one numpy array to its spec",
    parameters=("value", "tspec", "ts_context"),
)
ORBAX_NUMPY_METADATA_KEY = PrivateApi(
    "orbax.checkpoint:type_handlers.NumpyHandler", "the metadata key a numpy handler writes under",
    instance_attributes=("_metadata_key",),
)
ORBAX_WAIT_FOR_WRITES = PrivateApi(
    "orbax.checkpoint:CheckpointManager._wait_for_checkpointers",
    "ending a failed save's background writes before its temporary folder is removed", parameters=("self",),
)
ORBAX_SAVE_WRITES = PrivateApi(
    "orbax.checkpoint._src.checkpointers.async_checkpointer:_AsyncManager.start_async_commit",
    "ending every write of a failed save, which Orbax keeps as its async checkpointer's _async_manager._commit_futures",
    parameters=("self", "directory", "commit_futures", "on_commit_callback"),
)

PRIVATE_APIS = (DISTRIBUTED_STATE, CLUSTER_DETECTION, COORDINATION_SERVICE, COORDINATION_CLIENT, BACKENDS_STARTED,
                NVIDIA_GPU_PROBE, AMD_GPU_PROBE, TPU_PROBE, LIVE_DEVICES_CACHE, ORBAX_BARRIER_TIMEOUT, ORBAX_WRITE_SPEC, ORBAX_OCDBT_SUBDIR, ORBAX_NUMPY_SERIALIZE,
                ORBAX_NUMPY_WRITE, ORBAX_NUMPY_METADATA_KEY, ORBAX_WAIT_FOR_WRITES, ORBAX_SAVE_WRITES)
"""Every private API of this module, for :func:`check_all`."""


def check_all() -> None:
    """Raise :class:`PrivateApiChanged` for the first private API the installed JAX or Orbax lacks or reshaped."""
    for api in PRIVATE_APIS:
        api.check()


# ------------------------------------------------------------------ JAX's distributed runtime


def coordination_client():
    """The client of JAX's coordination service, or ``None`` before the process joined a job (Orbax reads it the
    same way)."""
    return DISTRIBUTED_STATE.resolve().client


def own_process_id() -> int:
    """This process's id in the job, known once it joined, without starting a backend (``jax.process_index``
    would)."""
    return DISTRIBUTED_STATE.resolve().process_id


def preemption_service_running() -> bool:
    """Whether JAX's preemption sync manager runs (a multi-process job started by ``jax.distributed``)."""
    return DISTRIBUTED_STATE.resolve().preemption_sync_manager is not None


def detect_cluster(
    address: str | None, num_processes: int | None, process_id: int | None, initialization_timeout_s: int
) -> tuple[str | None, int | None, int | None, Sequence[int] | None]:
    """The coordinator address, process count, process id and local device ids: those given, the rest from the
    scheduler JAX detects (``None`` where it detects none)."""
    return CLUSTER_DETECTION.resolve()(address, num_processes, process_id, None, None, initialization_timeout_s)


def start_coordination_service(address: str, *, num_processes: int, heartbeat_timeout_s: int,
                               shutdown_timeout_s: int):
    """JAX's coordination service for ``num_processes`` at ``address``, recoverable (a dead process is declared
    dead, the others go on); call ``shutdown()`` on it at the end."""
    return COORDINATION_SERVICE.resolve()(address, num_processes, heartbeat_timeout=heartbeat_timeout_s,
                                          shutdown_timeout=shutdown_timeout_s, recoverable=True)


def join_as_client_only(address: str, *, num_processes: int, process_id: int, heartbeat_timeout_s: int,
                        initialization_timeout_s: int) -> None:
    """Connect to the coordination service at ``address`` and set JAX's distributed state as
    ``jax.distributed.initialize`` sets it, for the backends, Orbax and ``live_devices`` to find the client."""
    client = COORDINATION_CLIENT.resolve()(address, process_id, init_timeout=initialization_timeout_s,
                                           use_compression=True, heartbeat_timeout=heartbeat_timeout_s)
    client.connect()
    state = DISTRIBUTED_STATE.resolve()
    state.coordinator_address, state.process_id, state.num_processes, state.client = (
        address, process_id, num_processes, client)
    state.initialize_preemption_sync_manager()


def backends_started() -> bool:
    """Whether a JAX backend runs in this process (too late to configure its collectives and device counts)."""
    return BACKENDS_STARTED.resolve()()


def accelerator_hardware() -> str | None:
    """``"gpu"`` or ``"tpu"`` when this host has such devices, found the way JAX looks for them before it starts a
    backend (device files and PCI ids, jax's ``hardware_utils``), so that no backend starts; ``None`` for neither."""
    if NVIDIA_GPU_PROBE.resolve()() or AMD_GPU_PROBE.resolve()(stop_at=1):
        return "gpu"
    return "tpu" if TPU_PROBE.resolve()()[0] > 0 else None


def forget_live_devices() -> None:
    """Make ``multihost_utils.live_devices`` forget the devices it last saw: a dropped backend's."""
    LIVE_DEVICES_CACHE.resolve().devices = None


# ------------------------------------------------------------------ Orbax


def bound_orbax_barriers(timeout_s: int) -> None:
    """Make every barrier Orbax waits at without a timeout of its own give up after ``timeout_s``.

    With ``jax_enable_recoverability`` a process that dies does not fail a
    barrier of the coordination service: the others wait it out, and Orbax's
    wait is 300 s. Orbax takes that wait from one module constant (read by
    ``sync_global_processes`` and ``coordination_timeout()``) and offers no
    option for it, so it is set here, once per process, before any save.
    """
    module, _, name = ORBAX_BARRIER_TIMEOUT.path.partition(":")
    setattr(importlib.import_module(module), name, timeout_s)


def end_background_writes(manager: ocp.CheckpointManager) -> None:
    """Wait until the background writes of ``manager``'s last save have ended, whatever they end with.

    Orbax's ``wait_until_finished`` raises at the first failure of a save's
    finalization, and when that is its step metadata (written first) the
    save's own background thread is left running: its array and JSON writes
    would still be under way while the failed save's temporary folder is
    removed (failing then with ENOENT), and the next save would raise their
    error as its own before it wrote anything. Called once that failure is
    known, this joins the thread; its error is the same save's and is dropped.
    """
    try:
        ORBAX_WAIT_FOR_WRITES.resolve()(manager)
    except Exception:  # the failure of a save already known to have failed
        pass


WRITES_END_TIMEOUT_S = 10
"""How long, at most, a failed save's writes are waited for, all together."""


def end_save_writes(manager: ocp.CheckpointManager) -> None:
    """Wait until every write of ``manager``'s last save, a save that failed for I/O, has ended.

    Orbax's background thread (:func:`end_background_writes`) waits for the
    save's writes (its commit futures, a thread each) one after the other and
    stops at the first that fails, leaving the others running: one could
    re-create the failed save's folder once it was removed, or still hold a
    file there once a stopped run had returned (a small disk's unmount then
    failed, "target is busy"). Each is joined, for :data:`WRITES_END_TIMEOUT_S`
    at most in all: a write still waiting then waits for a signal that a
    failed write never sends, and gives up without writing. Their errors are
    the same save's and are dropped.
    """
    deadline = time.monotonic() + WRITES_END_TIMEOUT_S
    for write in save_writes(manager):
        try:
            write.result(timeout=max(deadline - time.monotonic(), 0.0))
        except Exception:  # noqa: BLE001 - a failure of the same save, or a write that will not start
            pass


def save_writes(manager: ocp.CheckpointManager) -> Sequence[Any]:
    """The writes (Orbax's commit futures) of ``manager``'s last asynchronous save; none for synchronous saves."""
    async_manager = getattr(manager._checkpointer, "_async_manager", None)  # only an AsyncCheckpointer has one
    return list(async_manager._commit_futures or ()) if async_manager is not None else []


class PrimaryNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's handler of numpy arrays, written by the saving group's primary process, not by process 0.

    Orbax's own writes a numpy array only in process 0 (its
    ``type_handlers.py``: ``if multihost.process_index() == 0``), whatever
    the primary host of the save. Numpy arrays are what the last live process
    of several saves (Orbax refuses a ``jax.Array`` held whole by one process
    of several): once process 0 was lost, Orbax committed those checkpoints
    with no array in them. Process 0 writes through Orbax's own code; any
    other primary opens and writes each array with the spec Orbax builds for it.

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
        build_write_spec, subdir = ORBAX_WRITE_SPEC.resolve(), ORBAX_OCDBT_SUBDIR.resolve()
        for value, info, arg in zip(values, infos, args or [ocp.SaveArgs()] * len(values)):
            await info.await_path_creation()
            spec = build_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=self._metadata_key,
                process_index=subdir(use_ocdbt=info.is_ocdbt_checkpoint),
            )
            await self._open_and_write(value, spec.json, info.ts_context)
