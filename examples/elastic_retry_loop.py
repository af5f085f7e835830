"""A training loop you keep, made elastic with ``et.elastic_retry`` (MaxText's ``elastic_retry`` shape).

The loop is plain JAX + optax + Orbax: linear regression, data parallel over
the slices. ``elastic_retry`` classifies what the loop raises, lets the
strategy decide, and calls the loop again on the new mesh; the loop restores
its own Orbax checkpoint onto that mesh, as a MaxText loop does.

    python examples/elastic_retry_loop.py RUN_DIR [--fail-at STEP]

With ``--fail-at``, slice 1 is lost for good at that step and the loop goes on
over the other three (scale_down). Prints the final loss and weights, and
writes RUN_DIR/report.json.
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 4 simulated slices of 2 CPU devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import elastic_trainer as et  # noqa: E402
from elastic_trainer.chaos import Chaos  # noqa: E402
from elastic_trainer.strategies import ScaleDown  # noqa: E402

STEPS, BATCH, FEATURES, SAVE_EVERY = 40, 24, 8, 5
optimizer = optax.adam(0.3)


def batch_at(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The same batch for a step on any mesh, so a resumed run sees the same data."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return x, x @ np.arange(1, FEATURES + 1, dtype=np.float32)[:, None] + 0.5


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@jax.jit
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1}, loss


def train(run: et.ElasticRun, checkpoint_dir: str) -> tuple[float, np.ndarray]:
    """Train to STEPS on ``run.mesh``, from the last checkpoint if there is one."""
    replicated = NamedSharding(run.mesh, PartitionSpec())
    data = NamedSharding(run.mesh, PartitionSpec(("slice", "device")))
    params = {"w": jnp.zeros((FEATURES, 1)), "b": jnp.zeros(())}
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    with ocp.CheckpointManager(checkpoint_dir) as checkpoints:
        if checkpoints.latest_step() is not None:  # a new attempt: what lived on the lost slice is gone
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
            state = checkpoints.restore(checkpoints.latest_step(), args=ocp.args.StandardRestore(target))
        state = jax.device_put(state, replicated)
        loss = jnp.nan
        for step in run.steps(int(state["step"]), STEPS):
            if step and step % SAVE_EVERY == 0:  # the state after `step` steps, checked by run.steps
                checkpoints.save(step, args=ocp.args.StandardSave(state))
            x, y = batch_at(step)
            state, loss = train_step(state, jax.device_put(x, data), jax.device_put(y, data))
        checkpoints.save(STEPS, args=ocp.args.StandardSave(state), force=True)
    return float(loss), np.asarray(state["params"]["w"]).ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--fail-at", type=int, default=None, help="lose slice 1 for good at this step")
    args = parser.parse_args()
    failures = [] if args.fail_at is None else [{"at_step": args.fail_at, "slice": 1}]
    elastic_train = et.elastic_retry(
        cluster=et.SimulatedCluster(slices=4, devices_per_slice=2), strategy=ScaleDown(),
        plugins=[Chaos(failures=failures)], run_dir=args.run_dir,
    )(train)
    loss, weights = elastic_train(f"{args.run_dir}/checkpoints")
    print(f"final loss {loss:.6f}")
    print("weights " + " ".join(f"{w:.6f}" for w in weights))


if __name__ == "__main__":
    main()
