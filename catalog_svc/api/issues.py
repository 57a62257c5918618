"""Turning domain diagnostics into the one error hierarchy (``services.errors``).

The domain reports issues as values (:class:`~catalog_svc.domain.Diagnostic`,
:class:`~catalog_svc.domain.CatalogDiagnostic`) whose paths are relative to the domain
value; the API reports them relative to the *request*, so every helper here takes the
request prefix. The first issue names ``ErrorDetail.field_path`` and its code becomes
``ErrorDetail.code``; all of them are listed in the ``issues`` attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import TypeVar

from catalog_svc.domain import CatalogDiagnostic, Diagnostic, DiagnosticCode
from services.errors import FailedPreconditionError, FlowError, InvalidArgumentError

__all__ = [
    "catalog_error",
    "enum_value",
    "invalid",
    "join_path",
    "require_text",
]

E = TypeVar("E", bound=IntEnum)
_MAX_LISTED = 1000

#: Codes that describe the generation's state, not the request's shape.
_PRECONDITION_CODES = frozenset(
    {
        DiagnosticCode.GENERATION_SEALED,
        DiagnosticCode.GENERATION_REJECTED,
        DiagnosticCode.VIEW_MISMATCH,
        DiagnosticCode.DANGLING_REFERENCE,
        DiagnosticCode.DIGEST_MISMATCH,
        DiagnosticCode.OWNER_CONFLICT,
        DiagnosticCode.DESCRIPTOR_CONFLICT,
        DiagnosticCode.HANDLER_REF_CONFLICT,
        DiagnosticCode.HANDLER_VERSION_CONFLICT,
        DiagnosticCode.HANDLER_BINDING_CONFLICT,
        DiagnosticCode.HANDLER_OWNER_MISMATCH,
        DiagnosticCode.PLATFORM_OWNED_OVERRIDE,
        DiagnosticCode.CAPABILITY_BROADENED,
        DiagnosticCode.SCOPE_MISMATCH,
    }
)


def join_path(prefix: str, path: str) -> str:
    """``prefix.path`` (either may be empty; ``[i]`` suffixes attach without a dot)."""
    if not prefix:
        return path
    if not path:
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


def _listed(pairs: Sequence[tuple[str, str]]) -> str:
    text = "; ".join(f"{path or '-'}:{code}" for path, code in pairs)
    return text if len(text) <= _MAX_LISTED else text[: _MAX_LISTED - 3] + "..."


def invalid(issues: Sequence[Diagnostic], prefix: str = "") -> InvalidArgumentError:
    """``INVALID_ARGUMENT`` for plain diagnostics under the request field ``prefix``."""
    first = issues[0]
    path = join_path(prefix, first.path)
    more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
    return InvalidArgumentError(
        f"{path or 'request'}: {first.message}{more}",
        reason=first.code.value,
        field_path=path,
        attributes={"issues": _listed([(join_path(prefix, d.path), d.code.value) for d in issues])},
    )


def catalog_error(
    issues: Sequence[CatalogDiagnostic],
    to_request_path: Callable[[str], str],
    *,
    attributes: dict[str, str] | None = None,
) -> FlowError:
    """The error for catalog-entry/generation diagnostics.

    State and §8.3 conflict codes are ``FAILED_PRECONDITION`` (the request may be well
    formed; the generation forbids it), everything else ``INVALID_ARGUMENT``. The detail
    names the entry (``entry`` attribute) and the request field (``field_path``).
    """
    first = issues[0]
    path = to_request_path(first.field)
    where = f"{first.entry!r}: " if first.entry else ""
    more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
    attrs = {
        "issues": _listed([(to_request_path(d.field), d.code.value) for d in issues]),
        **({"entry": first.entry} if first.entry else {}),
        **(attributes or {}),
    }
    message = f"{where}{path + ': ' if path else ''}{first.message}{more}"
    cls = FailedPreconditionError if first.code in _PRECONDITION_CODES else InvalidArgumentError
    return cls(message, reason=first.code.value, field_path=path, attributes=attrs)


def enum_value(cls: type[E], raw: int, path: str, issues: list[Diagnostic]) -> E:
    """``cls(raw)``; an unknown number is recorded (``unknown_enum_value``) and read as
    ``UNSPECIFIED`` so that validation can go on collecting issues."""
    try:
        return cls(raw)
    except ValueError:
        issues.append(
            Diagnostic(
                path,
                DiagnosticCode.UNKNOWN_ENUM_VALUE,
                f"unknown {cls.__name__} value {raw}",
            )
        )
        return cls(0)


def require_text(value: str, path: str, *, max_length: int, what: str = "") -> str:
    """A non-blank string of at most ``max_length`` characters, else ``INVALID_ARGUMENT``."""
    label = what or path
    if not value or not value.strip():
        raise InvalidArgumentError(f"{label} is required", reason="missing_field", field_path=path)
    if len(value) > max_length:
        raise InvalidArgumentError(
            f"{label} must be at most {max_length} characters",
            reason="out_of_range",
            field_path=path,
        )
    return value
