"""Flax NNX models as Equinox modules, so that the trainer trains, checkpoints and recovers them unchanged."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from ._extras import import_extra
from ._failures import ConfigError


def _nnx() -> Any:
    """``flax.nnx``, imported when first used: Flax is an optional extra."""
    return import_extra("flax.nnx", needed_by="NnxModel", package="Flax", extra="flax")


class NnxModel(eqx.Module):
    """A Flax NNX module split into its graph (static) and its parameters (nested dicts of arrays).

    ``NnxModel(module)`` is what ``et.Trainer(model=...)`` takes; calling it
    merges the two (``nnx.merge``) and calls the module, so a loss written for
    the NNX module works as it is. Only ``nnx.Param`` variables are held:
    state that the module changes while it runs (``nnx.BatchNorm``'s
    statistics, ``nnx.Rngs`` kept in the module) would not survive a pure
    train step, and is refused; take randomness from the loss's ``key``.

    :param module: the ``flax.nnx.Module`` to train.
    """

    graphdef: Any = eqx.field(static=True)
    params: dict[str, Any]

    def __init__(self, module: Any):
        nnx = _nnx()
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        if jax.tree.leaves(rest):
            kinds = sorted({type(variable).__name__ for variable in jax.tree.leaves(
                rest, is_leaf=lambda node: isinstance(node, nnx.Variable))})
            raise ConfigError(
                f"NnxModel trains nnx.Param variables only, but the {type(module).__name__} also holds "
                f"{', '.join(kinds)}; build it without them (Rngs passed to the call, no BatchNorm statistics)."
            )
        self.graphdef, self.params = graphdef, nnx.to_pure_dict(params)  # plain names in checkpoints

    def to_module(self) -> Any:
        """The NNX module with these parameters (after training: the trained one)."""
        return _nnx().merge(self.graphdef, self.params)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.to_module()(*args, **kwargs)
