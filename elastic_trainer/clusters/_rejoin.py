"""A lost process that comes back joins the running job (``cluster=multiprocess``, docs/multiprocess.md, "Rejoin").

With jax 0.10.2 on CPU a replacement cannot take part in the survivors'
collectives as they stand: gloo's rendezvous keys in the coordination
service are named after the devices only, and each process keeps its
communicators for as long as its CPU client lives (XLA's
``gloo_collectives.cc`` and ``cpu_cliques.cc``). So the survivors take a
replacement in at a step boundary, all together: they meet it at a barrier,
the lowest of them deletes the old backend's keys, and every process starts a
new CPU backend; the train state then reaches the replacement from a peer
(:func:`compile_from_peers`), with no checkpoint read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .._mesh import SLICE_AXIS
from .._private_apis import own_process_id
from ._base import SyncCall
from ._coordinator import KEY_PREFIX, noted
from ._platform import PLATFORM_LAYERS, PlatformLayer

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
    processes, barrier = list(admission.processes), f"{KEY_PREFIX}rejoin{admission.round}"
    try:
        client.wait_at_barrier(f"{barrier}/met", int(timeout_s * 1000), process_ids=processes)
    except jax.errors.JaxRuntimeError:  # timed out for every process that came: none has changed anything
        return False
    before_restart()
    if own_process_id() == min(processes):  # a replacement has no backend yet: it must not start one here
        platform.forget_collectives(client)
    client.wait_at_barrier(f"{barrier}/clean", int(timeout_s * 1000), process_ids=processes)
    platform.restart_backend()
    return True


def wait_to_be_admitted(client, key: str, *, timeout_s: float) -> Admission | str:
    """In a replacement: wait until the live processes take it in (their :class:`Admission` under ``key``); when
    they do not, why, in words."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = noted(client, key)
        if answer is not None:
            return Admission.from_json(answer)
        if noted(client, "ended") is not None:
            return "the job ended before taking it back in"
        time.sleep(0.2)
    return (f"the strategy did not take its slice back within cluster.initialization_timeout_s={timeout_s:g} "
            "(scale_down takes slices back with strategy.scale_up=true)")


def note_return(client, down_for_s: float, *, back_at: float | None = None) -> None:
    """Before this process is taken down for ``down_for_s`` (or until ``back_at``, a ``time.time()``): tell the
    launcher when to start its replacement, and the others when to expect it
    (:meth:`ProcessRejoin.lost_slices_return`)."""
    directory = os.environ.get(RETURNS_DIR_ENV)
    if directory is not None:
        back_at = repr(time.time() + down_for_s if back_at is None else back_at)
        Path(directory, f"process{own_process_id()}.returns_at").write_text(back_at)
        client.key_value_set(f"{KEY_PREFIX}returns/{own_process_id()}", back_at, allow_overwrite=True)


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


def compile_from_peers(arrays: PyTree, shardings: PyTree, donor: int) -> Callable[[PyTree], PyTree]:
    """The compiled program that gives ``arrays`` every slice's shards from the slice at position ``donor`` of the
    mesh: a sum over the slices to which only the donor adds anything, so every value is the donor's exactly.

    Compiling runs no collective; the caller runs the program once every
    process of the mesh is there to take part (gloo waits only 30 s for a
    peer's first collective on a new backend).
    """
    specs = jax.tree.map(lambda s: s.spec, shardings)
    mesh = jax.tree.leaves(shardings)[0].mesh

    def keep_donors(tree: PyTree) -> PyTree:
        mine = jax.lax.axis_index(SLICE_AXIS) == donor

        def one(x: jax.Array) -> jax.Array:
            wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
            summed = jax.lax.psum(jnp.where(mine, wide, jnp.zeros_like(wide)), SLICE_AXIS)
            return summed.astype(x.dtype)

        return jax.tree.map(one, tree)

    spread = jax.shard_map(keep_donors, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
    return jax.jit(spread, out_shardings=shardings).lower(arrays).compile()


def _left_key(process: int, incarnation: int) -> str:
    """The key-value note by which ``process`` says it has noted whether it comes back with its slice, lost in the
    slice's ``incarnation`` (its failure count as the live processes agreed on it)."""
    return f"left/{process}/{incarnation}"


def donor_of(slices: Sequence[int], returning: Sequence[int]) -> int:
    """The position in ``slices`` of the first slice that is not returning: the one whose state the others get."""
    return next(i for i, s in enumerate(slices) if s not in returning)


class ProcessRejoin:
    """The rejoin of :class:`MultiprocessCluster`: a replacement asks to join, the live processes agree on it at
    the end of a step, and the trainer takes it in at the next step boundary (:meth:`take_in`).

    Mixed into the cluster, whose ``slices``, ``processes_of``, ``initialization_timeout_s``,
    ``barrier_timeout_s``, ``_client``, ``_live``, ``_failures``, ``_dispatched`` and
    ``_leave_with_lost_slice`` it uses.
    """

    platform_layer: PlatformLayer = PLATFORM_LAYERS["cpu"]
    """What restarts the backend at a rejoin (the cluster's ``cluster.platform``)."""
    _returning: frozenset[int] = frozenset()  # processes that asked to join, as the live ones agreed
    _agreements = 0  # times the live processes agreed on who lives
    _rounds = 0  # admissions so far

    def _ask_to_join(self) -> bool:
        """In a process that starts: if this process id ran in the job before (its ``pid`` note is there), it is a
        replacement: ask the live processes to take it in, and wait for them; ``False`` for a first start.

        Called before this process starts its backend, which it starts together with theirs.
        """
        client, process, me = self._client(), own_process_id(), str(os.getpid())
        if noted(client, f"pid/{process}") is None:
            return False
        client.key_value_set(f"{KEY_PREFIX}join/{process}", me, allow_overwrite=True)
        admission = wait_to_be_admitted(client, f"admitted/{process}/{me}", timeout_s=self.initialization_timeout_s)
        if isinstance(admission, str):  # it ends, and the launcher does not take that for the job's end
            client.key_value_delete(f"{KEY_PREFIX}join/{process}")
            raise SystemExit(f"elastic_trainer: process {process} came back, but {admission}; it ends.")
        if not restart_backends(client, admission, platform=self.platform_layer, timeout_s=self.barrier_timeout_s):
            raise SystemExit(f"elastic_trainer: process {process} came back, but not every process came to take it "
                             f"in within cluster.barrier_timeout_s={self.barrier_timeout_s}; it ends.")
        self.admission = admission
        self._rounds = admission.round + 1
        self._live, self._failures = set(admission.processes), list(admission.incarnations)
        self._dispatched, self._agreements = admission.dispatched, admission.agreements
        return True

    def _offer_returns(self) -> None:
        """Before the processes agree on who lives: the lowest live one notes which replacements asked to join."""
        self._agreements += 1
        if own_process_id() != min(self._live):
            return
        asking = [int(key.rsplit("/", 1)[1]) for key, _ in self._client().key_value_dir_get(f"{KEY_PREFIX}join")]
        asking = sorted(p for p in asking if p not in self._live)
        if asking:
            self._client().key_value_set(f"{KEY_PREFIX}asks/{self._agreements}", json.dumps(asking))

    def _hear_returns(self) -> None:
        """After the agreement: every live process reads which replacements asked (the same for all)."""
        asked = noted(self._client(), f"asks/{self._agreements}")
        self._returning = frozenset(json.loads(asked)) if asked is not None else frozenset()

    def lost_slices_return(self, slices: Sequence[int], *, within_s: float) -> bool:
        """Whether every process of lost ``slices`` is due back within ``within_s``: the local launcher starts a
        replacement of a process that failure injection took down for a while, when it said (:func:`note_return`).
        Nothing else is known to come back: another scheduler's replacements join too, but are not waited for.

        The live processes of those slices are leaving the job and note first whether they come back with their
        dead partners (:meth:`_note_own_return`): this waits until each has (:meth:`_await_partners`), so the
        answer does not depend on which process got there first."""
        self._await_partners(slices)
        due = [noted(self._client(), f"returns/{p}") for s in slices for p in self.processes_of(s)]
        return None not in due and max(map(float, due), default=0) <= time.time() + within_s

    def _await_partners(self, slices: Sequence[int]) -> None:
        """Wait until every process of lost ``slices`` still live at the last agreement has said whether it comes
        back (its ``left`` note for the slice's incarnation), up to ``barrier_timeout_s`` in all: one that died
        before saying so is not waited for longer."""
        deadline = time.monotonic() + self.barrier_timeout_s
        for s in slices:
            for p in (p for p in self.processes_of(s) if p in self._live):
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                try:
                    self._client().blocking_key_value_get(f"{KEY_PREFIX}{_left_key(p, self._failures[s])}",
                                                          remaining_ms)
                except jax.errors.JaxRuntimeError:  # not noted in time: it died before it could
                    return

    def _note_own_return(self, slice_index: int) -> None:
        """In a live process that leaves the job with its slice: when the dead ones of the slice come back, come
        back with them (the slice returns whole); a slice dropped alive comes back at once, to wait until wanted.
        Then note that it has decided (:meth:`_await_partners` waits for that)."""
        dead = [p for p in self.processes_of(slice_index) if p not in self._live]
        due = [noted(self._client(), f"returns/{p}") for p in dead]
        if None not in due:
            note_return(self._client(), 0, back_at=max(map(float, due), default=time.time()))
        self._client().key_value_set(f"{KEY_PREFIX}{_left_key(own_process_id(), self._failures[slice_index])}", "1",
                                     allow_overwrite=True)

    def await_returns(self) -> None:
        """The live processes agree on who lives (a barrier), and so on the replacements that asked to join."""
        self._agree_on_live_processes(SyncCall.AWAIT_RETURNS)

    def returning_slices(self) -> list[int]:
        """Slices whose every process is a replacement that asked to join."""
        return [s for s in range(self.slices) if set(self.processes_of(s)) <= self._returning]

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
        returning = self.returning_slices()
        joining = sorted(p for s in slices if s in returning for p in self.processes_of(s))
        admission = Admission(
            round=self._rounds, processes=tuple(sorted(self._live | set(joining))), slices=tuple(slices),
            donor=donor_of(slices, returning), step=step, position=position, dispatched=self._dispatched,
            agreements=self._agreements, incarnations=tuple(self._failures), checkpoint_group=checkpoint_group,
        )
        client = self._client()
        if own_process_id() == min(self._live):
            for process in joining:
                replacement = noted(client, f"join/{process}")
                client.key_value_delete(f"{KEY_PREFIX}join/{process}")
                client.key_value_set(f"{KEY_PREFIX}admitted/{process}/{replacement}", admission.to_json())
        self._returning -= set(joining)
        self._rounds += 1  # a round given up is not met again: its barriers' names are not used twice
        if not restart_backends(client, admission, platform=self.platform_layer, timeout_s=self.barrier_timeout_s,
                                before_restart=before_restart):
            print(f"elastic_trainer: process(es) {joining} asked to join but did not come to be taken in within "
                  f"cluster.barrier_timeout_s={self.barrier_timeout_s}; going on without them", file=sys.stderr)
            return ()
        self._live |= set(joining)
        return tuple(joining)

    def release(self, slices: Sequence[int]) -> None:
        """``slices`` are no longer used: their processes leave the job (a process outside every mesh cannot stay
        in it), as a lost slice's live processes do, and the others stop waiting for them at once. Under the local
        launcher they come back at once as replacements, taken in when the strategy wants the slices again
        (``scale_down``: after ``strategy.drop_for_steps``)."""
        leaving = {p for s in slices for p in self.processes_of(s)} & self._live
        if own_process_id() in leaving:
            self._leave_with_lost_slice(f"slice(s) {sorted(slices)} were dropped by the strategy")
        self._live -= leaving
        if own_process_id() == min(self._live):
            note_lost(sorted(leaving))  # their replacements may start
        for s in slices:
            self._failures[s] += 1
