"""Checksums of a train state's arrays, computed on their devices and verified when a checkpoint is restored.

Each array's checksum is two 32-bit words over its bits (viewed as unsigned
32-bit integers): their sum, and their sum weighted by each word's odd
position number, both modulo 2**32. Integer sums are exact in any order, so
a checksum is the same for the same values on any mesh and any sharding,
whichever devices reduce which part. One compiled program computes every array's
checksum where the array lives; only 8 bytes per array leave the devices.

In a job of several processes that program reduces across them, so it is
compiled first (:func:`compile_checksums`, on its own in each process) and
run once every process is ready: a collective that one process enters while
another is still compiling would time out on a busy machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

CHECKSUMS_KEY = "checksums"
"""Where a checkpoint's JSON metadata keeps ``{array name: checksum}``; checkpoints saved before it lack it."""


class ChecksumMismatch(Exception):
    """An array read back from a checkpoint has other bits than the array that was saved (silent corruption)."""


def _as_words(array: jax.Array) -> jax.Array:
    """``array``'s bits as unsigned 32-bit words: one per element of up to 32 bits, two per 64-bit element."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    if array.dtype == jnp.bool_:
        return array.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[array.dtype.itemsize]
    return jax.lax.bitcast_convert_type(array, unsigned).astype(jnp.uint32)  # 64-bit: a trailing axis of 2


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position, modulo 2**32, built from iotas so that no sharded array is reshaped."""
    positions, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        positions = positions + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return positions


def _checksum(array: jax.Array) -> jax.Array:
    """The two words of ``array``'s checksum: the sum of its words, and their sum weighted by ``2 * position + 1``."""
    words = _as_words(array)
    weights = _positions(words.shape) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


MAX_COMPILED = 8
"""Compiled checksum programs kept, one per shapes and shardings (a layout), like ``trainer.max_cached_layouts``."""


@functools.lru_cache(maxsize=MAX_COMPILED)
def _compiled(signature: tuple[jax.tree_util.PyTreeDef, tuple[jax.ShapeDtypeStruct, ...]]) -> jax.stages.Compiled:
    """The checksum program for ``signature``, jitted from a function of its own: JAX's caches, keyed on the
    function, then let go of the executable when this cache does (as :class:`StepCache` does)."""
    structure, leaves = signature
    tree_checksums = jax.jit(lambda arrays: jax.tree.map(_checksum, arrays))
    return tree_checksums.lower(structure.unflatten(leaves)).compile()


def _program(arrays: PyTree) -> jax.stages.Compiled:
    """The compiled checksum program for arrays of ``arrays``' structure, shapes, dtypes and shardings."""
    leaves, structure = jax.tree.flatten(arrays)
    signature = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)) for a in leaves)
    return _compiled((structure, signature))


def compile_checksums(arrays: PyTree) -> None:
    """Compile the program that :func:`checksums` runs on arrays like ``arrays``, without running it."""
    _program(arrays)


def checksums(arrays: PyTree) -> dict[str, str]:
    """``{"params.blocks.0.weight": "0123abcd4567ef89"}``: every array's checksum, as 16 hex digits."""
    words = jax.device_get(_program(arrays)(arrays))
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): f"{int(pair[0]):08x}{int(pair[1]):08x}"
        for path, pair in jax.tree_util.tree_leaves_with_path(words)
    }


def verify_checksums(arrays: PyTree, saved: dict[str, str] | None) -> None:
    """Raise :class:`ChecksumMismatch` naming the first array of ``arrays`` whose checksum is not ``saved``'s.

    ``saved`` is ``None`` for a checkpoint written before checksums existed: nothing to verify.
    """
    if saved is None:
        return
    for name, checksum in checksums(arrays).items():
        if name in saved and saved[name] != checksum:
            raise ChecksumMismatch(f"array {name} does not match the checksum saved with it")
