"""Clusters: where the devices come from and how they group into slices.

:class:`AbstractCluster` is what every backend provides; what only some can do is a capability class the trainer
asks for with ``isinstance`` (docs/clusters.md).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
from jaxtyping import PyTree

from .._failures import ConfigError

if TYPE_CHECKING:
    from .multicontroller._rejoin import Admission


class SyncCall(enum.Enum):
    """The named synchronization calls (:meth:`AbstractCluster.synchronize`), each worded for "made at ...".

    A call's branches on success and on failure share its name: a process
    whose save failed and one whose save went through make the same call.
    """

    RUN_START = "the run's start"
    STEP_END = "a step's end"
    SAVE_START = "a checkpoint save's start"
    SAVE_END = "a checkpoint save's end"
    CHECKPOINT_GROUP = "a checkpoint group's forming"
    CHECKPOINT_RESTORE = "a checkpoint's restore"
    MEMORY_RESTORE = "a restore from memory"
    STATE_SHARING = "the sharing of the state with replacements, compiled"
    STATE_SHARED = "the sharing of the state with replacements, done"
    AWAIT_RETURNS = "a wait for lost slices"


class AbstractCluster(abc.ABC):
    """A set of devices grouped into slices of equal size, driven by one controller unless it is an
    :class:`AbstractMultiControllerCluster`."""

    kind: str

    @abc.abstractmethod
    def configure_jax(self) -> None:
        """Configure JAX for this cluster; call before JAX's backend starts."""

    @abc.abstractmethod
    def slice_devices(self) -> list[list[jax.Device]]:
        """The devices of every slice, slice by slice."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """The cluster as the report's ``cluster`` field."""

    @abc.abstractmethod
    def healthy_slices(self) -> list[int]:
        """Indices of the slices that are up now."""

    def incarnations(self) -> tuple[int, ...]:
        """How often each slice has failed so far.

        Data placed on a slice before its count changed is gone, even if the
        slice is healthy again. By default no slice has ever failed.
        """
        return (0,) * len(self.slice_devices())

    def synchronize(self, call: SyncCall, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """The one synchronization call, made at ``call``: raise what the hardware raises if a slice in ``slices``
        was lost since :meth:`incarnations` were ``since`` (a :class:`~elastic_trainer.SliceLostError`).

        On several processes it is also where the live ones agree on who
        lives, and every live process must make the same calls in the same
        order (a :class:`~elastic_trainer.plugin.SyncMismatchError` if not). Real
        single-controller runtimes raise from the step itself, so by default
        this does nothing.
        """


class AbstractWholeArrayLossCluster(AbstractCluster):
    """A cluster whose lost slice takes every array on it with it as a whole, replicated ones included (their
    copies on other slices are not read), and for good (Pathways, as pathwaysutils' ``DeviceLossSimulator``
    models it). The trainer then brings each committed step's metrics to the host as the step ends, not in
    batches (``LOSSES_ON_DEVICE``): after a loss, the ones left on the devices could not be read."""


class AbstractTimedCluster(AbstractCluster):
    """A cluster that times each slice's own part of a step: what finding stragglers needs."""

    @abc.abstractmethod
    def step_dispatched(self) -> None:
        """Called on the training thread each time a step has been dispatched."""

    @abc.abstractmethod
    def slice_step_seconds(self) -> dict[int, float]:
        """Each slice's own time in the latest step that passed its end's :meth:`synchronize`, by slice: from its dispatch
        until it was done, without the time it waited for the other slices.

        Every process must get the same times (stragglers are found from
        them, the same everywhere); empty while there are none. A cluster
        may give each step's times once: a step that ended with no
        synchronize (a semi-synchronous mode's inner steps on several
        processes) then has none, and says nothing about stragglers.
        """


class AbstractMultiControllerCluster(AbstractCluster):
    """A cluster where each process runs its own part of every program (JAX's multi-controller runtime).

    A program with no collective then ends on the processes that live when
    another dies, so a step is two programs, its gradients (the collective)
    and its update (the state donated, no collective), and a process lost
    during the update leaves the others the state after the step. On a single
    controller one program over every slice fails as a whole: a step is one
    program, the state donated, as in a hand-written loop
    (docs/architecture.md, "The step").
    """

    @abc.abstractmethod
    def live_processes(self) -> frozenset[int]:
        """The processes that hold a device of a healthy slice, which save checkpoints together."""

    @abc.abstractmethod
    def release(self, slices: Sequence[int]) -> None:
        """``slices``, healthy, are no longer used (a strategy dropped them at a step boundary): a process
        outside the mesh cannot stay in the job, so their processes leave it."""

    def explain_failure(
        self, error: Exception, slices: Sequence[int], *, since: tuple[int, ...], pending: PyTree
    ) -> None:
        """A step on ``slices`` raised ``error``; raise a ``DATA_LOSS`` error instead if lost slices explain it.

        Called on the training thread when a step's wait raised (a timeout
        included); ``since`` is as for :meth:`synchronize`, ``pending`` the
        failed step's outputs. By default the error stands as it is.
        """


class AbstractRejoinCluster(AbstractMultiControllerCluster):
    """A multi-controller cluster whose lost slices come back into the running job: their processes return as
    replacements, which the live ones take in at a step boundary."""

    admission: Admission | None = None
    """In a process that replaces a lost one: how the running job took it in (set when it joined the job, in
    :meth:`configure_jax`); ``None`` in every other process."""

    @abc.abstractmethod
    def lost_slices_return(self, slices: Sequence[int], *, within_s: float) -> bool:
        """Whether lost ``slices`` can come back into the running job within ``within_s`` seconds. If not, a
        strategy that would wait for them re-forms the whole job instead: the processes exit to be restarted
        together (see :class:`RecoveryPlan`)."""

    @abc.abstractmethod
    def await_returns(self) -> None:
        """While a recovery waits for lost slices: learn which have come back (:meth:`returning_slices`). Every
        live process calls it as often as the others (it may be a barrier)."""

    @abc.abstractmethod
    def returning_slices(self) -> list[int]:
        """Slices lost earlier whose processes came back and wait to be taken in (:meth:`take_in`)."""

    @abc.abstractmethod
    def take_in(self, slices: Sequence[int], *, step: int, position: int, checkpoint_group: int,
                before_restart: Callable[[], None]) -> tuple[int, ...]:
        """At a step boundary the run goes on with ``slices``, some of them returning: take those in; the processes
        taken in, none when they did not come (else the state must move onto the new backend's devices).

        ``step``, ``position`` and ``checkpoint_group`` are what the
        replacements start from; ``before_restart`` lets go of what runs on
        the backend before it restarts.
        """


def admission_of(cluster: AbstractCluster) -> Admission | None:
    """How the running job took this process in, if ``cluster`` is a rejoin cluster's replacement; else ``None``."""
    return cluster.admission if isinstance(cluster, AbstractRejoinCluster) else None


def returning_slices(cluster: AbstractCluster) -> list[int]:
    """Lost slices back and waiting to be taken in, if ``cluster`` is a rejoin cluster; else none (a slice that
    comes back to any other cluster is simply healthy again)."""
    return cluster.returning_slices() if isinstance(cluster, AbstractRejoinCluster) else []


def release(cluster: AbstractCluster, slices: Sequence[int]) -> None:
    """Healthy ``slices`` are no longer used: a multi-controller cluster lets their processes go; on any other
    cluster they stay, idle, and may be used again."""
    if isinstance(cluster, AbstractMultiControllerCluster):
        cluster.release(slices)


class AbstractSpareCluster(AbstractCluster):
    """A cluster with spare slices: slices of the job kept out of the mesh, each ready to take the place of a
    lost one (docs/clusters.md, "Spare slices")."""

    spare_slices: int = 0
    """How many of :meth:`slice_devices` are spares at the start: the last ones. A mesh never holds more slices
    than the others (:func:`mesh_slice_count`); any healthy slice out of the mesh is a spare, a lost one back
    included."""


def has_spares(cluster: AbstractCluster) -> bool:
    """Whether ``cluster`` keeps spare slices."""
    return isinstance(cluster, AbstractSpareCluster) and cluster.spare_slices > 0


def vital_slices(cluster: AbstractCluster) -> tuple[int, ...]:
    """The slices whose loss ends the job (``protected_slices``, where ``cluster`` is injectable): no layout
    without them is compiled ahead and no straggler among them is dropped."""
    return cluster.protected_slices if isinstance(cluster, AbstractInjectableCluster) else ()


def mesh_slice_count(cluster: AbstractCluster) -> int:
    """The most slices a mesh of ``cluster`` holds: all of them but its spares."""
    return len(cluster.slice_devices()) - (cluster.spare_slices if has_spares(cluster) else 0)


class AbstractInjectableCluster(AbstractCluster):
    """A cluster whose slices can be lost on purpose: what failure injection (``+chaos=``) needs. Where the
    hardware does not really lose them, the cluster also shows what it would (:meth:`check_launch`,
    :meth:`surviving`)."""

    protected_slices: tuple[int, ...] = ()
    """Slices whose loss would end the job: random failure injection never picks them, and
    :func:`vital_slices` names them to the layouts compiled ahead and to straggler drops."""

    @abc.abstractmethod
    def fail_slice(self, index: int, *, down_for_s: float) -> None:
        """Lose slice ``index`` now, as hardware loses it; it may come back after ``down_for_s`` seconds."""

    @abc.abstractmethod
    def hang_slice(self, index: int, *, down_for_s: float) -> None:
        """Hang slice ``index`` now: a step that uses it does not finish for ``down_for_s`` seconds."""

    def slow_slice(self, index: int, *, factor: float, for_s: float) -> None:
        """Slow slice ``index`` down now: for ``for_s`` seconds its steps take ``factor`` times as long.

        Not abstract, so that an injectable cluster written before slowing
        existed still builds; one that does not override it refuses chaos's
        ``slow`` key with a :class:`~elastic_trainer.ConfigError`.
        """
        raise ConfigError(f"{type(self).__name__} cannot slow a slice down; drop the chaos entry's slow key, or "
                          "implement slow_slice on the cluster.")

    def check_launch(self, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Raise what the runtime raises when a step is launched on ``slices`` while one of them is known to be
        lost: before the step takes the state, which stays whole.

        ``since`` is as for :meth:`synchronize`. Real runtimes refuse the launch
        themselves, so by default this does nothing.
        """

    def surviving(self, tree: PyTree, lost_slices: Sequence[int]) -> PyTree:
        """What is left of ``tree`` once ``lost_slices`` are gone.

        On real hardware the lost shards are already unreadable, so by default
        ``tree`` comes back as it is.
        """
        return tree


class AbstractProcessInjectableCluster(AbstractInjectableCluster):
    """An injectable cluster whose slices are made of processes, each of which can be lost on its own (chaos's
    ``process`` key)."""

    @abc.abstractmethod
    def fail_process(self, index: int, position: int, *, down_for_s: float) -> None:
        """Kill the process at ``position`` in slice ``index``; the rest of its slice goes down with it, and the
        whole slice may come back after ``down_for_s`` seconds."""
