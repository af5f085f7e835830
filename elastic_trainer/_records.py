"""Typed records of a run: its layout, the loop's state, and what the report says of failures, resizes and compiles.

Records are frozen: a change makes a new record (``dataclasses.replace``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._goodput import GoodputClock
from ._json_records import JsonRecord
from ._ledger import SampleLedger

if TYPE_CHECKING:
    import pluggy

    from .clusters import AbstractCluster

RestoredFrom = Literal["replica", "snapshot", "checkpoint", "peer", "none"]
"""Where a recovery took the state from (``report.json``'s ``restored_from``; ``_restore_sources.py``; ``"peer"``
only for a rejoin, which is no failure), or ``"none"``: the state of step 0 again, on a restart with no checkpoint
yet."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """The slices in use, their mesh, the global batch and the step compiled for them.

    :param compile_s: seconds spent getting ``compiled`` (compiling, or
        waiting for a compile started ahead).
    :param compile_cached: whether that compile already existed or was under way.
    """

    slices: tuple[int, ...]
    mesh: Mesh
    batch_size: int
    lr_scale: float
    compiled: Any
    shardings: PyTree
    compile_s: float
    compile_cached: bool


@dataclasses.dataclass(frozen=True)
class PendingRecovery:
    """A recovery whose time is known once the next productive step ends.

    :param failure: the index of its failure in the run's :class:`FailureLog`.
    :param failed_at: when the failure was raised (``time.time()``).
    """

    failure: int
    failed_at: float


@dataclasses.dataclass(frozen=True)
class LoopState:
    """Where the step loop is: the state of the last committed step and what it runs on.

    :param arrays: the train state's arrays, on ``layout``.
    :param step: steps completed (``arrays.step``, kept on the host).
    :param position: samples consumed (``arrays.data_position``, kept on the host).
    :param incarnations: the cluster's :meth:`~AbstractCluster.incarnations` as of ``arrays``.
    :param whole: ``False`` while ``arrays`` hold no trained state yet (a run to resume).
    :param save_due: ``step`` is committed and is to be saved before the next step.
    :param at_boundary: between two steps, the previous one committed (and saved if due):
        where the slices in use may change.
    :param pending: the recovery that ends with the next productive step, if any.
    :param consumed: the step after ``step`` took ``arrays`` (they were donated to it) and failed: no slice
        holds them any more.
    """

    arrays: PyTree
    layout: Layout
    step: int
    position: int
    incarnations: tuple[int, ...]
    whole: bool = True
    save_due: bool = False
    at_boundary: bool = False
    pending: PendingRecovery | None = None
    consumed: bool = False


@dataclasses.dataclass(frozen=True)
class FailureRecord(JsonRecord):
    """One failure, as ``RunReport.failures`` lists it (the report reference, docs/reference/report.md).

    Filled in as the recovery goes: detection first, then the strategy's
    action and wait, the new layout's compile and re-mesh, the restore, and
    ``recovery_s`` once the first productive step after it has ended
    (``None`` until then, and for good when the run ended first). A failure
    that stopped the run has ``ended_run`` set. On a cluster with spares,
    ``spares_taken`` are the spares the new layout took in the lost slices'
    place and ``spares_left`` the healthy ones still out of it. A slice whose
    replica a semi-synchronous mode dropped (``action`` ``"drop_replica"``)
    lost ``samples_skipped`` samples' training and no step. Optional parts
    that did not happen (``fell_back_from``, ``regrouped``, the compile and
    restore of a recovery that stopped, spares on a cluster without) are left
    out of :meth:`to_json`.

    :param step: the step that failed (steps completed before it).
    :param phase: where it failed: ``train_step``, ``checkpoint_save``, ``checkpoint_restore``, ``boundary``, ...
    :param slices: the slices lost (``slice`` in the report is the first of them).
    :param kind: what was lost (``slice_lost``, ``timeout``, ...).
    :param slices_before: the slices in use before it.
    :param failed_at: when it was raised (``time.time()``).
    :param detection_s: from then until the strategy had a plan.
    :param action: what the strategy did (``scale_down``, ``pause_resume``, ``hot_swap``, ``restart``,
        ``drop_replica``, ``stop``).
    :param slices_after: the slices in use after the recovery.
    :param restored_from: where the state came from: ``replica``, ``snapshot``, ``checkpoint`` or ``none``.
    :param lost_steps: steps done again.
    :param recovery_s: from the failure to the end of the first productive step after it.
    :param ended_run: the failure stopped the run.
    :param waiting_s: how long the recovery waited for slices.
    :param fell_back_from: the strategies that declined before the one that acted (``fallback``).
    :param regrouped: whether the processes regrouped onto a new group (``cluster=multiprocess``).
    :param compile_s: the new layout's compile (or wait for it).
    :param compile_cached: whether that compile already existed or was under way.
    :param remesh_s: making the new mesh and moving the state onto it.
    :param restore_s: reading the state back.
    :param startup_s: a restart's new worker process's start-up, from the old one's end (a merged report).
    :param processes: ``cluster=multiprocess``: the processes lost.
    :param spares_taken: the spares that took the lost slices' places.
    :param spares_left: the healthy spares still out of the mesh after it.
    :param samples_skipped: ``drop_replica``: the samples whose training the dropped replica lost.
    """

    step: int
    phase: str
    slices: tuple[int, ...]
    kind: str
    slices_before: int
    failed_at: float
    detection_s: float
    action: str = "stop"
    slices_after: int | None = None
    restored_from: RestoredFrom = "none"
    lost_steps: int = 0
    recovery_s: float | None = None
    ended_run: bool = False
    waiting_s: float | None = None
    fell_back_from: tuple[str, ...] | None = None
    regrouped: bool | None = None
    compile_s: float | None = None
    compile_cached: bool | None = None
    remesh_s: float | None = None
    restore_s: float | None = None
    startup_s: float | None = None
    processes: tuple[int, ...] | None = None
    spares_taken: tuple[int, ...] | None = None
    spares_left: int | None = None
    samples_skipped: int | None = None

    _REPORT_ORDER = (
        "step", "phase", "slice", "slices", "processes", "kind", "action", "slices_before", "slices_after", "restored_from",
        "lost_steps", "samples_skipped", "recovery_s", "ended_run", "failed_at", "detection_s", "waiting_s", "fell_back_from", "regrouped",
        "compile_s", "compile_cached", "remesh_s", "restore_s", "startup_s", "spares_taken", "spares_left",
    )

    def to_json(self) -> dict[str, Any]:
        """The report's entry: every field in the report's order, ``slice`` the first lost slice."""
        fields = {
            **dataclasses.asdict(self),
            "slice": self.slices[0] if self.slices else None,
            "slices": list(self.slices),
            "slices_after": self.slices_before if self.slices_after is None else self.slices_after,
            "fell_back_from": None if self.fell_back_from is None else list(self.fell_back_from),
            "processes": None if self.processes is None else list(self.processes),
            "spares_taken": None if self.spares_taken is None else list(self.spares_taken),
        }
        optional = ("processes", "waiting_s", "fell_back_from", "regrouped", "compile_s", "compile_cached", "remesh_s",
                    "restore_s", "startup_s", "spares_taken", "spares_left", "samples_skipped")
        return {k: fields[k] for k in self._REPORT_ORDER if not (k in optional and fields[k] is None)}


@dataclasses.dataclass(frozen=True)
class ResizeRecord(JsonRecord):
    """A change of the slices in use, as ``report["resizes"]`` lists it (``slices_after`` there is
    ``len(slices)``).

    :param step: the step boundary it was made at (steps completed).
    :param at: when it was done (``time.time()``).
    :param reason: ``"failure"``, ``"scale_up"``, ``"dropped"`` (a plugin took slices in use away at a step
        boundary: ``scale_down`` dropping a straggler), or ``"rejoined"`` (a scale-up onto slices whose
        processes came back as replacements on ``cluster=multiprocess``, their state sent by a live peer,
        no checkpoint read).
    :param slices_before: the slices in use before it.
    :param slices: the slices in use after it.
    :param seconds: the time it took (re-mesh, compile and state transfer).
    :param compile_s: its layout's compile (or wait for it).
    :param compile_cached: whether that compile already existed or was under way.
    :param state_from_peer: the processes of a ``"rejoined"`` resize's returning slices, which got the state
        from a live peer.
    """

    step: int
    at: float
    reason: str
    slices_before: int
    slices: tuple[int, ...]
    seconds: float
    compile_s: float
    compile_cached: bool
    state_from_peer: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The report's entry (``state_from_peer`` only for a resize that took processes back in)."""
        return {
            "step": self.step, "at": self.at, "reason": self.reason, "slices_before": self.slices_before,
            "slices_after": len(self.slices), "slices": list(self.slices), "seconds": self.seconds,
            "compile_s": self.compile_s, "compile_cached": self.compile_cached,
            **({"state_from_peer": list(self.state_from_peer)} if self.state_from_peer else {}),
        }


@dataclasses.dataclass(frozen=True)
class CompileRecord(JsonRecord):
    """One layout's compiled step: when it was asked for and when it was ready, as ``report["compile_cache"]["layouts"]`` lists it.

    :param slices: the layout's slices.
    :param ahead: asked for ahead of need (:meth:`StepCache.compile_ahead`), not by a layout made now.
    :param requested_at: when it was asked for (``time.time()``).
    :param started_at: when its compile started (later than ``requested_at`` while others were compiling first).
    :param ready_at: when it was ready to run (``None`` while compiling, or when the run ended first).
    :param loaded: loaded from JAX's persistent compilation cache rather than compiled.

    The report's entry adds ``compile_s``, ``ready_at - started_at``.
    """

    slices: tuple[int, ...]
    ahead: bool
    requested_at: float
    started_at: float | None = None
    ready_at: float | None = None
    loaded: bool = False

    def to_json(self) -> dict[str, Any]:
        """The report's entry; ``compile_s`` is ``ready_at - started_at``."""
        compile_s = None if self.ready_at is None or self.started_at is None else self.ready_at - self.started_at
        return {**dataclasses.asdict(self), "slices": list(self.slices), "compile_s": compile_s}


class FailureLog:
    """The run's failures in order; an entry changes only by being replaced with a new record."""

    def __init__(self) -> None:
        self._records: list[FailureRecord] = []

    def add(self, record: FailureRecord) -> int:
        """Append ``record``; its index."""
        self._records.append(record)
        return len(self._records) - 1

    def amend(self, index: int, **changes: Any) -> FailureRecord:
        """Replace entry ``index`` by a copy with ``changes``; the new record."""
        self._records[index] = dataclasses.replace(self._records[index], **changes)
        return self._records[index]

    def __getitem__(self, index: int) -> FailureRecord:
        return self._records[index]

    def __iter__(self) -> Iterator[FailureRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def to_json(self) -> list[dict[str, Any]]:
        """The report's ``failures``."""
        return [record.to_json() for record in self._records]


LOSSES_ON_DEVICE = 64
"""Committed steps whose loss stays on the devices as the step left it (the newest ones). Once twice as many
are, the older half comes to the host in one transfer (their steps ended long ago: nothing waits), so a run
holds a float per step, not a device array with a buffer per device (a long run's memory grew with its
steps: tests/test_soak.py counts the live arrays)."""


class StepHistory:
    """The committed steps: their samples, metrics (the loss, and a ``has_aux`` loss's scalars) and times, rolled
    back together. The trainer's loop
    (``_trainer.py``) alone writes it.

    :param ledger: the samples of the committed steps.
    :param on_device: how many committed steps keep their metrics on the devices (:data:`LOSSES_ON_DEVICE`); 0
        brings each step's to the host as it is committed, where a lost slice takes every array on it with it
        (an ``AbstractWholeArrayLossCluster``: Pathways).
    """

    def __init__(self, ledger: SampleLedger, *, on_device: int = LOSSES_ON_DEVICE):
        self.ledger = ledger
        self._keep_on_device = on_device
        self.metrics: dict[int, dict[str, jax.Array | float]] = {}
        """Each committed step's metrics by name (``loss`` first), by step: floats, or for the newest
        :data:`LOSSES_ON_DEVICE` steps or more, the device arrays the step made."""
        self._on_device: list[int] = []  # the steps whose metrics are still device arrays, in commit order
        self.seconds: dict[int, float] = {}
        """Each committed step's wall time, by step."""
        self.slices: dict[int, tuple[int, ...]] = {}
        """The slices each committed step's batch was split over, by step."""
        self._dropped_time: list[tuple[int, int, float]] = []  # (as of which step, step, seconds) of each drop_slice
        self.resumed_from: int | None = None
        """The checkpoint step a resumed run continued from."""
        self.first_step_ended_at: float | None = None
        """When this process's first step ended (``time.time()``)."""
        self.badput_before_first_step_s: dict[str, float] | None = None
        """The badput booked until then, by category."""

    def note_first_step(self, clock: GoodputClock) -> None:
        """After each committed step: the first one's end and the badput before it are noted once."""
        if self.first_step_ended_at is None:
            self.first_step_ended_at, self.badput_before_first_step_s = time.time(), dict(clock.badput_s)

    def resume_at(self, step: int, position: int) -> None:
        """A run that resumes from step ``step``'s checkpoint: count samples from its data position ``position``."""
        self.start_at(position)
        self.resumed_from = step

    def start_at(self, position: int) -> None:
        """Count samples from data position ``position`` (where a resumed run continues); forget every step."""
        self.ledger = SampleLedger(self.ledger.num_samples, seed=self.ledger.seed, start_position=position)
        self.metrics, self.seconds, self.slices, self._on_device, self._dropped_time = {}, {}, {}, [], []

    def commit(self, step: int, ids: np.ndarray, metrics: dict[str, jax.Array], *, slices: tuple[int, ...]) -> None:
        """Record step ``step`` (0-based): its samples, split over ``slices``, and its metrics (``loss`` and a
        ``has_aux`` loss's scalars, left on the device for now)."""
        self.ledger.commit(step, ids)
        self.slices[step] = slices
        self.metrics[step] = metrics
        self._on_device.append(step)
        if len(self._on_device) >= 2 * self._keep_on_device:
            self._to_host(len(self._on_device) - self._keep_on_device)

    def losses_to_host(self) -> None:
        """Bring every metric still on the devices to the host, in one transfer: before the backend that holds
        them is dropped (a rejoin restarts it, and arrays of the old backend must not be read after)."""
        self._to_host(len(self._on_device))

    def _to_host(self, count: int) -> None:
        """The ``count`` oldest steps' metrics still on the devices, as floats."""
        older, self._on_device = self._on_device[:count], self._on_device[count:]
        for older_step, values in zip(older, jax.device_get([self.metrics[s] for s in older]), strict=True):
            self.metrics[older_step] = {name: float(value) for name, value in values.items()}

    def time_step(self, step: int, seconds: float) -> None:
        """Add ``seconds`` to how long step ``step`` took, wall time (its run, then what follows until it is
        committed)."""
        self.seconds[step] = self.seconds.get(step, 0.0) + seconds

    def roll_back(self, to_step: int) -> float:
        """Forget the steps from ``to_step`` on; the seconds they took, less those a slice's drop as of them had
        taken from earlier steps, which the state holds again (:meth:`drop_slice`)."""
        self.ledger.roll_back(to_step)
        self.metrics = {s: metrics for s, metrics in self.metrics.items() if s < to_step}
        self.slices = {s: slices for s, slices in self.slices.items() if s < to_step}
        self._on_device = [s for s in self._on_device if s < to_step]
        given_back = 0.0
        for at, step, seconds in [d for d in self._dropped_time if d[0] >= to_step and d[1] < to_step]:
            self.seconds[step] += seconds
            given_back += seconds
        self._dropped_time = [d for d in self._dropped_time if d[0] < to_step and d[1] < to_step]
        return sum(self.seconds.pop(s) for s in [s for s in self.seconds if s >= to_step]) - given_back

    def drop_slice(self, dropped: int, *, since: int, until: int, at: int) -> tuple[int, float]:
        """Slice ``dropped``'s training of the steps from ``since`` to ``until`` (excluded) is lost as of step
        ``at`` (its replica was dropped): its share of their samples is skipped, and its share of their time is
        no longer the steps' (a roll-back to a state from before ``at`` undoes the skip, not the time). Returns how
        many samples that is, and how much time (goodput it no longer is)."""
        skipped, seconds = 0, 0.0
        for step in sorted(s for s in self.slices if since <= s < until and dropped in self.slices[s]):
            slices, ids = self.slices[step], self.ledger.ids_of(step)
            share = len(ids) // len(slices)  # the batch is split over the slices in order, one share each
            position = slices.index(dropped)
            forgotten = self.ledger.forget(step, slice(position * share, (position + 1) * share), at=at)
            if forgotten:  # its share of the step's time, once
                part = self.seconds.get(step, 0.0) * forgotten / len(ids)
                self.seconds[step] = self.seconds.get(step, 0.0) - part
                self._dropped_time.append((at, step, part))
                skipped, seconds = skipped + forgotten, seconds + part
        return skipped, seconds

    def ordered_losses(self) -> list[float]:
        """The committed steps' losses, in step order."""
        return self.ordered_metrics().get("loss", [])

    def ordered_metrics(self) -> dict[str, list[float]]:
        """The committed steps' metrics in step order, by name (``step``, counted as completed, first)."""
        steps = sorted(self.metrics)
        columns: dict[str, list[float]] = {"step": [step + 1 for step in steps]}
        for values in jax.device_get([self.metrics[step] for step in steps]):
            for name, value in values.items():
                columns.setdefault(name, []).append(float(value))
        return columns


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunContext:
    """What a run's parts reach the cluster, the plugins and the clock through (layouts, checkpoints, and
    recovery in any loop).

    :param cluster: the slices.
    :param hooks: the plugins' hooks (:class:`GuardedHooks`).
    :param plugin_manager: the manager behind them, to name a plugin in an error.
    :param view: what hooks receive as ``trainer``.
    :param clock: books detection and waiting.
    :param failures: the run's failure records.
    """

    cluster: AbstractCluster
    hooks: Any
    plugin_manager: pluggy.PluginManager
    view: object
    clock: GoodputClock
    failures: FailureLog
