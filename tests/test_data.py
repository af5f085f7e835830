import numpy as np
import pytest

import elastic_trainer as et


def test_sample_ids_are_a_pure_function_of_seed_and_position():
    np.testing.assert_array_equal(
        et.sample_ids(100, seed=3, start=40, count=30), et.sample_ids(100, seed=3, start=0, count=70)[40:]
    )
    assert not np.array_equal(et.sample_ids(100, seed=3, start=0, count=30), et.sample_ids(100, seed=4, start=0, count=30))


def test_every_sample_once_per_epoch_and_epochs_shuffled_differently():
    ids = et.sample_ids(50, seed=0, start=0, count=150)
    for epoch in range(3):
        assert sorted(ids[epoch * 50 : (epoch + 1) * 50]) == list(range(50))
    assert not np.array_equal(ids[:50], ids[50:100])


def test_stdlib_text_windows_are_bytes_of_python_source():
    data = et.StdlibText(seq_len=32, max_bytes=100_000)
    assert data.num_samples == 100_000 // 33
    batch = data.get_batch(np.array([0, 5]))
    assert batch.shape == (2, 33) and batch.dtype == np.int32
    assert 0 <= batch.min() and batch.max() < 256
    assert bytes(batch[0].astype(np.uint8)).isascii()


def test_stdlib_text_rejects_too_little_text():
    with pytest.raises(et.ConfigError, match="data.max_bytes=10 holds no window of 33 bytes"):
        et.StdlibText(seq_len=32, max_bytes=10)
