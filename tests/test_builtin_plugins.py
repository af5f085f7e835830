import io

import jax
from rich.console import Console

import elastic_trainer as et
from elastic_trainer_plugins import failures
from elastic_trainer_plugins.progress import ProgressPlugin


def test_slice_loss_codes_are_elastic_and_everything_else_fatal():
    lost = failures.et_classify_failure(error=jax.errors.JaxRuntimeError("DATA_LOSS: slice gone"), step=3, phase="train_step")
    assert (lost.elastic, lost.kind, lost.step) == (True, "slice_lost", 3)
    fatal = failures.et_classify_failure(error=ZeroDivisionError("oops"), step=3, phase="train_step")
    assert (fatal.elastic, fatal.kind) == (False, "fatal")


def test_progress_bar_on_a_terminal_shows_step_loss_and_throughput(tiny_trainer_kwargs):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    manager = et.make_plugin_manager(load_entry_points=False)
    manager.unregister(name="elastic_trainer_plugins.progress:ProgressPlugin")
    manager.register(ProgressPlugin(console, refresh_s=0.0))
    et.Trainer(**tiny_trainer_kwargs(steps=3, plugin_manager=manager)).fit()
    text = out.getvalue()
    assert "3/3" in text and "loss 2." in text and "samples/s" in text
