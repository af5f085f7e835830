"""Where checkpoints go: a local directory, or a Google Cloud Storage URL (``gs://bucket/path``), as the
``etils.epath.Path`` that Orbax itself takes.

Orbax writes arrays through tensorstore and everything else through epath.
Of the URL schemes, only ``gs://`` is written by both (Orbax 0.12's
``tensorstore_utils._build_ocdbt_kvstore_tspec`` takes a remote path only
for ``gs://``; any other must be an absolute local path), so any other
``scheme://`` is refused, before anything runs. A ``pathlib.Path`` of a URL
would be a local path (``gs:/bucket/...`` under the current directory).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from etils import epath

from .._extras import import_extra
from .._failures import ConfigError

OBJECT_STORE_SCHEMES = ("gs",)
"""URL schemes a checkpoint directory may have: Google Cloud Storage (through tensorstore's ``gcs`` driver)."""

GCS_CLIENTS = (("gcsfs", "gcsfs"), ("google.cloud.storage", "google-cloud-storage"))
"""What Orbax needs beside tensorstore for ``gs://``: etils' ``epath`` reaches GCS through gcsfs (fsspec's GCS
filesystem) unless TensorFlow is installed, and Orbax lists a bucket's steps with google-cloud-storage."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def checkpoint_path(directory: str | os.PathLike[str]) -> epath.Path:
    """``directory`` as Orbax takes it: a ``gs://`` URL as it is, a local directory made absolute.

    Raises :class:`ConfigError` for a URL of another scheme, or one that names no bucket.
    """
    text = os.fspath(directory)
    url = _URL.match(text)
    if url is None:
        return epath.Path(Path(text).absolute())
    scheme, rest = url.groups()
    if scheme not in OBJECT_STORE_SCHEMES:
        raise ConfigError(
            f"checkpoint.dir {text} is a {scheme}:// URL, which Orbax cannot store checkpoints in; give a local "
            "directory (shared storage for several hosts) or a Google Cloud Storage URL, gs://BUCKET/PATH."
        )
    if not rest.split("/", 1)[0]:
        raise ConfigError(f"checkpoint.dir {text} names no bucket; give gs://BUCKET/PATH.")
    for module, package in GCS_CLIENTS:
        import_extra(module, needed_by=f"checkpoint.dir {text}", package=package, extra="gcs")
    return epath.Path(f"{scheme}://{rest.rstrip('/')}")


def is_object_store(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is an object store URL (``gs://...``), not a local path."""
    url = _URL.match(os.fspath(directory))
    return url is not None and url.group(1) in OBJECT_STORE_SCHEMES


COMMIT_SUCCESS_FILE = "commit_success.txt"
"""What marks a step committed on object storage, where Orbax writes a step's folder in place (its
``CommitFileTemporaryPath``) and adds this file last; on a local disk Orbax renames the folder from
``<step>.orbax-checkpoint-tmp-...`` to the step's number once it is committed."""


def holds_committed_step(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` (a local directory or ``gs://`` URL) holds a step that Orbax committed, read from its
    listing alone (no Orbax manager: a supervisor deciding whether a restarted worker resumes)."""
    directory = epath.Path(directory)
    if not directory.is_dir():
        return False
    in_place = is_object_store(directory)
    return any(p.name.isdigit() and (not in_place or (p / COMMIT_SUCCESS_FILE).exists()) for p in directory.iterdir())
