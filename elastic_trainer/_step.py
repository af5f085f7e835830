"""The train step: one optimizer update, jitted over a mesh and compiled ahead of time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, PyTree

from ._mesh import WithinSlice, batch_sharding, replicated, state_shardings
from ._state import TrainState

LossFn = Callable[..., Array]
"""``loss_fn(model, batch, *, key) -> scalar loss``."""

StepFn = Callable[[PyTree, jax.Array, jax.Array], tuple[PyTree, dict[str, jax.Array]]]


def make_step_fn(loss_fn: LossFn, optimizer: optax.GradientTransformation, static: PyTree) -> StepFn:
    """The pure step over the array part of a :class:`TrainState`.

    ``static`` is the non-array part (``eqx.partition(state, eqx.is_array)[1]``);
    the step takes and returns the array part, so it can be jitted with
    explicit shardings. ``lr_scale`` multiplies the updates: the learning-rate
    rescaling of a shrunk global batch (1 otherwise).
    """

    def step(arrays: PyTree, batch: jax.Array, lr_scale: jax.Array) -> tuple[PyTree, dict[str, jax.Array]]:
        state: TrainState = eqx.combine(arrays, static)
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.params, batch, key=step_key)
        updates, opt_state = optimizer.update(grads, state.opt_state, eqx.filter(state.params, eqx.is_array))
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        new_state = TrainState(
            params=eqx.apply_updates(state.params, updates),
            opt_state=opt_state,
            step=state.step + 1,
            key=jax.random.key_data(key),
            data_position=state.data_position + batch.shape[0],
        )
        return eqx.filter(new_state, eqx.is_array), {"loss": loss}

    return step


def compile_step(
    step_fn: StepFn,
    arrays: PyTree,
    batch: jax.ShapeDtypeStruct,
    mesh: Mesh,
    *,
    within_slice: WithinSlice,
) -> tuple[Any, PyTree]:
    """Compile ``step_fn`` for ``mesh`` ahead of time.

    Returns the compiled step and the state shardings it expects. The input
    state is not donated: until a step has succeeded everywhere, the state
    before it is what survivors of a failure restore from.
    """
    shardings = state_shardings(arrays, mesh, within_slice=within_slice)
    jitted = jax.jit(
        step_fn,
        in_shardings=(shardings, batch_sharding(mesh), replicated(mesh)),
        out_shardings=(shardings, replicated(mesh)),
    )
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
    return jitted.lower(abstract, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile(), shardings
