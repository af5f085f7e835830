"""A lost process that comes back joins the running job (``cluster=multiprocess``, docs/multiprocess.md, "Rejoin").

With jax 0.10.2 on CPU a replacement cannot take part in the survivors'
collectives as they stand: gloo's rendezvous keys in the coordination
service are named after the devices only, and each process keeps its
communicators for as long as its CPU client lives (XLA's
``gloo_collectives.cc`` and ``cpu_cliques.cc``). So the survivors take a
replacement in at a step boundary, all together: they meet it at a barrier,
the lowest of them deletes the old backend's keys, and every process starts a
new CPU backend; the train state then reaches the replacement from a peer
(:func:`compile_from_peers`), with no checkpoint read. A spare process
(``cluster.spare_slices``) is taken in the same way: it waits as a replacement
waits, from the job's start (docs/multiprocess.md, "Spare processes").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, final

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ..._mesh import SLICE_AXIS
from ..._private_apis import own_process_id
from . import _keys as keys
from ._membership import dead_here
from ._platform import PlatformLayer

if TYPE_CHECKING:
    from ._membership import Membership

RETURNS_DIR_ENV = "ELASTIC_TRAINER_RETURNS_DIR"
"""Set by the local launcher to a directory where a process that failure injection takes down for a while (or
one that leaves with its slice, lost or dropped) notes when it comes back (``process<i>.returns_at``, its
``time.time()`` then), and where the live processes note that they found it lost (``process<i>.lost``). The launcher starts its replacement once both are there, as Kubernetes
or Slurm's ``--requeue`` would restart a lost task: a replacement that joined before the live processes found
its predecessor's death would hold their agreement on who lives (``live_devices`` waits for every live process
it names, and the replacement is live)."""

@dataclasses.dataclass(frozen=True)
class Admission:
    """How the live processes take a replacement in, as they tell it.

    :param round: the how-manieth admission of the job (it names the barriers).
    :param processes: every process of the job once it is in.
    :param slices: the slices the job goes on with.
    :param donor: the slice whose state every other slice gets.
    :param step: the step the job is at.
    :param position: samples consumed by then.
    :param dispatched: steps the processes have dispatched (their count of step agreements).
    :param agreements: how many times the processes agreed on who lives.
    :param incarnations: the slices' failure counts.
    :param checkpoint_group: the number of the checkpoint group the processes save in from then on.
    :param returning: the slices taken back in (their processes replacements or spares).
    """

    round: int
    processes: tuple[int, ...]
    slices: tuple[int, ...]
    donor: int
    step: int
    position: int
    dispatched: int
    agreements: int
    incarnations: tuple[int, ...]
    checkpoint_group: int
    returning: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Admission:
        fields = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def restart_backends(client, admission: Admission, *, platform: PlatformLayer, timeout_s: float,
                     before_restart: Callable[[], None] = lambda: None) -> bool:
    """Every process of ``admission`` (the survivors and the replacements alike) starts a new backend of
    ``platform``; ``False`` when not every one of them came to meet within ``timeout_s`` (a replacement died after
    asking to join), and nothing was done.

    They meet; each does ``before_restart``; the lowest deletes what the old
    backend's collectives left in the key-value store
    (:meth:`PlatformLayer.forget_collectives`); they meet again, and each
    drops its backend (its communicators go with it) and starts a new one,
    whose start-up exchanges the topology of every process. Arrays of the
    old backend must not be used afterwards.
    """
    processes = list(admission.processes)
    try:
        client.wait_at_barrier(keys.rejoin_barrier(admission.round, "met"), int(timeout_s * 1000), process_ids=processes)
    except jax.errors.JaxRuntimeError:  # timed out for every process that came: none has changed anything
        return False
    before_restart()
    if own_process_id() == min(processes):  # a replacement has no backend yet: it must not start one here
        platform.forget_collectives(client)
    client.wait_at_barrier(keys.rejoin_barrier(admission.round, "clean"), int(timeout_s * 1000), process_ids=processes)
    platform.restart_backend()
    return True


def wait_to_be_admitted(client, key: str, *, timeout_s: float) -> Admission | str:
    """In a replacement or a spare: wait until the live processes take it in (their :class:`Admission` under
    ``key``); when they do not, why, in words."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = keys.noted(client, key)
        if answer is not None:
            return Admission.from_json(answer)
        if keys.noted(client, keys.ENDED) is not None:
            return "the job ended before taking it in"
        time.sleep(0.2)
    return (f"the strategy did not take its slice back within cluster.initialization_timeout_s={timeout_s:g} "
            "(scale_down takes slices back with strategy.scale_up=true)")


def note_pid(client) -> None:
    """Note ``"<host> <OS pid>"`` of this process under its process id (:func:`keys.pid`)."""
    client.key_value_set(keys.pid(own_process_id()), keys.NotedPid(socket.gethostname(), os.getpid()).text,
                         allow_overwrite=True)


def note_return(client, down_for_s: float, *, back_at: float | None = None, process: int | None = None) -> None:
    """Before this process (or ``process``) is taken down for ``down_for_s`` (or until ``back_at``, a
    ``time.time()``): tell the launcher when to start its replacement, and the others when to expect it
    (:meth:`Rejoin.lost_slices_return`)."""
    directory = os.environ.get(RETURNS_DIR_ENV)
    process = own_process_id() if process is None else process
    if directory is not None:
        back_at = repr(time.time() + down_for_s if back_at is None else back_at)
        Path(directory, f"process{process}.returns_at").write_text(back_at)
        client.key_value_set(keys.returns(process), back_at, allow_overwrite=True)


def say_down(client) -> None:
    """Note when this process goes down (failure injection, or its slice was lost or dropped), for the others'
    records."""
    client.key_value_set(keys.down(own_process_id()), repr(time.time()))


def note_lost(processes: Sequence[int]) -> None:
    """In the lowest live process, once the live ones agreed that ``processes`` died: the launcher may start their
    replacements (:data:`RETURNS_DIR_ENV`)."""
    directory = os.environ.get(RETURNS_DIR_ENV)
    for process in processes if directory is not None else ():
        Path(directory, f"process{process}.lost").touch()


def to_host(arrays: PyTree) -> list[dict[int, np.ndarray]]:
    """This process's shards of each of ``arrays``' leaves, in host memory, by device id: what a new backend's
    arrays are made from (:func:`from_host`)."""
    return [{s.device.id: np.asarray(s.data) for s in leaf.addressable_shards} for leaf in jax.tree.leaves(arrays)]


def from_host(host: list[dict[int, np.ndarray]], abstract: PyTree, shardings: PyTree) -> PyTree:
    """Arrays shaped like ``abstract`` on ``shardings``, each device's shard from ``host`` (:func:`to_host`) where
    it held one, else zeros (a returning slice's devices, which :func:`compile_from_peers` fills)."""
    likes, structure = jax.tree.flatten(abstract)

    def make(held: dict[int, np.ndarray], like: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.Array:
        zeros = np.zeros(sharding.shard_shape(like.shape), like.dtype)
        return jax.make_array_from_single_device_arrays(like.shape, sharding, [
            jax.device_put(held.get(device.id, zeros), device) for device in sharding.addressable_devices
        ])

    return structure.unflatten([make(*leaf) for leaf in zip(host, likes, structure.flatten_up_to(shardings))])


def compile_from_peers(arrays: PyTree, shardings: PyTree, donor: int, returning: Sequence[int]
                       ) -> Callable[[PyTree], PyTree]:
    """The compiled program that gives ``arrays`` every slice's shards from the slice at position ``donor`` of the
    mesh: a sum over the slices to which only the donor adds anything, so every value is the donor's exactly. A
    leaf split over the slices (its spec names the slice axis: a semi-synchronous mode's rows, each slice's own)
    changes only at the positions ``returning``, which take the donor's part; the other slices keep theirs.

    Compiling runs no collective; the caller runs the program once every
    process of the mesh is there to take part (gloo waits only 30 s for a
    peer's first collective on a new backend).
    """
    specs = jax.tree.map(lambda s: s.spec, shardings)
    mesh = jax.tree.leaves(shardings)[0].mesh

    def keep_donors(tree: PyTree) -> PyTree:
        position = jax.lax.axis_index(SLICE_AXIS)
        mine, takes = position == donor, jnp.isin(position, jnp.asarray(returning, jnp.int32))

        def one(x: jax.Array, spec: PartitionSpec) -> jax.Array:
            wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
            summed = jax.lax.psum(jnp.where(mine, wide, jnp.zeros_like(wide)), SLICE_AXIS).astype(x.dtype)
            split = any(SLICE_AXIS in (axes if isinstance(axes, tuple) else (axes,)) for axes in spec)
            return jnp.where(takes, summed, x) if split else summed  # split: each slice holds a part of its own

        return jax.tree.map(one, tree, specs)

    spread = jax.shard_map(keep_donors, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
    return jax.jit(spread, out_shardings=shardings).lower(arrays).compile()


def donor_of(slices: Sequence[int], returning: Sequence[int]) -> int:
    """The position in ``slices`` of the first slice that is not returning: the one whose state the others get."""
    return next(i for i, s in enumerate(slices) if s not in returning)


@final
class Rejoin:
    """The rejoin of :class:`MultiprocessCluster`: a replacement (or a spare) asks to join, the live processes
    agree on it at the end of a step (:meth:`Membership.agree`), and the trainer takes it in at the next step
    boundary (:meth:`take_in`).

    :param membership: who is in the job.
    :param client: returns the coordination service's client.
    :param initialization_timeout_s: how long a replacement waits to be taken in.
    :param barrier_timeout_s: how long the processes wait for each other at an admission's barriers.
    :param platform_layer: what restarts the backend at a rejoin (the cluster's ``cluster.platform``).
    :param keeps_spares: the job keeps spare slices: a replacement waits as long as the job runs, a spare now.
    """

    def __init__(self, membership: Membership, *, client: Callable, initialization_timeout_s: float,
                 barrier_timeout_s: float, platform_layer: PlatformLayer, keeps_spares: bool = False):
        self.admission: Admission | None = None
        """In a replacement: how the live processes took it in (once :meth:`ask_to_join` returned); else ``None``."""
        self._membership = membership
        self._client = client
        self._initialization_timeout_s = initialization_timeout_s
        self._barrier_timeout_s = barrier_timeout_s
        self._platform_layer = platform_layer
        self._keeps_spares = keeps_spares
        self._rounds = 0  # admissions so far

    def ask_to_join(self) -> bool:
        """In a process that starts: if this process id ran in the job before (its ``pid`` note is there), it is a
        replacement; if it is a spare's, a spare. Either asks the live processes to take it in and waits for them;
        ``False`` for a first start in the mesh.

        A replacement asks before it starts its backend, which it starts
        together with theirs. A spare starts its backend with every other
        process first (the job's first backend counts it), then waits for as
        long as the job runs.
        """
        client, process, me = self._client(), own_process_id(), str(os.getpid())
        spare = process not in self._membership.live and keys.noted(client, keys.pid(process)) is None
        if spare:
            jax.devices()  # the job's first backend, started together
            note_pid(client)
        elif keys.noted(client, keys.pid(process)) is None:
            return False
        client.key_value_set(keys.join(process), me, allow_overwrite=True)
        admission = wait_to_be_admitted(client, keys.admitted(process, me),
                                        timeout_s=math.inf if self._keeps_spares else self._initialization_timeout_s)
        if isinstance(admission, str):  # it ends, and the launcher does not take that for the job's end
            client.key_value_delete(keys.join(process))
            if spare:
                print(f"elastic_trainer: spare process {process} was not needed: {admission}.", file=sys.stderr)
                raise SystemExit(0)
            raise SystemExit(f"elastic_trainer: process {process} came back, but {admission}; it ends.")
        if not restart_backends(client, admission, platform=self._platform_layer, timeout_s=self._barrier_timeout_s):
            raise SystemExit(f"elastic_trainer: process {process} came back, but not every process came to take it "
                             f"in within cluster.barrier_timeout_s={self._barrier_timeout_s}; it ends.")
        self.admission = admission
        self._rounds = admission.round + 1
        self._membership.go_on_from(admission)
        return True

    def lost_slices_return(self, slices: Sequence[int], *, within_s: float) -> bool:
        """Whether every process of lost ``slices`` is due back within ``within_s``: the local launcher starts a
        replacement of a process that failure injection took down for a while, when it said (:func:`note_return`).
        Nothing else is known to come back: another scheduler's replacements join too, but are not waited for.

        The live processes of those slices are leaving the job and note first whether they come back with their
        dead partners (:meth:`note_own_return`): this waits until each has (:meth:`_await_partners`), so the
        answer does not depend on which process got there first."""
        self._await_partners(slices)
        due = [self._slice_due_back(s) for s in slices]
        return None not in due and max(due, default=0) <= time.time() + within_s

    def _slice_due_back(self, slice_index: int) -> float | None:
        """When every process of lost slice ``slice_index`` is due back (``time.time()``); ``None`` if one is not
        known to come back.

        A process of the slice that died before it could say so (a partner
        whose collectives aborted when its peer was killed: gloo's SIGABRT)
        comes back with its slice, as it would have said (:meth:`note_own_return`):
        the lowest live process notes that for it, so the launcher starts its
        replacement too.
        """
        client, membership = self._client(), self._membership
        noted = {p: keys.noted(client, keys.returns(p)) for p in membership.processes_of(slice_index)}
        known = [float(back_at) for back_at in noted.values() if back_at is not None]
        unsaid = [p for p, back_at in noted.items() if back_at is None]
        if not known or any(p in membership.live and not dead_here(client, p) for p in unsaid):
            return None
        if own_process_id() == min(membership.live):
            for process in unsaid:
                note_return(client, 0, back_at=max(known), process=process)
        return max(known)

    def _await_partners(self, slices: Sequence[int]) -> None:
        """Wait until every process of lost ``slices`` still live at the last agreement has said whether it comes
        back (its ``left`` note for the slice's incarnation), up to ``barrier_timeout_s`` in all: one that died
        before saying so is not waited for longer."""
        membership = self._membership
        deadline = time.monotonic() + self._barrier_timeout_s
        for s in slices:
            for p in (p for p in membership.processes_of(s) if p in membership.live):
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                try:
                    self._client().blocking_key_value_get(keys.left(p, membership.failures[s]), remaining_ms)
                except jax.errors.JaxRuntimeError:  # not noted in time: it died before it could
                    return

    def note_own_return(self, slice_index: int) -> None:
        """In a live process that leaves the job with its slice: when the dead ones of the slice come back, come
        back with them (the slice returns whole); a slice dropped alive comes back at once, to wait until wanted.
        Then note that it has decided (:meth:`_await_partners` waits for that)."""
        membership = self._membership
        dead = [p for p in membership.processes_of(slice_index) if p not in membership.live]
        due = [keys.noted(self._client(), keys.returns(p)) for p in dead]
        if None not in due:
            note_return(self._client(), 0, back_at=max(map(float, due), default=time.time()))
        self._client().key_value_set(keys.left(own_process_id(), membership.failures[slice_index]), "1",
                                     allow_overwrite=True)

    def take_in(self, slices: Sequence[int], *, step: int, position: int, checkpoint_group: int,
                before_restart: Callable[[], None]) -> tuple[int, ...]:
        """At a step boundary, go on with ``slices``: take in the replacements of those returning; the processes
        taken in (none when they did not come).

        Every live process calls this with the same values. Every process (the
        replacements too) then starts a new backend (:func:`restart_backends`):
        ``before_restart`` lets go of what runs on the old one, and the caller
        moves the state over (:func:`compile_from_peers`) afterwards. A replacement
        that does not come to meet (it died after asking) is given up, and the
        job goes on as it was. Replacements of slices not in ``slices`` go on
        waiting to be wanted.
        """
        membership = self._membership
        returning = membership.returning_slices()
        joining = sorted(p for s in slices if s in returning for p in membership.processes_of(s))
        admission = Admission(
            round=self._rounds, processes=tuple(sorted(membership.live | set(joining))), slices=tuple(slices),
            donor=donor_of(slices, returning), step=step, position=position, dispatched=membership.dispatched,
            agreements=membership.agreements, incarnations=tuple(membership.failures),
            checkpoint_group=checkpoint_group, returning=tuple(s for s in slices if s in returning),
        )
        client = self._client()
        if own_process_id() == min(membership.live):
            for process in joining:
                replacement = keys.noted(client, keys.join(process))
                client.key_value_delete(keys.join(process))
                client.key_value_set(keys.admitted(process, replacement), admission.to_json())
        membership.returning -= set(joining)
        self._rounds += 1  # a round given up is not met again: its barriers' names are not used twice
        if not restart_backends(client, admission, platform=self._platform_layer, timeout_s=self._barrier_timeout_s,
                                before_restart=before_restart):
            print(f"elastic_trainer: process(es) {joining} asked to join but did not come to be taken in within "
                  f"cluster.barrier_timeout_s={self._barrier_timeout_s}; going on without them", file=sys.stderr)
            return ()
        membership.live |= set(joining)
        return tuple(joining)

    def release(self, slices: Sequence[int]) -> None:
        """``slices`` are no longer used: their processes leave the job (a process outside every mesh cannot stay
        in it), as a lost slice's live processes do, and the others stop waiting for them at once. Under the local
        launcher they come back at once as replacements, taken in when the strategy wants the slices again
        (``scale_down``: after ``strategy.drop_for_steps``)."""
        leaving = {p for s in slices for p in self._membership.processes_of(s)} & self._membership.live
        if own_process_id() in leaving:
            self.leave_with_slice(f"slice(s) {sorted(slices)} were dropped by the strategy")
        self._membership.lose(leaving)

    def leave_with_slice(self, message: str) -> None:
        """This process lives but its slice is lost or dropped: go too (SIGKILL, as the slice's dead process went),
        saying why."""
        say_down(self._client())
        self.note_own_return(own_process_id() // self._membership.processes_per_slice)
        print(f"elastic_trainer: process {own_process_id()} leaves the job: {message}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
