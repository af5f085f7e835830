"""What ``overhead.py`` and ``step_budget.py`` run side by side: the loop a user writes, and the trainer.

Call :func:`configure` before any JAX operation. Both loops train the same
model on the same data over the same mesh with the same shardings; each
returns the interval between consecutive step ends, compile excluded.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Iterable

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import elastic_trainer as et  # noqa: E402
import elastic_trainer.plugin as etp  # noqa: E402
from elastic_trainer._step import make_step_fn  # noqa: E402

SEED = 0


def configure(devices: int) -> None:
    """Give JAX ``devices`` CPU devices; call before any JAX operation."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, a global batch and the simulated slices to train on.

    :param name: what the output calls it.
    :param model: ``et.Transformer``'s arguments (``seq_len`` and ``key`` aside).
    :param global_batch: samples per step.
    :param slices: slices of ``devices_per_slice`` CPU devices.
    """

    name: str
    model: dict
    global_batch: int
    slices: int
    devices_per_slice: int = 2

    @property
    def devices(self) -> int:
        return self.slices * self.devices_per_slice


DEFAULT_JOB = Workload("default job (d_model 128, 2 layers, batch 48, 4 x 2 devices)", {}, 48, 4)


def small(devices: int) -> Workload:
    """The small model on ``devices`` simulated devices in slices of 2: ``d_model=64``, 2 layers, 2 samples per
    device (steps of tens of milliseconds on 8 devices)."""
    return Workload(f"small model (d_model 64, 2 layers, batch {2 * devices}, {devices // 2} x 2 devices)",
                    {"d_model": 64, "num_layers": 2}, 2 * devices, devices // 2)


def parts(work: Workload) -> tuple[et.StdlibText, et.Transformer, optax.GradientTransformation]:
    data = et.StdlibText(seq_len=64)
    model = et.Transformer(seq_len=64, key=jax.random.key(SEED), **work.model)
    return data, model, optax.adamw(1e-3)


def bare_intervals(work: Workload, steps: int) -> list[float]:
    """A hand-written loop, what a user writes without elastic_trainer: the step jitted with the state donated
    (``donate_argnums``, as MaxText does), the next batch put on the devices while the step runs, one step in
    flight (XLA:CPU deadlocks with several multi-device steps in flight; the trainer does the same).

    Its step is the trainer's math (``make_step_fn``: forward, backward, AdamW, and the step count, key and
    data position a resumable loop keeps), so that the two differ in what runs around the step only. A step
    written the usual optax way (``jax.value_and_grad``, ``optimizer.update``, ``optax.apply_updates``) measured
    the same within the machine's noise (82-85 ms against 80-82 ms on the default job).
    """
    data, model, optimizer = parts(work)
    mesh = Mesh(np.array(jax.devices()[: work.devices]).reshape(work.slices, work.devices_per_slice),
                ("slice", "device"))
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P(("slice", "device")))
    arrays, static = eqx.partition(etp.init_train_state(model, optimizer, key=jax.random.key(1)), eqx.is_array)
    jitted = jax.jit(make_step_fn(et.next_token_loss, optimizer, static, arrays), donate_argnums=0,
                     in_shardings=(replicated, batch_sharding, replicated), out_shardings=(replicated, replicated))

    def batch(position):
        ids = et.sample_ids(data.num_samples, seed=SEED, start=position, count=work.global_batch)
        return jax.device_put(data.get_batch(ids), batch_sharding)

    arrays = jax.device_put(jax.tree.map(np.asarray, arrays), replicated)  # buffers of its own, to donate
    lr_scale = jax.device_put(np.float32(1.0), replicated)
    next_batch = batch(0)
    compiled = jitted.lower(arrays, next_batch, lr_scale).compile()
    ends = [time.perf_counter()]
    for s in range(steps):
        arrays, metrics = compiled(arrays, next_batch, lr_scale)
        next_batch = batch((s + 1) * work.global_batch)  # prepared while the step runs
        jax.block_until_ready(arrays)
        ends.append(time.perf_counter())
    return list(np.diff(ends))


class StepClock:
    """A plugin noting when each step ends: everything between two step ends is the trainer's cost of a step."""

    def __init__(self):
        self.ends: list[float] = []

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]

    @et.hookimpl
    def et_step_end(self) -> None:
        self.ends.append(time.perf_counter())


def trainer_intervals(work: Workload, steps: int, plugins: Iterable[object] = ()) -> list[float]:
    """The same work through ``Trainer.fit`` with its built-in plugins and defaults (host snapshots, the
    watchdog), no strategy and no checkpoints (a checkpoint's cost is ``checkpoint_overhead.py``'s)."""
    data, model, optimizer = parts(work)
    clock = StepClock()
    et.Trainer(model=model, loss_fn=et.next_token_loss, optimizer=optimizer, data=data, steps=steps,
               global_batch_size=work.global_batch, cluster=et.SimulatedCluster(work.slices, work.devices_per_slice),
               seed=SEED, plugins=[clock, *plugins]).fit()
    return clock.intervals()


def median_ms(intervals: list[float]) -> float:
    """The median interval in milliseconds: a stall of the shared machine in one step does not decide it."""
    return 1e3 * statistics.median(intervals)
