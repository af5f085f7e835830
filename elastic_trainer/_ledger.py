"""Which samples the committed steps consumed, to prove none was skipped or seen twice."""

from __future__ import annotations

import numpy as np

from ._data import sample_ids


class SampleLedger:
    """The sample indices of every committed step, by step.

    Steps rolled back by a restore are dropped again, so the ledger always
    holds what the surviving state was trained on.

    :param num_samples: size of the dataset.
    :param seed: the data order's seed.
    :param start_position: the data position the run started from.
    """

    def __init__(self, num_samples: int, *, seed: int, start_position: int):
        self.num_samples = num_samples
        self.seed = seed
        self.start_position = start_position
        self._ids_by_step: dict[int, np.ndarray] = {}

    def commit(self, step: int, ids: np.ndarray) -> None:
        """Record that step ``step`` (0-based) was trained on samples ``ids``."""
        self._ids_by_step[step] = ids

    def roll_back(self, to_step: int) -> None:
        """Forget steps ``to_step`` and later: the state no longer contains them."""
        for step in [s for s in self._ids_by_step if s >= to_step]:
            del self._ids_by_step[step]

    def counts(self, end_position: int) -> dict[str, int]:
        """``consumed``, ``duplicated`` and ``skipped`` against the stream up to ``end_position``.

        Counted from the recorded indices: a sample recorded more often than
        the stream holds it is duplicated, one recorded less often is skipped.
        """
        consumed = np.concatenate([np.empty(0, np.int64), *self._ids_by_step.values()])
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
