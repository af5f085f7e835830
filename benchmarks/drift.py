"""How far "the same training" drifts after a resize, why, and what an order-independent reduction costs.

Side by side in this process, on the default simulated cluster (4 slices of 2
CPU devices) with the default model, data, batch (48) and optimizer (AdamW,
warm-up and cosine decay over the run), each run trains ``--steps`` steps and
saves a checkpoint at every horizon; the parameters of each horizon are read
back from it and compared with a reference run's:

- ``scale_down`` (``keep_global``): slice 1 lost during step ``--fail-at``, for
  good; the rest of the run trains on 6 devices, on the same samples;
- the cause: a failure-free run on 6 devices (3 slices) from step 0, against
  the one on 8: the same samples and arithmetic, summed in another order
  (each device adds up its share of the batch, then the devices' sums are
  added), so each step's gradient differs in its last bits and Adam carries
  the difference on;
- the control: ``pause_resume`` loses the same slice at the same step but
  resumes on the same 8 devices, so it must be bit-identical;
- the prototype (``FixedOrderLoss``, below): the batch's mean loss and its
  gradient summed in an order fixed by a group count that every reachable
  device count divides (24 for 8, 6, 4 and 2 devices), not by the device
  count; its ``scale_down`` run is compared with its own failure-free run,
  and its steps/s with the default step's.

For each horizon and pair the table gives the relative norm difference of the
parameters (all leaves together), how many leaves are outside rtol 1e-5 (and
1e-7) and how many are bit-identical, and the relative difference of that
step's loss. Steps/s are one over the median step interval of the failure-free
8-device runs (compile excluded). The last line is ``drift_rel=...``: the
parameters' relative difference of ``scale_down`` at the longest horizon, with
the default step.

    python benchmarks/drift.py [--steps 600] [--horizons 100,200,400,600] [--fail-at 50]

Takes about 22 minutes on 2 shared cores at the defaults (six runs of about 3.5 minutes).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("ELASTIC_TRAINER_DISABLE_PLUGIN_AUTOLOAD", "1")

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, PartitionSpec

import elastic_trainer as et
import elastic_trainer.plugin as etp
from elastic_trainer.chaos import Chaos
from elastic_trainer.strategies import PauseResume, ScaleDown

GLOBAL_BATCH = 48
GROUPS = 24
"""The prototype's sample groups: every device count from 1 slice (2 devices) to 4 (8) divides 24, and 24 divides 48."""
SEED = 0
MESH_AXES = (etp.SLICE_AXIS, etp.DEVICE_AXIS)


# ---------------------------------------------------------------- the prototype: a fixed reduction order


def fold(stacked: jax.Array) -> jax.Array:
    """The mean over the leading axis, added one element after the other in index order (XLA does not reorder it)."""
    total = stacked[0]
    for index in range(1, stacked.shape[0]):
        total = total + stacked[index]
    return total / stacked.shape[0]


def fixed_order_value_and_grad(
    loss_fn: Callable[..., jax.Array], model: eqx.Module, batch: jax.Array, key: jax.Array, *, mesh: Mesh, groups: int
) -> tuple[jax.Array, eqx.Module]:
    """``loss_fn``'s mean over ``batch`` and its gradient, summed in an order that depends on ``groups`` only.

    The batch is cut into ``groups`` groups of consecutive samples. Each
    device computes the loss and gradient of each of its groups in turn (a
    scan, so every group is computed by the same program, whatever the device
    count); an all-to-all then gives each device every group's gradient for
    1/n of the parameters, which it adds up in group order; an all-gather
    puts the sum together. Group ``g``'s key is ``fold_in(key, g)``.
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)
    devices = mesh.size
    per_device = groups // devices

    def on_device(params, batch, key):
        grouped = jax.tree.map(lambda a: a.reshape(per_device, -1, *a.shape[1:]), batch)
        first = jax.lax.axis_index(MESH_AXES) * per_device

        def one_group(carry, indexed):
            index, group = indexed
            group_key = jax.random.fold_in(key, first + index)

            def group_loss(trainable):
                return loss_fn(eqx.combine(trainable, static), group, key=group_key)

            return carry, jax.value_and_grad(group_loss)(params)

        _, (losses, grads) = jax.lax.scan(one_group, None, (jnp.arange(per_device), grouped))
        flat = jax.vmap(lambda tree: ravel_pytree(tree)[0])(grads)  # (per_device, parameters)
        unravel = ravel_pytree(params)[1]
        size = flat.shape[1]
        padded = math.ceil(size / devices) * devices
        flat = jnp.pad(flat, ((0, 0), (0, padded - size))).reshape(per_device, devices, padded // devices)
        every_group = jax.lax.all_to_all(flat, MESH_AXES, 1, 0, tiled=True).reshape(groups, padded // devices)
        summed = jax.lax.all_gather(fold(every_group), MESH_AXES, tiled=True)[:size]
        return fold(jax.lax.all_gather(losses, MESH_AXES, tiled=True)), unravel(summed)

    everywhere = PartitionSpec()
    return jax.shard_map(
        on_device, mesh=mesh, in_specs=(everywhere, PartitionSpec(MESH_AXES), everywhere), out_specs=everywhere,
        check_vma=False,
    )(params, batch, key)


@eqx.filter_custom_vjp
def _fixed_order_loss(model, batch, key, loss_fn, mesh, groups):
    return fixed_order_value_and_grad(loss_fn, model, batch, key, mesh=mesh, groups=groups)[0]


@_fixed_order_loss.def_fwd
def _fixed_order_loss_fwd(perturbed, model, batch, key, loss_fn, mesh, groups):
    del perturbed
    return fixed_order_value_and_grad(loss_fn, model, batch, key, mesh=mesh, groups=groups)


@_fixed_order_loss.def_bwd
def _fixed_order_loss_bwd(grads, cotangent, perturbed, model, batch, key, loss_fn, mesh, groups):
    del perturbed, model, batch, key, loss_fn, mesh, groups
    return jax.tree.map(lambda g: g * cotangent, grads)


class FixedOrderLoss:
    """A mean loss whose value and gradient do not depend on the device count (:func:`fixed_order_value_and_grad`).

    Pass it as the trainer's ``loss_fn`` and in its ``plugins``: a loss
    function does not see the mesh it is compiled for, so this plugin notes
    each mesh as plugins make it (``et_make_mesh``), just before the step is
    compiled for it. Compiling layouts ahead (``ScaleDown(compile_ahead=True)``)
    compiles later, on another thread, so it must be off. Inside the trainer,
    ``compile_gradients`` knows its mesh and needs none of this. A batch that
    does not cut into the groups (the trainer's shape check, on one sample)
    gets ``loss_fn`` itself.

    :param loss_fn: ``loss_fn(model, batch, *, key)``, a mean over the samples of ``batch``.
    :param groups: sample groups; every device count of the run must divide it, and it the global batch.
    """

    def __init__(self, loss_fn: Callable[..., jax.Array], groups: int = GROUPS):
        self.loss_fn = loss_fn
        self.groups = groups
        self.mesh: Mesh | None = None

    @et.hookimpl
    def et_run_start(self, trainer: etp.TrainerView) -> None:
        """Check the group count against the batch and the cluster; the full mesh until plugins make one."""
        if trainer.global_batch_size % self.groups:
            raise et.ConfigError(f"FixedOrderLoss(groups={self.groups}) must divide the global batch "
                                 f"({trainer.global_batch_size}); choose a divisor of it.")
        self.mesh = etp.make_mesh(trainer.cluster.slice_devices())

    @et.hookimpl(wrapper=True)
    def et_make_mesh(self, trainer: etp.RunView, slice_devices: Sequence[Sequence[jax.Device]]):
        """Note the mesh the next step is compiled for."""
        mesh = yield
        if isinstance(mesh, Mesh) and self.groups % mesh.size:
            raise et.ConfigError(f"FixedOrderLoss(groups={self.groups}) must be divisible by the {mesh.size} "
                                 "devices of the new mesh; choose a multiple of every device count the run reaches.")
        self.mesh = mesh
        return mesh

    def __call__(self, model: eqx.Module, batch: jax.Array, *, key: jax.Array) -> jax.Array:
        if jax.tree.leaves(batch)[0].shape[0] % self.groups:  # the trainer's shape check, on one sample
            return self.loss_fn(model, batch, key=key)
        return _fixed_order_loss(model, batch, key, self.loss_fn, self.mesh, self.groups)


# ---------------------------------------------------------------- the runs


class RunSpec(NamedTuple):
    """One training run of the comparison."""

    name: str
    slices: int
    fixed_order: bool = False
    strategy: Callable[[], object] | None = None
    failures: tuple[dict, ...] = ()


class RunResult(NamedTuple):
    """What a run left: its parameters at each horizon, each step's loss, and its steady-state steps/s."""

    params: dict[int, list[np.ndarray]]
    losses: dict[int, float]
    steps_per_s: float


class StepLog:
    """A plugin noting each committed step's loss and when it ended."""

    def __init__(self):
        self.losses: dict[int, float] = {}
        self.ends: list[float] = []

    @et.hookimpl
    def et_step_end(self, step: int, metrics: dict[str, jax.Array]) -> None:
        self.losses[step] = float(metrics["loss"])
        self.ends.append(time.perf_counter())


def read_params(directory: Path, step: int) -> list[np.ndarray]:
    """The parameters saved for ``step``, as numpy arrays in leaf order (plain Orbax, as the README shows)."""
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "metadata": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers) as manager:
        here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        tree = manager.item_metadata(step)["state"].tree
        arrays = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=here), tree)
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(restore_args=arrays), metadata=ocp.args.JsonRestore()))
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored.state["params"])]


def train(spec: RunSpec, *, steps: int, horizons: Sequence[int], work: Path) -> RunResult:
    """Run ``spec`` for ``steps`` steps, saving every horizon, and read the horizons back."""
    data = et.StdlibText(seq_len=64)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=10, decay_steps=steps, end_value=3e-4)
    log = StepLog()
    plugins: list[object] = [log, Chaos(failures=list(spec.failures))]
    loss_fn: Callable[..., jax.Array] = et.next_token_loss
    if spec.fixed_order:
        loss_fn = FixedOrderLoss(et.next_token_loss)
        plugins.append(loss_fn)
    period = math.gcd(*horizons)
    checkpoints = work / spec.name
    trainer = et.Trainer(
        model=et.Transformer(seq_len=64, key=jax.random.key(SEED)), loss_fn=loss_fn,
        optimizer=optax.adamw(schedule, weight_decay=0.01), data=data, steps=steps, global_batch_size=GLOBAL_BATCH,
        cluster=et.SimulatedCluster(spec.slices, 2), seed=SEED, plugins=plugins,
        strategy=None if spec.strategy is None else spec.strategy(),
        checkpointer=et.Checkpointer(checkpoints, period=period, max_to_keep=steps // period + 1),
    )
    _, report = trainer.fit()
    lost = [failure.lost_steps for failure in report.failures]
    print(f"  {spec.name}: {report.steps_completed} steps, failures {len(lost)} (lost steps {lost}), "
          f"final loss {report.final_loss:.4f}", flush=True)
    return RunResult(
        params={h: read_params(checkpoints, h) for h in horizons},
        losses=log.losses,
        steps_per_s=1 / statistics.median(np.diff(log.ends)),
    )


class Difference(NamedTuple):
    """How two runs' parameters and loss differ at one horizon."""

    params_rel: float
    outside_1e5: int
    outside_1e7: int
    identical: int
    leaves: int
    loss_rel: float


def compare(a: RunResult, b: RunResult, horizon: int) -> Difference:
    """``b`` against ``a`` at ``horizon``: relative norm difference of all parameters together, per-leaf counts, loss."""
    ours, theirs = a.params[horizon], b.params[horizon]
    squared = sum(float(np.sum((y.astype(np.float64) - x) ** 2)) for x, y in zip(ours, theirs))
    norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in ours))

    def outside(rtol: float) -> int:
        return sum(not np.allclose(y, x, rtol=rtol, atol=0) for x, y in zip(ours, theirs))

    loss_a, loss_b = a.losses[horizon], b.losses[horizon]
    return Difference(
        params_rel=math.sqrt(squared) / norm, outside_1e5=outside(1e-5), outside_1e7=outside(1e-7),
        identical=sum(np.array_equal(x, y) for x, y in zip(ours, theirs)), leaves=len(ours),
        loss_rel=abs(loss_b - loss_a) / abs(loss_a),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--horizons", default="100,200,400,600", help="comma-separated steps, each at most --steps")
    parser.add_argument("--fail-at", type=int, default=50, help="the step during which slice 1 is lost")
    args = parser.parse_args()
    horizons = sorted(int(h) for h in args.horizons.split(","))
    if horizons[0] < 1 or horizons[-1] > args.steps or not 0 <= args.fail_at < args.steps:
        parser.error("every horizon must be between 1 and --steps, and --fail-at below --steps.")
    lost_for_good = ({"at_step": args.fail_at, "slice": 1},)
    lost_briefly = ({"at_step": args.fail_at, "slice": 1, "down_for_s": 0.5},)
    runs = [
        RunSpec("failure-free", 4),
        RunSpec("scale_down", 4, strategy=lambda: ScaleDown(compile_ahead=False), failures=lost_for_good),
        RunSpec("6 devices", 3),
        RunSpec("pause_resume", 4, strategy=lambda: PauseResume(timeout_s=60), failures=lost_briefly),
        RunSpec("fixed-order failure-free", 4, fixed_order=True),
        RunSpec("fixed-order scale_down", 4, fixed_order=True,
                strategy=lambda: ScaleDown(compile_ahead=False), failures=lost_for_good),
    ]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    with tempfile.TemporaryDirectory(prefix="elastic_trainer_drift_") as work:
        jax.config.update("jax_compilation_cache_dir", str(Path(work) / "jax_cache"))
        print(f"{len(runs)} runs of {args.steps} steps, global batch {GLOBAL_BATCH}, slice 1 lost at step "
              f"{args.fail_at}:", flush=True)
        results = {spec.name: train(spec, steps=args.steps, horizons=horizons, work=Path(work)) for spec in runs}
    pairs = [
        (f"scale_down 8->6 devices at step {args.fail_at} vs failure-free", "failure-free", "scale_down"),
        ("cause: 6 devices vs 8 from step 0, no failure", "failure-free", "6 devices"),
        ("control: pause_resume (same 8 devices) vs failure-free", "failure-free", "pause_resume"),
        ("fixed-order: scale_down vs failure-free", "fixed-order failure-free", "fixed-order scale_down"),
        ("fixed-order vs default step, both failure-free", "failure-free", "fixed-order failure-free"),
    ]
    print(f"\n{'comparison':56} {'step':>5} {'params rel':>10} {'>1e-5':>6} {'>1e-7':>6} {'equal':>6} {'loss rel':>9}")
    for label, first, second in pairs:
        for horizon in horizons:
            d = compare(results[first], results[second], horizon)
            print(f"{label:56} {horizon:5d} {d.params_rel:10.2e} {d.outside_1e5:3d}/{d.leaves:<2d} "
                  f"{d.outside_1e7:3d}/{d.leaves:<2d} {d.identical:3d}/{d.leaves:<2d} {d.loss_rel:9.2e}")
    default_rate = results["failure-free"].steps_per_s
    fixed_rate = results["fixed-order failure-free"].steps_per_s
    print(f"\nsteps/s on 8 devices: default step {default_rate:.2f}, fixed-order {fixed_rate:.2f} "
          f"(ratio {fixed_rate / default_rate:.3f}); 6 devices, default step: {results['6 devices'].steps_per_s:.2f}")
    print(f"drift_rel={compare(results['failure-free'], results['scale_down'], horizons[-1]).params_rel:.2e}")


if __name__ == "__main__":
    main()
