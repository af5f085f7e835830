"""A loss that returns ``(loss, aux)`` (``has_aux=True``): the aux scalars reach the progress line, the report's
history and TensorBoard; a loss whose output does not match ``has_aux`` is one sentence, before anything compiles."""

import io
import json
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_cli import TINY_MODEL, run_cli
from test_trainer import Regression, mse

import elastic_trainer as et
from elastic_trainer_plugins.metrics import TensorBoard
from elastic_trainer_plugins.progress import ProgressPlugin

STEPS = 12


def mse_with_error(model, batch, *, key):
    """The mean squared error, and the mean absolute error as an aux scalar."""
    errors = jax.vmap(model)(batch[:, :4])[:, 0] - batch[:, 4]
    return jnp.mean(errors**2), {"mae": jnp.mean(jnp.abs(errors))}


def next_token_with_accuracy(model, batch, *, key):
    """The default job's loss, and how often the most likely next token is the right one (from the command line:
    ``loss._target_=test_aux.next_token_with_accuracy loss.has_aux=true``)."""
    logits = jax.vmap(model.__call__)(batch[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch[:, 1:])}


def regression_trainer(loss_fn, *, has_aux, **kwargs):
    return et.Trainer(model=eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(1)), loss_fn=loss_fn,
                      optimizer=optax.sgd(0.05), data=Regression(), steps=STEPS, global_batch_size=32,
                      cluster=et.SimulatedCluster(slices=2, devices_per_slice=2), has_aux=has_aux, **kwargs)


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_aux_scalars_reach_the_progress_line_the_report_history_and_tensorboard(tmp_path):
    out = io.StringIO()
    progress = ProgressPlugin(Console(file=out, force_terminal=False, width=200), lines=STEPS)
    trainer = regression_trainer(mse_with_error, has_aux=True, run_dir=tmp_path,
                                 plugins=[progress, TensorBoard()])
    _, report = trainer.fit()

    history = report.history
    assert history.step == tuple(range(1, STEPS + 1))
    assert list(history.metrics) == ["loss", "mae"]
    assert history.metrics["loss"][0] == report.loss_first and history.metrics["loss"][-1] == report.final_loss
    assert all(mae > 0 for mae in history.metrics["mae"])
    assert history.metrics["mae"][-1] < history.metrics["mae"][0]  # it trains
    written = json.loads((tmp_path / "report.json").read_text())["history"]
    assert written == {"step": list(history.step), "loss": list(history.metrics["loss"]),
                       "mae": list(history.metrics["mae"])}

    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS
    assert lines[-1].split()[:6] == ["step", f"{STEPS}/{STEPS}", "loss", f"{report.final_loss:.4f}", "mae",
                                     f"{history.metrics['mae'][-1]:.4f}"]

    board = scalars(tmp_path / "tensorboard")
    assert [step for step, _ in board["train/mae"]] == list(history.step)
    assert [value for _, value in board["train/mae"]] == pytest.approx(history.metrics["mae"], rel=1e-6)


def test_a_loss_without_aux_has_a_history_of_its_loss_alone():
    _, report = regression_trainer(mse, has_aux=False).fit()
    assert list(report.history.metrics) == ["loss"]
    assert len(report.history.step) == STEPS


@pytest.mark.parametrize(("loss_fn", "has_aux", "message"), [
    (mse_with_error, False,
     r"^the loss returns a tuple of 2, not a scalar; if it returns \(loss, aux\), pass Trainer\(\.\.\., has_aux=True\) "
     r"\(loss\.has_aux=true on the command line\), else return the loss alone\.$"),
    (mse, True, r"^has_aux is set but the loss returns an array of shape \(\), not \(loss, aux\)"),
    (lambda model, batch, *, key: (mse(model, batch, key=key), {"errors": batch[:, 4]}), True,
     r"^the loss's aux 'errors' is an array of shape \(32,\); aux must map names \(other than loss and step\) to "
     r"scalars"),
    (lambda model, batch, *, key: (mse(model, batch, key=key), {"loss": 1.0}), True, r"aux 'loss' is a float"),
])
def test_a_loss_whose_output_does_not_match_has_aux_is_one_sentence_before_compiling(loss_fn, has_aux, message):
    trainer = regression_trainer(loss_fn, has_aux=has_aux)
    with pytest.raises(et.ConfigError, match=message):
        trainer.fit()


TINY = [*TINY_MODEL, f"trainer.steps={STEPS}"]


@pytest.fixture
def losses_importable(monkeypatch):
    """A command run from the test imports this file's losses."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def test_has_aux_from_the_command_line_reaches_the_report_and_the_progress_lines(tmp_path, losses_importable):
    result = run_cli(*TINY, "loss._target_=test_aux.next_token_with_accuracy", "loss.has_aux=true",
                     f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    history = json.loads((tmp_path / "report.json").read_text())["history"]
    assert history["step"] == list(range(1, STEPS + 1))
    assert len(history["accuracy"]) == STEPS and all(0 <= a <= 1 for a in history["accuracy"])
    assert any(line.startswith("step ") and " accuracy " in line for line in result.stdout.splitlines())


def test_a_tuple_loss_without_has_aux_on_the_command_line_exits_2_with_the_fix(tmp_path, losses_importable):
    result = run_cli(*TINY, "loss._target_=test_aux.next_token_with_accuracy", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert "loss.has_aux=true on the command line" in result.stderr
    assert "Traceback" not in result.stderr
