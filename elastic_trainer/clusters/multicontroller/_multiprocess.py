"""The multi-process cluster: slices made of whole JAX processes, on JAX's distributed runtime."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable, Sequence

import jax
from jaxtyping import PyTree

from .._base import (
    AbstractProcessInjectableCluster, AbstractRejoinCluster, AbstractSpareCluster, AbstractTimedCluster, SyncCall,
)
from ..._failures import ConfigError, SliceLostError, StepTimeoutError
from ..._private_apis import backends_started, bound_orbax_barriers, coordination_client, own_process_id
from .._accelerators import accelerator_platform, warn_if_accelerators_unused
from . import _keys as keys
from ._coordinator import DEFAULT_HEARTBEAT_TIMEOUT_S, join_job
from ._membership import Membership, devices_of
from ._platform import PLATFORM_LAYERS, PlatformLayer
from ._process_injection import ProcessInjection
from ._rejoin import Admission, Rejoin, note_lost, note_pid
from ._step_times import TimeoutCheck
from ...config._settings import check_multiprocess_settings

PROCESS_ID_ENV = "ELASTIC_TRAINER_PROCESS_ID"
"""Set by the local launcher to a worker's process id; unset, JAX detects it (Slurm, Kubernetes, Cloud TPU)."""

AUTO_COLLECTIVE_TIMEOUT_S = 2
"""The collective timeout when ``cluster.collective_timeout_s`` is unset. The processes meet before each step's
first dispatch (:meth:`MultiprocessCluster.check_launch`), so a peer late to a step (its compile, a busy host) is
waited for there, without a timeout of this kind; a collective waits only for what a peer does inside the step.
Measured (3 processes of the tiny model, 2 cores shared with other agents, load average 8.6 to 20): how much later
than the earliest process each reached the first step's collectives was at most 0.16 s without CPU hogs (3 runs)
and 0.04 s with two (2 runs); 2 s is over 12 times that, and it bounds how long the survivors of a process that
dies during a step wait for it (docs/multiprocess.md, "Detection")."""


def _wait_quietly(arrays: PyTree) -> None:
    """Wait until ``arrays`` are computed or their computation failed."""
    try:
        jax.block_until_ready(arrays)
    except Exception:  # noqa: BLE001 - the failure itself is being handled
        pass


def _configure_runtime(
    *, platform: PlatformLayer, devices_per_process: int | None, collective_timeout_s: int, barrier_timeout_s: int
) -> None:
    """The platform's collectives (on CPU: gloo, with a timeout) and device count, recoverability, and Orbax's
    barrier timeout."""
    platform.configure(devices_per_process=devices_per_process, collective_timeout_s=collective_timeout_s)
    jax.config.update("jax_enable_recoverability", True)  # survivors live on when a process dies
    bound_orbax_barriers(barrier_timeout_s)


def job_processes(*, num_processes: int, spare_slices: int, processes_per_slice: int) -> int:
    """Every process of a job of ``num_processes`` processes in the mesh and ``spare_slices`` spare slices: what
    the launcher starts and ``jax.distributed`` counts."""
    return num_processes + spare_slices * processes_per_slice


class MultiprocessCluster(AbstractRejoinCluster, AbstractProcessInjectableCluster, AbstractSpareCluster,
                          AbstractTimedCluster):
    """Slices made of processes of a multi-controller JAX job (``jax.distributed``).

    Every process runs the same training loop on its own devices; a slice is
    ``processes_per_slice`` consecutive processes. A process that dies (killed,
    crashed, out of memory) is found with ``jax_enable_recoverability`` and
    :func:`jax.experimental.multihost_utils.live_devices`: the survivors'
    step raises (or they see it at the step's end), they agree on the live
    processes, and the slices with a dead process count as lost. Before
    each step the live processes meet (:meth:`check_launch`), so a peer late
    to a step (a compile, a busy host) is waited for before any collective
    starts; one that does not come within ``barrier_timeout_s`` is stuck
    (alive, heartbeating, but not computing): it is killed, and then lost
    like a dead one. A step whose collectives gave up while the processes
    agree that every one lives loses no slice, whatever its error says.

    :param num_processes: processes in the job.
    :param devices_per_process: CPU devices each process starts with (the
        local launcher; ``None`` keeps the platform's own devices).
    :param processes_per_slice: processes that make up one slice.
    :param spare_slices: slices more, whose processes (the last ones) start with the job and wait to be taken
        in, as a replacement waits; each takes a lost slice's place (docs/multiprocess.md, "Spare slices").
    :param heartbeat_timeout_s: the coordination service declares a silent
        process dead after this long; the floor of every detection.
    :param collective_timeout_s: on CPU, a collective still waiting for a
        peer after this long fails (XLA's ``xla_cpu_collective_timeout_seconds``).
        Without it, a collective whose peer died never returns and blocks the
        survivors' devices for good; so this bounds detection and recovery.
        ``None``: :data:`AUTO_COLLECTIVE_TIMEOUT_S`, with a warning once the
        measured step time says it is too short (XLA reads it once, when the
        backend starts, so it cannot follow the step time).
    :param initialization_timeout_s: how long a process waits for the others to start.
    :param barrier_timeout_s: how long a process waits at any barrier of the
        coordination service (Orbax's in a save included) before that save
        fails: a process that died in the window does not fail such a
        barrier, it is waited out. A peer that has not come to a step this
        long after a process came to it is stuck.
    :param platform: ``"cpu"`` (gloo collectives between processes on CPU) or
        ``None`` for JAX's default platform on a real cluster.
    :param launcher: ``"local"``: the command line starts the processes on
        this machine; ``"none"``: something else started them (Slurm,
        Kubernetes, Cloud TPU) and JAX detects the job from the environment.
    :param coordinator: ``"separate"``: JAX's coordination service runs in
        a process of its own (the local launcher; on a cluster,
        ``python -m elastic_trainer.coordinator``), so any training process
        may die; ``"process0"``: JAX's default, process 0 hosts it, and
        losing it ends the job (failure injection spares its slice).
    """

    kind = "multiprocess"

    def __init__(
        self,
        num_processes: int = 2,
        devices_per_process: int | None = 2,
        processes_per_slice: int = 1,
        spare_slices: int = 0,
        heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
        collective_timeout_s: int | None = None,
        initialization_timeout_s: int = 120,
        barrier_timeout_s: int = 30,
        platform: str | None = "cpu",
        launcher: str = "local",
        coordinator: str = "separate",
    ):
        check_multiprocess_settings(
            num_processes=num_processes, devices_per_process=devices_per_process,
            processes_per_slice=processes_per_slice, spare_slices=spare_slices, heartbeat_timeout_s=heartbeat_timeout_s,
            collective_timeout_s=collective_timeout_s, initialization_timeout_s=initialization_timeout_s,
            barrier_timeout_s=barrier_timeout_s, platform=platform, launcher=launcher, coordinator=coordinator,
        )
        self.num_processes = num_processes
        self.devices_per_process = devices_per_process
        self.processes_per_slice = processes_per_slice
        self.spare_slices = spare_slices
        self.job_processes = job_processes(num_processes=num_processes, spare_slices=spare_slices,
                                           processes_per_slice=processes_per_slice)
        """Every process of the job, the spares' included."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.collective_timeout_s = collective_timeout_s or AUTO_COLLECTIVE_TIMEOUT_S
        self._timeout_check = None if collective_timeout_s else TimeoutCheck(self.collective_timeout_s)
        self.initialization_timeout_s = initialization_timeout_s
        self.barrier_timeout_s = barrier_timeout_s
        self.platform = platform
        self.platform_layer = PLATFORM_LAYERS[platform]
        self.launcher = launcher
        self.coordinator = coordinator
        self.protected_slices = (0,) if coordinator == "process0" else ()  # failure injection spares the service's host
        self.slices = num_processes // processes_per_slice
        """Slices in the mesh at the start (the spares are more)."""
        self.membership = Membership(num_processes=self.job_processes, processes_per_slice=processes_per_slice,
                                     spare_slices=spare_slices, client=self._client, on_lost=note_lost)
        """Who is in the job, as the live processes last agreed."""
        self._rejoin = Rejoin(self.membership, client=self._client, initialization_timeout_s=initialization_timeout_s,
                              barrier_timeout_s=barrier_timeout_s, platform_layer=self.platform_layer,
                              keeps_spares=spare_slices > 0)
        self._injection = ProcessInjection(self.membership, client=self._client, protected_slices=self.protected_slices)
        self._step_seconds: dict[int, float] = {}

    # ------------------------------------------------------------------ start-up

    def configure_jax(self) -> None:
        """Join the job: configure JAX's CPU collectives and recoverability, then ``jax.distributed.initialize``;
        process 0 warns where JAX would use GPUs or TPUs here (:class:`~elastic_trainer.AcceleratorUnusedWarning`)."""
        if jax.distributed.is_initialized():
            return
        if backends_started():  # too late to configure collectives and device counts
            raise ConfigError(
                "cluster=multiprocess must configure JAX before any JAX operation runs in this process; "
                "start it with python -m elastic_trainer, or build the cluster first."
            )
        unused = accelerator_platform() if self.platform == "cpu" else None  # before the runtime is configured
        _configure_runtime(platform=self.platform_layer, devices_per_process=self.devices_per_process,
                           collective_timeout_s=self.collective_timeout_s, barrier_timeout_s=self.barrier_timeout_s)
        process_id = os.environ.get(PROCESS_ID_ENV)  # unset: JAX's cluster detection knows it, and the count
        join_job(self.coordinator, num_processes=self.job_processes if process_id is not None else None,
                 process_id=int(process_id) if process_id is not None else None,
                 heartbeat_timeout_s=self.heartbeat_timeout_s, initialization_timeout_s=self.initialization_timeout_s)
        if own_process_id() == 0:  # one warning for the job
            warn_if_accelerators_unused("multiprocess", unused)
        self._rejoin.ask_to_join()  # a replacement of a lost process, or a spare: taken in by the live ones, or ended
        if jax.process_count() != self.job_processes:
            raise ConfigError(
                f"cluster.num_processes ({self.num_processes}) and cluster.spare_slices ({self.spare_slices}) of "
                f"{self.processes_per_slice} process(es) make {self.job_processes} processes but the job has "
                f"{jax.process_count()}; set them to the number of processes the scheduler starts."
            )
        local = len(jax.local_devices())
        if self.devices_per_process is not None and local != self.devices_per_process:
            raise ConfigError(
                f"cluster.devices_per_process is {self.devices_per_process} but this process has {local} devices; "
                "set it to match, or to null to take the platform's devices."
            )
        note_pid(self._client())
        atexit.register(self._leave)  # runs before JAX's own exit handler, which shuts the client down

    def _leave(self) -> None:
        """Leave the job together, the lowest live process last.

        With recoverability on, JAX's shutdown does not wait for the other
        processes, so with ``coordinator=process0`` a process 0 that ended
        first took the service with it and the others aborted in their own
        shutdown.
        """
        client = self._client()
        if client is None:
            return
        live = sorted(self.membership.live)
        if jax.process_index() == live[0]:
            client.key_value_set(keys.ENDED, "1", allow_overwrite=True)  # replacements waiting: leave too
        try:
            client.wait_at_barrier(keys.LEAVE, 1000 * (10 + 2 * self.heartbeat_timeout_s), process_ids=live)
            if jax.process_index() == live[0]:
                client.get_live_nodes(live)  # returns once the others have shut down
        except Exception as error:  # noqa: BLE001 - a process lost at the very end: leave anyway
            print(f"elastic_trainer: leaving the job without the others: {error}", file=sys.stderr)
        jax.distributed.shutdown()

    _client = staticmethod(coordination_client)  # the coordination service's client, None before joining

    # ------------------------------------------------------------------ layout

    def processes_of(self, index: int) -> range:
        """The processes that make up slice ``index``."""
        return self.membership.processes_of(index)

    def slice_devices(self) -> list[list[jax.Device]]:
        return [devices_of(self.processes_of(s)) for s in range(self.slices + self.spare_slices)]

    def describe(self) -> dict:
        per_process = self.devices_per_process or len(jax.local_devices())
        return {
            "kind": self.kind, "slices": self.slices, "devices_per_slice": per_process * self.processes_per_slice,
            "processes": self.num_processes, "processes_per_slice": self.processes_per_slice,
            "spare_slices": self.spare_slices,
            "heartbeat_timeout_s": self.heartbeat_timeout_s, "collective_timeout_s": self.collective_timeout_s,
            "barrier_timeout_s": self.barrier_timeout_s, "coordinator": self.coordinator,
        }

    # ------------------------------------------------------------------ health

    def healthy_slices(self) -> list[int]:
        """Slices whose processes were all live when the processes last agreed (at the end of a step)."""
        return self.membership.healthy_slices()

    def incarnations(self) -> tuple[int, ...]:
        return tuple(self.membership.failures)

    def live_processes(self) -> frozenset[int]:
        """The processes of the healthy slices."""
        return frozenset(p for s in self.healthy_slices() for p in self.processes_of(s))

    def synchronize(self, call: SyncCall, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Agree with the other live processes on who lives (a barrier), each having made the same ``call``;
        raise ``DATA_LOSS`` for slices lost.

        The step's own time of each process is exchanged at the same barrier (:meth:`slice_step_seconds`).
        """
        membership = self.membership
        timed = membership.own_times.note(membership.dispatched)
        membership.agree(call)
        live = [(s, self.processes_of(s)) for s in self.healthy_slices()]
        self._step_seconds = membership.own_times.read(membership.dispatched, live) if timed else {}
        healthy = set(self.healthy_slices())
        lost = [s for s in slices if s not in healthy or membership.failures[s] != since[s]]
        if lost:
            dead = sorted(p for s in lost for p in self.processes_of(s) if p not in membership.live)
            if all(keys.noted(self._client(), keys.stuck(p)) for p in dead):
                message = f"DEADLINE_EXCEEDED: process(es) {dead} of slice(s) {lost} were stuck and have been killed"
            else:
                message = f"DATA_LOSS: process(es) {dead} of slice(s) {lost} died"
            leaving = sorted(p for s in lost for p in self.processes_of(s) if p in membership.live)
            if leaving:  # a slice goes down whole: the live processes of a lost slice leave the job
                message += f"; process(es) {leaving} of the same slice(s) leave the job"
                if jax.process_index() in leaving:
                    self._rejoin.leave_with_slice(message)
            down = [membership.lost_at.get(p) for p in dead]
            raise SliceLostError(message, slices=lost, processes=dead + leaving,
                                 occurred_at=min(down) if down and None not in down else None)

    def check_launch(self, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Before the first dispatch of a step over every live process, they meet (:meth:`Membership.meet`): a
        peer late to the step is waited for, up to ``barrier_timeout_s``, before any collective starts. One that
        did not come in time is stuck (killed); then the live processes agree on who lives, and a lost slice
        raises here, before the step takes the state. A program on some slices only (a semi-synchronous mode's
        inner step) does not meet: its processes meet the others at the boundary (the outer step)."""
        membership = self.membership
        spans_every_process = {p for s in slices for p in membership.processes_of(s)} >= membership.live
        if spans_every_process and not membership.meet(stuck_after_s=self.barrier_timeout_s):
            self.synchronize(SyncCall.STEP_END, slices, since=since)  # the step not launched ends before it began

    def explain_failure(
        self, error: Exception, slices: Sequence[int], *, since: tuple[int, ...], pending: PyTree
    ) -> None:
        """A step on ``slices`` raised ``error`` (its collectives gave up waiting for a peer, or the watchdog did).

        First the processes stuck before the step are found and killed (a
        stuck process would never reach the next barrier); then the live
        processes agree on who died, and a lost slice is raised as
        ``DATA_LOSS`` (``DEADLINE_EXCEEDED`` when it was stuck). When they
        agree that every process lives, the step failed on a peer only slow,
        whatever the error says (a peer's collective timed out, another's saw
        that peer close the connection): a ``DEADLINE_EXCEEDED`` with no slice
        lost, which the strategy retries. That holds for the runtime's errors
        (and the watchdog's); any other error (out of memory, a Python error)
        stands. Either way it first waits until the
        failed step's collectives have given up (``collective_timeout_s``):
        until then they hold this process's devices, and a new step would
        queue behind them.
        """
        self.membership.own_times.forget()
        draining = threading.Thread(target=_wait_quietly, args=(pending,), name="et-drain", daemon=True)
        draining.start()
        self.membership.kill_stuck(collective_timeout_s=self.collective_timeout_s)
        try:
            self.synchronize(SyncCall.STEP_END, slices, since=since)  # the failed step's end
        finally:
            draining.join(self.collective_timeout_s + 5)
        if isinstance(error, StepTimeoutError) or (
                isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" not in str(error)):
            raise StepTimeoutError(
                f"DEADLINE_EXCEEDED: the step's collectives gave up (cluster.collective_timeout_s="
                f"{self.collective_timeout_s}) but the processes agree that every one lives; raise "
                f"cluster.collective_timeout_s if a peer is this slow within a step: {error}",
                slices=(),
            ) from error

    def step_dispatched(self) -> None:
        """Note in the key-value store that this process reached its latest step's collectives."""
        self.membership.step_dispatched()
        if self._timeout_check is not None:
            self._timeout_check.dispatched()

    def slice_step_seconds(self) -> dict[int, float]:
        """Each slice's own time in the latest step: from a process's dispatch until it reached the step's end
        (the barrier where the processes agree), the slowest of the slice's processes.

        A process that is slow before the step's collectives (its devices,
        or its host before the dispatch) makes every process wait inside the
        step alike, and is not told apart; one slow after them is (a slice
        slowed by failure injection is slow there). Each is given once: a step
        that ended with no agreement (a semi-synchronous mode's inner step) has none.
        """
        seconds, self._step_seconds = self._step_seconds, {}
        return seconds

    # ------------------------------------------------------------------ rejoin (clusters/multicontroller/_rejoin.py)

    @property
    def admission(self) -> Admission | None:
        """In a replacement: how the live processes took it in (after :meth:`configure_jax`); ``None`` elsewhere."""
        return self._rejoin.admission

    def lost_slices_return(self, slices: Sequence[int], *, within_s: float) -> bool:
        return self._rejoin.lost_slices_return(slices, within_s=within_s)

    def await_returns(self) -> None:
        """The live processes agree on who lives (a barrier), and so on the replacements that asked to join."""
        self.membership.agree(SyncCall.AWAIT_RETURNS)

    def returning_slices(self) -> list[int]:
        return self.membership.returning_slices()

    def take_in(self, slices: Sequence[int], *, step: int, position: int, checkpoint_group: int,
                before_restart: Callable[[], None]) -> tuple[int, ...]:
        return self._rejoin.take_in(slices, step=step, position=position, checkpoint_group=checkpoint_group,
                                    before_restart=before_restart)

    def release(self, slices: Sequence[int]) -> None:
        self._rejoin.release(slices)

    # ------------------------------------------------------------------ failure injection (_process_injection.py)

    def fail_slice(self, index: int, *, down_for_s: float) -> None:
        self._injection.fail_slice(index, down_for_s=down_for_s)

    def fail_process(self, index: int, position: int, *, down_for_s: float = 1e9) -> None:
        self._injection.fail_process(index, position, down_for_s=down_for_s)

    def slow_slice(self, index: int, *, factor: float, for_s: float) -> None:
        self._injection.slow_slice(index, factor=factor, for_s=for_s)

    def hang_slice(self, index: int, *, down_for_s: float) -> None:
        self._injection.hang_slice(index, down_for_s=down_for_s)
