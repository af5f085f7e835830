"""A layout's compiled step: the gradients program over every slice, one update program per group of slices, and
the views that hand the state from one to the other without a copy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding

from ._mesh import replicated

LeafLayout = tuple[jax.core.ShapedArray, NamedSharding]
"""One array's shape and dtype, and its sharding."""


def assemble(aval: jax.core.ShapedArray, sharding: NamedSharding, buffers: list[jax.Array]) -> jax.Array:
    """The array over ``sharding`` made of ``buffers`` (its addressable devices' single-device arrays, in the
    sharding's order), copying nothing and checking nothing.

    What ``jax.make_array_from_single_device_arrays`` makes, without its
    checks of every buffer: measured here, 40-50 us an array against 8 us,
    and a step makes some 250 such views (jax 0.10.2, where this constructor
    lives; the callers take the buffers in the order of a layout's own devices).
    """
    return ArrayImpl(aval, sharding, buffers, committed=True, _skip_checks=True)


@dataclasses.dataclass(frozen=True)
class GroupUpdate:
    """The update program of one group of a layout's slices, and where its devices' buffers sit in the layout's
    arrays.

    :param slices: the group's slices.
    :param compiled: the update program over the group's mesh (the state donated).
    :param mesh: the group's mesh.
    :param state: the state's leaves on the group's mesh (the program's input and output).
    :param gradients: the gradients' leaves on the group's mesh.
    :param positions: for each of the group's devices on this process, in the group's order, its place among
        the layout's arrays' buffers (their devices on this process, in the layout's order).
    """

    slices: tuple[int, ...]
    compiled: Any
    mesh: Mesh
    state: tuple[LeafLayout, ...]
    gradients: tuple[LeafLayout, ...]
    positions: tuple[int, ...]
    _scalars: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def scalars(self, lr_scale: float, batch_size: int) -> tuple[jax.Array, jax.Array]:
        """``lr_scale`` and ``batch_size`` on the group's devices, put there once."""
        key = (lr_scale, batch_size)
        if key not in self._scalars:
            self._scalars[key] = jax.device_put((np.float32(lr_scale), np.int32(batch_size)), replicated(self.mesh))
        return self._scalars[key]

    def run(self, leaves: list[jax.Array], gradients: list[jax.Array], *, lr_scale: float, batch_size: int
            ) -> list[jax.Array]:
        """Dispatch the update of ``leaves`` by ``gradients`` (the group's views), ``leaves`` donated."""
        return self.compiled(leaves, gradients, *self.scalars(lr_scale, batch_size))


def views(leaves: Sequence[jax.Array], layouts: Sequence[LeafLayout], positions: Sequence[int]) -> list[jax.Array]:
    """``leaves`` cut down to the devices at ``positions`` of their buffers, as arrays of ``layouts``."""
    return [assemble(aval, sharding, [leaf._arrays[p] for p in positions])
            for leaf, (aval, sharding) in zip(leaves, layouts, strict=True)]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A layout's step (docs/architecture.md, "Donation"): ``gradients`` over every slice, then one update per
    group of slices (:meth:`~elastic_trainer.AbstractCluster.update_groups`) that has devices on this process.

    :param gradients: the gradients program over the layout's mesh (nothing donated).
    :param groups: the update of each group of slices with devices on this process.
    :param state: the state's leaves on the layout.
    :param gradient_leaves: the positions in ``state`` of the leaves that have a gradient.
    :param join_order: for each of the layout's devices on this process, in order: the group (its index in
        ``groups``) and the device's place among that group's buffers.
    """

    gradients: Any
    groups: tuple[GroupUpdate, ...]
    state: tuple[LeafLayout, ...]
    gradient_leaves: tuple[int, ...]
    join_order: tuple[tuple[int, int], ...]

    @property
    def executables(self) -> tuple[Any, ...]:
        """Every program one step runs (what ``benchmarks/memory.py`` accounts)."""
        return (self.gradients, *(group.compiled for group in self.groups))

    def cut(self, leaves: Sequence[jax.Array], *, gradients: bool = False) -> list[list[jax.Array]]:
        """``leaves`` on the layout (the state's, or with ``gradients`` the gradients') as each group's views of
        them, in the order of ``groups``. Views of arrays still being computed are fine: nothing is read."""
        return [views(leaves, group.gradients if gradients else group.state, group.positions) for group in self.groups]

    def update(self, parts: Sequence[list[jax.Array]], gradients: Sequence[list[jax.Array]], *, lr_scale: float,
               batch_size: int) -> list[list[jax.Array] | BaseException]:
        """Dispatch every group's update of its part of the state (``parts``, from :meth:`cut` or :meth:`join`)
        by its part of the gradients; each group's new state leaves, or what its dispatch raised.

        Every view is made before any update is dispatched: donating a view
        takes the buffers of the layout's array it was cut from.
        """
        outcomes: list[list[jax.Array] | BaseException] = []
        for group, state, grads in zip(self.groups, parts, gradients, strict=True):
            try:
                outcomes.append(group.run(state, grads, lr_scale=lr_scale, batch_size=batch_size))
            except Exception as error:  # noqa: BLE001 - that group's update did not run; the others' may have
                outcomes.append(error)
        return outcomes

    def join(self, parts: Sequence[Sequence[jax.Array]]) -> list[jax.Array]:
        """The state's leaves on the layout, made of every group's (``parts``, in the order of ``groups``): the
        next step's :meth:`update` takes ``parts`` as they are."""
        joined = []
        for index, (aval, sharding) in enumerate(self.state):
            buffers = [part[index]._arrays for part in parts]
            joined.append(assemble(aval, sharding, [buffers[group][place] for group, place in self.join_order]))
        return joined


def build_compiled_step(gradients: Any, state: Sequence[LeafLayout], gradient_leaves: Sequence[int],
                        groups: Sequence[tuple[tuple[int, ...], Any, Mesh, Sequence[LeafLayout]]]) -> CompiledStep:
    """A :class:`CompiledStep` from its programs: ``gradients`` over the layout (whose state leaves are
    ``state``), and for each group of slices with devices here ``(slices, compiled update, mesh, state leaves on
    the group's mesh)``."""
    here = list(state[0][1]._addressable_device_assignment)  # the layout's devices here, in its arrays' order
    updates, join_order = [], {}
    for index, (slices, compiled, mesh, group_state) in enumerate(groups):
        devices = list(group_state[0][1]._addressable_device_assignment)
        for place, device in enumerate(devices):
            join_order[here.index(device)] = (index, place)
        updates.append(GroupUpdate(
            slices=slices, compiled=compiled, mesh=mesh, state=tuple(group_state),
            gradients=tuple(group_state[i] for i in gradient_leaves),
            positions=tuple(here.index(device) for device in devices),
        ))
    return CompiledStep(gradients=gradients, groups=tuple(updates), state=tuple(state),
                        gradient_leaves=tuple(gradient_leaves),
                        join_order=tuple(join_order[position] for position in range(len(here))))
