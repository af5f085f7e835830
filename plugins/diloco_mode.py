"""DiLoCo's training mode: each slice trains a replica of its own, and every H steps the live slices average
their progress into one outer step (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training").

The state keeps one row per slice of the layout (its replica: parameters,
inner optimizer state, step, key and data position), sharded over the mesh's
slice axis, and the outer parameters and outer optimizer state, a full copy
on every slice. A step runs one program per slice, on that slice's devices
alone, over a zero-copy view of its row and of its share of the batch: no
collective crosses slices, and a slice lost in its program takes only its row
with it (:meth:`~elastic_trainer.plugin.StepMonitor.dropped`). The boundary (the
outer step) is one program over the layout's mesh: the mean of the replicas'
parameters, the outer optimizer's step on ``outer - mean``, and the new outer
parameters copied into every row. On a runtime of several processes each runs
its own slices' programs and holds their rows; the processes meet only at the
outer step (docs/architecture.md, "Dropped replicas").
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

import elastic_trainer as et
import elastic_trainer.plugin as etp


class DiLoCoState(eqx.Module):
    """A DiLoCo run's state: a replica per slice, and the outer parameters and their optimizer's state.

    :param replicas: a train state whose every leaf has a leading axis of one row per slice of the layout (in
        the layout's order), sharded over the slices: row ``r`` is the replica of the layout's ``r``-th slice.
    :param outer_params: the parameters of the last outer step (its floating-point leaves, as a list).
    :param outer_opt_state: the outer optimizer's state for them.
    """

    replicas: etp.TrainState
    outer_params: list
    outer_opt_state: PyTree


def _trained(params: PyTree) -> list[int]:
    """Where the floating-point leaves of ``params`` (arrays or shapes) sit among its leaves: those the outer
    step averages."""
    return [i for i, p in enumerate(jax.tree.leaves(params)) if jnp.issubdtype(p.dtype, jnp.inexact)]


@dataclasses.dataclass(eq=False)
class DiLoCoMode(etp.AbstractTrainingMode):
    """Each slice its own replica for ``inner_steps`` steps, then one outer step over the live slices.

    :param inner_steps: steps between outer steps (DiLoCo's H); the run's last step is an outer step too.
    :param outer_optimizer: the outer step's optimizer, applied to ``outer - mean(replicas)``.
    :param slices: the slices of the run's first layout (the rows of :meth:`init`).
    :param limit: the cluster's slices: each slice's share of a step's batch is the global batch over these.
    :param steps: the run's steps: its last one ends with an outer step too.
    :param min_slices: the fewest slices a step goes on with when others are lost; with fewer, the step fails
        as a whole and the failure flow takes over (the strategy's plan).
    """

    name = "diloco"
    inner_steps: int
    outer_optimizer: optax.GradientTransformation
    slices: int
    limit: int
    steps: int
    min_slices: int = 1
    _programs: dict = dataclasses.field(default_factory=dict)  # a slice's devices and batch -> its program
    _inner_steps: dict = dataclasses.field(default_factory=dict)  # the run's step functions -> the inner step
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def init(self, arrays: etp.TrainState) -> DiLoCoState:
        outer = [jax.tree.leaves(arrays.params)[i] for i in _trained(arrays.params)]
        return DiLoCoState(replicas=jax.tree.map(lambda a: jnp.stack([a] * self.slices), arrays),
                           outer_params=outer, outer_opt_state=self.outer_optimizer.init(outer))

    def train_state(self, arrays: DiLoCoState) -> etp.TrainState:
        """The outer parameters in the first replica's train state (its optimizer state, step, key and data
        position: every replica's step, key and position are the same). After an outer step, and so at the
        run's end, every replica's parameters are the outer ones."""
        first = jax.tree.map(lambda a: a[0], arrays.replicas)
        leaves, structure = jax.tree.flatten(first.params)
        for i, outer in zip(_trained(first.params), arrays.outer_params, strict=True):
            leaves[i] = outer
        return dataclasses.replace(first, params=structure.unflatten(leaves))

    def abstract(self, abstract: DiLoCoState, *, slices: int) -> DiLoCoState:
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct((slices, *a.shape[1:]), a.dtype), abstract.replicas)
        return dataclasses.replace(abstract, replicas=rows)

    def batch_size(self, global_batch_size: int, *, slices: int, limit: int) -> int:
        """Each slice takes its share of the global batch, whatever the slices left: the global batch over the
        cluster's slices (a slice's program never changes)."""
        return global_batch_size // limit * slices

    def boundary_due(self, step: int, *, steps: int) -> bool:
        return step % self.inner_steps == 0 or step == steps

    def unsynced_from(self, step: int) -> int:
        """The step after the last outer step: one every ``inner_steps`` steps, and one after the run's last."""
        return step if step >= self.steps else step // self.inner_steps * self.inner_steps

    def rows_onto(self, arrays: DiLoCoState, from_slices: Sequence[int], to_slices: Sequence[int]
                  ) -> tuple[DiLoCoState, tuple[int, ...]]:
        """Each slice of ``to_slices`` that ``from_slices`` held keeps its row, and a new one starts from the outer
        parameters with a copy of the first kept row's optimizer state (a copy of its parameters too would count
        that replica's progress twice in the next outer step's mean); the outer parts as they are. With no row
        kept, every slice gets a copy of the first row held, whose training it then carries."""
        kept = [s for s in to_slices if s in from_slices]
        source = kept[0] if kept else from_slices[0]
        rows = np.asarray([list(from_slices).index(s if s in from_slices else source) for s in to_slices])
        replicas = jax.tree.map(lambda a: a[rows], arrays.replicas)
        if kept:
            new = [p for p, s in enumerate(to_slices) if s not in from_slices]
            replicas = _outer_params_at(replicas, arrays.outer_params, new)
        return dataclasses.replace(arrays, replicas=replicas), tuple(kept or [source])

    def move(self, arrays: DiLoCoState, mesh: Mesh, positions: Sequence[int], shardings: DiLoCoState) -> DiLoCoState:
        """The replicated parts as by default; the rows of the slices at ``positions`` to the same slices of
        ``shardings``' mesh (no copy), and a new slice the outer parameters and a copy of the first kept row's
        optimizer state (as :meth:`rows_onto`; at an outer step, where slices are taken in, every replica's
        parameters are the outer ones anyway)."""
        outer = super().move((arrays.outer_params, arrays.outer_opt_state), mesh, positions,
                             (shardings.outer_params, shardings.outer_opt_state))
        leaves, structure = jax.tree.flatten(arrays.replicas)
        fresh = dict(zip(_trained(arrays.replicas.params), arrays.outer_params, strict=True))  # params come first
        moved = [_move_rows(a, mesh, positions, s, new_row=fresh.get(i))
                 for i, (a, s) in enumerate(zip(leaves, jax.tree.leaves(shardings.replicas), strict=True))]
        return DiLoCoState(structure.unflatten(moved), *outer)

    def compile(self, functions: etp.StepFunctions, abstract: DiLoCoState, batch: PyTree, mesh: Mesh, *,
                within_slice: etp.WithinSlice) -> tuple[DiLoCoStep, DiLoCoState]:
        slices = mesh.shape[etp.SLICE_AXIS]
        abstract = self.abstract(abstract, slices=slices)
        row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract.replicas)
        shardings = DiLoCoState(
            replicas=jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(etp.SLICE_AXIS, *s.spec)),
                                  etp.state_shardings(row, mesh, within_slice=within_slice)),
            outer_params=etp.state_shardings(abstract.outer_params, mesh, within_slice=within_slice),
            outer_opt_state=etp.state_shardings(abstract.outer_opt_state, mesh, within_slice=within_slice),
        )
        share = jax.tree.map(lambda b: jax.ShapeDtypeStruct((b.shape[0] // slices, *b.shape[1:]), b.dtype), batch)
        inner = [self._inner_program(functions, row, share, Mesh(mesh.devices[i:i + 1], mesh.axis_names),
                                     within_slice) if _own(mesh.devices[i]) else None for i in range(slices)]
        outer = _compile_outer(self.outer_optimizer, abstract, shardings)
        return DiLoCoStep(mesh, tuple(inner), outer, len(jax.tree.leaves(row)), tuple(_trained(row.params)),
                          jax.tree.leaves(shardings.replicas)), shardings

    def forget_compiled(self) -> None:
        """Let go of every slice's program: the backend they were compiled for is going."""
        with self._lock:
            self._programs.clear()

    def _inner_program(self, functions: etp.StepFunctions, row: etp.TrainState, share: PyTree, mesh: Mesh,
                       within_slice: etp.WithinSlice) -> Any:
        """One slice's step over its row and its share of the batch, on its own devices (``mesh``, 1 slice), the
        row donated; compiled once per slice and share, whatever the layout."""
        key = (tuple(d.id for d in mesh.devices.flat), str(share), within_slice)
        with self._lock:
            if key not in self._programs:
                inner = self._inner_steps.setdefault(functions, _inner_step(functions))
                self._programs[key] = _compile_inner(inner, row, share, mesh, within_slice)
            return self._programs[key]


def _inner_step(functions: etp.StepFunctions) -> Callable[[list, PyTree, jax.Array], tuple[list, dict]]:
    """The inner step of one slice: gradients over its share (averaged over its own devices), then the run's
    optimizer's update; the step's position moves on by the whole step's batch (``batch_size``). One function
    for every slice: JAX traces and lowers it once and compiles it for each slice's devices (four slices' first
    layout took 1.6 s with a function per slice, a quarter of that with one)."""

    def inner(rows: list, batch: PyTree, batch_size: jax.Array) -> tuple[list, dict]:
        leaves = [r[0] for r in rows]
        gradients, metrics = functions.gradients(leaves, batch)
        return [n[None] for n in functions.update(leaves, gradients, jnp.float32(1.0), batch_size)], metrics

    return inner


def _compile_inner(inner: Callable, row: etp.TrainState, share: PyTree, mesh: Mesh, within_slice: etp.WithinSlice
                   ) -> Any:
    """``inner`` (:func:`_inner_step`) compiled for one slice's devices (``mesh``), its row donated."""
    rows = [NamedSharding(mesh, PartitionSpec(etp.SLICE_AXIS, *s.spec))
            for s in jax.tree.leaves(etp.state_shardings(row, mesh, within_slice=within_slice))]
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(inner, donate_argnums=0, in_shardings=(rows, etp.batch_sharding(mesh), replicated),
                     out_shardings=(rows, replicated))
    abstract_rows = [jax.ShapeDtypeStruct((1, *a.shape), a.dtype) for a in jax.tree.leaves(row)]
    return jitted.lower(abstract_rows, share, jax.ShapeDtypeStruct((), jnp.int32)).compile()


def _compile_outer(optimizer: optax.GradientTransformation, abstract: DiLoCoState, shardings: DiLoCoState) -> Any:
    """The outer step over the layout's mesh: ``outer - mean(replicas)`` as the outer gradient, the outer
    optimizer's step, and the new outer parameters as every row's. Nothing donated: a slice lost while it runs
    is dropped, and it runs again over the others."""
    trained = _trained(abstract.replicas.params)
    opt_structure = jax.tree.structure(abstract.outer_opt_state)

    def outer(rows: list, params: list, opt_leaves: list) -> tuple[list, list, list]:
        delta = [p - jnp.mean(r, axis=0) for p, r in zip(params, rows, strict=True)]
        updates, opt_state = optimizer.update(delta, opt_structure.unflatten(opt_leaves), params)
        new = optax.apply_updates(params, updates)
        return ([jnp.broadcast_to(n[None], r.shape) for n, r in zip(new, rows, strict=True)], new,
                jax.tree.leaves(opt_state))

    row_shardings = [jax.tree.leaves(shardings.replicas.params)[i] for i in trained]
    params_shardings, opt_shardings = jax.tree.leaves(shardings.outer_params), jax.tree.leaves(shardings.outer_opt_state)
    jitted = jax.jit(outer, in_shardings=(row_shardings, params_shardings, opt_shardings),
                     out_shardings=(row_shardings, params_shardings, opt_shardings))
    rows = [jax.tree.leaves(abstract.replicas.params)[i] for i in trained]
    return jitted.lower(rows, abstract.outer_params, jax.tree.leaves(abstract.outer_opt_state)).compile()


def _own(devices: np.ndarray) -> bool:
    """Whether this process runs the slice of ``devices``: on a runtime of several processes, each runs its own
    slices' programs alone (a slice of several processes, each of them)."""
    return any(d.process_index == jax.process_index() for d in devices.flat)


def _view(array: jax.Array, rows: Sequence[int], shape: tuple[int, ...]) -> jax.Array:
    """The shards of ``array`` on ``rows`` of its mesh (slices), as an array of ``shape`` on those slices alone:
    no copy (this process's shards; another process's slices hold theirs)."""
    mesh = array.sharding.mesh
    kept = Mesh(mesh.devices[list(rows)], mesh.axis_names)
    by_device = {shard.device: shard.data for shard in array.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(kept, array.sharding.spec), [by_device[d] for d in kept.devices.flat if d in by_device],
        dtype=array.dtype)


def _row(array: jax.Array, position: int) -> jax.Array:
    """Row ``position`` of a stacked ``array``, on its slice alone (no copy)."""
    return _view(array, [position], (1, *array.shape[1:]))


def _assemble(parts: Sequence[jax.Array], mesh: Mesh, spec: PartitionSpec, like: jax.Array) -> jax.Array:
    """The rows of ``parts`` (each one row on one slice of ``mesh``: those this process holds) as one array with a
    row per slice of ``mesh``, shaped and typed like ``like``'s rows."""
    by_device = {shard.device: shard.data for part in parts for shard in part.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        (mesh.shape[etp.SLICE_AXIS], *like.shape[1:]), NamedSharding(mesh, spec),
        [by_device[d] for d in mesh.devices.flat if d in by_device], dtype=like.dtype)


def _move_rows(array: jax.Array, mesh: Mesh, positions: Sequence[int], sharding: NamedSharding, *,
               new_row: jax.Array | None) -> jax.Array:
    """The rows at ``positions`` of ``array`` (over ``mesh``) on ``sharding``'s mesh: a slice there keeps its own
    row if it was kept, and if it is new gets ``new_row`` (one row's value), or a copy of the first kept row (only
    where this process runs the new slice)."""
    kept = {tuple(mesh.devices[p]): _row(array, p) for p in positions}
    first = kept[tuple(mesh.devices[positions[0]])] if new_row is None else np.asarray(new_row)[None]
    parts = [kept[tuple(devices)] if tuple(devices) in kept else jax.device_put(
        first, NamedSharding(Mesh(devices[None], sharding.mesh.axis_names), array.sharding.spec))
        for devices in sharding.mesh.devices if _own(devices)]
    return _assemble(parts, sharding.mesh, sharding.spec, array)


def _outer_params_at(replicas: etp.TrainState, outer_params: Sequence[jax.Array], positions: Sequence[int]
                     ) -> etp.TrainState:
    """``replicas`` (rows of host arrays) with the outer parameters in the rows at ``positions``."""
    if not positions:
        return replicas
    leaves, structure = jax.tree.flatten(replicas.params)
    for i, outer in zip(_trained(replicas.params), outer_params, strict=True):
        rows = np.array(leaves[i])
        rows[list(positions)] = np.asarray(outer)
        leaves[i] = rows
    return dataclasses.replace(replicas, params=structure.unflatten(leaves))


@dataclasses.dataclass(frozen=True)
class DiLoCoStep:
    """A layout's DiLoCo step: one program per slice, run one at a time (XLA:CPU deadlocks with several
    multi-device programs in flight, DESIGN.md §6), and the outer step at the boundary.

    :param mesh: the layout's mesh.
    :param inner: each slice's program, in the layout's order.
    :param outer: the outer step's program.
    :param replica_leaves: how many of the state's leaves are the replicas' (they come first).
    :param trained: where the parameters averaged by the outer step sit among a replica's leaves.
    :param row_shardings: the replicas' leaves' shardings on the mesh.
    """

    mesh: Mesh
    inner: tuple[Any, ...]
    outer: Any
    replica_leaves: int
    trained: tuple[int, ...]
    row_shardings: list
    scalars: dict = dataclasses.field(default_factory=dict)  # (program, batch size) -> the scalar on its devices
    made_rows: dict = dataclasses.field(default_factory=dict)  # replica leaf -> (a step's array, weakly; its rows)

    @property
    def executables(self) -> tuple[Any, ...]:
        return (*(program for program in self.inner if program is not None), self.outer)

    @property
    def own(self) -> list[int]:
        """The positions of the slices whose programs this process runs: every one, or on a runtime of several
        processes, this process's."""
        return [i for i, program in enumerate(self.inner) if program is not None]

    def run(self, leaves: list[jax.Array], batch: PyTree, *, lr_scale: float, batch_size: int,
            monitor: etp.StepMonitor) -> tuple[list[jax.Array], dict[str, float]]:
        """Each slice's inner step on its own row and share of ``batch``; a slice lost before or during its
        program is dropped (its row goes with it) and the others go on. With fewer than ``min_slices`` left, the
        step fails as a whole (:class:`~elastic_trainer.plugin.StepInterrupted`: the failure flow takes over).

        On a runtime of several processes, each runs its own slices' programs, and a step's end is its own
        programs' end: the processes meet only at the outer step (:meth:`boundary`), where a process lost
        meanwhile is found. The loss (and each aux scalar of a ``has_aux`` loss) is the mean of this process's
        slices', each computed over its equal share of the batch."""
        rows, outer = leaves[:self.replica_leaves], leaves[self.replica_leaves:]
        slices, own = self.mesh.shape[etp.SLICE_AXIS], self.own
        meets = jax.process_count() == 1  # one process: every slice's end is checked, as a step's end is
        # this process's slices' rows, before any is donated
        views = [list(v) for v in zip(*(self._rows(j, a) for j, a in enumerate(rows)), strict=True)]
        batch_leaves, structure = jax.tree.flatten(batch)
        made: dict[int, list[jax.Array]] = {}
        slice_metrics, lost, started, announced = [], None, False, False
        for view, i in zip(views, own, strict=True):
            slice_id, program = monitor.slices[i], self.inner[i]
            share = structure.unflatten([_view(b, [i], (b.shape[0] // slices, *b.shape[1:])) for b in batch_leaves])
            try:
                monitor.launching([slice_id])
                started = True  # rows are donated from here on
                new, metrics = program(view, share, self._size(program, batch_size))
                monitor.dispatched()
                if not announced:  # the first program runs
                    announced = True
                    monitor.before_update()
                monitor.wait([*new, *metrics.values()], end=meets, slices=[slice_id])
            except et.SliceLostError as error:  # this slice's row goes with it; the others go on
                monitor.dropped([slice_id], error)
                lost = error
                continue
            except Exception as error:  # noqa: BLE001 - not a slice's loss: the step fails as a whole
                if started:
                    raise etp.StepInterrupted(error, leaves=None, metrics=None) from error
                raise
            made[i] = new
            slice_metrics.append(metrics)
        if not made:  # every slice of this process lost: no row is left
            raise etp.StepInterrupted(lost, leaves=None, metrics=None)
        kept = [i for i in range(slices) if i in made or i not in own]
        mesh = self.mesh if len(kept) == slices else Mesh(self.mesh.devices[kept], self.mesh.axis_names)
        new_rows = [_assemble([made[i][j] for i in sorted(made)], mesh, self.row_shardings[j].spec, rows[j])
                    for j in range(self.replica_leaves)]
        self.made_rows.clear()
        if len(kept) == slices:  # the next step on this layout takes these rows as they are
            for j in range(self.replica_leaves):
                self._remember(j, new_rows[j], [made[i][j] for i in own])
        new_leaves = new_rows + (outer if len(kept) == slices else [_view(a, kept, a.shape) for a in outer])
        monitor.made(new_leaves)
        got = jax.device_get(slice_metrics)
        return new_leaves, {name: float(np.mean([m[name] for m in got])) for name in got[0]}

    def _rows(self, leaf: int, array: jax.Array) -> list[jax.Array]:
        """This process's slices' rows of ``array`` (:attr:`own`), the replica leaf at ``leaf``: the rows the last
        step made it from, if it is that step's, else a view of each (no copy either way; making views of every
        leaf took half of a tiny model's step on the host)."""
        made, rows = self.made_rows.get(leaf, (lambda: None, None))
        return rows if made() is array else [_row(array, i) for i in self.own]

    def _remember(self, leaf: int, array: jax.Array, rows: list[jax.Array]) -> None:
        """Keep ``rows``, which ``array`` (the replica leaf at ``leaf``) was made from, for as long as ``array``
        lives: once the run has let go of it (a resize, a restore), its rows are let go of too."""

        def forget(ref: weakref.ref) -> None:
            if self.made_rows.get(leaf, (None,))[0] is ref:
                del self.made_rows[leaf]

        self.made_rows[leaf] = (weakref.ref(array, forget), rows)

    def _size(self, program: Any, batch_size: int) -> jax.Array:
        """``batch_size`` on ``program``'s devices, put there once."""
        key = (id(program), batch_size)
        if key not in self.scalars:
            self.scalars[key] = jax.device_put(np.int32(batch_size), program.input_shardings[0][2])
        return self.scalars[key]

    def boundary(self, leaves: list[jax.Array], *, monitor: etp.StepMonitor) -> list[jax.Array]:
        """The outer step over every slice of the layout; the new leaves (the replicas' optimizer states, steps,
        keys and positions unchanged)."""
        rows, outer = leaves[:self.replica_leaves], leaves[self.replica_leaves:]
        trained = len(self.trained)
        monitor.launching()
        new_rows, params, opt_state = self.outer([rows[i] for i in self.trained], outer[:trained], outer[trained:])
        monitor.before_update()
        monitor.wait([*new_rows, *params, *opt_state], end=True)
        replaced = dict(zip(self.trained, new_rows, strict=True))
        return [replaced.get(i, a) for i, a in enumerate(rows)] + params + opt_state

