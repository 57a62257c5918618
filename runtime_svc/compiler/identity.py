"""The declared execution principal of a durable step (§17.1, §17.2).

A compiled Durable Orchestration step carries a :class:`StepPrincipal`: the mode it runs
under, the explicit system/background identity when that mode is ``system`` (or when a
denial hands off to system), and what a failed reauthorization does. The vocabulary is
the catalog's ``SecurityPolicy`` (``PrincipalMode``, ``ReauthorizationPolicy``) in the
runtime's lower-case form. Pure values: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["ExecutionPrincipalMode", "ReauthorizationPolicy", "StepPrincipal"]


class ExecutionPrincipalMode(StrEnum):
    """Whose authority a step acts with (catalog ``PrincipalMode``).

    ``caller`` exists only inside the caller's own save (Embedded Before-Save) and is
    never the mode of a durable step.
    """

    CALLER = "caller"
    INITIATING_PRINCIPAL = "initiating_principal"
    SYSTEM = "system"


class ReauthorizationPolicy(StrEnum):
    """What a durable step does when its principal is disabled or its permission state
    changed materially since the run was admitted (catalog ``ReauthorizationPolicy``)."""

    FAULT_PATH = "fault_path"
    TERMINAL_FAILURE = "terminal_failure"
    SYSTEM_HANDOFF = "system_handoff"


@dataclass(frozen=True)
class StepPrincipal:
    """A durable step's declared principal contract.

    Attributes:
        mode: ``initiating_principal`` or ``system``.
        on_denied: the reauthorization policy of the step.
        system_identity: the explicit declared system identity; required when ``mode``
            is ``system`` or ``on_denied`` is ``system_handoff`` (a compile error
            otherwise), ``None`` else.
    """

    mode: ExecutionPrincipalMode
    on_denied: ReauthorizationPolicy
    system_identity: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (part of the plan digest)."""
        return {
            "mode": self.mode.value,
            "on_denied": self.on_denied.value,
            "system_identity": self.system_identity,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepPrincipal:
        """Inverse of :meth:`to_dict`."""
        return cls(
            ExecutionPrincipalMode(d["mode"]),
            ReauthorizationPolicy(d["on_denied"]),
            d.get("system_identity"),
        )
