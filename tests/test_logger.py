"""+logger=tensorboard: the run's scalars in a TensorBoard event file, read back with TensorBoard's own reader."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_cli import run_cli
from test_cli_recovery import TINY, failure_at

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer_plugins.metrics import TensorBoard


def scalars(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_event_file_holds_loss_throughput_slices_goodput_and_each_recovery(tmp_path):
    result = run_cli(*TINY, "+logger=tensorboard", "+strategy=scale_down", *failure_at(8, 1),
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    written = scalars(tmp_path / "tensorboard")
    assert [step for step, _ in written["train/loss"]] == list(range(1, 21))
    assert written["train/loss"][-1][1] == pytest.approx(report["final_loss"], rel=1e-6)
    assert dict(written["train/slices"])[8] == 4 and dict(written["train/slices"])[9] == 3  # slice 1 lost in step 9
    assert all(value > 0 for _, value in written["train/samples_per_s"])
    assert written["run/goodput"] == [(20, pytest.approx(report["goodput"], rel=1e-6))]
    (failure,) = report["failures"]
    assert written["failures/recovery_s"] == [(8, pytest.approx(failure["recovery_s"], rel=1e-6))]
    assert written["failures/lost_steps"] == [(8, 0)]
    assert set(written) >= {f"badput/{category}_s" for category in etp.BADPUT_CATEGORIES}


def test_a_bad_period_is_one_sentence():
    with pytest.raises(et.ConfigError, match=r"^logger.every must be at least 1, got 0.$"):
        TensorBoard(every=0)
