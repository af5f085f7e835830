"""Clusters: where the devices come from and how they group into slices."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import jax
from jaxtyping import PyTree

from .._failures import ConfigError


class AbstractCluster(abc.ABC):
    """A set of devices grouped into slices of equal size."""

    kind: str

    independent_processes: bool = False
    """Whether each process runs its own part of every program (JAX's multi-controller runtime): then a program
    with no collective ends on the processes that live when another dies, and a step is two programs, its
    gradients (the collective) and its update (the state donated, no collective), so that a process lost
    during the update leaves the others the state after the step. ``False`` (the default) for a single
    controller, where one program over every slice fails as a whole: a step is one program, the state donated,
    as in a hand-written loop (docs/architecture.md, "The step")."""

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

    def check_step(self, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Raise what the hardware raises if a slice in ``slices`` was lost during the step.

        ``since`` holds the :meth:`incarnations` as of the state the step
        started from. Real runtimes raise from the step itself, so by default
        this does nothing.
        """

    def check_launch(self, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """Raise what the runtime raises when a step is launched on ``slices`` while one of them is known to be
        lost: before the step takes the state, which stays whole.

        ``since`` is as for :meth:`check_step`. Real runtimes refuse the launch
        themselves, so by default this does nothing.
        """

    def check_gradients(self, slices: Sequence[int], *, since: tuple[int, ...]) -> None:
        """With :attr:`independent_processes`: raise what the hardware raises if a slice in ``slices`` was lost
        while a step's gradients were computed (they are ready on this process), before its update consumes
        the state.

        ``since`` is as for :meth:`check_step`. Real runtimes raise from the
        gradients' program itself (it spans every slice), so by default this
        does nothing.
        """

    def step_dispatched(self) -> None:
        """Called on the training thread each time a step has been dispatched; by default nothing."""

    def slice_step_seconds(self) -> dict[int, float]:
        """Each slice's own time in the latest step that passed :meth:`check_step`, by slice: from its dispatch
        until it was done, without the time it waited for the other slices.

        Every process must get the same times (stragglers are found from
        them, the same everywhere). Empty (the default) when the runtime
        cannot tell the slices apart: one program over every slice ends on
        every slice at once.
        """
        return {}

    def release(self, slices: Sequence[int]) -> None:
        """``slices``, healthy, are no longer used (a strategy dropped them at a step boundary).

        By default they stay, idle, and may be used again. A runtime where a
        process outside the mesh cannot stay in the job has their processes
        leave it.
        """

    def explain_failure(
        self, error: Exception, slices: Sequence[int], *, since: tuple[int, ...], pending: PyTree
    ) -> None:
        """A step on ``slices`` raised ``error``; raise a ``DATA_LOSS`` error instead if lost slices explain it.

        Called on the training thread when a step's wait raised (a timeout
        included); ``since`` is as for :meth:`check_step`, ``pending`` the
        failed step's outputs. By default the error stands as it is.
        """

    def surviving(self, tree: PyTree, lost_slices: Sequence[int]) -> PyTree:
        """What is left of ``tree`` once ``lost_slices`` are gone.

        On real hardware the lost shards are already unreadable, so by default
        ``tree`` comes back as it is.
        """
        return tree

    def lost_slices_return(self, slices: Sequence[int], *, within_s: float) -> bool:
        """Whether lost ``slices`` can come back into the running job within ``within_s`` seconds. If not, a
        strategy that would wait for them re-forms the whole job instead: the processes exit to be restarted
        together (see :class:`RecoveryPlan`). ``True`` by default."""
        return True

    def await_returns(self) -> None:
        """While a recovery waits for lost slices: learn which have come back (:meth:`returning_slices`). Every
        live process calls it as often as the others (it may be a barrier). Nothing by default."""

    admission = None
    """In a process that replaces a lost one: how the running job took it in (a :class:`Admission`, set when it
    joined the job, in :meth:`configure_jax`); ``None`` in every other process."""

    def returning_slices(self) -> list[int]:
        """Slices lost earlier whose processes came back and wait to be taken in (:meth:`take_in`).

        Empty by default: on a runtime where a returning slice's devices are
        as they were, it is simply healthy again.
        """
        return []

    def take_in(self, slices: Sequence[int], *, step: int, position: int, checkpoint_group: int,
                before_restart: Callable[[], None]) -> tuple[int, ...]:
        """At a step boundary the run goes on with ``slices``, some of them returning: take those in; the processes
        taken in, none when they did not come (else the state must move onto the new backend's devices).

        ``step``, ``position`` and ``checkpoint_group`` are what the
        replacements start from; ``before_restart`` lets go of what runs on
        the backend before it restarts. Only a cluster with returning slices is asked.
        """
        raise NotImplementedError(f"{type(self).__name__} has no returning slices to take in")

    def live_processes(self) -> frozenset[int] | None:
        """The processes that hold a device of a healthy slice, which save checkpoints together.

        ``None`` (the default) for a cluster driven by one process, whose
        checkpoint group never changes, even when every slice is lost.
        """
        return None


class AbstractInjectableCluster(AbstractCluster):
    """A cluster whose slices can be lost on purpose: what failure injection (``+chaos=``) needs."""

    spared_slices: tuple[int, ...] = ()
    """Slices that random failure injection never picks (a slice whose loss would end the job)."""

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


class AbstractProcessInjectableCluster(AbstractInjectableCluster):
    """An injectable cluster whose slices are made of processes, each of which can be lost on its own (chaos's
    ``process`` key)."""

    @abc.abstractmethod
    def fail_process(self, index: int, position: int, *, down_for_s: float) -> None:
        """Kill the process at ``position`` in slice ``index``; the rest of its slice goes down with it, and the
        whole slice may come back after ``down_for_s`` seconds."""
