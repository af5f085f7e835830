"""The train step's pure functions, and their compiled programs for a layout.

On a single controller (the simulated cluster, Pathways) a step is one
program, the state donated to it, as in a hand-written loop
(:func:`compile_step`); on a runtime where each process runs its own part of
every program (``cluster=multiprocess``) it is two, the gradients (the
collective) and the update (the state donated, no collective), so that a
process lost during the update leaves the others the state after the step
(:func:`compile_gradients`, :func:`compile_update`; docs/architecture.md,
"The step").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, PyTree

from ._failures import ConfigError
from ._mesh import WithinSlice, batch_sharding, replicated, state_shardings
from ._state import TrainState

LossFn = Callable[..., Array | tuple[Array, dict[str, Array]]]
"""``loss_fn(model, batch, *, key) -> scalar loss``, or with ``has_aux=True`` ``-> (scalar loss, aux)``, ``aux`` a
dict of scalars (as ``jax.value_and_grad(..., has_aux=True)`` takes)."""

Metrics = dict[str, Array]
"""A step's metrics: ``loss``, then the scalars of a loss's ``aux``."""

RESERVED_METRICS = ("loss", "step")
"""Names an aux scalar cannot take: the loss's, and the report history's step column."""

StepFn = Callable[[PyTree, jax.Array, jax.Array], tuple[PyTree, dict[str, jax.Array]]]


def gradient_part(params: PyTree) -> PyTree:
    """The parameters the loss is differentiated by (Equinox's filtered gradients): the floating-point ones of
    ``params`` (arrays or shapes), the others ``None``."""
    return jax.tree.map(lambda p: p if jnp.issubdtype(p.dtype, jnp.inexact) else None, params)


def gradient_positions(arrays: PyTree) -> list[int]:
    """Where the parameters that have a gradient (:func:`gradient_part`) sit among the leaves of the state's
    ``arrays`` (the parameters are its first field, so their leaves come first)."""
    return [i for i, p in enumerate(jax.tree.leaves(arrays.params)) if jnp.issubdtype(p.dtype, jnp.inexact)]


class StepFunctions(NamedTuple):
    """The pure functions of a step over the array part of a :class:`TrainState`, as flat lists of its leaves.

    ``step(leaves, batch, lr_scale) -> (leaves, metrics)``: the whole step;
    ``gradients(leaves, batch) -> (gradient leaves, metrics)``: forward and
    backward over the global batch (``batch`` is whatever the dataset's
    ``get_batch`` returns); ``update(leaves, gradient_leaves, lr_scale,
    batch_size) -> leaves``: the optimizer's update, the updates times
    ``lr_scale`` (the learning-rate rescaling of a shrunk global batch, 1
    otherwise), the step, key and data position moved on. ``step`` is
    ``update`` after ``gradients``. Flat lists, not the state's pytree:
    flattening Equinox modules on every call costs tens of microseconds a
    step on the host. ``metrics`` (:data:`Metrics`) are the loss and its aux
    scalars, computed over the global batch as the loss is.
    """

    step: Callable[[list, PyTree, Array], tuple[list, Metrics]]
    gradients: Callable[[list, PyTree], tuple[list, Metrics]]
    update: Callable[[list, list, Array, Array], list]


def make_step_functions(loss_fn: LossFn, optimizer: optax.GradientTransformation, static: PyTree, arrays: PyTree,
                        *, has_aux: bool = False) -> StepFunctions:
    """The step's functions for the state whose array part is ``arrays`` (arrays or shapes) and whose
    non-array part is ``static`` (``eqx.partition(state, eqx.is_array)``); with ``has_aux``, ``loss_fn``
    returns ``(loss, aux)``."""
    structure = jax.tree.structure(arrays)
    gradient_structure = jax.tree.structure(gradient_part(arrays.params))

    def keys(state: TrainState) -> tuple[jax.Array, jax.Array]:
        """The state's key for the next step, and this step's."""
        return tuple(jax.random.split(jax.random.wrap_key_data(state.key)))

    def loss_and_aux(params: PyTree, batch: PyTree, *, key: jax.Array) -> tuple[Array, Metrics]:
        return split_loss_output(loss_fn(params, batch, key=key), has_aux=has_aux)

    def gradients(leaves: list, batch: PyTree) -> tuple[list, Metrics]:
        state: TrainState = eqx.combine(structure.unflatten(leaves), static)
        (loss, aux), grads = eqx.filter_value_and_grad(loss_and_aux, has_aux=True)(state.params, batch,
                                                                                    key=keys(state)[1])
        return gradient_structure.flatten_up_to(grads), {"loss": loss, **aux}

    def update(leaves: list, gradient_leaves: list, lr_scale: Array, batch_size: Array) -> list:
        state: TrainState = eqx.combine(structure.unflatten(leaves), static)
        grads = gradient_structure.unflatten(gradient_leaves)
        updates, opt_state = optimizer.update(grads, state.opt_state, eqx.filter(state.params, eqx.is_array))
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        new_state = TrainState(
            params=eqx.apply_updates(state.params, updates),
            opt_state=opt_state,
            step=state.step + 1,
            key=jax.random.key_data(keys(state)[0]),
            data_position=state.data_position + batch_size.astype(state.data_position.dtype),
        )
        return structure.flatten_up_to(eqx.filter(new_state, eqx.is_array))

    gradients, update = TracedOnce(gradients), TracedOnce(update)

    def step(leaves: list, batch: PyTree, lr_scale: Array) -> tuple[list, Metrics]:
        gradient_leaves, metrics = gradients(leaves, batch)
        batch_size = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.int32)
        return update(leaves, gradient_leaves, lr_scale, batch_size), metrics

    return StepFunctions(step, gradients, update)


def split_loss_output(output: Any, *, has_aux: bool) -> tuple[Array, Metrics]:
    """The loss and its aux scalars (none without ``has_aux``) of what a loss function returned, checked while
    it is traced: a :class:`ConfigError` that says how to fix a loss whose output does not match ``has_aux``."""
    fix_python, fix_cli = "Trainer(..., has_aux=True)", "loss.has_aux=true on the command line"
    if not has_aux and isinstance(output, (tuple, list)):
        raise ConfigError(
            f"the loss returns a {type(output).__name__} of {len(output)}, not a scalar; if it returns (loss, aux), "
            f"pass {fix_python} ({fix_cli}), else return the loss alone.")
    if has_aux and not (isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[1], dict)):
        raise ConfigError(
            f"has_aux is set but the loss returns {_described(output)}, not (loss, aux) with aux a dict of scalars; "
            f"return (loss, {{'name': scalar, ...}}), or drop has_aux.")
    loss, aux = output if has_aux else (output, {})
    if jnp.shape(loss) != ():
        raise ConfigError(f"the loss must be a scalar, but it has shape {jnp.shape(loss)}; reduce it (a mean over "
                          "the batch).")
    wrong = {name: _described(value) for name, value in aux.items() if not isinstance(name, str)
             or name in RESERVED_METRICS or not hasattr(value, "shape") and not isinstance(value, (int, float))
             or jnp.shape(value) != ()}
    if wrong:
        name, value = next(iter(wrong.items()))
        raise ConfigError(
            f"the loss's aux {name!r} is {value}; aux must map names (other than {' and '.join(RESERVED_METRICS)}) "
            f"to scalars, such as a mean over the batch.")
    return loss, {name: jnp.asarray(value) for name, value in aux.items()}


def _described(value: Any) -> str:
    """``value`` in a few words, for an error about a loss's output."""
    if hasattr(value, "shape"):
        return f"an array of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


class TracedOnce:
    """``fn`` traced once per shapes and dtypes of its arguments: a later call (the same step compiled for
    another layout's mesh, or for the same one after an eviction) replays the recorded program, its jaxpr,
    instead of running ``fn``'s Python again, its ``vmap`` and differentiation included.

    JAX's own trace cache is keyed on the function object, and the step
    cache makes new function objects after each eviction (so that the
    evicted layout's executable goes with the old ones); the jaxpr holds no
    executable. Replayed, the step lowers to the same program as when traced
    (docs/architecture.md, "Compiles").
    """

    def __init__(self, fn: Callable):
        self._fn = fn
        self._traces: dict[tuple, tuple[ClosedJaxpr, Any]] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        leaves, structure = jax.tree.flatten(args)
        jaxpr, out_structure = self._trace(leaves, structure)
        return out_structure.unflatten(jaxpr_as_fun(jaxpr)(*leaves))

    def trace(self, *args: Any) -> tuple[ClosedJaxpr, Any]:
        """The jaxpr for arguments like ``args`` (arrays, tracers or ``jax.ShapeDtypeStruct``), traced now if
        not yet, and its output's tree structure."""
        return self._trace(*jax.tree.flatten(args))

    def _trace(self, leaves: list, structure: Any) -> tuple[ClosedJaxpr, Any]:
        types = tuple(jax.typeof(leaf) for leaf in leaves)
        key = (structure, tuple((t.shape, t.dtype, t.weak_type) for t in types))
        if key not in self._traces:  # two threads may both trace it: the same jaxpr either way
            abstract = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type) for t in types]
            traced = jax.jit(self._fn).trace(*structure.unflatten(abstract))
            self._traces[key] = traced.jaxpr, jax.tree.structure(traced.out_info)
        return self._traces[key]


def make_step_fn(loss_fn: LossFn, optimizer: optax.GradientTransformation, static: PyTree, arrays: PyTree) -> StepFn:
    """The whole step as one pure function of the state's pytree, ``step(arrays, batch, lr_scale) -> (arrays,
    {"loss": loss})``: what a hand-written loop jits (the benchmarks' baselines)."""
    functions = make_step_functions(loss_fn, optimizer, static, arrays)
    structure = jax.tree.structure(arrays)

    def step(arrays: PyTree, batch: PyTree, lr_scale: jax.Array) -> tuple[PyTree, dict[str, jax.Array]]:
        leaves, metrics = functions.step(structure.flatten_up_to(arrays), batch, lr_scale)
        return structure.unflatten(leaves), metrics

    return step


def check_fits(functions: StepFunctions, arrays: PyTree, sample: PyTree, batch_size: int) -> None:
    """Raise :class:`ConfigError` when the loss cannot be computed on a batch of ``batch_size`` samples like
    ``sample`` (a model that does not fit the data) or returns what ``has_aux`` does not say (:func:`split_loss_output`),
    before anything compiles; only shapes are traced, and the
    gradients' trace is the one the first layout's step then replays (:class:`TracedOnce`)."""
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((batch_size, *a.shape[1:]), a.dtype), sample)
    try:
        functions.gradients.trace(_abstract_leaves(arrays), batch)
    except ConfigError as error:  # the loss's output does not match has_aux: said as such, without JAX's frames
        raise ConfigError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - any error of the user's model or loss on this batch
        described = str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", sample))
        shapes = re.sub(r"'(\w+\[[^]]*\])'", r"\1", described)  # float32[1, 8], not 'float32[1, 8]'
        detail = (str(error).strip().splitlines() or [""])[0].rstrip(".")
        raise ConfigError(
            f"the loss cannot be computed on a batch of the data (get_batch returns {shapes} for one sample): "
            f"{type(error).__name__}: {detail}; make the model's input and the loss fit what get_batch returns."
        ) from error


_LR_SCALE = jax.ShapeDtypeStruct((), jnp.float32)
_BATCH_SIZE = jax.ShapeDtypeStruct((), jnp.int32)


def compile_step(functions: StepFunctions, arrays: PyTree, batch: PyTree, mesh: Mesh, *, within_slice: WithinSlice
                 ) -> tuple[Any, PyTree]:
    """Compile the whole step for ``mesh`` ahead of time, the state donated; the program and the state shardings.

    ``arrays`` are the state's arrays or shapes, ``batch`` a
    ``jax.ShapeDtypeStruct`` per leaf of the batch. The new state takes the
    old one's buffers: the step needs no more memory than a hand-written
    loop's, and a failure while it runs leaves no slice the state.
    """
    shardings = state_shardings(arrays, mesh, within_slice=within_slice)
    leaves = jax.tree.leaves(shardings)
    jitted = jax.jit(
        functions.step, donate_argnums=0,
        in_shardings=(leaves, batch_sharding(mesh), replicated(mesh)), out_shardings=(leaves, replicated(mesh)),
    )
    return jitted.lower(_abstract_leaves(arrays), batch, _LR_SCALE).compile(), shardings


def compile_gradients(functions: StepFunctions, arrays: PyTree, batch: PyTree, mesh: Mesh, *,
                      within_slice: WithinSlice) -> tuple[Any, PyTree]:
    """Compile the gradients for ``mesh`` ahead of time; the program and the state shardings.

    ``arrays`` and ``batch`` are as for :func:`compile_step`. The whole state
    goes in (only the parameters and key are read): the optimizer state lives
    on the devices during this program too, and XLA's accounting of it then
    says so. The gradients come out with the parameters' shardings, summed
    over every device; nothing is donated.
    """
    shardings = state_shardings(arrays, mesh, within_slice=within_slice)
    leaves = jax.tree.leaves(shardings)
    jitted = jax.jit(
        functions.gradients, keep_unused=True,
        in_shardings=(leaves, batch_sharding(mesh)),
        out_shardings=([leaves[i] for i in gradient_positions(arrays)], replicated(mesh)),
    )
    return jitted.lower(_abstract_leaves(arrays), batch).compile(), shardings


def compile_update(functions: StepFunctions, arrays: PyTree, mesh: Mesh, *, within_slice: WithinSlice) -> Any:
    """Compile the update for ``mesh`` ahead of time, the state donated: its new state takes the old one's
    buffers. It has no collective: every device updates its own shards."""
    shardings: list[NamedSharding] = jax.tree.leaves(state_shardings(arrays, mesh, within_slice=within_slice))
    gradients = [shardings[i] for i in gradient_positions(arrays)]
    jitted = jax.jit(
        functions.update, donate_argnums=0,
        in_shardings=(shardings, gradients, replicated(mesh), replicated(mesh)), out_shardings=shardings,
    )
    return jitted.lower(_abstract_leaves(arrays), _abstract_leaves(gradient_part(arrays.params)),
                        _LR_SCALE, _BATCH_SIZE).compile()


def _abstract_leaves(tree: PyTree) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(tree)]
