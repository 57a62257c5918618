"""Pure rules of the owner-inbox acceptance/rejection fence (spec §10.7, §15.4).

The inbox row is keyed by ``EffectHandoffKey`` (within the trusted org). The complete
trusted Runtime work scope, the originating Runtime outbox identity and the payload
digest are *immutable validation attributes* of the row, never key parts. Every request
that names a key is checked against them by :func:`mismatch`; any difference fails
closed — the caller is refused without learning anything about the row, the row gets a
quarantine marker, and no second fence, command or receipt can be written.

Before any row is consulted, :func:`key_scope_mismatch` checks that the key's canonical
grammar (``services.effect_contract``) encodes exactly the caller's trusted scope: a key
minted for another org, installation, capability or binding digest is refused the same
way.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.effect_contract import handoff_key_matches_scope

__all__ = [
    "FenceState",
    "HandoffAttributes",
    "MismatchReason",
    "key_scope_mismatch",
    "mismatch",
]


class FenceState(StrEnum):
    """``owner_inbox.state`` (``effect.v1.InboxFenceState``)."""

    ACCEPTED = "ACCEPTED"
    REJECTED = "REJECTED"


class MismatchReason(StrEnum):
    """Why a request failed closed against a fence row (stored as the quarantine reason;
    never sent to the caller)."""

    SCOPE = "scope_mismatch"
    PAYLOAD_DIGEST = "payload_digest_mismatch"
    OUTBOX_ID = "outbox_id_mismatch"
    OWNER_KIND = "owner_kind_mismatch"


@dataclass(frozen=True)
class HandoffAttributes:
    """What a request asserts about a handoff key (all of it must match the row)."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: str
    effect_handoff_key: str
    runtime_outbox_message_id: str
    payload_digest: str


def key_scope_mismatch(attrs: HandoffAttributes) -> bool:
    """True when the key was not minted for the request's (trusted) scope."""
    return not handoff_key_matches_scope(attrs.effect_handoff_key, attrs)


def mismatch(row: HandoffAttributes, request: HandoffAttributes) -> MismatchReason | None:
    """The first attribute in which ``request`` differs from the stored ``row``."""
    if (
        row.org_id,
        row.app_installation_id,
        row.runtime_capability_id,
        row.runtime_work_binding_digest,
    ) != (
        request.org_id,
        request.app_installation_id,
        request.runtime_capability_id,
        request.runtime_work_binding_digest,
    ):
        return MismatchReason.SCOPE
    if row.payload_digest != request.payload_digest:
        return MismatchReason.PAYLOAD_DIGEST
    if row.runtime_outbox_message_id != request.runtime_outbox_message_id:
        return MismatchReason.OUTBOX_ID
    return None
