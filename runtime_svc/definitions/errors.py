"""Errors the definitions service raises beyond the kernel's classes."""

from __future__ import annotations

from collections.abc import Sequence

from runtime_svc.definitions.inventory import DiagnosticValue
from services.errors import AlreadyExistsError, FailedPreconditionError

__all__ = ["ActivationBlockedError", "FlowVersionConflictError"]


class FlowVersionConflictError(AlreadyExistsError):
    """The API name and version are taken by a *different* source."""

    reason = "flow_version_source_conflict"

    def __init__(self, api_name: str, version: int, existing: str, submitted: str) -> None:
        super().__init__("FlowVersion", f"{api_name}@{version}")
        self.safe_message = (
            f"Flow {api_name} version {version} is already registered with a different "
            f"source (metadata digest {existing}, submitted {submitted}); Flow versions are "
            "immutable: register the change as a new version number"
        )
        self.args = (self.safe_message,)
        self.attributes.update(
            existing_metadata_digest=existing, submitted_metadata_digest=submitted
        )


class ActivationBlockedError(FailedPreconditionError):
    """Activation re-compiled the Flow and the compiler rejected it (§9.2: no fallback).

    The diagnostics are stored on the BLOCKED activation attempt ``activation_id``.
    """

    reason = "activation_blocked"

    def __init__(self, activation_id: str, diagnostics: Sequence[DiagnosticValue]) -> None:
        self.activation_id = activation_id
        self.diagnostics = tuple(diagnostics)
        lines = []
        for d in self.diagnostics[:20]:
            chain = f" (blocker: {' → '.join(d.blocker_chain)})" if d.blocker_chain else ""
            lines.append(f"{d.path}: [{d.code}] {d.message}{chain}")
        super().__init__(
            f"activation blocked: {len(self.diagnostics)} compile issue(s):\n" + "\n".join(lines),
            attributes={
                "activation_id": activation_id,
                "issue_count": str(len(self.diagnostics)),
                "codes": ",".join(sorted({d.code for d in self.diagnostics})),
            },
        )
