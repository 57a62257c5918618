"""Domain values of the record engine (frozen; no proto, no SQL)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

__all__ = [
    "RECORD_ID_RE",
    "Actor",
    "Lineage",
    "MutationKind",
    "MutationResult",
    "ParentRef",
    "RecordMutation",
    "RecordState",
    "RequestRef",
    "new_record_id",
]

#: Record identities (caller-chosen or server-generated) and reference values: at most
#: ``services.db.ID_LEN`` characters, no white space or separators that need quoting.
RECORD_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


def new_record_id() -> str:
    """A fresh server-generated record identity."""
    return f"rec_{uuid.uuid4().hex}"


class MutationKind(StrEnum):
    """What a mutation does to its record; also the business event type."""

    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"


@dataclass(frozen=True)
class ParentRef:
    """A record's reference to its parent through one relationship of its object."""

    relationship_name: str
    parent_object: str
    parent_record_id: str

    def to_dict(self) -> dict[str, str]:
        """Stored form."""
        return {
            "relationship": self.relationship_name,
            "parent_object": self.parent_object,
            "parent_record_id": self.parent_record_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParentRef:
        """Decode the stored form."""
        return cls(str(d["relationship"]), str(d["parent_object"]), str(d["parent_record_id"]))


@dataclass(frozen=True)
class RecordState:
    """A business record as stored.

    Attributes:
        org_id: trusted org.
        object_name: object API name.
        record_id: identity within org and object.
        version: optimistic concurrency version (1 after create, +1 per write).
        fields: field values keyed by field API name (cleared fields are absent).
        parent_refs: references to parents, sorted by relationship name.
        is_deleted: soft-delete fact.
        created_at: creation time (database clock).
        updated_at: last write time (database clock).
    """

    org_id: str
    object_name: str
    record_id: str
    version: int
    fields: Mapping[str, Any]
    parent_refs: tuple[ParentRef, ...]
    is_deleted: bool
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class RecordMutation:
    """One validated record mutation (build it with :mod:`runtime_svc.records.validation`).

    Attributes:
        kind: create, update or delete.
        object_name: object API name.
        record_id: record identity (already generated for a server-assigned create).
        fields: CREATE: every value; UPDATE: the changes, ``None`` clears; DELETE: empty.
        expected_version: UPDATE/DELETE compare-and-swap version; ``None`` means "the
            version read under lock" (a Flow step that admitted the row in its lock plan).
    """

    kind: MutationKind
    object_name: str
    record_id: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    expected_version: int | None = None


@dataclass(frozen=True)
class Actor:
    """Who performs a mutation, as written to the audit record (never a credential)."""

    kind: str
    id: str


@dataclass(frozen=True)
class Lineage:
    """The Flow step a mutation belongs to (empty for ordinary record writes)."""

    flow_run_id: str | None = None
    step_execution_id: str | None = None
    attempt_id: str | None = None


@dataclass(frozen=True)
class RequestRef:
    """Caller request identity of an RPC-driven mutation, kept on its business event as
    evidence (deduplication is the request ledger's, ``services.request_dedupe``).

    Attributes:
        rpc: RPC name (``CreateRecord``, …).
        request_id: caller idempotency token.
        request_digest: digest of the request body; a reuse with another body is refused.
    """

    rpc: str
    request_id: str
    request_digest: str


@dataclass(frozen=True)
class MutationResult:
    """What one applied mutation produced.

    Attributes:
        record: the record after the mutation.
        history_sequence: the reserved per-record history sequence.
        event_id: the business event row written with it.
        audit_record_id: the audit row written with it.
        changed_fields: field names the mutation set or cleared, sorted.
        prior: the record before the mutation (``None`` for a create).
    """

    record: RecordState
    history_sequence: int
    event_id: str
    audit_record_id: str
    changed_fields: tuple[str, ...]
    prior: RecordState | None = None
