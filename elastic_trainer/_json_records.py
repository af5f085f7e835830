"""Frozen records that are written to JSON and read back: the report's parts (``report.json``).

One rule for every such record: :meth:`JsonRecord.to_json` writes each field
under its name (a nested record as its JSON, a tuple as a list), leaving out
the fields named in ``_omitted_when_none`` while they are ``None``;
:meth:`JsonRecord.from_json` reads that back, a missing field taking its
default, and a key the record does not know kept in its ``extra`` field when
it has one (written back at the same level), else ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Self, Union

EXTRA = "extra"
"""The field that keeps the keys a record does not know."""


class JsonRecord:
    """A frozen dataclass written to JSON by :meth:`to_json` and read back by :meth:`from_json`."""

    _omitted_when_none: ClassVar[tuple[str, ...]] = ()
    """Fields left out of the JSON while they are ``None`` (parts a run may not have)."""

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values, in field order; ``extra``'s keys last, at this level."""
        written = {
            field.name: encode(getattr(self, field.name)) for field in dataclasses.fields(self)
            if field.name != EXTRA and not (field.name in self._omitted_when_none and getattr(self, field.name) is None)
        }
        return {**written, **encode(getattr(self, EXTRA, {}))}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        """The record of ``data`` (what :meth:`to_json` wrote, or an older or newer version of it)."""
        if not isinstance(data, dict):
            raise ValueError(f"a {cls.__name__} is a JSON object, not {type(data).__name__} {data!r}.")
        fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
        missing = [name for name, field in fields.items() if name not in data and name != EXTRA
                   and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"a {cls.__name__} needs {', '.join(missing)}, which the JSON lacks.")
        hints = _hints(cls)
        known = {name: _decode(hints[name], value) for name, value in data.items() if name in fields and name != EXTRA}
        if EXTRA in fields:
            known[EXTRA] = {name: value for name, value in data.items() if name not in fields}
        return cls(**known)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def encode(value: Any) -> Any:
    """``value`` as JSON values: a record as its :meth:`~JsonRecord.to_json`, a tuple as a list."""
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    return value


def _decode(hint: Any, value: Any) -> Any:
    """``value`` read as ``hint`` says: a record from its JSON, a tuple from a list; others as they are."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (Union, types.UnionType):
        return _decode(next(arg for arg in args if arg is not type(None)), value)
    if isinstance(hint, type) and issubclass(hint, JsonRecord):
        return hint.from_json(value)
    if origin is tuple and isinstance(value, list):
        return tuple(_decode(args[0], item) for item in value)
    if origin is dict and isinstance(value, dict):
        return {key: _decode(args[1], item) for key, item in value.items()}
    return value
