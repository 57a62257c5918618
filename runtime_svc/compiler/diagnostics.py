"""Compile issues, non-fatal diagnostics and the one error the compiler raises.

The compiler never stops at the first problem: every phase reports into an
:class:`IssueSink`, and :func:`IssueSink.raise_if_errors` raises a single
:class:`PlanCompileError` carrying every blocking issue, sorted so that the
report does not depend on element order in the source.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from services.errors import InvalidArgumentError

__all__ = [
    "CompileIssue",
    "Diagnostic",
    "IssueSink",
    "PlanCompileError",
    "Severity",
    "format_chain",
]


class Severity(StrEnum):
    """How much a diagnostic matters; only ``ERROR`` blocks a plan."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def format_chain(chain: Iterable[str]) -> str:
    """Render a transitive blocker chain as ``"Subflow X → ActionCall Y"``."""
    return " → ".join(chain)


@dataclass(frozen=True, order=True)
class CompileIssue:
    """One blocking problem found while compiling.

    Attributes:
        path: Stable location in the Flow source (``elements[send_mail].next``);
            element names, never list indexes, once the element is named.
        code: Stable machine-readable code (``profile.atomic_unsafe``).
        message: Human explanation, safe to show to an author.
        blocker_chain: Transitive chain that causes the problem, outermost
            first (``("Subflow notify", "ActionCall send_email")``); empty when
            the problem is local.
    """

    path: str
    code: str
    message: str
    blocker_chain: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Canonical dictionary form (golden files, activation attempts)."""
        return {
            "path": self.path,
            "code": self.code,
            "message": self.message,
            "blocker_chain": list(self.blocker_chain),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileIssue:
        """Inverse of :meth:`to_dict`."""
        return cls(
            path=str(data["path"]),
            code=str(data["code"]),
            message=str(data["message"]),
            blocker_chain=tuple(str(c) for c in data.get("blocker_chain", ())),
        )


@dataclass(frozen=True, order=True)
class Diagnostic:
    """A non-blocking remark kept in a valid plan's diagnostic summary."""

    severity: Severity
    path: str
    code: str
    message: str
    blocker_chain: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Canonical dictionary form."""
        return {
            "severity": self.severity.value,
            "path": self.path,
            "code": self.code,
            "message": self.message,
            "blocker_chain": list(self.blocker_chain),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Diagnostic:
        """Inverse of :meth:`to_dict`."""
        return cls(
            severity=Severity(data["severity"]),
            path=str(data["path"]),
            code=str(data["code"]),
            message=str(data["message"]),
            blocker_chain=tuple(str(c) for c in data.get("blocker_chain", ())),
        )


class PlanCompileError(InvalidArgumentError):
    """The Flow cannot be compiled; ``issues`` holds every blocking issue.

    The same inputs always fail the same way, so the error is not retryable.
    Mapped to ``INVALID_ARGUMENT`` by the shared interceptor; ``field_path``
    is the first issue's path and the attributes carry the issue count and codes.
    """

    reason = "plan_compile_failed"

    def __init__(self, issues: Iterable[CompileIssue]) -> None:
        self.issues: tuple[CompileIssue, ...] = tuple(sorted(set(issues)))
        lines = [f"{i.path}: [{i.code}] {i.message}" for i in self.issues]
        super().__init__(
            f"{len(self.issues)} compile issue(s):\n" + "\n".join(lines),
            field_path=self.issues[0].path if self.issues else "",
            attributes={"issue_count": str(len(self.issues)), "codes": ",".join(self.codes())},
        )

    def codes(self) -> tuple[str, ...]:
        """Sorted distinct issue codes (handy in tests and inventory reports)."""
        return tuple(sorted({i.code for i in self.issues}))

    def to_dict(self) -> dict[str, Any]:
        """Canonical dictionary form (``diagnostics.json`` golden files)."""
        return {"issues": [i.to_dict() for i in self.issues]}


class IssueSink:
    """Collects issues and diagnostics across compiler phases."""

    def __init__(self) -> None:
        self._issues: list[CompileIssue] = []
        self._diagnostics: list[Diagnostic] = []

    def error(self, path: str, code: str, message: str, chain: Iterable[str] = ()) -> None:
        """Record a blocking issue."""
        self._issues.append(CompileIssue(path, code, message, tuple(chain)))

    def note(
        self,
        severity: Severity,
        path: str,
        code: str,
        message: str,
        chain: Iterable[str] = (),
    ) -> None:
        """Record a non-blocking diagnostic (``ERROR`` is routed to :meth:`error`)."""
        if severity is Severity.ERROR:
            self.error(path, code, message, chain)
            return
        self._diagnostics.append(Diagnostic(severity, path, code, message, tuple(chain)))

    def extend(self, issues: Iterable[CompileIssue]) -> None:
        """Record issues produced elsewhere (for example by a subflow compile)."""
        self._issues.extend(issues)

    @property
    def has_errors(self) -> bool:
        """True once any blocking issue was recorded."""
        return bool(self._issues)

    @property
    def issues(self) -> tuple[CompileIssue, ...]:
        """Blocking issues so far, sorted and de-duplicated."""
        return tuple(sorted(set(self._issues)))

    def diagnostics(self) -> tuple[Diagnostic, ...]:
        """Non-blocking diagnostics, sorted and de-duplicated."""
        return tuple(sorted(set(self._diagnostics)))

    def raise_if_errors(self) -> None:
        """Raise one :class:`PlanCompileError` carrying every issue so far."""
        if self._issues:
            raise PlanCompileError(self._issues)
