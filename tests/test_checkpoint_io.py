"""A checkpoint directory on a real, small filesystem that fills up: failed saves are reported, not slice losses."""

import asyncio
import errno
import os
import subprocess
import sys
import threading
import time

import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.serialization import jax_array_handlers
from test_cli import TINY_MODEL

import elastic_trainer as et
from elastic_trainer._private_apis import end_background_writes
from elastic_trainer.checkpoints import _failed_writes


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 3 MB mounted at ``tmp_path / "disk"`` (a real filesystem that runs out of space), unmounted after."""
    disk = tmp_path / "disk"
    yield mount_tmpfs(disk, "3m")
    subprocess.run(["umount", str(disk)], check=True)


def mount_tmpfs(directory, size):
    """Mount a tmpfs of ``size`` at ``directory``; skip the test where this process may not mount one."""
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"a small real filesystem needs mount (root): {mounted.stderr.strip()}")
    return directory


def fill(disk):
    """Write a file until the filesystem is full (a real ENOSPC)."""
    with open(disk / "filler", "wb", buffering=0) as filler:
        with pytest.raises(OSError) as full:
            while True:
                filler.write(b"\0" * 65536)
    assert full.value.errno == errno.ENOSPC


class DiskSpace:
    """Fills the disk after step ``fill_after`` (once the save in flight committed) and frees it after ``free_after``
    (once the save in flight ended)."""

    def __init__(self, disk, *, fill_after, free_after=None):
        self.disk, self.fill_after, self.free_after = disk, fill_after, free_after

    @et.hookimpl
    def et_step_end(self, trainer, step):
        if step == self.fill_after:
            trainer.checkpointer.manager.wait_until_finished()
            fill(self.disk)
        if step == self.free_after:
            # the save in flight must meet the full disk: on busy cores its background writes can start later
            # than this step's end. Orbax's manager can end a save whose step metadata failed to write while
            # that save's own thread still writes its arrays (end_background_writes says more): wait for both,
            # so that no write of the failed save lands on the freed disk (seen 3 times in about 70 runs, on
            # 2026-12-06: the save of step 6 reported failed, then committed; the order was not forced here)
            while trainer.checkpointer.manager.is_saving_in_progress():
                time.sleep(0.01)
            end_background_writes(trainer.checkpointer.manager)
            (self.disk / "filler").unlink()


def on_disk(directory):
    """The checkpoints and Orbax's temporary folders in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if p.name[0].isdigit())


def test_saves_that_fail_for_a_full_disk_are_reported_and_training_goes_on(tiny_trainer_kwargs, small_disk):
    checkpoints = small_disk / "checkpoints"
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=10, checkpointer=et.Checkpointer(checkpoints, period=2, max_to_keep=10),
        plugins=[DiskSpace(small_disk, fill_after=3, free_after=7)],
    ))
    with pytest.warns(et.CheckpointWarning) as warned:
        state, report = trainer.fit()
    assert int(state.step) == 10 and report["stopped"] is None
    assert [(f["step"], f["cause"]) for f in report["checkpoint_failures"]] == [
        (4, "ENOSPC: No space left on device"), (6, "ENOSPC: No space left on device")]
    messages = [str(w.message) for w in warned]
    assert len(messages) == 2 and all("failed (ENOSPC: No space left on device); training goes on" in m
                                      for m in messages)
    assert "save of step 4" in messages[0] and "save of step 6" in messages[1]  # not the step in flight
    assert on_disk(checkpoints) == ["10", "2", "8"]  # space returned at step 7; no failed save's folder is left
    assert et.Checkpointer(checkpoints).steps_newest_first() == [10, 8, 2]
    restored = et.Trainer(**tiny_trainer_kwargs(steps=10, checkpointer=et.Checkpointer(checkpoints), resume=True))
    assert restored.fit().report["resumed_from"] == 10


def test_max_failed_saves_in_a_row_stop_the_run_naming_the_step_and_cause(tiny_trainer_kwargs, small_disk):
    checkpoints = small_disk / "checkpoints"
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=12, checkpointer=et.Checkpointer(checkpoints, period=2, max_to_keep=10, max_failed_saves=2),
        plugins=[DiskSpace(small_disk, fill_after=3)],
    ))
    with pytest.warns(et.CheckpointWarning, match="save of step 4 failed"):
        with pytest.raises(et.TrainingStopped) as stopped:
            trainer.fit()
    assert str(stopped.value) == (
        "the checkpoint save of step 6 failed (ENOSPC: No space left on device), 2 failed saves in a row "
        "(checkpoint.max_failed_saves=2); the newest checkpoint, step 2, is intact; free space in "
        f"{checkpoints} or fix its storage, then continue with checkpoint.resume=true."
    )
    report = stopped.value.report
    # step 6's save fails at once (found then) or in the background (found when step 8 is due, which is not started)
    assert report["steps_completed"] in (6, 8)
    assert [f["step"] for f in report["checkpoint_failures"]] == [4, 6]
    assert on_disk(checkpoints) == ["2"]  # every write of the failed saves ended before their folders went
    assert et.Checkpointer(checkpoints).steps_newest_first() == [2]


def test_every_write_of_a_failed_save_has_ended_when_a_stopped_run_returns(tiny_trainer_kwargs, small_disk,
                                                                         monkeypatch):
    # Orbax waits for a save's writes one after the other and stops at the first that fails; here the sharding
    # file's write of each failed save goes on only once Orbax reported the failure, and then only after the run
    # returned (or 1 s). Were the other writes not waited for, it would end after the run had returned (a clean
    # clone's unmount of this disk once failed, "target is busy"), re-creating the failed save's folder.
    failure_reported, returned, late_writes = threading.Event(), threading.Event(), []
    write_shardings = jax_array_handlers._async_serialize_shardings
    wait_for_writes = ocp.CheckpointManager.wait_until_finished

    def reporting_failure(manager):
        try:
            wait_for_writes(manager)
        except Exception:
            failure_reported.set()
            raise

    async def after_the_failure(*args, **kwargs):
        if not (small_disk / "filler").exists():
            return await write_shardings(*args, **kwargs)  # a save before the disk is full
        await asyncio.to_thread(failure_reported.wait, 10)
        await asyncio.to_thread(returned.wait, 1)
        try:
            await write_shardings(*args, **kwargs)
        finally:
            late_writes.append("ended after the run returned" if returned.is_set() else "ended before")

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", reporting_failure)
    monkeypatch.setattr(jax_array_handlers, "_async_serialize_shardings", after_the_failure)
    checkpoints = small_disk / "checkpoints"
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=12, checkpointer=et.Checkpointer(checkpoints, period=2, max_to_keep=10, max_failed_saves=2),
        plugins=[DiskSpace(small_disk, fill_after=3)],
    ))
    with pytest.warns(et.CheckpointWarning), pytest.raises(et.TrainingStopped):
        trainer.fit()
    ended_by_then = list(late_writes)
    returned.set()
    assert failure_reported.is_set() and ended_by_then and set(ended_by_then) == {"ended before"}
    assert on_disk(checkpoints) == ["2"]


def test_a_failed_saves_background_writes_end_before_the_next_save(tiny_trainer_kwargs, small_disk, monkeypatch):
    # Orbax's wait raises at a save's failed step metadata while the save's own thread still writes; here its JSON
    # write waits (1 s at most) for the failed save's folder to be removed. Were that thread not joined first, the
    # next save would raise the thread's error as its own before writing anything (seen once in a clean-clone CI
    # run, with ENOENT from a write into the removed folder): step 6's save would never be tried.
    removed, json_writes = threading.Event(), []
    remove_temporary, write_json = _failed_writes.remove_temporary, ocp.JsonCheckpointHandler._save_fn

    def noting_removal(directory, steps):
        remove_temporary(directory, steps)
        removed.set()

    async def after_removal(handler, item, directory):
        json_writes.append(ocp.path.step.step_from_checkpoint_name(directory.parent.name))
        removed.wait(timeout=1)
        await write_json(handler, item, directory)

    monkeypatch.setattr(_failed_writes, "remove_temporary", noting_removal)
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", after_removal)
    checkpoints = small_disk / "checkpoints"
    trainer = et.Trainer(**tiny_trainer_kwargs(
        steps=6, checkpointer=et.Checkpointer(checkpoints, period=2, max_to_keep=10),
        plugins=[DiskSpace(small_disk, fill_after=3)],
    ))
    with pytest.warns(et.CheckpointWarning):
        report = trainer.fit().report
    assert json_writes == [2, 4, 6]
    assert [(f["step"], f["cause"]) for f in report["checkpoint_failures"]] == [
        (4, "ENOSPC: No space left on device"), (6, "ENOSPC: No space left on device")]


def test_the_command_line_stops_with_one_sentence_and_no_traceback_when_the_disk_stays_full(tmp_path):
    disk = mount_tmpfs(tmp_path / "disk", "700k")  # room for one checkpoint of this model (about 450 kB), not two
    try:
        result = subprocess.run(
            [sys.executable, "-m", "elastic_trainer", *TINY_MODEL, "trainer.steps=12", "checkpoint.period=2",
             "checkpoint.max_failed_saves=2", f"checkpoint.dir={disk}", f"hydra.run.dir={tmp_path / 'run'}"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )
        assert on_disk(disk) == ["2"]
        assert et.Checkpointer(disk).steps_newest_first() == [2]
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert "the checkpoint save of step 4 failed (ENOSPC: No space left on device); training goes on" in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "elastic_trainer: training stopped: the checkpoint save of step 6 failed (ENOSPC: No space left on device)")
    log = next((tmp_path / "run").glob("*.log")).read_text()
    assert "Traceback" in log and "No space left on device" in log  # Orbax's own report, in the run's log file


@pytest.mark.parametrize("bad", [0, 1.5])
def test_max_failed_saves_must_be_a_whole_number_of_at_least_one(tmp_path, bad):
    with pytest.raises(et.ConfigError, match=rf"^checkpoint.max_failed_saves must be a whole number of saves, "
                                             rf"at least 1 \(1: stop at the first save that fails for I/O\), got {bad}.$"):
        et.Checkpointer(tmp_path, max_failed_saves=bad)
