"""Device memory: what the trainer's step needs per device, against the same step jitted with ``donate_argnums=0``.

For each case (the default model, and ``model.d_model=512 model.num_layers=4``;
``trainer.within_slice=replicated`` and ``sharded``) the default job is built
from the Hydra config and trained for one step; then every compiled executable
that step ran is asked for XLA's own accounting (``compiled.memory_analysis()``,
per device: arguments + outputs - aliased + temporaries): its gradients program
(which takes the whole state, so the optimizer state it does not read counts
too) and the update program of each half of the slices. The trainer's peak is
the largest of its executables (what lives between them is an output of one
and an argument of the next, so it is counted). The baseline is the same pure
step (``make_step_fn``) over the same mesh and shardings, jitted with the state
donated, as a hand-written loop would. Prints one line per case and, last, the
worst ratio: ``memory_ratio=1.02``.

    python benchmarks/memory.py [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402

from elastic_trainer._mesh import batch_sharding, replicated  # noqa: E402
from elastic_trainer._step import make_step_fn  # noqa: E402
from elastic_trainer.config._build import build_trainer  # noqa: E402
from elastic_trainer.config._schemas import register_configs  # noqa: E402
from elastic_trainer.launch._cli import CONFIG_MODULE  # noqa: E402

MODELS = {"default": [], "d512_l4": ["model.d_model=512", "model.num_layers=4"]}
WITHIN_SLICE = ("replicated", "sharded")


def peak_bytes(compiled) -> int:
    """Per-device peak of one executable, as XLA accounts it."""
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)


def trained_one_step(overrides: list[str]):
    """The trainer of the default job with ``overrides``, after one step."""
    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            cfg = compose("config", overrides=[*overrides, "trainer.steps=1", "optimizer.learning_rate.warmup_steps=0",
                                              "checkpoint.enabled=false"])
        trainer = build_trainer(cfg, run_dir=run_dir)
        trainer.fit()
    return trainer


def donating_baseline(trainer) -> int:
    """Peak bytes of the same step over the same mesh and shardings, jitted with ``donate_argnums=0``."""
    ctx, layout = trainer._ctx, trainer._ctx.layouts.current
    step_fn = make_step_fn(trainer.loss_fn, trainer.optimizer, ctx.static, ctx.abstract)
    sample = trainer.data.get_batch(jnp.zeros(1, dtype=jnp.int32))
    batch = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((layout.batch_size, *leaf.shape[1:]), leaf.dtype), sample)
    jitted = jax.jit(
        step_fn, donate_argnums=0,
        in_shardings=(layout.shardings, batch_sharding(layout.mesh), replicated(layout.mesh)),
        out_shardings=(layout.shardings, replicated(layout.mesh)),
    )
    return peak_bytes(jitted.lower(ctx.abstract, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile())


def executables(compiled) -> tuple:
    """Every compiled executable one step of the layout runs."""
    return tuple(getattr(compiled, "executables", (compiled,)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every case")
    args = parser.parse_args()
    register_configs()
    ratios = []
    for name, model in MODELS.items():
        for within_slice in WITHIN_SLICE:
            trainer = trained_one_step([*args.overrides, *model, f"trainer.within_slice={within_slice}"])
            peaks = [peak_bytes(c) for c in executables(trainer._ctx.layouts.current.compiled)]
            baseline = donating_baseline(trainer)
            ratios.append(max(peaks) / baseline)
            print(f"{name} {within_slice}: trainer {max(peaks) / 1e6:.1f} MB per device "
                  f"(executables {', '.join(f'{p / 1e6:.1f}' for p in peaks)} MB), "
                  f"donating loop {baseline / 1e6:.1f} MB, ratio {ratios[-1]:.3f}", flush=True)
    print(f"memory_ratio={max(ratios):.3f}")


if __name__ == "__main__":
    main()
