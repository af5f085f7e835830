"""grain pipelines as datasets: a ``grain.MapDataset`` read by index, in the trainer's own order."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from ._data import AbstractDataset
from ._extras import import_extra
from ._failures import ConfigError


def _grain() -> Any:
    """``grain``, imported when first used: it is an optional extra."""
    return import_extra("grain", needed_by="GrainDataset", package="grain", extra="grain")


def _lineage(dataset: Any) -> Iterator[object]:
    """``dataset`` and every dataset it was built from."""
    yield dataset
    for parent in dataset.parents:
        yield from _lineage(parent)


class GrainDataset(AbstractDataset):
    """A grain ``MapDataset`` (with its ``.map``, ``.shuffle``, ``.random_map`` ...) as a dataset of the trainer.

    The trainer draws the sample indices of every step itself (``sample_ids``,
    a seeded permutation per epoch) and counts them in its sample ledger, so
    that after a resize, a restore or a full restart it continues at the exact
    sample, with none skipped or seen twice. A ``MapDataset`` gives random
    access, so this wrapper reads exactly those indices, ``dataset[i]``, and
    stacks the samples (any pytree of arrays) along a new leading axis.
    grain's own batching and iterators are therefore not used: they keep the
    position in an iterator state of their own, which a resize or a restore
    by the trainer would not move. Leave ``.batch()``, an endless ``.repeat()``
    (the trainer runs epochs itself) and ``.to_iter_dataset()`` out of the pipeline.

    :param dataset: the ``grain.MapDataset``; every index ``0 .. len(dataset) - 1`` must hold a sample.
    """

    def __init__(self, dataset: Any):
        if not isinstance(dataset, _grain().MapDataset):
            raise ConfigError(
                f"GrainDataset needs a grain.MapDataset (random access), got {type(dataset).__name__}; "
                "pass the pipeline before .to_iter_dataset()."
            )
        if any(type(node).__name__ == "BatchMapDataset" for node in _lineage(dataset)):
            raise ConfigError(
                "the grain pipeline given to GrainDataset is batched (.batch()); drop .batch(): the trainer "
                "batches the samples itself, trainer.global_batch_size per step."
            )
        if len(dataset) >= sys.maxsize:
            raise ConfigError(
                "the grain pipeline given to GrainDataset is infinite (.repeat() without num_epochs); drop "
                ".repeat(): the trainer runs as many epochs as trainer.steps needs."
            )
        self.dataset = dataset
        self.num_samples = len(dataset)

    def get_batch(self, sample_ids: np.ndarray) -> PyTree[np.ndarray]:
        samples = [self.dataset[int(i)] for i in sample_ids]
        for i, sample in zip(sample_ids, samples, strict=True):
            if sample is None:
                raise ConfigError(
                    f"the grain pipeline has no sample at index {i} (a .filter() dropped it); the trainer reads "
                    "every index, so filter the source before building the MapDataset."
                )
        return jax.tree.map(lambda *leaves: np.stack(leaves), *samples)

