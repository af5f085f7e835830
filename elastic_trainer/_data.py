"""Datasets and the deterministic, index-based order in which samples are consumed."""

from __future__ import annotations

import abc
import functools
import sysconfig
from pathlib import Path

import numpy as np

from ._failures import ConfigError
from .config._settings import check_stdlib_text_settings


class AbstractDataset(abc.ABC):
    """A fixed, finite set of samples addressed by index."""

    num_samples: int

    @abc.abstractmethod
    def get_batch(self, sample_ids: np.ndarray) -> np.ndarray:
        """The samples with these indices, stacked along a new leading axis."""


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, num_samples: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def sample_ids(num_samples: int, *, seed: int, start: int, count: int) -> np.ndarray:
    """The sample indices at stream positions ``start .. start + count - 1``.

    The stream visits every sample once per epoch, in an order shuffled by
    ``(seed, epoch)``. It is a pure function: the batch of step ``s`` with a
    global batch ``B`` is ``sample_ids(..., start=s * B, count=B)``, so training
    can resume at an exact data position and count every sample it consumed.
    """
    positions = np.arange(start, start + count)
    epochs, offsets = np.divmod(positions, num_samples)
    ids = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        ids[in_epoch] = _epoch_permutation(seed, num_samples, int(epoch))[offsets[in_epoch]]
    return ids


class StdlibText(AbstractDataset):
    """Byte-level language-model samples cut from the Python standard library's source.

    The text ships with every Python install, so nothing is downloaded. The
    standard library's top-level ``.py`` files are read in name order until
    ``max_bytes`` and cut into non-overlapping windows of ``seq_len + 1`` bytes
    (inputs plus the next-token targets).

    :param seq_len: tokens the model sees per sample.
    :param max_bytes: how much text to read.
    """

    vocab_size = 256

    def __init__(self, seq_len: int = 64, max_bytes: int = 4_000_000):
        check_stdlib_text_settings(seq_len=seq_len)
        text = self._read_stdlib(max_bytes)
        window = seq_len + 1
        self.num_samples = len(text) // window
        if self.num_samples < 1:
            raise ConfigError(f"data.max_bytes={max_bytes} holds no window of {window} bytes; raise it.")
        self.seq_len = seq_len
        self._windows = np.frombuffer(text[: self.num_samples * window], dtype=np.uint8).reshape(-1, window)

    @staticmethod
    def _read_stdlib(max_bytes: int) -> bytes:
        chunks, size = [], 0
        for path in sorted(Path(sysconfig.get_path("stdlib")).glob("*.py")):
            chunks.append(path.read_bytes())
            size += len(chunks[-1])
            if size >= max_bytes:
                break
        return b"".join(chunks)[:max_bytes]

    def get_batch(self, sample_ids: np.ndarray) -> np.ndarray:
        return self._windows[sample_ids].astype(np.int32)
