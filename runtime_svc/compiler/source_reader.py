"""Reads one JSON-shaped mapping of a Flow document, reporting problems at exact paths.

Unknown keys are errors (a misspelt ``fualt`` connector must not silently
vanish); ``label``, ``description`` and ``location`` are accepted everywhere
and ignored because they are not semantic.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from .diagnostics import IssueSink
from .expressions import Expr, ExpressionError, parse_expression
from .language import IDENT_RE

__all__ = ["IGNORED_KEYS", "FieldReader", "read_expr", "read_expr_map"]

IGNORED_KEYS = frozenset({"label", "description", "location"})

_E = TypeVar("_E", bound=StrEnum)


class FieldReader:
    """Reads one mapping, reporting every problem at a precise path."""

    def __init__(
        self, sink: IssueSink, d: Mapping[str, Any], path: str, allowed: frozenset[str]
    ) -> None:
        self.sink, self.d, self.path = sink, d, path
        for key in sorted(k for k in d if isinstance(k, str)):
            if key not in allowed and key not in IGNORED_KEYS:
                sink.error(f"{path}.{key}", "source.unknown_field", f"unknown field {key!r}")
        for key in d:
            if not isinstance(key, str):
                sink.error(path, "source.invalid_key", f"key {key!r} is not a string")

    def err(self, key: str, code: str, message: str) -> None:
        self.sink.error(f"{self.path}.{key}" if key else self.path, code, message)

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def text(self, key: str, *, required: bool = True, ident: bool = False) -> str | None:
        v = self.d.get(key)
        if v is None:
            if required:
                self.err(key, "source.missing_field", f"{key!r} is required")
            return None
        if not isinstance(v, str) or not v:
            self.err(key, "source.invalid_type", f"{key!r} must be a non-empty string")
            return None
        if ident and not IDENT_RE.match(v):
            self.err(
                key,
                "source.invalid_name",
                f"{v!r} is not a valid name (letter, then letters/digits/_)",
            )
            return None
        return v

    def integer(self, key: str, *, required: bool = False, minimum: int = 0) -> int | None:
        v = self.d.get(key)
        if v is None:
            if required:
                self.err(key, "source.missing_field", f"{key!r} is required")
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            self.err(key, "source.invalid_type", f"{key!r} must be an integer >= {minimum}")
            return None
        return v

    def flag(self, key: str) -> bool | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            self.err(key, "source.invalid_type", f"{key!r} must be true or false")
            return None
        return v

    def enum(self, key: str, cls: type[_E], *, required: bool = True) -> _E | None:
        raw = self.text(key, required=required)
        if raw is None:
            return None
        try:
            return cls(raw)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            self.err(key, "source.invalid_value", f"{raw!r} is not one of: {allowed}")
            return None

    def mapping(self, key: str, *, required: bool = False) -> Mapping[str, Any] | None:
        v = self.d.get(key)
        if v is None:
            if required:
                self.err(key, "source.missing_field", f"{key!r} is required")
            return None
        if not isinstance(v, Mapping):
            self.err(key, "source.invalid_type", f"{key!r} must be an object")
            return None
        return v

    def seq(self, key: str, *, required: bool = False) -> Sequence[Any]:
        v = self.d.get(key)
        if v is None:
            if required:
                self.err(key, "source.missing_field", f"{key!r} is required")
            return ()
        if not isinstance(v, list | tuple):
            self.err(key, "source.invalid_type", f"{key!r} must be a list")
            return ()
        return v

    def expr(self, key: str, *, required: bool = True) -> Expr | None:
        v = self.d.get(key)
        if v is None:
            if required:
                self.err(key, "source.missing_field", f"{key!r} is required")
            return None
        return read_expr(self.sink, f"{self.path}.{key}", v)


def read_expr(sink: IssueSink, path: str, v: Any) -> Expr | None:
    if isinstance(v, bool | int) or v is None:
        # A bare JSON scalar is its own literal ("limit": 5 style values).
        return parse_expression(json.dumps(v))
    if not isinstance(v, str):
        sink.error(path, "source.invalid_type", "an expression must be a string")
        return None
    try:
        return parse_expression(v)
    except ExpressionError as exc:
        sink.error(path, "expression.syntax", f"{exc.reason} at offset {exc.position} in {v!r}")
        return None


def read_expr_map(
    sink: IssueSink, path: str, m: Mapping[str, Any] | None
) -> tuple[tuple[str, Expr], ...]:
    out: list[tuple[str, Expr]] = []
    for k in sorted((m or {}).keys()):
        if not isinstance(k, str) or not IDENT_RE.match(k):
            sink.error(
                f"{path}.{k}",
                "source.invalid_name",
                f"{k!r} is not a valid field or parameter name",
            )
            continue
        e = read_expr(sink, f"{path}.{k}", (m or {})[k])
        if e is not None:
            out.append((k, e))
    return tuple(out)
