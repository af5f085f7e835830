"""Compiled train steps kept per layout, compiled on demand or ahead of time in the background."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._mesh import WithinSlice, batch_sharding
from ._step import StepFn, compile_step


class StepCache:
    """Compiled steps by (devices, global batch): a resize back onto a known layout compiles nothing.

    :meth:`compile_ahead` compiles a likely next layout (one slice fewer, say)
    on a background thread while training goes on, so a recovery onto it only
    waits for what is left of that compile.

    :param step_fn: the pure step (see :func:`make_step_fn`).
    :param arrays: the state's arrays, or abstract ones: shapes and dtypes.
    :param sample: a batch of one sample from the dataset (an array or a pytree of them), for the shapes and dtypes.
    :param within_slice: the state's layout within a slice.
    """

    def __init__(self, step_fn: StepFn, arrays: PyTree, sample: PyTree, *, within_slice: WithinSlice):
        self._step_fn = step_fn
        self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
        self._sample = sample
        self._within_slice = within_slice
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="et-compile")
        self.saved_s = 0.0
        self.compiled_ahead = 0

    def get(self, mesh: Mesh, batch_size: int) -> tuple[Any, PyTree, dict[str, Any]]:
        """The compiled step and state shardings for ``mesh``, and how the compile went.

        The third value is ``{"compile_s", "compile_cached"}``: seconds spent
        here (compiling, or waiting for a compile started ahead) and whether a
        compile already existed or was under way.
        """
        begin = time.time()
        future = self._futures.get(self._key(mesh, batch_size))
        if future is None:
            compiled, shardings, _ = self._compile(mesh, batch_size)
            done = concurrent.futures.Future()
            done.set_result((compiled, shardings, time.time() - begin))
            self._futures[self._key(mesh, batch_size)] = done
            return compiled, shardings, {"compile_s": time.time() - begin, "compile_cached": False}
        compiled, shardings, compile_s = future.result()
        waited = time.time() - begin
        self.saved_s += max(0.0, compile_s - waited)
        return compiled, shardings, {"compile_s": waited, "compile_cached": True}

    def compile_ahead(self, mesh: Mesh, batch_size: int) -> None:
        """Start compiling for ``mesh`` on the background thread, unless already known."""
        key = self._key(mesh, batch_size)
        if key not in self._futures:
            self._futures[key] = self._background.submit(self._compile, mesh, batch_size)
            self.compiled_ahead += 1

    def close(self) -> None:
        """Drop compiles not started yet; one under way finishes on its own."""
        self._background.shutdown(wait=False, cancel_futures=True)

    def _compile(self, mesh: Mesh, batch_size: int) -> tuple[Any, PyTree, float]:
        begin = time.time()
        batch = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct((batch_size, *leaf.shape[1:]), leaf.dtype, sharding=batch_sharding(mesh)),
            self._sample,
        )
        compiled, shardings = compile_step(self._step_fn, self._abstract, batch, mesh, within_slice=self._within_slice)
        return compiled, shardings, time.time() - begin

    @staticmethod
    def _key(mesh: Mesh, batch_size: int) -> tuple:
        return tuple(device.id for device in mesh.devices.flat), mesh.devices.shape, batch_size
