"""The same synchronization calls in the same order on every live process, checked at each agreement.

On the multi-controller runtime every :meth:`~elastic_trainer.clusters.AbstractCluster.synchronize` is a global
agreement: every live process must make the same calls in the same order, or the processes meet at the wrong barriers (one
waits in a save's collectives while another restores) and hang or mismatch. Each process notes which call it makes
under the agreement's number before the barrier, and reads the others' after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..._failures import SyncMismatchError
from .._base import SyncCall
from . import _keys as keys

SLOTS = 2
"""Agreement ``n`` is noted in slot ``n % 2``: a process writes agreement ``n + 2`` there only after the barrier of
``n + 1``, which every process passes after reading agreement ``n``'s, so two slots hold every note still read."""


class CallOrder:
    """Notes this process's synchronization calls, and checks them against the other live processes'.

    :param client: the coordination service's client.
    :param process: this process's index.
    """

    def __init__(self, client: Callable, process: Callable[[], int]):
        self._client, self._process = client, process

    def note(self, number: int, call: SyncCall) -> None:
        """Before agreement ``number``'s barrier: this process makes it from ``call``."""
        self._client().key_value_set(keys.sync_call(number % SLOTS, self._process()), f"{number} {call.name}",
                                     allow_overwrite=True)

    def check(self, number: int, call: SyncCall, live: Iterable[int]) -> None:
        """After agreement ``number``'s barrier, which no process died in: raise :class:`SyncMismatchError`
        naming the two calls if a ``live`` process made it from another call than ``call``, or did not make it."""
        slot = self._client().key_value_dir_get(keys.sync_slot(number % SLOTS))  # one read, not one per process
        notes = {int(key.rsplit("/", 1)[1]): value for key, value in slot}
        for process in sorted(live):
            theirs = notes.get(process)
            if theirs == f"{number} {call.name}":
                continue
            their_number, _, their_call = (theirs or "none none").partition(" ")
            made = (f"made call {their_number} at {SyncCall[their_call].value}" if their_call in SyncCall.__members__
                    else "made none")
            raise SyncMismatchError(
                f"process {self._process()} made synchronization call {number} at {call.value} but process "
                f"{process} {made} there: every live process must make the same synchronization calls in the same "
                "order, and one of them was made on one process only (by a plugin or by elastic_trainer itself)."
            )
