"""The step designs docs/architecture.md ("The step") chose between: steps/s and memory against a donating step.

Each design trains the same model over the same mesh and shardings, one step
in flight at a time, in turns (the order alternates from round to round), and
is timed as the median step interval of ``--steps`` steps:

- ``fused``: one program, the state donated (the trainer's step on a single
  controller, and what a hand-written loop jits); a failure while it runs
  leaves no slice the state, so it comes from the host snapshot;
- ``fused_snapshot_every_step``: the same, the state copied to host memory
  before every step (``HostSnapshots`` with ``snapshot_period=1``): a failure
  inside a step then loses no committed step;
- ``fused_host_copy``: the same program also writing the state it took to
  host memory (``pinned_host`` outputs, each slice its own copy, spread over
  its devices): a failure then loses at most the step before;
- ``split``: the gradients (nothing donated), then the update over the whole
  mesh (the state donated): the trainer's step on ``cluster=multiprocess``,
  where each process runs its own part of the update;
- ``undonated``: one program, nothing donated (the step before issue 13).

Memory is XLA's accounting per device (``memory_analysis()``: arguments +
outputs - aliased + temporaries), the worst program of a design over the
fused step's. Prints one line per round, then the medians; with ``--devices``
the small model of ``overhead.py --devices N``. The per-half updates of the
step before this one (issue 31's "two phases") are not rebuilt here: their
measurements are in docs/architecture.md.

    python benchmarks/step_designs.py [--devices N] [--rounds 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None, help="the small model on this many devices")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    import _loops

    _loops.configure(args.devices or _loops.DEFAULT_JOB.devices)
    import equinox as eqx
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import elastic_trainer as et
    import elastic_trainer.plugin as etp
    from elastic_trainer._mesh import DEVICE_AXIS, batch_sharding, replicated, state_shardings
    from elastic_trainer._snapshots import host_copy
    from elastic_trainer._step import gradient_positions, make_step_functions

    work = _loops.DEFAULT_JOB if args.devices is None else _loops.small(args.devices)
    data, model, optimizer = _loops.parts(work)
    arrays, static = eqx.partition(etp.init_train_state(model, optimizer, key=jax.random.key(1)), eqx.is_array)
    leaves = jax.tree.leaves(arrays)
    mesh = Mesh(np.array(jax.devices()[: work.devices]).reshape(work.slices, work.devices_per_slice),
                (etp.SLICE_AXIS, etp.DEVICE_AXIS))
    shardings = jax.tree.leaves(state_shardings(arrays, mesh, within_slice="replicated"))
    functions = make_step_functions(et.next_token_loss, optimizer, static, arrays)
    rep, batches = replicated(mesh), batch_sharding(mesh)

    def spread_in_slice(leaf) -> NamedSharding:  # each slice its own copy, spread over its devices
        axes = [a for a, size in enumerate(leaf.shape) if size % work.devices_per_slice == 0]
        spec = [None] * leaf.ndim
        if axes:
            spec[max(axes, key=lambda a: leaf.shape[a])] = DEVICE_AXIS
        return NamedSharding(mesh, jax.sharding.PartitionSpec(*spec), memory_kind="pinned_host")

    def with_host_copy(leaves, batch, lr_scale):
        new, loss = functions.step(leaves, batch, lr_scale)
        return new, loss, leaves

    def batch(position):
        ids = et.sample_ids(data.num_samples, seed=_loops.SEED, start=position, count=work.global_batch)
        return jax.device_put(data.get_batch(ids), batches)

    one = jax.device_put(np.float32(1.0), rep)
    count = jax.device_put(np.int32(work.global_batch), rep)
    example = batch(0)
    abstract = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    step_in = (shardings, batches, rep)
    compiled = {
        "fused": jax.jit(functions.step, donate_argnums=0, in_shardings=step_in, out_shardings=(shardings, rep)),
        "undonated": jax.jit(functions.step, in_shardings=step_in, out_shardings=(shardings, rep)),
        "fused_host_copy": jax.jit(with_host_copy, donate_argnums=0, in_shardings=step_in,
                                   out_shardings=(shardings, rep, [spread_in_slice(leaf) for leaf in leaves])),
    }
    compiled = {name: jitted.lower(abstract, example, one).compile() for name, jitted in compiled.items()}
    gradient_leaves = gradient_positions(arrays)
    compiled["gradients"] = jax.jit(functions.gradients, keep_unused=True, in_shardings=(shardings, batches),
                                    out_shardings=([shardings[i] for i in gradient_leaves], rep)
                                    ).lower(abstract, example).compile()
    compiled["update"] = jax.jit(functions.update, donate_argnums=0,
                                 in_shardings=(shardings, [shardings[i] for i in gradient_leaves], rep, rep),
                                 out_shardings=shardings).lower(
        abstract, [abstract[i] for i in gradient_leaves], one, count).compile()

    def peak(name: str) -> int:
        stats = compiled[name].memory_analysis()
        return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                + stats.temp_size_in_bytes)

    programs = {"fused": ["fused"], "fused_snapshot_every_step": ["fused"], "fused_host_copy": ["fused_host_copy"],
                "split": ["gradients", "update"], "undonated": ["undonated"]}
    memory = {design: max(peak(p) for p in names) / peak("fused") for design, names in programs.items()}

    def run(design: str) -> float:
        state = jax.device_put([np.asarray(leaf) for leaf in leaves], shardings)
        next_batch, ends = batch(0), [time.perf_counter()]
        for s in range(args.steps):
            if design == "fused_snapshot_every_step":
                [host_copy(leaf) for leaf in state]
            if design == "split":
                grads, _ = compiled["gradients"](state, next_batch)
                state = compiled["update"](state, grads, one, count)
            else:
                state = compiled["fused" if design == "fused_snapshot_every_step" else design](state, next_batch, one)[0]
            next_batch = batch((s + 1) * work.global_batch)
            jax.block_until_ready(state)
            ends.append(time.perf_counter())
        return statistics.median(np.diff(ends[3:]))

    print(work.name, flush=True)
    ratios: dict[str, list[float]] = {design: [] for design in programs}
    for round_ in range(args.rounds):
        order = list(programs) if round_ % 2 == 0 else list(programs)[::-1]
        seconds = {design: run(design) for design in order}
        for design in programs:
            ratios[design].append(seconds["fused"] / seconds[design])
        print(f"round {round_ + 1}: fused {1e3 * seconds['fused']:.2f} ms/step; " + ", ".join(
            f"{d} {ratios[d][-1]:.3f}" for d in programs if d != "fused"), flush=True)
    print(f"{'design':<28}{'steps/s of fused':>18}{'memory of fused':>17}")
    for design in programs:
        print(f"{design:<28}{statistics.median(ratios[design]):>18.3f}{memory[design]:>17.3f}")


if __name__ == "__main__":
    main()
