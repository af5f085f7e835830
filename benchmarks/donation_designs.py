"""Step designs that donate the train state, measured against a donating step: memory per device and steps/s.

The designs docs/architecture.md ("Donation") compares, each over the default
job's 4 x 2 mesh and shardings:

- ``as_now``: the trainer's step, nothing donated;
- ``split_whole``: a gradients program (forward, backward, the all-reduce over
  every slice; nothing donated), then one apply program over all slices (the
  optimizer update, the state donated);
- ``split_per_slice``: the same gradients, then one apply program per slice
  over that slice's shards (split from the global arrays, and joined again).

Memory is XLA's accounting per device (``memory_analysis()``: arguments +
outputs - aliased + temporaries; every phase takes the whole state, so the
state alive beside it is counted); the ratio is the worst phase over the same
step jitted with ``donate_argnums=0``, for the default model and
``model.d_model=512 model.num_layers=4``, ``trainer.within_slice=replicated``
and ``sharded``. With ``--rounds N`` it also times each design on the default
model, in turns, against the donating step (the median step interval of
``--steps`` steps per round), and checks that every design ends with the same
state.

    python benchmarks/donation_designs.py [--rounds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from memory import MODELS, WITHIN_SLICE, peak_bytes  # noqa: E402

import elastic_trainer as et  # noqa: E402
from elastic_trainer._mesh import batch_sharding, replicated, state_shardings  # noqa: E402
from elastic_trainer._step import make_step_fn  # noqa: E402
from elastic_trainer.config._schemas import register_configs  # noqa: E402
from elastic_trainer.launch._cli import CONFIG_MODULE  # noqa: E402


class Workload:
    """The default job's model, optimizer, data and batch with ``overrides``, on the 4 x 2 mesh."""

    def __init__(self, overrides: list[str], within_slice: str):
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            cfg = compose("config", overrides=overrides)
        model = instantiate(cfg.model, key=jax.random.fold_in(jax.random.key(cfg.seed), 0))
        self.optimizer, self.loss_fn, self.data = instantiate(cfg.optimizer), instantiate(cfg.loss), instantiate(cfg.data)
        self.batch_size, self.seed = cfg.trainer.global_batch_size, cfg.seed
        state = et.init_train_state(model, self.optimizer, key=jax.random.key(1))
        self.arrays, self.static = eqx.partition(state, eqx.is_array)
        self.abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.arrays)
        self.mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), (et.SLICE_AXIS, et.DEVICE_AXIS))
        self.slice_meshes = [Mesh(self.mesh.devices[i:i + 1], self.mesh.axis_names) for i in range(4)]
        self.shardings = state_shardings(self.arrays, self.mesh, within_slice=within_slice)
        sample = self.data.get_batch(np.arange(self.batch_size))
        self.batch = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), sample)

    def gradients(self, arrays, batch):
        """Forward and backward over the whole mesh: the gradients (reduced over every slice) and the loss."""
        state = eqx.combine(arrays, self.static)
        _, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        loss, grads = eqx.filter_value_and_grad(self.loss_fn)(state.params, batch, key=step_key)
        return grads, loss

    def apply(self, arrays, grads, lr_scale, batch_size):
        """The optimizer update: the state after the step (the same as ``make_step_fn``'s)."""
        state = eqx.combine(arrays, self.static)
        key, _ = jax.random.split(jax.random.wrap_key_data(state.key))
        updates, opt_state = self.optimizer.update(grads, state.opt_state, eqx.filter(state.params, eqx.is_array))
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        new = et.TrainState(params=eqx.apply_updates(state.params, updates), opt_state=opt_state, step=state.step + 1,
                            key=jax.random.key_data(key), data_position=state.data_position + batch_size)
        return eqx.filter(new, eqx.is_array)

    def compiled(self):
        """Every executable: the fused step as now and donating, the gradients, the apply over all slices and per slice."""
        mesh, shardings, scalar = self.mesh, self.shardings, jax.ShapeDtypeStruct((), jnp.float32)
        count = jax.ShapeDtypeStruct((), jnp.int32)
        step = make_step_fn(self.loss_fn, self.optimizer, self.static, self.abstract)
        fused = dict(in_shardings=(shardings, batch_sharding(mesh), replicated(mesh)),
                     out_shardings=(shardings, replicated(mesh)))
        on = lambda m, tree: jax.tree.map(lambda s: NamedSharding(m, s.spec), tree)  # noqa: E731
        apply = lambda m: jax.jit(  # noqa: E731
            self.apply, in_shardings=(on(m, shardings), on(m, shardings.params), replicated(m), replicated(m)),
            out_shardings=on(m, shardings), donate_argnums=0,
        ).lower(self.abstract, self.abstract.params, scalar, count).compile()
        return {
            "as_now": jax.jit(step, **fused).lower(self.abstract, self.batch, scalar).compile(),
            "donating": jax.jit(step, donate_argnums=0, **fused).lower(self.abstract, self.batch, scalar).compile(),
            "gradients": jax.jit(self.gradients, in_shardings=(shardings, batch_sharding(mesh)),
                                 out_shardings=(shardings.params, replicated(mesh)),
                                 keep_unused=True).lower(self.abstract, self.batch).compile(),
            "apply_whole": apply(mesh),
            "apply_per_slice": [apply(m) for m in self.slice_meshes],
        }


def memory_ratios(compiled: dict) -> dict[str, float]:
    """Each design's worst phase over the donating step (every phase takes the whole state, so it is counted)."""
    donating = peak_bytes(compiled["donating"])
    split = max(peak_bytes(compiled["gradients"]), peak_bytes(compiled["apply_per_slice"][0]))
    return {"as_now": peak_bytes(compiled["as_now"]) / donating, "split": split / donating}


def per_slice(tree, mesh: Mesh):
    """``tree``'s shards on ``mesh`` (one slice) as arrays of their own; nothing is copied."""
    devices = list(mesh.devices.flat)

    def view(array):
        by_device = {shard.device: shard.data for shard in array.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            array.shape, NamedSharding(mesh, array.sharding.spec), [by_device[d] for d in devices])

    return jax.tree.map(view, tree)


def joined(parts: list, shardings):
    """The per-slice arrays ``parts`` as global arrays on ``shardings``; nothing is copied."""
    return jax.tree.map(
        lambda sharding, *leaves: jax.make_array_from_single_device_arrays(
            leaves[0].shape, sharding, [shard.data for leaf in leaves for shard in leaf.addressable_shards]),
        shardings, *parts)


def steps_per_second(work: Workload, compiled: dict, design: str, steps: int):
    """One design trained for ``steps`` steps, one in flight at a time: its steps/s (median interval) and final state."""
    one, batch_size = np.float32(1.0), np.int32(work.batch_size)
    batches = [jax.device_put(work.data.get_batch(et.sample_ids(work.data.num_samples, seed=work.seed,
                                                                 start=i * work.batch_size, count=work.batch_size)),
                              batch_sharding(work.mesh)) for i in range(steps)]

    def step(arrays, batch):
        if design in ("as_now", "donating"):
            return compiled[design](arrays, batch, one)[0]
        grads, _ = compiled["gradients"](arrays, batch)
        if design == "split_whole":
            return compiled["apply_whole"](arrays, grads, one, batch_size)
        jax.block_until_ready(grads)  # the step is committed here: every slice has its gradients
        views = [(per_slice(arrays, m), per_slice(grads, m)) for m in work.slice_meshes]  # all before any donation
        return joined([apply(a, g, one, batch_size) for apply, (a, g) in zip(compiled["apply_per_slice"], views)],
                      work.shardings)

    arrays = jax.device_put(jax.tree.map(np.asarray, work.arrays), work.shardings)
    ends = [time.perf_counter()]
    for batch in batches:
        arrays = step(arrays, batch)
        jax.block_until_ready(arrays)
        ends.append(time.perf_counter())
    return 1 / statistics.median(np.diff(ends[3:])), arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=0, help="timing rounds on the default model (0: memory only)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    register_configs()
    for name, model in MODELS.items():
        for within_slice in WITHIN_SLICE:
            work = Workload([*model, f"trainer.within_slice={within_slice}"], within_slice)
            ratios = memory_ratios(work.compiled())
            print(f"memory {name} {within_slice}: as now {ratios['as_now']:.3f}, split {ratios['split']:.3f} "
                  "of the donating step", flush=True)
    if not args.rounds:
        return
    work = Workload([], "replicated")
    compiled = work.compiled()
    designs = ("donating", "as_now", "split_whole", "split_per_slice")
    for round_ in range(args.rounds):
        order = designs if round_ % 2 == 0 else designs[::-1]  # alternate, so drift on a shared machine cancels
        results = {design: steps_per_second(work, compiled, design, args.steps) for design in order}
        reference = jax.tree.leaves(results["donating"][1])
        same = all(all(np.array_equal(a, b) for a, b in zip(reference, jax.tree.leaves(results[d][1]))) for d in designs)
        print(f"round {round_ + 1}: " + ", ".join(f"{d} {results[d][0] / results['donating'][0]:.3f}" for d in designs)
              + f" of the donating step's steps/s; the same final state: {same}", flush=True)


if __name__ == "__main__":
    main()
