"""The train state: everything needed to continue training exactly."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PyTree, UInt32


class TrainState(eqx.Module):
    """A pytree of the model, optimizer state, step, RNG key and data position.

    ``key`` holds raw key data (``jax.random.key_data``) so the state is made
    of plain arrays only, which every checkpoint format can store.
    ``data_position`` counts samples consumed: the next batch starts there.
    """

    params: PyTree
    opt_state: optax.OptState
    step: Int[Array, ""]
    key: UInt32[Array, "2"]
    data_position: Int[Array, ""]


def init_train_state(model: PyTree, optimizer: optax.GradientTransformation, *, key: jax.Array) -> TrainState:
    """Start training ``model`` with ``optimizer`` from step 0."""
    return TrainState(
        params=model,
        opt_state=optimizer.init(eqx.filter(model, eqx.is_array)),
        step=jnp.zeros((), jnp.int32),
        key=jax.random.key_data(key),
        data_position=jnp.zeros((), jnp.int32),
    )
