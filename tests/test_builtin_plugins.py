import io
import types

import jax
from rich.console import Console

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer_plugins import failures
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.progress import ProgressPlugin


def test_slice_loss_codes_are_elastic_and_everything_else_fatal():
    lost = failures.et_classify_failure(error=jax.errors.JaxRuntimeError("DATA_LOSS: slice gone"), step=3, phase="train_step")
    assert (lost.elastic, lost.kind, lost.step) == (True, "slice_lost", 3)
    fatal = failures.et_classify_failure(error=ZeroDivisionError("oops"), step=3, phase="train_step")
    assert (fatal.elastic, fatal.kind) == (False, "fatal")


def test_progress_bar_on_a_terminal_shows_step_loss_and_throughput(tiny_trainer_kwargs):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    manager = etp.make_plugin_manager(load_entry_points=False)
    manager.unregister(name="elastic_trainer_plugins.progress:ProgressPlugin")
    manager.register(ProgressPlugin(console, refresh_s=0.0))
    et.Trainer(**tiny_trainer_kwargs(steps=3, plugin_manager=manager)).fit()
    text = out.getvalue()
    assert "3/3" in text and "loss 2." in text and "samples/s" in text


class RecordingCluster:
    protected_slices = ()  # as elastic_trainer.clusters.AbstractInjectableCluster declares

    def __init__(self):
        self.lost = []

    def fail_slice(self, slice_, *, down_for_s):
        self.lost.append((slice_, down_for_s))


def test_periodic_chaos_loses_one_seeded_slice_in_every_window_of_steps():
    def strikes(seed):
        trainer = types.SimpleNamespace(cluster=RecordingCluster(), slices=(0, 1, 2, 3), run_dir=None)
        chaos = Chaos(steps_per_failure=10, random_down_for_s=2.0, seed=seed)
        struck = []
        for step in range(30):
            before = len(trainer.cluster.lost)
            chaos.et_step_start(trainer=trainer, step=step)
            if len(trainer.cluster.lost) > before:
                struck.append(step)
                chaos.et_step_start(trainer=trainer, step=step)  # the step retried after recovery is spared
        return struck, trainer.cluster.lost

    steps, lost = strikes(seed=3)
    assert [step // 10 for step in steps] == [0, 1, 2]
    assert all(slice_ in (0, 1, 2, 3) and down_for_s == 2.0 for slice_, down_for_s in lost) and len(lost) == 3
    assert strikes(seed=3) == (steps, lost)
    assert strikes(seed=4)[0] != steps
