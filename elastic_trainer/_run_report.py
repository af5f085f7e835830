"""The run report as a typed, frozen record: what :meth:`Trainer.fit` returns and ``report.json`` holds.

``report.json`` is :meth:`RunReport.to_json` written out, and
:meth:`RunReport.load` reads it back. A key that an older or newer
``report.json`` has at its top level and this record does not know (a
plugin's, such as the example plugin's ``step_counter``) is kept in
:attr:`RunReport.extra` and written back; one inside a nested part is
ignored. A key this version added that an older file lacks takes its default.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

from ._json_records import EXTRA, JsonRecord, encode
from ._records import CompileRecord, FailureRecord, ResizeRecord
from ._stragglers import StragglerRecord

REPORT_FILE = "report.json"
"""The report's file in the run directory."""


@dataclasses.dataclass(frozen=True)
class ClusterInfo(JsonRecord):
    """The cluster the run trained on (its :meth:`~elastic_trainer.clusters.AbstractCluster.describe`)."""

    kind: str
    """The cluster's kind (``"simulated"``, ``"multiprocess"``, ``"pathways"``, ...)."""
    slices: int
    """The slices the run trains on at most (spares not counted)."""
    devices_per_slice: int
    """Devices in each slice."""
    spare_slices: int | None = None
    """Healthy slices kept out of the mesh to take a lost slice's place (left out for a cluster without)."""
    processes: int | None = None
    """``cluster=multiprocess``: the processes of the job."""
    processes_per_slice: int | None = None
    """``cluster=multiprocess``: the processes that make up one slice."""
    heartbeat_timeout_s: float | None = None
    """``cluster=multiprocess``: how long a silent process lives on in the coordination service."""
    collective_timeout_s: float | None = None
    """``cluster=multiprocess``: how long a collective whose peer died waits before it fails."""
    barrier_timeout_s: float | None = None
    """``cluster=multiprocess``: how long the live processes wait for each other at a barrier."""
    coordinator: str | None = None
    """``cluster=multiprocess``: the coordination service's address."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What a cluster of another kind describes beyond these fields."""

    _omitted_when_none = ("spare_slices", "processes", "processes_per_slice", "heartbeat_timeout_s",
                          "collective_timeout_s", "barrier_timeout_s", "coordinator")


@dataclasses.dataclass(frozen=True)
class Badput(JsonRecord):
    """Seconds of wall time that were not productive, by category (aligned with ml-goodput-measurement)."""

    startup: float
    """From the process start (the launcher's, for a job of several) to the trainer's first work."""
    compile: float
    """Compiling (or waiting for) the step of a layout."""
    checkpoint_save: float
    """The step loop blocked on saving a checkpoint."""
    checkpoint_restore: float
    """Restoring a checkpoint."""
    detection: float
    """From a failure being raised until the strategy had a plan."""
    waiting_for_slices: float
    """Waiting for lost slices to come back (``pause_resume``, a wait for a replacement)."""
    remesh: float
    """Making the new mesh and moving the state onto it."""
    wasted_progress: float
    """Steps done and then rolled back: their time was not goodput."""
    other: float
    """Wall time not measured as any of the above or as productive."""


@dataclasses.dataclass(frozen=True)
class Spares(JsonRecord):
    """On a cluster with spare slices: where the spares are at the end."""

    in_use: tuple[int, ...]
    """The slices that started as spares and are in the mesh now (they took lost slices' places)."""
    left: int
    """Healthy slices still out of the mesh."""


@dataclasses.dataclass(frozen=True)
class CompileCache(JsonRecord):
    """The compiled steps of the run's layouts."""

    compiled_ahead: int
    """Layouts compiled ahead of need (for the slices a failure could leave) and not used yet."""
    saved_s: float
    """Compile time a recovery did not wait for, because the layout was compiled ahead."""
    evicted: int
    """Compiled layouts dropped to bound the memory they hold."""
    persistent_cache_dir: str | None
    """JAX's persistent compilation cache directory, or ``None`` when it is off."""
    layouts: tuple[CompileRecord, ...] = ()
    """Each compile asked for, in order (see :class:`~elastic_trainer._records.CompileRecord`)."""


@dataclasses.dataclass(frozen=True)
class AutoPeriod(JsonRecord):
    """``checkpoint.period=auto``: the period the Young/Daly rule chose last, and why."""

    period_steps: int
    """Steps between saves."""
    interval_s: float
    """The Young/Daly interval, ``sqrt(2 x save cost x MTBF)``, in seconds."""
    save_cost_s: float
    """The median time a save blocked the step loop."""
    step_time_s: float
    """The median step time."""
    mtbf_s: float
    """The mean time between failures used."""
    mtbf_source: str
    """Where that MTBF came from (``checkpoint.mtbf_s``, or observed in the run)."""
    why: str
    """The choice in one sentence."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo(JsonRecord):
    """Where the run's checkpoints go and how often."""

    dir: str
    """The checkpoint directory (a path or a URL)."""
    period: int | str
    """Steps between saves, or ``"auto"``."""
    auto: AutoPeriod | None = None
    """For ``period="auto"``, the period chosen last (``None`` before the first save, or for a fixed period)."""


@dataclasses.dataclass(frozen=True)
class FailedSave(JsonRecord):
    """A checkpoint save that failed for I/O; training went on and the step was not committed."""

    step: int
    """The step whose save failed."""
    cause: str | None
    """The storage's error in words (``"ENOSPC: No space left on device"``)."""
    time: float
    """When the failure was found (``time.time()``)."""


@dataclasses.dataclass(frozen=True)
class Samples(JsonRecord):
    """The samples of the committed steps, against the data stream up to the final data position."""

    consumed: int
    """Samples the final state was trained on."""
    duplicated: int
    """Samples trained on more often than the stream holds them (0 is the guarantee)."""
    skipped: int
    """Samples of the stream the state was not trained on (0, except a dropped replica's under ``diloco``)."""


@dataclasses.dataclass(frozen=True)
class History(JsonRecord):
    """Each committed step's metrics, as columns: ``report.json`` holds ``{"step": [...], "loss": [...],
    "<aux name>": [...]}``."""

    step: tuple[int, ...] = ()
    """The committed steps, counted as completed (1-based: the step the progress line and TensorBoard show)."""
    metrics: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    """By name, one value per step: ``loss``, then the scalars of a loss with ``has_aux=True``."""

    def to_json(self) -> dict[str, Any]:
        """``step`` and each metric's column."""
        return {"step": list(self.step), **{name: list(values) for name, values in self.metrics.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> History:
        """The history of the columns in ``data``."""
        return cls(tuple(data.get("step", ())), {k: tuple(v) for k, v in data.items() if k != "step"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunReport(JsonRecord):
    """The run report: what :meth:`Trainer.fit` returns (``FitResult.report``), :class:`TrainingStopped` and
    :class:`Preempted` carry, plugins get in ``et_run_end``, and ``report.json`` holds.

    Read it by attribute (``report.failures[0].recovery_s``); ``report["failures"]`` reads the JSON of
    ``report.json`` instead, for code written against the dict. A plugin adds its own keys in
    ``et_run_end`` with ``report.extra[name] = value`` (``report[name] = value`` still works, with a
    :class:`DeprecationWarning`).
    """

    strategy: str | None
    """The strategy's name, or ``None``: a failure stops the run."""
    training_mode: str = "synchronous"
    """The training mode's name (``synchronous``, ``diloco``)."""
    cluster: ClusterInfo
    """What the run trained on."""
    steps_target: int
    """The steps asked for (``trainer.steps``)."""
    steps_completed: int
    """The steps the final state holds."""
    loss_first: float | None
    """The loss of the first committed step, or ``None`` when none was."""
    final_loss: float | None
    """The loss of the last committed step, or ``None`` when none was."""
    wall_s: float
    """Wall time from the process start (the launcher's or supervisor's, for a job of several) to the end."""
    productive_s: float
    """Time spent in steps whose results survive."""
    goodput: float
    """``productive_s / wall_s``."""
    badput_s: Badput
    """Where the rest of the wall time went."""
    failures: tuple[FailureRecord, ...]
    """Each failure, in order (see :class:`~elastic_trainer._records.FailureRecord`)."""
    resizes: tuple[ResizeRecord, ...] = ()
    """Each change of the slices in use, in order (see :class:`~elastic_trainer._records.ResizeRecord`)."""
    stragglers: tuple[StragglerRecord, ...] = ()
    """Each slice found to be a straggler (see :class:`~elastic_trainer._stragglers.StragglerRecord`)."""
    spares: Spares | None = None
    """On a cluster with spare slices, where they are at the end; ``None`` on one without."""
    compile_cache: CompileCache | None = None
    """The compiled steps of the run's layouts."""
    checkpoint: CheckpointInfo | None = None
    """Where checkpoints go and how often, or ``None`` for a run without."""
    checkpoint_failures: tuple[FailedSave, ...] = ()
    """Each checkpoint save that failed for I/O."""
    resumed_from: int | None = None
    """The checkpoint step a resumed run continued from."""
    samples: Samples
    """Samples consumed, duplicated and skipped."""
    data_position: int = 0
    """Samples of the stream consumed, at the end."""
    started_at: float | None = None
    """When the run's clock started (``time.time()``): the process start for the command line."""
    ended_at: float | None = None
    """When training ended (``time.time()``)."""
    first_step_ended_at: float | None = None
    """When this process's first step ended (``time.time()``)."""
    badput_before_first_step_s: Badput | None = None
    """The badput booked until the first step ended."""
    history: History = dataclasses.field(default_factory=History)
    """Each committed step's loss and auxiliary metrics."""
    stopped: str | None = None
    """Why training stopped before its last step, or ``None``: it completed (or was preempted and saved)."""
    workers: int | None = None
    """A run whose worker processes were restarted (``full_restart``, ``cluster=multiprocess``): how many ran."""
    process_exits: tuple[dict[str, Any], ...] | None = None
    """``cluster=multiprocess``: each attempt's processes' exit codes, as the launcher saw them."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keys the record does not know: a plugin's (``report.extra[name] = value`` in ``et_run_end``), or an
    older or newer ``report.json``'s; written back at the top level."""

    _omitted_when_none = ("workers", "process_exits")

    @classmethod
    def load(cls, path: str | Path) -> RunReport:
        """The report in ``path`` (a ``report.json``, or a run directory that holds one)."""
        path = Path(path)
        if path.is_dir():
            path = path / REPORT_FILE
        try:
            return cls.from_json(json.loads(path.read_text()))
        except ValueError as error:
            raise ValueError(f"{path} is not a run report: {error}") from None

    def write(self, run_dir: str | Path) -> Path:
        """Write the report as ``report.json`` in ``run_dir`` (created if missing); the file's path."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / REPORT_FILE
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def __getitem__(self, key: str) -> Any:
        """``report.json``'s value for ``key`` (JSON: dicts and lists), for code written against the dict."""
        if key != EXTRA and key in _FIELDS and not (key in self._omitted_when_none and getattr(self, key) is None):
            return encode(getattr(self, key))
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        """``report[name] = value``, as a plugin added keys to the dict: kept in :attr:`extra`, with a
        :class:`DeprecationWarning` that names ``report.extra[name] = value``; the core's fields are frozen."""
        if key in _FIELDS:
            raise TypeError(f"report[{key!r}] is the core's and frozen; a plugin adds keys of its own with "
                            f"report.extra[name] = value.")
        warnings.warn(f"report[{key!r}] = value is deprecated; write report.extra[{key!r}] = value.",
                      DeprecationWarning, stacklevel=2)
        self.extra[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        """``report.json``'s value for ``key``, or ``default``, for code written against the dict."""
        return self[key] if key in self else default

    def __contains__(self, key: str) -> bool:
        """Whether ``report.json`` has ``key``."""
        try:
            self[key]
        except KeyError:
            return False
        return True


_FIELDS = frozenset(field.name for field in dataclasses.fields(RunReport))
