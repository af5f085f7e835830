"""The run report (:class:`RunReport`): made at a run's end, its one-screen summary, and one report out of a
full restart's workers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from rich.table import Table

from .events import CheckpointFailureEvent, Event, FailureEvent, RecoveryEvent, ResizeEvent, StragglerEvent
from ._goodput import BADPUT_CATEGORIES
from ._ledger import SampleLedger
from ._plugins import strategy_name
from ._records import FailureRecord
from ._run_report import (REPORT_FILE, Badput, CheckpointInfo, ClusterInfo, CompileCache, FailedSave, History,
                          RunReport, Samples, Spares)
from .clusters import has_spares

if TYPE_CHECKING:
    from ._records import LoopState
    from ._recovery import TrainingContext
    from ._trainer import Trainer


def write_report(run_dir: Path, report: RunReport | dict[str, Any]) -> Path:
    """Write ``report`` as ``report.json`` in ``run_dir`` (created if missing); the file's path. A dict is
    written as it is (``elastic_retry``'s report, which is not a training run's)."""
    if isinstance(report, RunReport):
        return report.write(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / REPORT_FILE
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def run_report(trainer: Trainer, ctx: TrainingContext, state: LoopState, *, stopped: str | None) -> RunReport:
    """The report of a run that ended at ``state``, stopped early for ``stopped`` (``None``: it was not)."""
    history = ctx.history
    metrics = history.ordered_metrics()
    losses = metrics.get("loss", [])
    step_cache = ctx.step_cache
    return RunReport(
        strategy=None if trainer.strategy is None else strategy_name(trainer.strategy),
        training_mode=ctx.mode.name,
        cluster=ClusterInfo.from_json(trainer.cluster.describe()),
        steps_target=trainer.steps,
        steps_completed=state.step,
        loss_first=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        **_clock_summary(ctx.clock.summary()),
        failures=tuple(ctx.failures),
        resizes=tuple(ctx.layouts.resizes),
        stragglers=tuple(ctx.stragglers.records),
        spares=_spares_at_end(ctx, state.layout.slices),
        compile_cache=CompileCache(
            compiled_ahead=step_cache.compiled_ahead, saved_s=step_cache.saved_s, evicted=step_cache.evicted,
            persistent_cache_dir=jax.config.jax_compilation_cache_dir, layouts=tuple(step_cache.records),
        ),
        checkpoint=None if trainer.checkpointer is None else CheckpointInfo.from_json(trainer.checkpointer.describe()),
        checkpoint_failures=() if ctx.checkpoints is None else tuple(
            FailedSave.from_json(failed.to_json()) for failed in ctx.checkpoints.failed_saves),
        resumed_from=history.resumed_from,
        samples=Samples(**history.ledger.counts(state.position)),
        data_position=state.position,
        started_at=ctx.clock.started_at,
        ended_at=ctx.clock.ended_at,
        first_step_ended_at=history.first_step_ended_at,
        badput_before_first_step_s=None if history.badput_before_first_step_s is None
        else Badput(**history.badput_before_first_step_s),
        history=History(step=tuple(metrics.pop("step", ())), metrics={k: tuple(v) for k, v in metrics.items()}),
        stopped=stopped,
    )


def _clock_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The clock's :meth:`~GoodputClock.summary` as the report's fields."""
    return {**summary, "badput_s": Badput(**summary["badput_s"])}


def _spares_at_end(ctx: TrainingContext, in_use: tuple[int, ...]) -> Spares | None:
    """On a cluster with spares: those that started as spares now in use (they took lost slices' places), and
    how many healthy slices are left out of the mesh; ``None`` on a cluster without."""
    if not has_spares(ctx.cluster):
        return None
    return Spares(in_use=tuple(s for s in in_use if s >= ctx.layouts.limit), left=len(ctx.layouts.spares(in_use)))


def summary_table(report: RunReport) -> Table:
    """The run at a glance: progress, loss, and where the wall time went."""
    table = Table(title="elastic_trainer run", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("strategy", str(report.strategy))
    table.add_row("steps", f"{report.steps_completed} / {report.steps_target}")
    if report.loss_first is not None:
        table.add_row("loss", f"{report.loss_first:.4f} -> {report.final_loss:.4f}")
    table.add_row("wall", f"{report.wall_s:.1f} s")
    table.add_row("goodput", f"{report.goodput:.1%} ({report.productive_s:.1f} s productive)")
    for category, seconds in report.badput_s.to_json().items():
        if seconds >= 0.05:
            share = seconds / report.wall_s
            table.add_row(f"  {category}", f"{seconds:6.1f} s  {'#' * round(30 * share):<30} {share:.1%}")
    for failure in report.failures:
        recovered = "not recovered" if failure.recovery_s is None else f"recovered in {failure.recovery_s:.1f} s"
        if failure.action == "drop_replica":  # the others went on, nothing was restored
            outcome = f"the others went on, its {failure.samples_skipped} samples since the last sync skipped"
        else:
            outcome = f"from {failure.restored_from}, {failure.lost_steps} steps lost, {recovered}"
        table.add_row(
            f"failure @ {failure.step}",
            f"slices {list(failure.slices)} {failure.kind}: {failure.action}, "
            f"{failure.slices_before} -> {failure.to_json()['slices_after']} slices, {outcome}" + _spares(failure),
        )
    for resize in report.resizes:
        if resize.state_from_peer:
            table.add_row(f"rejoined @ {resize.step}",
                          f"process(es) {list(resize.state_from_peer)} back, their state from a live peer: "
                          f"{resize.slices_before} -> {len(resize.slices)} slices in {resize.seconds:.1f} s")
    for straggler in report.stragglers:
        recovered = straggler.recovered_at_step
        table.add_row(f"straggler @ {straggler.detected_at_step}",
                      f"slice {straggler.slice} {straggler.ratio:.1f}x slower than the others since step "
                      f"{straggler.slow_since_step}, " + (f"recovered at {recovered}" if recovered else "still slow"))
    if report.spares:
        table.add_row("spares", f"{list(report.spares.in_use)} in use, {report.spares.left} left")
    failed_saves = report.checkpoint_failures
    if failed_saves:
        table.add_row("checkpoint saves failed", f"{len(failed_saves)} (steps "
                      f"{', '.join(str(f.step) for f in failed_saves)}; last: {failed_saves[-1].cause})")
    auto_period = report.checkpoint.auto if report.checkpoint else None
    if auto_period:
        table.add_row("checkpoint period", f"every {auto_period.period_steps} steps: {auto_period.why}")
    samples = report.samples
    table.add_row("samples", f"{samples.consumed} consumed, {samples.duplicated} duplicated, {samples.skipped} skipped")
    if report.stopped:
        table.add_row("stopped", report.stopped)
    return table


def _spares(failure: FailureRecord) -> str:
    """The spares a failure's recovery took, for its summary line (nothing on a cluster without spares)."""
    if failure.spares_taken is None:
        return ""
    return f"; spare(s) {list(failure.spares_taken)} in, {failure.spares_left} left"


def merge_worker_reports(reports: list[RunReport], ledgers: list[dict], *, started_at: float) -> RunReport:
    """One report for a run whose workers were restarted: wall time from ``started_at``
    (the supervisor's start), time summed over workers, the gaps between them as
    startup, each restart's recovery measured from its failure to the next
    worker's first step (split into the new worker's ``startup_s``,
    ``compile_s`` and ``restore_s``), each restart's ``slices_after`` the
    slices the next worker trained on (every slice of its cluster: a worker
    starts on all of them), samples counted over every worker's
    committed steps, and the history of each step the last worker to commit it made.
    """
    first, last = reports[0], reports[-1]
    wall = last.ended_at - started_at
    badput = {category: sum(getattr(r.badput_s, category) for r in reports) for category in BADPUT_CATEGORIES}
    badput["startup"] += wall - sum(r.wall_s for r in reports)  # process restarts between workers
    productive = sum(r.productive_s for r in reports)
    badput["other"] = max(0.0, badput["other"] + wall - productive - sum(badput.values()))
    failures: list[FailureRecord] = []
    for worker, following in zip(reports, [*reports[1:], None]):
        copies = list(worker.failures)
        if following is not None:
            copies[-1] = dataclasses.replace(copies[-1], slices_after=following.cluster.slices)
        if following is not None and following.first_step_ended_at is not None:
            restart, before = copies[-1], following.badput_before_first_step_s
            copies[-1] = dataclasses.replace(  # the new worker's process start (from the old one's end), compile, restore
                restart, recovery_s=following.first_step_ended_at - restart.failed_at,
                startup_s=following.started_at - worker.ended_at + before.startup,
                compile_s=before.compile, restore_s=before.checkpoint_restore,
            )
        failures += copies
    ledger = SampleLedger.from_arrays(ledgers[0])
    for more in ledgers[1:]:
        ledger.extend(more)
    return dataclasses.replace(
        last,
        loss_first=first.loss_first,
        wall_s=wall,
        productive_s=productive,
        goodput=productive / wall,
        badput_s=Badput(**badput),
        failures=tuple(failures),
        resizes=tuple(z for r in reports for z in r.resizes),
        stragglers=tuple(z for r in reports for z in r.stragglers),
        checkpoint_failures=tuple(f for r in reports for f in r.checkpoint_failures),
        samples=Samples(**ledger.counts(last.data_position)),
        started_at=started_at,
        history=_merged_history([r.history for r in reports]),
        workers=len(reports),
    )


def _merged_history(histories: list[History]) -> History:
    """The steps' metrics over workers that each resumed from a checkpoint: each step's from the last worker
    that committed it."""
    by_step = {step: {name: values[i] for name, values in history.metrics.items()}
               for history in histories for i, step in enumerate(history.step)}
    steps = sorted(by_step)
    names = list(dict.fromkeys(name for history in histories for name in history.metrics))
    return History(step=tuple(steps), metrics={name: tuple(by_step[s].get(name, float("nan")) for s in steps)
                                               for name in names})


def report_events(report: RunReport) -> list[Event]:
    """The timeline events a report holds: each failure, its recovery
    (from the failure to the end of the first productive step after it),
    each resize, each straggler (from when it was found to when it recovered,
    if it did) and each checkpoint save that failed for I/O."""
    events: list[Event] = []
    for failure in report.failures:
        events.append(FailureEvent(time=failure.failed_at, failure=failure))
        if failure.recovery_s:
            events.append(RecoveryEvent(time=failure.failed_at, end=failure.failed_at + failure.recovery_s,
                                        step=failure.step, action=failure.action))
    events += [ResizeEvent(time=resize.at, resize=resize) for resize in report.resizes]
    events += [StragglerEvent(time=straggler.detected_at, straggler=straggler) for straggler in report.stragglers]
    events += [CheckpointFailureEvent(time=failed.time, step=failed.step, cause=failed.cause)
               for failed in report.checkpoint_failures]
    return events
