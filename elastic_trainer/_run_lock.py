"""One run per directory: an exclusive lock on a run's checkpoint directory and run directory, held for its life.

The lock is ``fcntl.flock`` on a file inside the directory, ``.elastic_trainer.lock``,
which holds its owner (host, PID, since when) so that a refusal can name it.
Why ``flock`` and not py-filelock (which wraps the same call): the kernel
releases a flock when its process dies, even by SIGKILL, so a dead owner never
blocks anyone; and what a run needs beyond the call itself (the owner record,
the takeover warning, removing the file on release without a race) is ours
either way. ``flock`` belongs to the open file, so a second lock of the same
directory in the same process is refused too.

A lock whose file is still there but that no process holds was left by an
owner that died: it is taken over with a :class:`StaleLockWarning` naming it.
On release the file is removed (while still locked, and a new owner checks
that the file it locked is still the one at the path), so a finished run
leaves its directories as they were.

On a shared filesystem the lock is only as good as the filesystem's locks:
on NFS, Linux turns ``flock`` into an NFS byte-range lock that the server
arbitrates between hosts (unless mounted with ``nolock`` or
``local_lock=flock|all``); on FUSE filesystems such as gcsfuse, and on local
disks, it is known only to the host that took it, so two hosts can both take
it. There, one job per checkpoint directory is the scheduler's business.
A checkpoint directory on object storage (``gs://``) is locked with a
conditional write of an object instead, renewed as a lease
(:mod:`._object_store_lock`): that one holds across hosts.

One job is one owner: the process that starts the job's processes (the
multi-process launcher, the full-restart supervisor, the command line) takes
the locks and names them in its children's environment (:data:`HOLDER_ENV`);
a child, or a :class:`~elastic_trainer.Trainer` in the holder's own process,
does not contend for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ._failures import ConfigError
from .checkpoints._storage import is_object_store

LOCK_FILE = ".elastic_trainer.lock"
"""The lock's file, inside the locked directory."""

HOLDER_ENV = "ELASTIC_TRAINER_RUN_LOCKS"
"""Set by the process holding a job's locks, for itself and its children: ``{"pid": ..., "dirs": [...]}``."""


class RunLockedError(ConfigError):
    """Another run holds the lock of a directory this run needs; the message names it and how to go on."""


class StaleLockWarning(UserWarning):
    """A directory's lock was left by an owner that died; this run took it over."""


@dataclasses.dataclass(frozen=True)
class LockOwner:
    """Who holds a lock: ``pid`` on ``host``, since ``since`` (``time.time()``)."""

    host: str
    pid: int
    since: float

    @classmethod
    def this_process(cls) -> LockOwner:
        """This process, from now."""
        return cls(host=socket.gethostname(), pid=os.getpid(), since=time.time())

    @classmethod
    def from_record(cls, record: bytes) -> LockOwner | None:
        """The owner a lock file records; ``None`` for an empty or unreadable record."""
        try:
            return cls(**json.loads(record))
        except (ValueError, TypeError):
            return None

    def record(self) -> bytes:
        """What the lock file holds."""
        return json.dumps(dataclasses.asdict(self)).encode()

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"


def _read_owner(fd: int) -> LockOwner | None:
    return LockOwner.from_record(os.pread(fd, 4096, 0))


class DirectoryLock:
    """The exclusive lock of one run directory; :meth:`acquire`, then :meth:`release`.

    :param directory: the directory to lock (created if missing).
    :param name: what the user calls it in a message (``"checkpoint.dir"``).
    """

    def __init__(self, directory: str | Path, *, name: str):
        self.directory = Path(directory).absolute()
        self.name = name
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        """The lock's file."""
        return self.directory / LOCK_FILE

    def acquire(self) -> bool:
        """Take the lock; whether it was taken.

        Raises :class:`RunLockedError` when a live run holds it. A directory
        that cannot be created or written (and a filesystem without locks) is
        not locked and ``False`` returned: the checkpointer refuses such a
        directory with its own sentence.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise RunLockedError(
                    f"{self.name} {self.directory} is in use by another run "
                    f"({owner or 'a process that is still starting'}); wait for that run to end or stop it, "
                    "or give this run another directory."
                ) from None
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    return False
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its owner removed it as we opened it: lock the new one
        stale = _read_owner(fd)
        if stale is not None:
            warnings.warn(
                f"taking over the lock of {self.name} {self.directory} from {stale}, which ended without "
                "releasing it (killed, or its host went down).",
                StaleLockWarning,
                stacklevel=3,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, LockOwner.this_process().record(), 0)
        os.fsync(fd)
        self._fd = fd
        return True

    def release(self) -> None:
        """Remove the lock's file and release the lock (in that order: see the module's docstring)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


class RunLock(Protocol):
    """A directory's lock: :class:`DirectoryLock`, or on object storage an ``ObjectStoreLock``."""

    def acquire(self) -> bool: ...

    def release(self) -> None: ...


def run_lock(directory: str | os.PathLike[str], *, name: str) -> RunLock:
    """The lock of ``directory``: a file lock, or for a ``gs://`` URL a conditional write of an object."""
    if is_object_store(directory):
        from ._object_store_lock import ObjectStoreLock  # tensorstore, only for object storage

        return ObjectStoreLock(os.fspath(directory), name=name)
    return DirectoryLock(directory, name=name)


def lock_key(directory: str | os.PathLike[str]) -> str:
    """How :data:`HOLDER_ENV` names ``directory``: its URL, or its resolved local path."""
    return os.fspath(directory).rstrip("/") if is_object_store(directory) else str(Path(directory).resolve())


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def held_by_job(directory: str | Path) -> bool:
    """Whether this process's job already holds the lock of ``directory`` (or of a directory above it):
    the holder named in :data:`HOLDER_ENV` is this process or the one that started it."""
    holder = json.loads(os.environ.get(HOLDER_ENV, "null"))
    if not holder or holder["pid"] not in (os.getpid(), os.getppid()):
        return False
    key = lock_key(directory)
    return any(key == held or key.startswith(held.rstrip("/") + "/") for held in holder["dirs"])


@contextlib.contextmanager
def hold_run_locks(directories: Sequence[tuple[str | Path, str]], *, for_job: bool = True) -> Iterator[None]:
    """Hold the locks of ``directories`` (``(path, name)`` pairs, ``name`` for messages) inside the block.

    Those the job already holds (:func:`held_by_job`) are skipped. The
    others are taken in order, all or none (:class:`RunLockedError` from the
    first one held elsewhere). With ``for_job`` (the process that starts a
    job) they are named in :data:`HOLDER_ENV` until the block ends, for this
    process and its children not to contend for them; without (a trainer),
    a second trainer in the same process is refused like any other run.
    """
    taken: list[tuple[RunLock, str]] = []
    previous_env = os.environ.get(HOLDER_ENV)
    try:
        for directory, name in directories:
            if held_by_job(directory):
                continue
            lock = run_lock(directory, name=name)
            if lock.acquire():
                taken.append((lock, lock_key(directory)))
        if taken and for_job:  # one job: the directories an enclosing holder named stay named
            enclosing = json.loads(previous_env or "null")
            held = enclosing["dirs"] if enclosing and enclosing["pid"] in (os.getpid(), os.getppid()) else []
            os.environ[HOLDER_ENV] = json.dumps(
                {"pid": os.getpid(), "dirs": [*held, *(key for _, key in taken)]})
        yield
    finally:
        if taken and for_job:
            if previous_env is None:
                os.environ.pop(HOLDER_ENV, None)
            else:
                os.environ[HOLDER_ENV] = previous_env
        for lock, _ in reversed(taken):
            lock.release()
