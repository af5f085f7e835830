"""The fault matrix: strategy x failure phase x cluster, every invariant in every cell.

The cells run in-process (a Trainer with strategy and chaos plugins, 6 steps
of a tiny model) and share one failure-free run. A ``full_restart`` worker
restart is done the way the supervisor does it: the Trainer ends with
:class:`RestartRequested` and a new Trainer (a new strategy, a new cluster)
resumes from the checkpoint, with the same run directory so that chaos does
not strike twice; the reports and sample ledgers are merged by the
supervisor's own code. A few cells also run through the command line:
full_restart with the real CLI supervisor and worker processes, and a
subset on ``cluster=multiprocess``, one JAX process per slice, the lost
ones really killed.

Invariants checked in every cell (:func:`check_invariants`, and for the
command-line cells :func:`test_cell_through_the_command_line`):

- the run finishes, or stops with one clear sentence and exit status 3 (a
  stop is then followed by the user's re-run with ``checkpoint.resume=true``,
  which must finish: the checkpoints it left are intact);
- no partial checkpoint is ever restored: every restore from a checkpoint
  reads a step whose save completed and gets exactly the failure-free state
  of that step, and every checkpoint on disk holds that state;
- ``samples.duplicated`` = 0 and ``samples.skipped`` = 0 over all workers;
- the final parameters equal the failure-free run's (every strategy here
  keeps the global batch);
- no process is left behind.

The cells share the session's compilation cache (tests/conftest.py): every
cell compiles the same few layouts, and compile time is not what they test.

``ELASTIC_TRAINER_WRITE_FAULT_MATRIX=1 python -m pytest tests/test_fault_matrix.py``
regenerates docs/fault_matrix.md from the results; without it, the last test
checks that the committed table is the one the run generates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
import psutil
import pytest
from test_cli import run_cli
from test_cli_recovery import report_of
from test_config import compose_config

import elastic_trainer as et
from elastic_trainer.launch._cli import EXIT_TRAINING_STOPPED
from elastic_trainer.config._build import build_trainer
from elastic_trainer._report import merge_worker_reports
from elastic_trainer.launch._supervisor import RESTART_EXIT_CODE
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.full_restart import FullRestart
from elastic_trainer_plugins.pause_resume import PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown

STEPS, BATCH, FAIL_AT, PERIOD = 6, 24, 3, 2  # BATCH divides over 8, 6, 4 and 2 devices
FOREVER = 1e9
BACK_SOON = 0.3  # pause_resume needs its slices back: they return after this many seconds
MAX_WORKERS = 5
TABLE = Path(__file__).parents[1] / "docs" / "fault_matrix.md"
WRITE_TABLE_ENV = "ELASTIC_TRAINER_WRITE_FAULT_MATRIX"

STRATEGIES = {
    "scale_down": lambda: ScaleDown(compile_ahead=False, timeout_s=0),  # the CLI tests cover compiling ahead;
    # timeout_s=0: with every slice lost for good, stop at once rather than wait for one (tests/test_soak.py waits)
    "pause_resume": lambda: PauseResume(timeout_s=30),
    "full_restart": lambda: FullRestart(max_restarts=3),
}
DOWN_FOR_S = {"scale_down": FOREVER, "pause_resume": BACK_SOON, "full_restart": FOREVER}


def lose(slice_, *, at_step=FAIL_AT, phase="train_step"):
    return {"at_step": at_step, "slice": slice_, "phase": phase}


PHASES = {  # phase: (what happens, in words; the chaos schedule)
    "train_step": ("slice 1 lost during step 4", [lose(1)]),
    "checkpoint_save": ("slice 1 lost while step 4 is saved", [lose(1, at_step=4, phase="checkpoint_save")]),
    "checkpoint_restore": (
        "an interrupted run resumed from step 2; slice 1 lost while that checkpoint is read",
        [lose(1, at_step=2, phase="checkpoint_restore")],
    ),
    "recovery": ("slice 1 lost during step 4, slice 2 while recovering", [lose(1), lose(2, phase="recovery")]),
    "two_slices": ("slices 1 and 2 lost during step 4", [lose(1), lose(2)]),
    "all_slices": ("all 4 slices lost during step 4", [lose(s) for s in range(4)]),
}
STOPS = {("scale_down", "all_slices")}
"""Cells that stop rather than finish: scale_down cannot go on with no live slice."""

ROWS: dict[tuple[str, str, str], dict] = {}
"""The results of the cells that passed, for docs/fault_matrix.md."""


# ------------------------------------------------------------------ arrays by name


def named_arrays(tree) -> dict[str, np.ndarray]:
    """Every array of ``tree`` by its path (``params.token_embedding.weight``), as numpy; PRNG keys as their data."""
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        name = ".".join(str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key)))) for key in path)
        named[name] = np.asarray(leaf)
    return named


def trained(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters and optimizer state: what training changes."""
    return {name: array for name, array in named.items() if name.startswith(("params.", "opt_state."))}


def assert_same_arrays(actual: dict, expected: dict, what: str) -> None:
    assert actual and set(actual) == set(expected), f"{what}: other arrays than the failure-free run's"
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {name}")


def saved_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def saved_states(directory: Path) -> dict[int, dict[str, np.ndarray]]:
    """The state of every checkpoint in ``directory``, by step, read with plain Orbax onto one device of this
    process (whatever devices and processes saved it)."""
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    states = {}
    with ocp.CheckpointManager(directory, item_handlers={"state": ocp.PyTreeCheckpointHandler()}) as manager:
        for step in saved_steps(directory):
            stored = manager.item_metadata(step)["state"]
            like = jax.tree.map(lambda array: jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=one_device), stored)
            args = ocp.args.PyTreeRestore(like, restore_args=ocp.checkpoint_utils.construct_restore_args(like))
            states[step] = trained(named_arrays(manager.restore(step, args=ocp.args.Composite(state=args)).state))
    return states


# ------------------------------------------------------------------ the failure-free run


@dataclasses.dataclass(repr=False)
class FailureFree:
    """The failure-free run every cell is compared with: its final params and its checkpoints."""

    params: dict[str, np.ndarray]
    states: dict[int, dict[str, np.ndarray]]  # checkpoint step -> params and optimizer state
    checkpoints: Path

    def __repr__(self) -> str:  # short, for Hypothesis's report of a failing example
        return f"FailureFree(checkpoints={self.checkpoints}, steps={sorted(self.states)})"


_failure_free: dict[str, FailureFree] = {}


@pytest.fixture
def failure_free(tiny_trainer_kwargs, tmp_path_factory) -> FailureFree:
    """Computed once per session (tests/test_properties.py shares it)."""
    if "run" not in _failure_free:
        directory = tmp_path_factory.mktemp("failure_free") / "checkpoints"
        checkpointer = et.Checkpointer(directory, period=PERIOD, max_to_keep=10)
        trainer = et.Trainer(**tiny_trainer_kwargs(
            steps=STEPS, global_batch_size=BATCH, snapshot_period=0, checkpointer=checkpointer))
        state, _ = trainer.fit()
        checkpointer.close()
        states = saved_states(directory)
        assert sorted(states) == list(range(PERIOD, STEPS + 1, PERIOD))
        _failure_free["run"] = FailureFree(trained(named_arrays(state)), states, directory)
    return _failure_free["run"]


def interrupted_run(failure_free: FailureFree, checkpoints: Path, *, at_step: int) -> None:
    """Put the checkpoints of a run interrupted after step ``at_step`` into ``checkpoints``."""
    later = {str(step) for step in failure_free.states if step > at_step}
    shutil.copytree(failure_free.checkpoints, checkpoints,
                    ignore=lambda d, names: [n for n in names if n in later] if Path(d) == failure_free.checkpoints else [])


# ------------------------------------------------------------------ workers and cells


class Recorder:
    """Records what a worker saved and restored (with the restored state)."""

    def __init__(self):
        self.saved: list[int] = []
        self.restored: list[tuple[int, str, dict]] = []

    @et.hookimpl
    def et_after_checkpoint_save(self, step):
        self.saved.append(step)

    @et.hookimpl
    def et_after_restore(self, step, source, state):
        self.restored.append((step, source, trained(named_arrays(state))))


@dataclasses.dataclass
class Worker:
    """One Trainer.fit: what a worker process of the CLI does."""

    trainer: et.Trainer
    recorder: Recorder
    state: et.TrainState | None
    report: dict
    stopped: et.TrainingStopped | None

    @property
    def exit_code(self) -> int:
        """The exit status the CLI gives this outcome."""
        if self.stopped is None:
            return 0
        return RESTART_EXIT_CODE if isinstance(self.stopped, et.RestartRequested) else EXIT_TRAINING_STOPPED


def run_worker(make, run_dir: Path, *, strategy, plugins, resume: bool) -> Worker:
    recorder = Recorder()
    trainer = et.Trainer(**make(
        steps=STEPS, global_batch_size=BATCH, snapshot_period=0, strategy=strategy, plugins=[*plugins, recorder],
        checkpointer=et.Checkpointer(run_dir / "checkpoints", period=PERIOD, max_to_keep=10), resume=resume,
        run_dir=run_dir,
    ))
    try:
        state, report = trainer.fit()
        stopped = None
    except et.TrainingStopped as stop:
        state, report, stopped = None, stop.report, stop
    finally:
        trainer.checkpointer.close()
    return Worker(trainer, recorder, state, report, stopped)


@dataclasses.dataclass
class Cell:
    """A run under one failure schedule: its workers, and the user's re-run if it stopped."""

    workers: list[Worker]
    rerun: Worker | None
    initial_checkpoints: list[int]
    orphans: list[psutil.Process]

    def merged_report(self) -> dict:
        """One report over the workers, merged by the supervisor's own code."""
        return merge_worker_reports(
            [w.report for w in self.workers], [w.trainer.ledger.to_arrays() for w in self.workers],
            started_at=self.workers[0].report["started_at"],
        )


def run_schedule(make, run_dir: Path, *, new_strategy, schedule: list[dict], resume: bool = False) -> Cell:
    """Run ``schedule`` under the strategy ``new_strategy()`` builds, restarting workers as the supervisor would
    (each worker gets a new strategy object, as a new process would)."""
    children_before = set(psutil.Process().children(recursive=True))
    initial = saved_steps(run_dir / "checkpoints") if resume else []
    workers: list[Worker] = []
    while not workers or workers[-1].exit_code == RESTART_EXIT_CODE:
        assert len(workers) < MAX_WORKERS, "the worker restarts did not end"
        if workers:  # as the supervisor: resume when the restart has a checkpoint to go back to, else start over
            resume = workers[-1].report["failures"][-1]["restored_from"] == "checkpoint"
        workers.append(run_worker(make, run_dir, strategy=new_strategy(), plugins=[Chaos(failures=schedule)],
                                  resume=resume))
    rerun = None
    if workers[-1].exit_code == EXIT_TRAINING_STOPPED:  # the user runs it again, without failures
        rerun = run_worker(make, run_dir, strategy=None, plugins=[], resume=bool(saved_steps(run_dir / "checkpoints")))
    orphans = [p for p in psutil.Process().children(recursive=True) if p not in children_before]
    return Cell(workers, rerun, initial, orphans)


# ------------------------------------------------------------------ invariants


def check_invariants(cell: Cell, failure_free: FailureFree) -> dict:
    """Assert every invariant of the matrix for ``cell``; returns what the table shows of it."""
    last = cell.workers[-1]
    for worker in cell.workers[:-1]:
        assert worker.exit_code == RESTART_EXIT_CODE
    # finishes, or stops with one clear sentence
    if last.stopped is None:
        assert last.report["steps_completed"] == STEPS and int(last.state.step) == STEPS
        finished = last
    else:
        reason = str(last.stopped)
        assert last.exit_code == EXIT_TRAINING_STOPPED
        assert reason and "\n" not in reason and reason.endswith(".")
        assert last.report["stopped"] == reason
        assert cell.rerun is not None and cell.rerun.stopped is None, "the re-run after the stop did not finish"
        finished = cell.rerun
    assert int(finished.state.step) == STEPS and int(finished.state.data_position) == STEPS * BATCH
    # no partial checkpoint is ever restored, and none is left on disk
    everyone = [*cell.workers, *([cell.rerun] if cell.rerun else [])]
    completed = set(cell.initial_checkpoints) | {step for w in everyone for step in w.recorder.saved}
    restored = [(step, source) for w in everyone for step, source, _ in w.recorder.restored]
    for worker in everyone:
        for step, source, state in worker.recorder.restored:
            if source == "checkpoint":
                assert step in completed, f"restored step {step}, whose save never completed"
                assert_same_arrays(state, failure_free.states[step], f"the restored checkpoint of step {step}")
    on_disk = saved_states(last.trainer.checkpointer.directory)
    assert STEPS in on_disk, "the final state was not saved: saves stopped after a failure"
    for step, state in on_disk.items():
        assert_same_arrays(state, failure_free.states[step], f"the checkpoint of step {step}")
    # exactly-once data, over every worker
    merged = cell.merged_report()
    assert merged["samples"]["duplicated"] == 0 and merged["samples"]["skipped"] == 0, merged["samples"]
    assert cell.rerun or merged["data_position"] == STEPS * BATCH
    # the same parameters as the failure-free run
    assert_same_arrays(trained(named_arrays(finished.state)), failure_free.params, "the final state")
    # nothing left behind
    assert cell.orphans == []
    failures = merged["failures"]
    return {
        "outcome": outcome_words(cell),
        "exit": " → ".join(str(w.exit_code) for w in cell.workers),
        "failures": ", ".join(f"{f['phase']} {f['slices']}" for f in failures) or "none struck",
        "restored_from": ", ".join(f["restored_from"] for f in failures) or "-",
        "lost_steps": sum(f["lost_steps"] for f in failures),
        "checkpoint_restores": ", ".join(str(step) for step, source in restored if source == "checkpoint") or "-",
        "on_disk": ", ".join(map(str, sorted(on_disk))),
        "samples": f"{merged['samples']['duplicated']} / {merged['samples']['skipped']}",
    }


def outcome_words(cell: Cell) -> str:
    last = cell.workers[-1]
    restarts = len(cell.workers) - 1
    if last.stopped is None:
        return f"finished {STEPS}/{STEPS}" + (f" after {restarts} worker restart(s)" if restarts else "")
    resumed = cell.rerun.report["resumed_from"]
    rerun = "from scratch" if resumed is None else f"with checkpoint.resume=true from step {resumed}"
    return f"stopped at step {last.report['steps_completed']}: “{last.stopped}” A re-run finished {rerun}"


# ------------------------------------------------------------------ the matrix


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_cell(tiny_trainer_kwargs, failure_free, tmp_path, strategy, phase):
    schedule = [dict(failure, down_for_s=DOWN_FOR_S[strategy]) for failure in PHASES[phase][1]]
    resume = phase == "checkpoint_restore"
    if resume:
        interrupted_run(failure_free, tmp_path / "checkpoints", at_step=2)
    cell = run_schedule(tiny_trainer_kwargs, tmp_path, new_strategy=STRATEGIES[strategy], schedule=schedule, resume=resume)
    assert (cell.workers[-1].exit_code == EXIT_TRAINING_STOPPED) == ((strategy, phase) in STOPS)
    struck = {(f["phase"], tuple(f["slices"])) for f in cell.merged_report()["failures"]}
    assert struck, "the schedule injected no failure"
    ROWS[(strategy, phase, "in-process")] = check_invariants(cell, failure_free)


# ------------------------------------------------------------------ cells through the command line

CLI_STEPS, CLI_PERIOD, CLI_BATCH = 12, 3, 48
CLI_TINY = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "data.max_bytes=200000",
            f"trainer.steps={CLI_STEPS}", f"checkpoint.period={CLI_PERIOD}", "checkpoint.max_to_keep=10"]


def processes(n: int) -> list[str]:
    """``cluster=multiprocess`` with ``n`` processes of 2 devices, a slice each, failures found within seconds."""
    return ["cluster=multiprocess", f"cluster.num_processes={n}", "cluster.heartbeat_timeout_s=3",
            "cluster.collective_timeout_s=6"]


CLI_CELLS = {  # (strategy, phase, run): (what fails, the cluster's overrides, the chaos schedule, expected)
    # expected: (workers, the checkpoint steps restored, one per restart). Every failure comes at least two steps
    # after a save, so that the asynchronous commit of that save has ended and the rows do not depend on timing.
    ("full_restart", "train_step", "CLI"): (
        "slice 1 lost during step 8", [], "[{at_step: 7, slice: 1}]", (2, [6])),
    ("pause_resume", "train_step", "multiprocess"): (  # synchronous saves: process 0 commits them, and an
        # asynchronous commit still running when it is killed (a loaded machine) would leave no step to restore
        "process 0 of 2 killed during step 6 (synchronous saves)", [*processes(2), "checkpoint.async_save=false"],
        "[{at_step: 5, slice: 0}]", (2, [3])),
    ("scale_down", "two_slices", "multiprocess"): (  # synchronous saves, as above: step 6's commit is process 0's
        "processes 0 and 2 of 3 killed during step 9 (synchronous saves)",
        [*processes(3), "checkpoint.async_save=false"], "[{at_step: 8, slice: 0}, {at_step: 8, slice: 2}]", (1, [])),
    ("full_restart", "checkpoint_save", "multiprocess"): (
        "process 1 of 2 killed while step 6 is saved", processes(2), "[{at_step: 6, slice: 1, phase: checkpoint_save}]",
        (2, [3])),
}
"""The cells run through ``python -m elastic_trainer``: with the full_restart supervisor and its worker
processes (*CLI*), or with ``cluster=multiprocess``, whose launcher runs one JAX process per slice and
kills the lost ones, process 0 among them (the launcher hosts JAX's coordination service)."""

_cli_references: dict[str, Path] = {}


def cli_reference(cluster: list[str], tmp_path_factory) -> Path:
    """The checkpoints of the same run without failures, trained in this process on a simulated cluster of
    as many slices and devices (once per cluster); its compiles go into the session's compilation cache."""
    slices = next((int(o.split("=")[1]) for o in cluster if o.startswith("cluster.num_processes=")), 4)
    if slices not in _cli_references:
        directory = tmp_path_factory.mktemp(f"failure_free_{slices}_slices") / "checkpoints"
        trainer = build_trainer(compose_config(*CLI_TINY, f"cluster.slices={slices}", f"checkpoint.dir={directory}"))
        trainer.fit()
        trainer.checkpointer.close()
        _cli_references[slices] = directory
    return _cli_references[slices]


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names ``run_dir``: workers, launchers and supervisors of that run."""
    return [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.parametrize("cell", list(CLI_CELLS), ids="-".join)
def test_cell_through_the_command_line(tmp_path, tmp_path_factory, cell):
    strategy, phase, _ = cell
    _, cluster, schedule, (workers, restored) = CLI_CELLS[cell]
    reference, run_dir = cli_reference(cluster, tmp_path_factory), tmp_path / "run"
    result = run_cli(*CLI_TINY, *cluster, f"+strategy={strategy}", "+chaos=schedule", f"chaos.failures={schedule}",
                     f"hydra.run.dir={run_dir}")
    leftover = processes_of(run_dir)
    for process in leftover:
        process.kill()

    # finishes, and nothing is left behind
    assert result.returncode == 0, result.stderr
    assert leftover == [], "processes outlived the command"
    report = report_of(run_dir)
    assert report["steps_completed"] == CLI_STEPS and report["stopped"] is None
    assert report.get("workers", 1) == workers
    failures = [failure for failure in report["failures"] if failure["slices"]]  # not a retried timeout
    assert {failure["phase"] for failure in failures} == {PHASES[phase][1][0]["phase"]}
    # exactly-once data over every worker
    assert report["samples"] == {"consumed": CLI_STEPS * CLI_BATCH, "duplicated": 0, "skipped": 0}
    assert report["data_position"] == CLI_STEPS * CLI_BATCH
    # every checkpoint holds the failure-free state of its step, the final one included
    on_disk, expected = saved_states(run_dir / "checkpoints"), saved_states(reference)
    assert CLI_STEPS in on_disk, "the final state was not saved"
    for step in on_disk:
        assert_same_arrays(on_disk[step], expected[step], f"the checkpoint of step {step}")
    # a checkpoint is restored only after its save completed, in an earlier worker
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    saves = [(e["worker"], e["step"]) for e in events if e["event"] == "checkpoint_save"]
    restores = [(e["worker"], e["step"]) for e in events if e["event"] == "restore" and e["source"] == "checkpoint"]
    assert [step for _, step in restores] == restored
    for worker, step in restores:
        assert any(w < worker and s == step for w, s in saves), f"worker {worker} restored step {step}, never saved"
    exits = "(the command)"
    if "process_exits" in report:  # multiprocess: a lost process is killed, the others end or ask for a restart
        codes = [attempt["exit_codes"] for attempt in report["process_exits"]]
        assert all(set(attempt) <= {RESTART_EXIT_CODE, -signal.SIGKILL} for attempt in codes[:-1]), codes
        assert set(codes[-1]) <= {0, -signal.SIGKILL} and 0 in codes[-1], codes
        exits = "(the command); processes: " + " → ".join(", ".join(map(str, attempt)) for attempt in codes)
    ROWS[cell] = {
        "what": CLI_CELLS[cell][0],
        "outcome": f"finished {CLI_STEPS}/{CLI_STEPS}"
                   + (f" after {report['workers'] - 1} restart(s), in new processes" if report["workers"] > 1 else ""),
        "exit": f"{result.returncode} {exits}",
        "failures": ", ".join(f"{f['phase']} {f['slices']}" for f in failures),
        "restored_from": ", ".join(f["restored_from"] for f in failures),
        "lost_steps": sum(f["lost_steps"] for f in failures),
        "checkpoint_restores": ", ".join(str(step) for _, step in restores) or "-",
        "on_disk": ", ".join(map(str, sorted(on_disk))),
        "samples": f"{report['samples']['duplicated']} / {report['samples']['skipped']}",
    }


# ------------------------------------------------------------------ the generated table


def render_table(rows: dict) -> str:
    header = [
        "# The fault matrix",
        "",
        "Generated by `tests/test_fault_matrix.py` (`ELASTIC_TRAINER_WRITE_FAULT_MATRIX=1 python -m pytest "
        "tests/test_fault_matrix.py`); CI checks that this file is what the tests generate. Do not edit it by hand.",
        "",
        f"Every cell trains the tiny test model for {STEPS} steps on 4 simulated slices of 2 CPU devices, global "
        f"batch {BATCH}, checkpoints every {PERIOD} steps, no host snapshots, and compares with one failure-free run. "
        f"Lost slices stay down for good, except under pause_resume, where they return after {BACK_SOON} s. "
        "Every row passed every invariant:",
        "",
        "- the run finishes, or stops with one clear sentence and exit status 3, after which a re-run with "
        "`checkpoint.resume=true` finishes from the checkpoints it left;",
        "- no partial checkpoint is ever restored: each checkpoint restore read a step whose save completed and "
        "got exactly the failure-free state of that step, and every checkpoint left on disk holds it;",
        "- `samples.duplicated` = 0 and `samples.skipped` = 0 over all workers;",
        "- the final parameters and optimizer state equal the failure-free run's (rtol 1e-5): every strategy here "
        "keeps the global batch;",
        "- no process is left behind.",
        "",
        "How a cell runs: *in-process* is a `Trainer` with the strategy and chaos plugins; a `full_restart` "
        "worker restart is done there as the supervisor does it: the trainer raises `RestartRequested` (exit 75) "
        "and a new `Trainer` resumes from the checkpoint. *CLI* runs `python -m elastic_trainer "
        "+strategy=full_restart` with the real supervisor and worker processes. *multiprocess* runs "
        "`python -m elastic_trainer cluster=multiprocess`: one JAX process per slice (2 CPU devices each, "
        "gloo collectives), a lost slice's process really killed (SIGKILL), process 0 included: the launcher "
        "hosts JAX's coordination service. All-slices cells run in-process only. The command-line cells train a "
        f"larger tiny model for {CLI_STEPS} steps, global batch {CLI_BATCH}, checkpoints every {CLI_PERIOD}, and "
        "are compared with the checkpoints of the same run without failures on as many simulated slices.",
        "",
        "| strategy | phase | what fails | run | outcome | exit | failures (phase [slices]) | restored from | "
        "lost steps | checkpoint restores | checkpoints on disk | duplicated / skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = []
    for strategy in STRATEGIES:
        for phase, (what, _) in PHASES.items():
            for how in ("in-process", "CLI", "multiprocess"):
                row = rows.get((strategy, phase, how))
                if row is not None:
                    lines.append(
                        f"| {strategy} | {phase} | {row.get('what', what)} | {how} | {row['outcome']} | {row['exit']} | "
                        f"{row['failures']} | {row['restored_from']} | {row['lost_steps']} | "
                        f"{row['checkpoint_restores']} | {row['on_disk']} | {row['samples']} |"
                    )
    return "\n".join(header + lines) + "\n"


def test_the_committed_table_is_the_generated_one():
    cells = {(s, p, "in-process") for s in STRATEGIES for p in PHASES} | set(CLI_CELLS)
    if set(ROWS) != cells:
        pytest.skip(f"{len(cells - set(ROWS))} cell(s) did not run or failed; the table is checked when all pass")
    table = render_table(ROWS)
    if os.environ.get(WRITE_TABLE_ENV):
        TABLE.write_text(table)
    assert TABLE.read_text() == table, (
        f"docs/fault_matrix.md is not what the tests generate; regenerate it with {WRITE_TABLE_ENV}=1 "
        "python -m pytest tests/test_fault_matrix.py"
    )
