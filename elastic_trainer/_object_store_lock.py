"""The run lock of a checkpoint directory on object storage (``gs://``), where no file can be locked.

The lock is an object, ``<directory>/.elastic_trainer.lock``, holding its
owner (:class:`~elastic_trainer._run_lock.LockOwner`), and it is taken with a
conditional write through tensorstore's ``gcs`` driver (the driver Orbax
writes arrays with): ``write(key, record, if_equal=<generation>)`` becomes
GCS's ``ifGenerationMatch`` precondition, ``0`` when the object must not
exist yet. GCS applies it atomically, so of two runs that find no lock and
write at once, one write succeeds and the other is refused (HTTP 412), and
that run is refused.

Nothing releases the object when its owner dies, so the owner renews it (a
conditional rewrite) every :data:`RENEW_S` while it runs: a lease. A lock
found in place is live when its owner is a live process of this host, and,
for an owner on another host, when the object changes within
:data:`LEASE_S`. A lock whose owner is a dead process of this host is taken
over at once; one from another host that was not renewed for
:data:`LEASE_S` is taken over then, conditioned on the generation that was
watched, so that of several runs taking it over one wins. Either way with a
:class:`~elastic_trainer._run_lock.StaleLockWarning` naming the owner. An
owner that cannot renew the lock for :data:`LEASE_S` (cut off from the
storage) may lose it to another run; it logs that when it finds out.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import warnings
from collections.abc import Iterator

import psutil
import tensorstore as ts

from ._failures import ConfigError
from ._run_lock import LOCK_FILE, LockOwner, RunLockedError, StaleLockWarning

LEASE_S = 30.0
"""A lock of another host's run that did not change for this long is stale (its owner is gone)."""

RENEW_S = 5.0
"""How often an owner rewrites its lock, well within :data:`LEASE_S`."""

POLL_S = 1.0
"""How often a lock of another host's run is read while it is watched for a renewal."""

_LOG = logging.getLogger(__name__)


class ObjectStoreLock:
    """The exclusive lock of a run directory on object storage; :meth:`acquire`, then :meth:`release`.

    :param directory: the directory, a ``gs://bucket/path`` URL.
    :param name: what the user calls it in a message (``"checkpoint.dir"``).
    """

    def __init__(self, directory: str, *, name: str):
        self.directory = directory.rstrip("/")
        self.name = name
        self._store: ts.KvStore | None = None
        self._owner = LockOwner.this_process()
        self._generation: bytes | None = None  # of the lock object as this run wrote it last
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def path(self) -> str:
        """The lock's object."""
        return f"{self.directory}/{LOCK_FILE}"

    def acquire(self) -> bool:
        """Take the lock (always ``True``: object storage has no directory that cannot be locked).

        Raises :class:`RunLockedError` when a live run holds it, and :class:`ConfigError` when the storage
        cannot be reached.
        """
        with self._storage_errors():
            self._store = ts.KvStore.open(f"{self.directory}/").result()
            found = self._store.read(LOCK_FILE).result()
            while True:
                stale = None if found.state == "missing" else LockOwner.from_record(found.value)
                if found.state != "missing" and not self._stale(found, stale):
                    raise self._locked(stale)
                if self._write(if_equal=found.stamp.generation):
                    break
                found = self._store.read(LOCK_FILE).result()  # another run wrote it first: see whose it is now
        if found.state != "missing":
            warnings.warn(
                f"taking over the lock of {self.name} {self.directory} from {stale or 'an unknown owner'}, which "
                "ended without releasing it (killed, or its host went down).",
                StaleLockWarning,
                stacklevel=3,
            )
        self._renewer = threading.Thread(target=self._renew, name="elastic_trainer-lock-lease", daemon=True)
        self._renewer.start()
        return True

    @contextlib.contextmanager
    def _storage_errors(self) -> Iterator[None]:
        """Turn tensorstore's errors of the storage (``ValueError``) into one sentence (:class:`ConfigError`): their
        status and message, without the request's details (``[http_response_body=...]``)."""
        try:
            yield
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(
                f"{self.name} {self.directory} could not be locked ({str(error).split(' [', 1)[0]}); check the "
                "bucket's name, that it exists, and the credentials."
            ) from error

    def _locked(self, owner: LockOwner | None) -> RunLockedError:
        return RunLockedError(
            f"{self.name} {self.directory} is in use by another run ({owner or 'a process that is still starting'}); "
            "wait for that run to end or stop it, or give this run another directory."
        )

    def _stale(self, found: ts.KvStore.ReadResult, owner: LockOwner | None) -> bool:
        """Whether the lock ``found`` (of ``owner``) is stale: its owner a dead process of this host, or, for
        another host's, not renewed within :data:`LEASE_S`."""
        if owner is not None and owner.host == socket.gethostname():
            return not _alive(owner)
        deadline = time.monotonic() + LEASE_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            now = self._store.read(LOCK_FILE).result()
            if now.state == "missing":
                return True  # released meanwhile: free (the write that follows sees it gone and reads again)
            if now.stamp.generation != found.stamp.generation:
                return False  # renewed (or taken by another run)
        return True

    def _write(self, *, if_equal: bytes) -> bool:
        """Write this run's record if the lock object's generation is ``if_equal``; whether it was written."""
        generation = self._store.write(LOCK_FILE, self._owner.record(), if_equal=if_equal).result().generation
        if not generation:  # tensorstore's answer to a condition that failed (GCS: 412 Precondition Failed)
            return False
        self._generation = generation
        return True

    def _renew(self) -> None:
        """Rewrite the lock every :data:`RENEW_S` until released; a renewal that fails is tried again."""
        while not self._stop_renewing.wait(RENEW_S):
            try:
                if not self._write(if_equal=self._generation):
                    _LOG.warning("the lock of %s %s was taken over by another run: this run could not renew it "
                                 "for %s s", self.name, self.directory, LEASE_S)
                    return
            except Exception as error:  # noqa: BLE001 - any failure of the storage: the lease lives on in the next try
                _LOG.warning("could not renew the lock of %s %s: %s", self.name, self.directory, error)

    def release(self) -> None:
        """Stop renewing the lock, and delete it if it is still this run's."""
        if self._renewer is None:
            return
        self._stop_renewing.set()
        self._renewer.join(timeout=LEASE_S)  # a renewal stuck in a request the storage never answers is let go
        self._renewer = None
        try:
            self._store.write(LOCK_FILE, None, if_equal=self._generation).result()
        except ValueError as error:  # the storage failed: the lock stays, stale, for the next run to take over
            _LOG.warning("could not remove the lock of %s %s: %s", self.name, self.directory, error)


def _alive(owner: LockOwner) -> bool:
    """Whether ``owner``, a process of this host, still runs (the same process: it started before it took the lock)."""
    try:
        return psutil.Process(owner.pid).create_time() <= owner.since + 1.0
    except psutil.Error:
        return False
