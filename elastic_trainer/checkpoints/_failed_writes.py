"""Failed checkpoint writes: which errors are the storage's, what a failed save leaves behind, unreadable
checkpoints moved aside, and the noise of Orbax's background threads kept off the terminal."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Collection
from typing import NamedTuple

import orbax.checkpoint as ocp
from etils import epath

from .._failures import CheckpointWarning
from ._storage import is_object_store

BACKGROUND_LOGGER = "elastic_trainer.orbax"
"""The logger that gets what Orbax's background work raises where nobody catches it; the command line's
``hydra.job_logging`` writes it to the run's log file only."""

UNREADABLE_SUFFIX = ".unreadable"
"""An unreadable checkpoint that a resumed run reaches again is moved aside to ``<step>.unreadable``."""

_TENSORSTORE_ERRNO = re.compile(r"\[os_error_code='(\d+)'\]")
"""How tensorstore (Orbax's array writer) names the OS error of a failed write in its ``ValueError``."""

_TENSORSTORE_OBJECT_STORE = re.compile(r"^([A-Z][A-Z_]+): Error \w+ (gs://\S+?):? ")
"""How tensorstore's ``ValueError`` of a failed request to object storage begins: its status, and the object
(``PERMISSION_DENIED: Error writing gs://bucket/run/4/state/...: ...``)."""

_HTTP_STATUS = re.compile(r"\[http_response_code='(\d+)'\]")
"""The storage's HTTP answer, when tensorstore's error has one."""


class SaveEnded(NamedTuple):
    """How a checkpoint save ended: committed, or failed for I/O.

    :param step: the step saved.
    :param at: when the outcome was known (``time.time()``).
    :param cause: the storage's error in words (``"ENOSPC: No space left on device"``); ``None``: committed.
    """

    step: int
    at: float
    cause: str | None = None

    def to_json(self) -> dict[str, object]:
        """A failed save as the report lists it: ``step``, ``cause`` and ``time``."""
        return {"step": self.step, "cause": self.cause, "time": self.at}


def io_cause(error: BaseException | None) -> str | None:
    """The storage's error behind ``error`` in words, or ``None`` when it is not an I/O error.

    An :class:`OSError` anywhere in the chain of causes counts, and so does
    tensorstore's ``ValueError`` that carries the OS error code of the write
    that failed (how Orbax surfaces a full disk while it writes arrays), or
    that a request to object storage failed (``gs://``: refused, or
    unanswered after tensorstore's retries), and gcsfs's ``HttpError``.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            return _in_words(error.errno) if error.errno else str(error)
        match = _TENSORSTORE_ERRNO.search(str(error))
        if match:
            return _in_words(int(match.group(1)))
        match = _TENSORSTORE_OBJECT_STORE.search(str(error))
        if match:
            http = _HTTP_STATUS.search(str(error))
            return f"{match.group(1)}{f' (HTTP {http.group(1)})' if http else ''} from {match.group(2)}"
        if type(error).__module__.startswith("gcsfs"):  # gcsfs.retry.HttpError: the storage's answer
            return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        error = error.__cause__ or error.__context__
    return None


def _in_words(code: int) -> str:
    """``"ENOSPC: No space left on device"`` for ``errno.ENOSPC``."""
    return f"{errno.errorcode.get(code, f'errno {code}')}: {os.strerror(code)}"


def remove_temporary(directory: epath.Path, steps: Collection[int]) -> None:
    """Remove Orbax's temporary folders of ``steps`` in ``directory`` (what failed saves of them left), if any.

    On object storage Orbax's temporary folder is the step's own folder without its ``commit_success.txt``.
    """
    for name in ocp.path.step.tmp_checkpoints(directory):
        if ocp.path.step.step_from_checkpoint_name(name) in steps:
            _remove_tree(directory / name)


def _remove_tree(path: epath.Path) -> None:
    """Remove the folder ``path`` and what it holds, as far as the storage lets (the next call tries again)."""
    if not is_object_store(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):  # gcsfs's errors of the storage; gone already
        path.rmtree(missing_ok=True)


class FailedSaves:
    """The saves into ``directory`` that failed for I/O, and the temporary folders they leave behind.

    Only Orbax's primary host removes folders (it owns them). A save found
    failed in the background has had its writes ended first
    (:func:`~elastic_trainer._private_apis.end_save_writes`); those
    Orbax does not hand over (a save that fails while it starts, or
    tensorstore's writes of one array group after the first failed) may
    still create a folder anew, so every :meth:`remove_leftovers` removes
    them again. Such a folder is never restored from, and Orbax replaces it
    at the next save of its step.
    """

    def __init__(self, directory: epath.Path):
        self._directory = directory
        self._steps: set[int] = set()

    def add(
        self, step: int, error: Exception, *, primary: bool, end_writes: Callable[[], None] = lambda: None,
    ) -> SaveEnded:
        """How the save of ``step`` ended, having failed with ``error``: ``error`` is raised unless it is I/O; then
        ``end_writes`` waits for the save's writes still under way, and the save's folder is removed."""
        cause = io_cause(error)
        if cause is None:
            raise error
        end_writes()
        self._steps.add(step)
        self.remove_leftovers(primary=primary)
        return SaveEnded(step, time.time(), cause)

    def remove_leftovers(self, *, primary: bool) -> None:
        """Remove the failed saves' temporary folders, when this process is the primary host (``primary``)."""
        if self._steps and primary:
            remove_temporary(self._directory, self._steps)


def move_aside(directory: epath.Path, step: int) -> None:
    """Move the unreadable checkpoint of ``step`` to ``<step>.unreadable`` (numbered if taken), untouched, with a
    warning, so that a new save of ``step`` can go ahead."""
    source, target, number = directory / str(step), directory / f"{step}{UNREADABLE_SUFFIX}", 1
    while target.exists():
        number += 1
        target = directory / f"{step}{UNREADABLE_SUFFIX}{number}"
    if source.exists():
        source.rename(target)
        warnings.warn(
            f"the unreadable checkpoint of step {step} was moved aside to {target}, untouched, "
            f"to save step {step} anew.",
            CheckpointWarning,
            stacklevel=4,
        )


def _is_closed_loop_noise(unraisable: sys.UnraisableHookArgs) -> bool:
    """Whether ``unraisable`` is tensorstore's callback finding the event loop of a failed Orbax write closed."""
    value = unraisable.exc_value
    return unraisable.object is None and isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def log_closed_loop_noise() -> None:
    """Send the ``RuntimeError: Event loop is closed`` that tensorstore's callbacks raise, once a failed write
    made Orbax close its event loop, to :data:`BACKGROUND_LOGGER` instead of the terminal.

    They reach Python's ``sys.unraisablehook`` from tensorstore's threads at
    any time after the failure, so the hook stays for the process's life;
    every other unraisable exception goes on to the hook that was there
    before. Installing it again does nothing.
    """
    previous = sys.unraisablehook
    if getattr(previous, "logs_closed_loop_noise", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not _is_closed_loop_noise(unraisable):
            previous(unraisable)
            return
        logging.getLogger(BACKGROUND_LOGGER).info(
            "a callback of a failed checkpoint write found its event loop closed",
            exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback),
        )

    hook.logs_closed_loop_noise = True
    sys.unraisablehook = hook
