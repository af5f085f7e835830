"""Optional extras (grain, Flax, pathwaysutils), imported when first used."""

from __future__ import annotations

import importlib
from types import ModuleType

from ._failures import ConfigError


def import_extra(module: str, *, needed_by: str, package: str, extra: str) -> ModuleType:
    """Import ``module``; when it is missing, a :class:`ConfigError` saying that ``needed_by`` needs ``package``
    and which extra of elastic-trainer installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"{needed_by} needs {package} ({error}); install it with pip install 'elastic-trainer[{extra}]'."
        ) from error
