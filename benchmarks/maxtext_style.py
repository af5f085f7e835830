"""A MaxText-style elastic loop over the default job's model: what ``recovery.py`` compares scale_down with.

The loop is what a MaxText user runs: the step jitted with the state donated,
an asynchronous Orbax checkpoint every ``--checkpoint-period`` steps, and
``et.elastic_retry`` around it (the shape of pathwaysutils' ``elastic_retry``,
which MaxText uses). After a slice is lost the loop is called again on the
healthy slices: it restores the newest checkpoint onto the new mesh, compiles
the step for that mesh (through JAX's persistent compilation cache when the
job's config turns it on, as MaxText's ``jax_cache_dir`` does) and trains on
from the checkpoint's step. The model, data, optimizer, seed and global batch
are the default job's (``python -m elastic_trainer``). Writes report.json
(``elastic_retry``'s: the failure and its ``recovery_s``) and
maxtext_style.json: the step each attempt started from, and each step's start
and end (``time.time()``).

    python benchmarks/maxtext_style.py RUN_DIR --fail-at 50 [--steps 160] [--down-for-s 5] [--checkpoint-period 10] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import elastic_trainer as et  # noqa: E402
import elastic_trainer.plugin as etp  # noqa: E402
from elastic_trainer._step import make_step_fn  # noqa: E402
from elastic_trainer.config._build import build_trainer  # noqa: E402
from elastic_trainer.config._schemas import register_configs  # noqa: E402
from elastic_trainer.launch._cli import CONFIG_MODULE  # noqa: E402
from elastic_trainer.chaos import Chaos  # noqa: E402
from elastic_trainer.strategies import ScaleDown  # noqa: E402


def default_job(steps: int, overrides: list[str]) -> et.Trainer:
    """The default job's trainer with ``overrides``, for its model, loss, optimizer, data, seed and batch (it is
    not run)."""
    register_configs()
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        cfg = compose("config", overrides=[*overrides, f"trainer.steps={steps}", "checkpoint.enabled=false"])
    return build_trainer(cfg)  # its cluster configures JAX, and the compilation cache as the config says


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--fail-at", type=int, required=True, help="slice 1 is lost during this step")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--down-for-s", type=float, default=5.0)
    parser.add_argument("--checkpoint-period", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the default job (model.d_model=512, ...)")
    args = parser.parse_intermixed_args()
    job = default_job(args.steps, args.overrides)
    log: dict[str, list] = {"started_from": [], "steps": []}
    options = ocp.CheckpointManagerOptions(save_interval_steps=args.checkpoint_period, enable_async_checkpointing=True)
    failure = {"at_step": args.fail_at, "slice": 1, "down_for_s": args.down_for_s}

    @et.elastic_retry(cluster=job.cluster, strategy=ScaleDown(), plugins=[Chaos(failures=[failure])],
                      run_dir=args.run_dir)
    def train(run: et.ElasticRun) -> None:
        state = etp.init_train_state(job.model, job.optimizer, key=jax.random.fold_in(jax.random.key(job.seed), 1))
        arrays, static = eqx.partition(state, eqx.is_array)
        replicated = NamedSharding(run.mesh, PartitionSpec())
        batch_sharding = NamedSharding(run.mesh, PartitionSpec(("slice", "device")))
        step = jax.jit(make_step_fn(job.loss_fn, job.optimizer, static, arrays), donate_argnums=0,
                       out_shardings=(replicated, replicated))
        with ocp.CheckpointManager((args.run_dir / "checkpoints").absolute(), options=options) as checkpoints:
            if checkpoints.latest_step() is None:
                arrays = jax.device_put(arrays, replicated)
            else:  # a new attempt: the newest checkpoint onto the new mesh
                target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), arrays)
                arrays = checkpoints.restore(checkpoints.latest_step(), args=ocp.args.StandardRestore(target))
            start = int(arrays.step)
            log["started_from"].append(start)
            for s in run.steps(start, args.steps):
                began = time.time()
                ids = et.sample_ids(job.data.num_samples, seed=job.seed, start=s * job.global_batch_size,
                                    count=job.global_batch_size)
                arrays, _ = step(arrays, jax.device_put(job.data.get_batch(ids), batch_sharding), np.float32(1.0))
                jax.block_until_ready(arrays)
                log["steps"].append([s, began, time.time()])
                checkpoints.save(s + 1, args=ocp.args.StandardSave(arrays))  # every checkpoint_period steps

    train()
    (args.run_dir / "maxtext_style.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
