"""Framework overhead: trainer steps/s against a bare Equinox + optax loop.

Both train the default model on the default data over the same 4 x 2 mesh
with the same shardings and jit, side by side in this process, for several
rounds. The bare loop donates its state to the step (``donate_argnums``), as a
user's loop would; so does the trainer's update (docs/architecture.md,
"Donation": its step is a gradients program over every slice and one update
program per half of the slices). Steady state only: compile time is excluded from both, and each
round's rate is one over its median step interval, so a stall of the shared
machine in one step does not decide the round. Prints the median ratio
(trainer / bare) over the rounds as the last line: ``overhead_ratio=0.981``.

    python benchmarks/overhead.py [--steps 100] [--rounds 5]
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
import optax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import elastic_trainer as et  # noqa: E402

GLOBAL_BATCH = 48
SEED = 0


def workload():
    data = et.StdlibText(seq_len=64)
    model = et.Transformer(seq_len=64, key=jax.random.key(SEED))
    return data, model, optax.adamw(1e-3)


def bare_steps_per_second(steps: int) -> float:
    """A hand-written loop: what a user would write without elastic_trainer, the state donated to the step."""
    data, model, optimizer = workload()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("slice", "device"))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(("slice", "device")))
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optimizer.init(params)

    def step(params, opt_state, batch):
        def loss(params):
            return et.next_token_loss(eqx.combine(params, static), batch, key=None)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(
        step,
        in_shardings=(replicated, replicated, batch_sharding),
        out_shardings=(replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )  # the state donated, as a user's loop would (MaxText does too)

    def batch(position):
        ids = et.sample_ids(data.num_samples, seed=SEED, start=position, count=GLOBAL_BATCH)
        return jax.device_put(data.get_batch(ids), batch_sharding)

    params, opt_state = jax.device_put(jax.tree.map(np.asarray, (params, opt_state)), replicated)  # own buffers
    next_batch = batch(0)
    compiled = jitted.lower(params, opt_state, next_batch).compile()
    step_ends = [time.perf_counter()]
    for s in range(steps):
        params, opt_state, loss = compiled(params, opt_state, next_batch)
        next_batch = batch((s + 1) * GLOBAL_BATCH)  # prepared while the step runs
        # One step in flight, as XLA:CPU needs (several concurrent multi-device
        # steps deadlock its collectives); the trainer does the same.
        jax.block_until_ready((params, opt_state))
        step_ends.append(time.perf_counter())
    return 1 / statistics.median(np.diff(step_ends))


class StepClock:
    """A plugin noting when each step ends: everything between two step ends is the trainer's cost of a step."""

    def __init__(self):
        self.step_ends: list[float] = []

    @et.hookimpl
    def et_step_end(self) -> None:
        self.step_ends.append(time.perf_counter())


def trainer_steps_per_second(steps: int) -> float:
    """The same work through ``Trainer.fit``, with its built-in plugins."""
    data, model, optimizer = workload()
    clock = StepClock()
    trainer = et.Trainer(
        model=model, loss_fn=et.next_token_loss, optimizer=optimizer, data=data, steps=steps,
        global_batch_size=GLOBAL_BATCH, cluster=et.SimulatedCluster(4, 2), seed=SEED, plugins=[clock],
    )
    trainer.fit()
    return 1 / statistics.median(np.diff(clock.step_ends))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ratios = []
    for round_ in range(args.rounds):
        if round_ % 2:  # alternate which goes first, so drift on a shared machine cancels out
            trainer, bare = trainer_steps_per_second(args.steps), bare_steps_per_second(args.steps)
        else:
            bare, trainer = bare_steps_per_second(args.steps), trainer_steps_per_second(args.steps)
        ratios.append(trainer / bare)
        print(f"round {round_ + 1}: bare {bare:.2f} steps/s, trainer {trainer:.2f} steps/s, ratio {ratios[-1]:.3f}")
    print(f"overhead_ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
