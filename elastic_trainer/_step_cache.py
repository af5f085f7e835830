"""Compiled train steps kept per layout, at most ``max_layouts`` of them, compiled on demand or ahead of time."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._mesh import WithinSlice, batch_sharding
from ._records import CompileRecord
from ._step import StepFunctions
from ._training_mode import AbstractTrainingMode, SynchronousMode

DEFAULT_MAX_LAYOUTS = 8
"""Layouts whose compiled step is kept. On the default 4 slices, the layout in
use, its 4 "one slice fewer" layouts compiled ahead and 3 more (the way back
up) fit; a layout's executable of the tiny CPU model takes about 10 MB of host
memory (more for a real model), and at N slices the layouts a run can visit are
2^N - 1: keeping all of them is no bound at scale."""

_persistent_cache_hits = threading.local()
"""Per thread: how many compiles JAX loaded from its persistent compilation cache (``hits``)."""


def _count_persistent_cache_hit(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded on the thread that asked for the compile
        _persistent_cache_hits.hits = getattr(_persistent_cache_hits, "hits", 0) + 1


jax.monitoring.register_event_listener(_count_persistent_cache_hit)  # once per process, when this module loads


class StepCache:
    """Compiled steps by (devices, global batch): a resize back onto a known layout compiles nothing.

    :meth:`compile_ahead` compiles a likely next layout (one slice fewer, say)
    on a background thread while training goes on, one at a time in the order
    asked, so a recovery onto it only waits for what is left of that compile;
    a layout needed while its compile is still queued behind others is
    compiled at once instead. With JAX's persistent compilation cache on, a
    compile of a layout some earlier run compiled is a load. :attr:`records`
    says when each layout was asked for and ready.

    At most ``max_layouts`` compiled steps are kept: the least recently used
    one goes first, never the layout in use (the last one :meth:`get` returned)
    nor a compile under way, and :meth:`compile_ahead` starts a compile only
    while there is room. The layouts compiled since the last eviction share
    one set of function objects (a *generation*), so JAX lowers the step once
    for all of them of the same shape (its lowering cache ignores which
    devices); an eviction starts a new generation, and dropping the old one's
    function objects lets JAX's caches (keyed on them) free the evicted
    executable. The layouts still kept hold their own compiled steps.

    A layout's step is what the training ``mode`` compiles for its mesh
    (:class:`~elastic_trainer.plugin.SynchronousMode` by default: one program with the
    state donated, or its gradients and then its update).

    :param functions: the step's pure functions (see :func:`make_step_functions`).
    :param arrays: the state's arrays, or abstract ones: shapes and dtypes.
    :param sample: a batch of one sample from the dataset (an array or a pytree of them), for the shapes and dtypes.
    :param within_slice: the state's layout within a slice.
    :param max_layouts: how many layouts' compiled steps to keep (at least 1: the one in use;
        ``trainer.max_cached_layouts``, checked with the trainer's settings).
    :param mode: the training mode, which compiles each layout's step.
    """

    def __init__(
        self, functions: StepFunctions, arrays: PyTree, sample: PyTree, *, within_slice: WithinSlice,
        max_layouts: int = DEFAULT_MAX_LAYOUTS, mode: AbstractTrainingMode = SynchronousMode(),
    ):
        self._functions = functions
        self._generation = _own(functions)
        self.mode = mode
        self._abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
        self._sample = sample
        self._within_slice = within_slice
        self.max_layouts = max_layouts
        self._futures: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._in_use: tuple | None = None
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="et-compile")
        self.saved_s = 0.0
        self.compiled_ahead = 0
        self.evicted = 0
        """Compiled steps dropped to keep within ``max_layouts``."""
        self.records: list[CompileRecord] = []
        """Every compile asked for, in order (an evicted layout's stays; a layout compiled again has a new one)."""
        self._record_of: dict[tuple, int] = {}  # key -> index in records of its current compile

    def __len__(self) -> int:
        """Layouts whose step is compiled or being compiled."""
        return len(self._futures)

    def get(self, mesh: Mesh, batch_size: int, slices: Sequence[int] = ()) -> tuple[Any, PyTree, dict[str, Any]]:
        """The compiled step and state shardings for ``mesh`` (the layout of ``slices``), now the layout in use, and
        how the compile went.

        The third value is ``{"compile_s", "compile_cached"}``: seconds spent
        here (compiling, or waiting for a compile started ahead) and whether a
        compile already existed or was under way.
        """
        begin = time.time()
        key = self._key(mesh, batch_size)
        future = self._futures.get(key)
        queued = future is not None and future.cancel()  # behind other layouts' compiles: needed now, compiled now
        if queued:
            self.compiled_ahead -= 1  # its record stays: asked for ahead, started now
            future = None
        cached = future is not None
        if future is None:
            if not queued:
                self._record(key, slices, ahead=False)
            future = concurrent.futures.Future()
            future.set_result(self._compile(mesh, batch_size, key, slices))
            self._futures[key] = future
        compiled, shardings, compile_s = future.result()
        waited = time.time() - begin
        if cached:
            self.saved_s += max(0.0, compile_s - waited)
        self._futures.move_to_end(key)
        self._in_use = key
        self._evict()
        return compiled, shardings, {"compile_s": waited, "compile_cached": cached}

    def compile_ahead(self, mesh: Mesh, batch_size: int, slices: Sequence[int] = ()) -> None:
        """Queue a compile for ``mesh`` (the layout of ``slices``) on the background thread, unless already known
        or the cache is full."""
        key = self._key(mesh, batch_size)
        if key not in self._futures and len(self._futures) < self.max_layouts:
            self._record(key, slices, ahead=True)
            self._futures[key] = self._background.submit(self._compile, mesh, batch_size, key, slices)
            self.compiled_ahead += 1

    def drop_queued(self, keep: Sequence[Sequence[int]]) -> None:
        """Drop the compiles asked for ahead that have not started, but those of the layouts of ``keep`` (slice
        lists): after a change of the layout in use they are no longer the likely ones. A compile under way
        finishes; a dropped one's record stays, never started."""
        kept = {tuple(sorted(slices)) for slices in keep}
        for key, future in list(self._futures.items()):
            record = self.records[self._record_of[key]]
            if record.ahead and record.slices not in kept and future.cancel():
                del self._futures[key]
                self.compiled_ahead -= 1

    def restart(self) -> None:
        """Forget every compiled step once the compile under way has ended: the backend they run on is going."""
        self._background.shutdown(wait=True, cancel_futures=True)
        self._futures.clear()
        self.mode.forget_compiled()
        self._in_use = None
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="et-compile")

    def close(self) -> None:
        """Drop compiles not started yet; one under way finishes on its own."""
        self._background.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        """Drop the least recently used compiled steps beyond ``max_layouts``, but the one in use and those under way."""
        evictable = [key for key, future in self._futures.items() if key != self._in_use and future.done()]
        for key in evictable[: max(0, len(self._futures) - self.max_layouts)]:
            del self._futures[key]
            self.evicted += 1
            self._generation = _own(self._functions)

    def _record(self, key: tuple, slices: Sequence[int], *, ahead: bool) -> None:
        """Note that ``key``'s step (the layout of ``slices``) was asked for now."""
        self._record_of[key] = len(self.records)
        self.records.append(CompileRecord(slices=tuple(slices), ahead=ahead, requested_at=time.time()))

    def _compile(self, mesh: Mesh, batch_size: int, key: tuple, slices: Sequence[int]) -> tuple[Any, PyTree, float]:
        begin, hits_before = time.time(), getattr(_persistent_cache_hits, "hits", 0)
        index = self._record_of[key]
        self.records[index] = dataclasses.replace(self.records[index], started_at=begin)
        batch = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct((batch_size, *leaf.shape[1:]), leaf.dtype, sharding=batch_sharding(mesh)),
            self._sample,
        )
        compiled, shardings = self.mode.compile(self._generation, self._abstract, batch, mesh,
                                                within_slice=self._within_slice)
        loaded = getattr(_persistent_cache_hits, "hits", 0) > hits_before
        self.records[index] = dataclasses.replace(self.records[index], ready_at=time.time(), loaded=loaded)
        return compiled, shardings, time.time() - begin

    @staticmethod
    def _key(mesh: Mesh, batch_size: int) -> tuple:
        return tuple(device.id for device in mesh.devices.flat), mesh.devices.shape, batch_size


def _own(functions: StepFunctions) -> StepFunctions:
    """``functions`` as function objects of their own, a generation's: once the step cache lets go of them, JAX's
    caches, keyed on the function, let go of what they compiled (their lowerings and executables)."""
    return StepFunctions(*(functools.wraps(f)(lambda *args, f=f: f(*args)) for f in functions))
