"""Internal field checks shared by the validators; each appends issues and returns ok."""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import IntEnum

from .diagnostics import Diagnostic, DiagnosticCode
from .ids import INT64_MAX

__all__ = ["check_enum", "check_int", "check_pattern", "check_text", "check_unique", "forbid"]


def check_enum(value: object, cls: type[IntEnum], path: str, out: list[Diagnostic]) -> bool:
    """A member of ``cls`` other than ``UNSPECIFIED`` (which reads as "missing")."""
    if not isinstance(value, cls):
        out.append(
            Diagnostic(
                path, DiagnosticCode.UNKNOWN_ENUM_VALUE, f"unknown {cls.__name__} value {value!r}"
            )
        )
        return False
    if value.value == 0:
        out.append(Diagnostic(path, DiagnosticCode.MISSING_FIELD, f"{path} is required"))
        return False
    return True


def check_int(
    value: object, low: int, path: str, out: list[Diagnostic], high: int = INT64_MAX
) -> bool:
    """An ``int`` (not ``bool``) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        out.append(Diagnostic(path, DiagnosticCode.INVALID_TYPE, f"{path} must be an integer"))
        return False
    if not low <= value <= high:
        shown = "2^63-1" if high == INT64_MAX else str(high)
        out.append(
            Diagnostic(
                path,
                DiagnosticCode.OUT_OF_RANGE,
                f"{path} must be in [{low}, {shown}], got {value}",
            )
        )
        return False
    return True


def check_pattern(
    value: object, rx: re.Pattern[str], limit: int, path: str, what: str, out: list[Diagnostic]
) -> bool:
    """A non-empty string of at most ``limit`` characters matching ``rx``."""
    if value is None:
        out.append(Diagnostic(path, DiagnosticCode.MISSING_FIELD, f"{what} is required"))
        return False
    if not isinstance(value, str):
        out.append(Diagnostic(path, DiagnosticCode.INVALID_TYPE, f"{what} must be a string"))
        return False
    if not value:
        out.append(Diagnostic(path, DiagnosticCode.MISSING_FIELD, f"{what} is required"))
        return False
    if len(value) > limit or not rx.match(value):
        out.append(
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                f"{what} {value!r} must match {rx.pattern} (<= {limit})",
            )
        )
        return False
    return True


def check_text(value: object, path: str, limit: int, out: list[Diagnostic]) -> None:
    """A string (possibly empty) of at most ``limit`` characters."""
    if not isinstance(value, str):
        out.append(Diagnostic(path, DiagnosticCode.INVALID_TYPE, "must be a string"))
    elif len(value) > limit:
        out.append(Diagnostic(path, DiagnosticCode.OUT_OF_RANGE, f"at most {limit} characters"))


def check_unique(
    names: Sequence[tuple[str, object]], what: str, out: list[Diagnostic], *, fold: bool = True
) -> None:
    """Report every later duplicate; strings compare case-insensitively unless ``fold`` is off."""
    seen: dict[object, str] = {}
    for path, name in names:
        key = name.casefold() if fold and isinstance(name, str) else name
        if key in seen:
            out.append(
                Diagnostic(
                    path,
                    DiagnosticCode.DUPLICATE_NAME,
                    f"duplicate {what} {name!r} (first at {seen[key]})",
                )
            )
        else:
            seen[key] = path


def forbid(present: bool, path: str, why: str, out: list[Diagnostic]) -> None:
    """Report ``path`` as inconsistent when ``present``."""
    if present:
        out.append(Diagnostic(path, DiagnosticCode.INCONSISTENT, why))
