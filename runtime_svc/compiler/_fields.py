"""Small typed readers for JSON-shaped mappings (inputs and plan decoding).

They raise :class:`FieldError` with a dotted path, so a malformed document
fails with a precise location instead of a ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "FieldError",
    "opt_int",
    "opt_str",
    "req_bool",
    "req_int",
    "req_map",
    "req_seq",
    "req_str",
    "str_tuple",
]


class FieldError(ValueError):
    """A JSON-shaped document lacks a field or has one of the wrong type."""


def req_map(d: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """Required mapping field."""
    v = d.get(key)
    if not isinstance(v, Mapping):
        raise FieldError(f"{where}.{key}: expected an object")
    return v


def req_seq(
    d: Mapping[str, Any], key: str, where: str, *, default_empty: bool = False
) -> Sequence[Any]:
    """Required list field (or empty when absent and ``default_empty``)."""
    v = d.get(key)
    if v is None and default_empty:
        return ()
    if not isinstance(v, list | tuple):
        raise FieldError(f"{where}.{key}: expected a list")
    return v


def req_str(d: Mapping[str, Any], key: str, where: str) -> str:
    """Required non-empty string field."""
    v = d.get(key)
    if not isinstance(v, str) or not v:
        raise FieldError(f"{where}.{key}: expected a non-empty string")
    return v


def opt_str(d: Mapping[str, Any], key: str, where: str) -> str | None:
    """Optional string field."""
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise FieldError(f"{where}.{key}: expected a string")
    return v


def req_int(d: Mapping[str, Any], key: str, where: str) -> int:
    """Required integer field (booleans are not integers here)."""
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise FieldError(f"{where}.{key}: expected an integer")
    return v


def opt_int(d: Mapping[str, Any], key: str, where: str) -> int | None:
    """Optional integer field."""
    if d.get(key) is None:
        return None
    return req_int(d, key, where)


def req_bool(d: Mapping[str, Any], key: str, where: str, default: bool | None = None) -> bool:
    """Boolean field with an optional default."""
    v = d.get(key)
    if v is None and default is not None:
        return default
    if not isinstance(v, bool):
        raise FieldError(f"{where}.{key}: expected a boolean")
    return v


def str_tuple(d: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    """Optional list of strings (empty when absent)."""
    out: list[str] = []
    for i, v in enumerate(req_seq(d, key, where, default_empty=True)):
        if not isinstance(v, str):
            raise FieldError(f"{where}.{key}[{i}]: expected a string")
        out.append(v)
    return tuple(out)
