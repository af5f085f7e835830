"""JAX's coordination service in a process of its own, so that any training process may die.

``jax.distributed.initialize`` starts the coordination service inside
process 0 (jax 0.10.2, ``jax/_src/distributed.py`` lines 146-158, whenever
``process_id == 0``) and offers no way to skip it; a process 0 that dies
takes the service, and with it every process of the job. Here the service is
started apart (:func:`serve`: in the local launcher, or
``python -m elastic_trainer.coordinator`` as a task or pod of its own on a
cluster, in the manner of torchft's lighthouse), and every training process
joins it as a client only (:func:`join_as_client`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax

from ..._failures import ConfigError
from ..._private_apis import detect_cluster, join_as_client_only, start_coordination_service

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
"""Where the coordination service listens (``host:port``), as ``jax.distributed.initialize`` reads it."""

DEFAULT_HEARTBEAT_TIMEOUT_S = 2
"""A process silent this long is declared dead. The survivors' agreement on who lives waits for that, after their
collectives timed out (2 s): with 3 s it waited up to 1.1 s more (detection 2.2 to 3.2 s, tiny model, 3 processes),
with 2 s it did not (2.2 to 2.3 s). JAX's own default, 100 s, is for hosts that reboot."""

SHUTDOWN_TIMEOUT_S = 10
"""How long the service waits at the end for its clients to say goodbye: the dead never do."""


@contextlib.contextmanager
def serve(address: str, *, num_processes: int, heartbeat_timeout_s: int) -> Iterator[None]:
    """Host the coordination service of a job of ``num_processes`` at ``address`` (``host:port``) while entered.

    It is recoverable (``jax_enable_recoverability``'s service): a process
    that dies is declared dead after ``heartbeat_timeout_s`` and the others
    go on.
    """
    service = start_coordination_service(address, num_processes=num_processes, heartbeat_timeout_s=heartbeat_timeout_s,
                                         shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)
    try:
        yield
    finally:
        service.shutdown()


def join_job(
    coordinator: str, *, num_processes: int | None, process_id: int | None, heartbeat_timeout_s: int,
    initialization_timeout_s: int,
) -> None:
    """Join the job's coordination service: as a client only (``coordinator="separate"``), or through
    ``jax.distributed.initialize``, which starts it in process 0 (``"process0"``)."""
    if coordinator == "separate":
        join_as_client(num_processes=num_processes, process_id=process_id, heartbeat_timeout_s=heartbeat_timeout_s,
                       initialization_timeout_s=initialization_timeout_s)
    else:
        jax.distributed.initialize(num_processes=num_processes, process_id=process_id,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   initialization_timeout=initialization_timeout_s)


def join_as_client(
    *, num_processes: int | None, process_id: int | None, heartbeat_timeout_s: int, initialization_timeout_s: int
) -> None:
    """What ``jax.distributed.initialize`` does, less starting the service in process 0.

    The address comes from :data:`COORDINATOR_ENV`, or, under a scheduler
    JAX detects (Slurm, Kubernetes, Cloud TPU), from its first host and
    ``JAX_COORDINATOR_PORT``; ``None`` for the process count or id takes
    the scheduler's. JAX keeps its distributed state private, so it is set
    as ``initialize`` sets it (:func:`~elastic_trainer._private_apis.join_as_client_only`).
    """
    address, num_processes, process_id, device_ids = detect_cluster(
        os.environ.get(COORDINATOR_ENV), num_processes, process_id, initialization_timeout_s)
    if address is None or num_processes is None or process_id is None:
        raise ConfigError(
            "cluster.coordinator=separate needs the address of the job's coordinator: set "
            f"{COORDINATOR_ENV} to where python -m elastic_trainer.coordinator listens (host:port), "
            "or set cluster.coordinator=process0 to have process 0 host it."
        )
    if device_ids:
        jax.config.update("jax_cuda_visible_devices", ",".join(str(d) for d in device_ids))
    join_as_client_only(address, num_processes=num_processes, process_id=process_id,
                        heartbeat_timeout_s=heartbeat_timeout_s, initialization_timeout_s=initialization_timeout_s)
