"""Which samples the committed steps consumed, to prove none was skipped or seen twice."""

from __future__ import annotations

import numpy as np

from ._data import sample_ids


class SampleLedger:
    """The sample indices of every committed step, by step.

    Steps rolled back by a restore are dropped again, so the ledger always
    holds what the surviving state was trained on. Samples a step read but
    whose training no state holds any more (a dropped replica's,
    :meth:`forget`) count as skipped.

    :param num_samples: size of the dataset.
    :param seed: the data order's seed.
    :param start_position: the data position the run started from.
    """

    def __init__(self, num_samples: int, *, seed: int, start_position: int):
        self.num_samples = num_samples
        self.seed = seed
        self.start_position = start_position
        self._ids_by_step: dict[int, np.ndarray] = {}
        self._forgotten: dict[int, list[tuple[int, slice]]] = {}  # step -> (when, its rows) of each forget

    def commit(self, step: int, ids: np.ndarray) -> None:
        """Record that step ``step`` (0-based) was trained on samples ``ids``."""
        self._ids_by_step[step] = ids
        self._forgotten.pop(step, None)

    def ids_of(self, step: int) -> np.ndarray:
        """The samples committed step ``step`` read."""
        return self._ids_by_step[step]

    def forget(self, step: int, rows: slice, *, at: int) -> int:
        """Step ``step``'s samples ``rows`` (of its batch) are no longer trained on by the state as of step ``at``
        (a replica dropped then): skipped, unless a roll-back to a state from before ``at`` undoes it. Returns how
        many of them were still counted."""
        forgotten = int(self._kept_of(step)[rows].sum())
        self._forgotten.setdefault(step, []).append((at, rows))
        return forgotten

    def roll_back(self, to_step: int) -> None:
        """Forget steps ``to_step`` and later: the state no longer contains them; and undo what was forgotten at
        those steps: the state restored still holds it."""
        for step in [s for s in self._ids_by_step if s >= to_step]:
            del self._ids_by_step[step]
            self._forgotten.pop(step, None)
        for step, forgets in self._forgotten.items():
            forgets[:] = [(at, rows) for at, rows in forgets if at < to_step]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The ledger as arrays (``steps``, ``sizes``, ``ids``, ``kept``, ``start_position``), for ``np.savez``."""
        steps = sorted(self._ids_by_step)
        return {
            "steps": np.asarray(steps, np.int64),
            "sizes": np.asarray([len(self._ids_by_step[s]) for s in steps], np.int64),
            "ids": np.concatenate([np.empty(0, np.int64), *(self._ids_by_step[s] for s in steps)]),
            "kept": np.concatenate([np.empty(0, bool), *(self._kept_of(s) for s in steps)]),
            "start_position": np.int64(self.start_position),
            "num_samples": np.int64(self.num_samples),
            "seed": np.int64(self.seed),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> SampleLedger:
        """A ledger back from :meth:`to_arrays`."""
        ledger = cls(int(arrays["num_samples"]), seed=int(arrays["seed"]), start_position=int(arrays["start_position"]))
        ledger.extend(arrays)
        return ledger

    def extend(self, arrays: dict[str, np.ndarray]) -> None:
        """Add the committed steps of another ledger (an earlier worker of the same run).

        A ledger without steps (a worker that failed before its first step,
        while restoring, say) says nothing about where the run started.
        """
        if not len(arrays["steps"]):
            return
        start = int(arrays["start_position"])
        self.start_position = min(self.start_position, start) if self._ids_by_step else start
        bounds = np.cumsum(arrays["sizes"])[:-1]
        ids = np.split(arrays["ids"], bounds)
        kept = np.split(arrays["kept"], bounds) if "kept" in arrays else [None] * len(ids)  # older files: all kept
        for step, step_ids, step_kept in zip(arrays["steps"].tolist(), ids, kept, strict=True):
            self._ids_by_step[step] = step_ids
            if step_kept is not None and not step_kept.all():  # for good: the run that forgot them has ended
                self._forgotten[step] = [(-1, ~step_kept)]

    def end_position(self) -> int:
        """The data position after the committed steps, if they follow one another."""
        return self.start_position + sum(len(ids) for ids in self._ids_by_step.values())

    def counts(self, end_position: int) -> dict[str, int]:
        """``consumed``, ``duplicated`` and ``skipped`` against the stream up to ``end_position``.

        Counted from the recorded indices: a sample recorded more often than
        the stream holds it is duplicated, one recorded less often is skipped.
        """
        consumed = np.concatenate([np.empty(0, np.int64),
                                   *(ids[self._kept_of(step)] for step, ids in self._ids_by_step.items())])
        expected = sample_ids(
            self.num_samples, seed=self.seed, start=self.start_position, count=end_position - self.start_position
        )
        difference = np.bincount(consumed, minlength=self.num_samples) - np.bincount(
            expected, minlength=self.num_samples
        )
        return {
            "consumed": int(consumed.size),
            "duplicated": int(difference[difference > 0].sum()),
            "skipped": int(-difference[difference < 0].sum()),
        }

    def _kept_of(self, step: int) -> np.ndarray:
        """Which of step ``step``'s samples the state holds."""
        kept = np.ones(len(self._ids_by_step[step]), bool)
        for _, rows in self._forgotten.get(step, ()):
            kept[rows] = False
        return kept
