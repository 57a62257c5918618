"""Internal helpers that read JSON-shaped dicts while collecting issues.

Every reader appends to an ``issues`` list instead of raising, so one pass over a
document reports every problem (STYLE 4). Enums are read by member name
(case-insensitive) or by their proto number; ``UNSPECIFIED`` is never accepted as an
explicit value. Emitted JSON always uses the lower-case member name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import TypeVar

from .diagnostics import Diagnostic, DiagnosticCode

__all__ = [
    "at",
    "enum_from_json",
    "enum_to_json",
    "expect_mapping",
    "get_bool",
    "get_enum",
    "get_int",
    "get_list",
    "get_str",
    "index",
    "read_items",
    "read_object",
    "reject_unknown_keys",
]

E = TypeVar("E", bound=IntEnum)
T = TypeVar("T")
#: Reads the mapping at a path into a value (``None`` when unusable), appending issues.
Reader = Callable[[Mapping[str, object], str, list[Diagnostic]], T | None]


def at(path: str, key: str) -> str:
    """Path of ``key`` under ``path``."""
    return f"{path}.{key}" if path else key


def index(path: str, i: int) -> str:
    """Path of item ``i`` of the sequence at ``path``."""
    return f"{path}[{i}]"


def enum_to_json(value: IntEnum) -> str:
    """JSON/digest form of an enum member: its lower-case name."""
    return value.name.lower()


def _type_name(raw: object) -> str:
    return "null" if raw is None else type(raw).__name__


def expect_mapping(raw: object, path: str, issues: list[Diagnostic]) -> Mapping[str, object] | None:
    """``raw`` as a string-keyed mapping, or ``None`` (with an issue)."""
    if isinstance(raw, Mapping) and all(isinstance(k, str) for k in raw):
        return raw
    issues.append(
        Diagnostic(path, DiagnosticCode.INVALID_TYPE, f"expected an object, got {_type_name(raw)}")
    )
    return None


def reject_unknown_keys(
    m: Mapping[str, object], allowed: frozenset[str], path: str, issues: list[Diagnostic]
) -> None:
    """Report every key of ``m`` not in ``allowed`` (typos must not pass silently)."""
    for key in sorted(set(m) - allowed):
        issues.append(
            Diagnostic(
                at(path, key),
                DiagnosticCode.UNKNOWN_FIELD,
                f"unknown field {key!r}; expected one of {sorted(allowed)}",
            )
        )


def get_str(
    m: Mapping[str, object], key: str, path: str, issues: list[Diagnostic], *, required: bool
) -> str | None:
    """A string field; missing/null gives ``None`` (and an issue when required)."""
    raw = m.get(key)
    if raw is None:
        if required:
            issues.append(
                Diagnostic(at(path, key), DiagnosticCode.MISSING_FIELD, f"{key} is required")
            )
        return None
    if not isinstance(raw, str):
        issues.append(
            Diagnostic(
                at(path, key),
                DiagnosticCode.INVALID_TYPE,
                f"{key} must be a string, got {_type_name(raw)}",
            )
        )
        return None
    return raw


def get_int(
    m: Mapping[str, object], key: str, path: str, issues: list[Diagnostic], *, required: bool
) -> int | None:
    """An integer field (booleans are not integers here)."""
    raw = m.get(key)
    if raw is None:
        if required:
            issues.append(
                Diagnostic(at(path, key), DiagnosticCode.MISSING_FIELD, f"{key} is required")
            )
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        issues.append(
            Diagnostic(
                at(path, key),
                DiagnosticCode.INVALID_TYPE,
                f"{key} must be an integer, got {_type_name(raw)}",
            )
        )
        return None
    return raw


def get_bool(m: Mapping[str, object], key: str, path: str, issues: list[Diagnostic]) -> bool:
    """A boolean field; missing/null is ``False``."""
    raw = m.get(key)
    if raw is None:
        return False
    if not isinstance(raw, bool):
        issues.append(
            Diagnostic(
                at(path, key),
                DiagnosticCode.INVALID_TYPE,
                f"{key} must be a boolean, got {_type_name(raw)}",
            )
        )
        return False
    return raw


def get_list(
    m: Mapping[str, object], key: str, path: str, issues: list[Diagnostic]
) -> list[object]:
    """A list field; missing/null is empty."""
    raw = m.get(key)
    if raw is None:
        return []
    if isinstance(raw, Sequence) and not isinstance(raw, str | bytes | bytearray):
        return list(raw)
    issues.append(
        Diagnostic(
            at(path, key),
            DiagnosticCode.INVALID_TYPE,
            f"{key} must be a list, got {_type_name(raw)}",
        )
    )
    return []


def enum_from_json(cls: type[E], raw: object, path: str, issues: list[Diagnostic]) -> E | None:
    """Read one enum value by member name (any case) or proto number; never UNSPECIFIED."""
    allowed = [enum_to_json(v) for v in cls if v.value != 0]
    if isinstance(raw, str):
        member = cls.__members__.get(raw.strip().upper())
        if member is not None and member.value != 0:
            return member
    elif isinstance(raw, int) and not isinstance(raw, bool):
        if raw == 0:
            issues.append(
                Diagnostic(path, DiagnosticCode.MISSING_FIELD, f"{cls.__name__} is unspecified")
            )
            return None
        try:
            return cls(raw)
        except ValueError:
            pass
    issues.append(
        Diagnostic(
            path,
            DiagnosticCode.UNKNOWN_ENUM_VALUE,
            f"unknown {cls.__name__} value {raw!r}; expected one of {allowed}",
        )
    )
    return None


def get_enum(
    m: Mapping[str, object],
    key: str,
    cls: type[E],
    path: str,
    issues: list[Diagnostic],
    *,
    required: bool = True,
) -> E | None:
    """An enum field; missing/null gives ``None`` (and an issue when required)."""
    raw = m.get(key)
    if raw is None:
        if required:
            issues.append(
                Diagnostic(at(path, key), DiagnosticCode.MISSING_FIELD, f"{key} is required")
            )
        return None
    return enum_from_json(cls, raw, at(path, key), issues)


def read_object(
    m: Mapping[str, object], key: str, path: str, issues: list[Diagnostic], read: Reader[T]
) -> T | None:
    """A required nested object read by ``read``."""
    raw = m.get(key)
    sub_path = at(path, key)
    if raw is None:
        issues.append(Diagnostic(sub_path, DiagnosticCode.MISSING_FIELD, f"{key} is required"))
        return None
    sub = expect_mapping(raw, sub_path, issues)
    return None if sub is None else read(sub, sub_path, issues)


def read_items(
    m: Mapping[str, object], key: str, path: str, issues: list[Diagnostic], read: Reader[T]
) -> tuple[T, ...]:
    """A list of objects each read by ``read``; unusable items are dropped (with issues)."""
    out: list[T] = []
    for i, raw in enumerate(get_list(m, key, path, issues)):
        item_path = index(at(path, key), i)
        sub = expect_mapping(raw, item_path, issues)
        if sub is not None:
            parsed = read(sub, item_path, issues)
            if parsed is not None:
                out.append(parsed)
    return tuple(out)
