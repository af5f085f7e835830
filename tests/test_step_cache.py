"""The step cache keeps at most ``max_layouts`` compiled steps: least recently used out first, never the layout in
use nor a compile under way, and an evicted step's executable is freed (JAX's own caches let go of it too)."""

import gc
import threading

import equinox as eqx
import jax
import numpy as np
import optax

import elastic_trainer as et
from elastic_trainer._state import init_train_state
from elastic_trainer._step import make_step_fn
from elastic_trainer._step_cache import StepCache

BATCH = 8


def new_cache(max_layouts: int) -> StepCache:
    model = et.Transformer(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=1, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    arrays, static = eqx.partition(init_train_state(model, optimizer, key=jax.random.key(1)), eqx.is_array)
    step_fn = make_step_fn(et.next_token_loss, optimizer, static)
    return StepCache(step_fn, arrays, np.zeros((1, 9), np.int32), within_slice="replicated", max_layouts=max_layouts)


def mesh_of(slice_: int) -> jax.sharding.Mesh:
    """The mesh of one simulated slice of 2 devices: a layout of its own."""
    return et.make_mesh([jax.devices()[2 * slice_: 2 * slice_ + 2]])


def cached(cache: StepCache, slice_: int) -> bool:
    """Get the step for slice ``slice_``'s layout; whether it was already compiled (or under way)."""
    return cache.get(mesh_of(slice_), BATCH)[2]["compile_cached"]


def live_executables() -> int:
    gc.collect()
    return len(jax.devices()[0].client.live_executables())


def test_the_least_recently_used_layout_goes_first():
    cache = new_cache(max_layouts=2)
    assert [cached(cache, s) for s in (0, 1, 2)] == [False, False, False]  # slice 0's layout is evicted
    assert (len(cache), cache.evicted) == (2, 1)
    assert cached(cache, 1) is True  # used again: now slice 2's layout is the least recently used
    assert cached(cache, 0) is False
    assert (len(cache), cache.evicted) == (2, 2)
    assert cached(cache, 1) is True and cached(cache, 2) is False


def test_the_layout_in_use_stays_and_compiling_ahead_keeps_within_the_bound():
    cache = new_cache(max_layouts=1)
    cached(cache, 0)
    cache.compile_ahead(mesh_of(1), BATCH)  # no room: the one layout kept is the one in use
    assert (len(cache), cache.compiled_ahead) == (1, 0)
    assert cached(cache, 0) is True
    cache = new_cache(max_layouts=3)
    cached(cache, 0)
    for slice_ in (1, 2, 3):
        cache.compile_ahead(mesh_of(slice_), BATCH)
    assert (len(cache), cache.compiled_ahead) == (3, 2)  # slice 3's layout did not fit
    assert [cached(cache, s) for s in (1, 2)] == [True, True]
    cache.close()


def test_a_compile_under_way_is_not_evicted():
    cache = new_cache(max_layouts=2)
    release = threading.Event()
    cache._background.submit(release.wait)  # holds the background thread: what is compiled ahead stays under way
    cache.compile_ahead(mesh_of(3), BATCH)
    cached(cache, 0)
    cached(cache, 1)  # 3 layouts: slice 0's goes, slice 3's compile is under way and stays
    assert (len(cache), cache.evicted) == (2, 1)
    release.set()
    assert cached(cache, 3) is True
    cache.close()


def test_an_evicted_layout_frees_its_executable():
    cache = new_cache(max_layouts=2)
    for slice_ in (0, 1):
        cached(cache, slice_)
    kept = live_executables()
    for slice_ in (2, 3, 0, 1):
        cached(cache, slice_)
    assert cache.evicted == 4
    assert live_executables() == kept
