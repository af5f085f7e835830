"""Checkpoints: the Orbax-backed store (``_checkpointer``), a run's use of it (``_run_checkpoints``), how Orbax
writes the state (``_orbax_handler``), failed writes (``_failed_writes``), checksums, the survivors' save barrier
(``_group_barrier``) and ``checkpoint.period=auto`` (``_young_daly``)."""

from ._checkpointer import Checkpointer as Checkpointer
