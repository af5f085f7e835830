"""The train step: one optimizer update, jitted over a mesh and compiled ahead of time."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, PyTree

from ._failures import ConfigError
from ._mesh import WithinSlice, batch_sharding, replicated, state_shardings
from ._state import TrainState

LossFn = Callable[..., Array]
"""``loss_fn(model, batch, *, key) -> scalar loss``."""

StepFn = Callable[[PyTree, jax.Array, jax.Array], tuple[PyTree, dict[str, jax.Array]]]


def make_step_fn(loss_fn: LossFn, optimizer: optax.GradientTransformation, static: PyTree) -> StepFn:
    """The pure step over the array part of a :class:`TrainState`.

    ``static`` is the non-array part (``eqx.partition(state, eqx.is_array)[1]``);
    the step takes and returns the array part, so it can be jitted with
    explicit shardings. ``batch`` is whatever the dataset's ``get_batch``
    returns: an array or any pytree of arrays with a leading batch axis. ``lr_scale`` multiplies the updates: the learning-rate
    rescaling of a shrunk global batch (1 otherwise).
    """

    def step(arrays: PyTree, batch: PyTree, lr_scale: jax.Array) -> tuple[PyTree, dict[str, jax.Array]]:
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
            data_position=state.data_position + jax.tree.leaves(batch)[0].shape[0],
        )
        return eqx.filter(new_state, eqx.is_array), {"loss": loss}

    return step


def check_fits(step_fn: StepFn, arrays: PyTree, sample: PyTree) -> None:
    """Raise :class:`ConfigError` when the loss cannot be computed on a batch like ``sample`` (a model that does
    not fit the data), before anything compiles; only shapes are traced."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (arrays, sample))
    try:
        jax.eval_shape(step_fn, *abstract, jax.ShapeDtypeStruct((), jnp.float32))
    except Exception as error:  # noqa: BLE001 - any error of the user's model or loss on this batch
        described = str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", sample))
        shapes = re.sub(r"'(\w+\[[^]]*\])'", r"\1", described)  # float32[1, 8], not 'float32[1, 8]'
        detail = (str(error).strip().splitlines() or [""])[0].rstrip(".")
        raise ConfigError(
            f"the loss cannot be computed on a batch of the data (get_batch returns {shapes} for one sample): "
            f"{type(error).__name__}: {detail}; make the model's input and the loss fit what get_batch returns."
        ) from error


def compile_step(
    step_fn: StepFn,
    arrays: PyTree,
    batch: PyTree,
    mesh: Mesh,
    *,
    within_slice: WithinSlice,
) -> tuple[Any, PyTree]:
    """Compile ``step_fn`` for ``mesh`` ahead of time.

    ``batch`` holds a ``jax.ShapeDtypeStruct`` per leaf of the batch.
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
