"""One process of the loop a user writes on ``jax.distributed``, what ``overhead.py --processes N`` starts N times.

Each process joins the job (gloo collectives on CPU, DESIGN.md section 6),
builds the trainer's ``(slice, device)`` mesh with one slice per process,
and runs the trainer's step math (``make_step_fn``) jitted with the state
donated, its own rows of each global batch put with
``jax.make_array_from_process_local_data``, one step in flight. Process 0
writes the intervals between consecutive step ends (perf_counter after the
new state is ready), the first ``--warm-up`` left out, to ``--out`` as JSON.

    python benchmarks/_bare_multiprocess.py --coordinator 127.0.0.1:PORT --processes N --process-id I \
        --devices-per-process D --global-batch B --steps S --warm-up W --out intervals.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warm-up", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=args.process_id)

    import equinox as eqx
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import _loops
    import elastic_trainer as et
    import elastic_trainer.plugin as etp
    from elastic_trainer._step import make_step_fn

    work = _loops.Workload("bare", {"d_model": args.d_model, "num_layers": args.layers}, args.global_batch,
                           args.processes, args.devices_per_process)
    data, model, optimizer = _loops.parts(work)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # one mesh row per process
    mesh = Mesh(np.array(devices).reshape(work.slices, work.devices_per_slice), ("slice", "device"))
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P(("slice", "device")))
    arrays, static = eqx.partition(etp.init_train_state(model, optimizer, key=jax.random.key(1)), eqx.is_array)
    jitted = jax.jit(make_step_fn(et.next_token_loss, optimizer, static, arrays), donate_argnums=0,
                     in_shardings=(replicated, batch_sharding, replicated), out_shardings=(replicated, replicated))
    rows = args.global_batch // args.processes  # this process's rows: its place in the mesh's first axis

    def put_replicated(value):
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])

    def batch(position):
        ids = et.sample_ids(data.num_samples, seed=_loops.SEED, start=position, count=args.global_batch)
        local = data.get_batch(ids[args.process_id * rows:(args.process_id + 1) * rows])
        return jax.make_array_from_process_local_data(batch_sharding, local, (args.global_batch, *local.shape[1:]))

    arrays = jax.tree.map(put_replicated, arrays)
    lr_scale = put_replicated(np.float32(1.0))
    next_batch = batch(0)
    compiled = jitted.lower(arrays, next_batch, lr_scale).compile()
    ends = [time.perf_counter()]
    for s in range(args.warm_up + args.steps):
        arrays, metrics = compiled(arrays, next_batch, lr_scale)
        next_batch = batch((s + 1) * args.global_batch)  # prepared while the step runs
        jax.block_until_ready(arrays)
        ends.append(time.perf_counter())
    if args.process_id == 0:
        with open(args.out, "w") as out:
            json.dump(list(np.diff(ends)[args.warm_up:]), out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
