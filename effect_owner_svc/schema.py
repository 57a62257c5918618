"""Effect-owner service schema (SQLAlchemy Core): the owner inbox and its
``RejectIfUnaccepted`` fence, external commands, remote attempts, completion receipts and
the owner's producer outbox.

Spec: §10.7 (owner inbox / acceptance-rejection fence), §15.1-§15.4 (submission,
completion, ``OUTCOME_UNKNOWN``, dead-letter convergence).

``owner_inbox`` is keyed by ``(org_id, effect_handoff_key)``. The spec makes the handoff
key alone unique; the project rule puts ``org_id`` first in every key. Both hold because
the key's canonical grammar already encodes the complete trusted Runtime work scope
(§10.7): the owner must check that the key it receives derives from the caller's trusted
scope before inserting, so one key can never belong to two orgs. The scope, Runtime outbox
id and payload digest are immutable validation attributes of the row, never key parts.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKeyConstraint,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    text,
)

from services.db import (
    CODE_LEN,
    DIGEST_LEN,
    ID_LEN,
    KEY_LEN,
    TABLE_OPTIONS,
    TOKEN_LEN,
    TRACE_CONTEXT_BYTES,
    WORK_SCOPE,
    JsonText,
    UtcDateTime,
    new_metadata,
    outbox_delivery_columns,
    work_scope_columns,
)
from services.request_dedupe import request_dedupe_table

__all__ = [
    "MAX_COMMAND_PAYLOAD_BYTES",
    "MAX_OUTBOX_PAYLOAD_BYTES",
    "MAX_OUTCOME_PAYLOAD_BYTES",
    "completion_receipts",
    "external_commands",
    "metadata",
    "owner_inbox",
    "owner_outbox",
    "owner_requests",
    "remote_attempts",
]

#: Accepted command envelope (the frozen Runtime handoff payload).
MAX_COMMAND_PAYLOAD_BYTES = 256 * 1024
#: Safe outcome evidence carried by a completion receipt.
MAX_OUTCOME_PAYLOAD_BYTES = 64 * 1024
#: Owner outbox envelope (wake-signal delivery to the Runtime).
MAX_OUTBOX_PAYLOAD_BYTES = 64 * 1024

metadata = new_metadata()

#: One row per handoff key: ACCEPTED (with its one command) or a durable REJECTED
#: tombstone. Inserted once with its decision; a later acceptance of a REJECTED key is
#: refused, a mismatching validation attribute fails closed.
owner_inbox = Table(
    "owner_inbox",
    metadata,
    *work_scope_columns(),
    Column("effect_handoff_key", String(KEY_LEN), nullable=False),
    Column("runtime_outbox_message_id", String(ID_LEN), nullable=False),
    Column("payload_digest", String(DIGEST_LEN), nullable=False),
    Column("payload_schema_version", Integer, nullable=False),
    Column("state", String(CODE_LEN), nullable=False),  # ACCEPTED | REJECTED
    Column("external_command_id", String(ID_LEN), nullable=True),
    Column("decided_at", UtcDateTime(), nullable=False),
    # Quarantine marker (revision 0003): a request naming this key with a different
    # scope, payload digest or outbox identity failed closed against this row. Evidence
    # for operators; the row's decision and attributes never change.
    Column("quarantine_count", Integer, nullable=False, server_default=text("0")),
    Column("quarantine_reason", String(CODE_LEN), nullable=True),
    Column("quarantined_at", UtcDateTime(), nullable=True),
    PrimaryKeyConstraint("org_id", "effect_handoff_key"),
    **TABLE_OPTIONS,
)

#: ``ExternalCommand``: exactly one per accepted handoff key; the owner's dispatcher
#: performs the network call after acceptance commits.
external_commands = Table(
    "external_commands",
    metadata,
    *work_scope_columns(),
    Column("external_command_id", String(ID_LEN), nullable=False),
    Column("effect_handoff_key", String(KEY_LEN), nullable=False),
    Column("effect_owner_kind", String(ID_LEN), nullable=False),
    Column("payload_schema_version", Integer, nullable=False),
    Column("payload", JsonText(MAX_COMMAND_PAYLOAD_BYTES), nullable=False),
    Column("payload_digest", String(DIGEST_LEN), nullable=False),
    # ACCEPTED | DISPATCHING | SUCCEEDED | FAILED | OUTCOME_UNKNOWN | ...
    Column("state", String(CODE_LEN), nullable=False),
    Column("state_version", BigInteger, nullable=False),
    # Version of the latest published completion receipt (0 = none yet).
    Column("outcome_version", BigInteger, nullable=False),
    Column("attempt_count", Integer, nullable=False),
    Column("next_attempt_at", UtcDateTime(), nullable=True),
    Column("lease_owner", String(TOKEN_LEN), nullable=True),
    Column("lease_token", String(TOKEN_LEN), nullable=True),
    Column("lease_until", UtcDateTime(), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    # Revision 0003: envelope lineage (immutable), the provider idempotency key, the
    # latest outcome's safe code/result digest, and OUTCOME_UNKNOWN reconciliation count.
    Column("runtime_outbox_message_id", String(ID_LEN), nullable=True),
    Column("flow_run_id", String(ID_LEN), nullable=True),
    Column("step_execution_id", String(ID_LEN), nullable=True),
    Column("submission_attempt_id", String(ID_LEN), nullable=True),
    Column("deadline", UtcDateTime(), nullable=True),
    Column("failure_policy", String(CODE_LEN), nullable=True),
    Column("provider_idempotency_key", String(KEY_LEN), nullable=True),
    Column("safe_error_code", String(ID_LEN), nullable=True),
    Column("result_digest", String(DIGEST_LEN), nullable=True),
    Column("reconcile_attempts", Integer, nullable=False, server_default=text("0")),
    # The acceptance's W3C trace context (``services.telemetry``; revision 0004): the
    # provider call and the receipt continue the run's trace. Diagnostics only.
    Column("trace_context", JsonText(TRACE_CONTEXT_BYTES), nullable=True),
    PrimaryKeyConstraint("org_id", "external_command_id"),
    UniqueConstraint("org_id", "effect_handoff_key", name="uq_external_commands_handoff"),
    ForeignKeyConstraint(
        ["org_id", "effect_handoff_key"], ["owner_inbox.org_id", "owner_inbox.effect_handoff_key"]
    ),
    Index("ix_external_commands_due", "org_id", "state", "next_attempt_at"),
    Index("ix_external_commands_lease", "org_id", "lease_until"),
    # ListCommands: one work scope, by acceptance time then id (revision 0003).
    Index(
        "ix_external_commands_scope_created",
        *WORK_SCOPE,
        "created_at",
        "external_command_id",
    ),
    **TABLE_OPTIONS,
)

#: One remote call of a command. ``outcome`` STARTED -> SUCCEEDED | FAILED_RETRYABLE |
#: FAILED_TERMINAL | OUTCOME_UNKNOWN (not success, not automatically retryable; §15.3).
remote_attempts = Table(
    "remote_attempts",
    metadata,
    Column("org_id", String(ID_LEN), nullable=False),
    Column("remote_attempt_id", String(ID_LEN), nullable=False),
    Column("external_command_id", String(ID_LEN), nullable=False),
    Column("attempt_number", Integer, nullable=False),
    Column("provider_idempotency_key", String(KEY_LEN), nullable=False),
    Column("outcome", String(CODE_LEN), nullable=False),
    Column("safe_error_code", String(ID_LEN), nullable=True),
    Column("response_digest", String(DIGEST_LEN), nullable=True),
    Column("state_version", BigInteger, nullable=False),
    Column("started_at", UtcDateTime(), nullable=False),
    Column("finished_at", UtcDateTime(), nullable=True),
    PrimaryKeyConstraint("org_id", "remote_attempt_id"),
    UniqueConstraint(
        "org_id", "external_command_id", "attempt_number", name="uq_remote_attempts_number"
    ),
    ForeignKeyConstraint(
        ["org_id", "external_command_id"],
        ["external_commands.org_id", "external_commands.external_command_id"],
    ),
    **TABLE_OPTIONS,
)

#: Durable completion receipts keyed by command and outcome version (§15.2); immutable.
completion_receipts = Table(
    "completion_receipts",
    metadata,
    *work_scope_columns(),
    Column("external_command_id", String(ID_LEN), nullable=False),
    Column("outcome_version", BigInteger, nullable=False),
    Column("effect_handoff_key", String(KEY_LEN), nullable=False),
    Column("outcome", String(CODE_LEN), nullable=False),
    Column("outcome_payload", JsonText(MAX_OUTCOME_PAYLOAD_BYTES), nullable=True),
    Column("outcome_digest", String(DIGEST_LEN), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("org_id", "external_command_id", "outcome_version"),
    ForeignKeyConstraint(
        ["org_id", "external_command_id"],
        ["external_commands.org_id", "external_commands.external_command_id"],
    ),
    Index("ix_completion_receipts_handoff", "org_id", "effect_handoff_key"),
    **TABLE_OPTIONS,
)

#: The owner's producer outbox: completion receipts delivered into the Runtime's
#: ``FlowWakeSignal`` (§15.2), at least once; ``message_key`` is the dedupe key (the wake
#: token the Runtime deduplicates on).
owner_outbox = Table(
    "owner_outbox",
    metadata,
    *work_scope_columns(),
    Column("owner_outbox_message_id", String(ID_LEN), nullable=False),
    Column("message_family", String(ID_LEN), nullable=False),
    Column("message_key", String(KEY_LEN), nullable=False),
    Column("payload", JsonText(MAX_OUTBOX_PAYLOAD_BYTES), nullable=False),
    Column("payload_digest", String(DIGEST_LEN), nullable=False),
    *outbox_delivery_columns(),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    PrimaryKeyConstraint("org_id", "owner_outbox_message_id"),
    UniqueConstraint("org_id", "message_family", "message_key", name="uq_owner_outbox_key"),
    Index("ix_owner_outbox_due", "org_id", "delivery_state", "next_attempt_at"),
    **TABLE_OPTIONS,
)


#: Transport dedupe of mutating RPCs (``AcceptHandoff``, ``RejectIfUnaccepted``) on
#: ``(complete trusted scope, RPC, request_id)`` (``services.request_dedupe``, revision
#: 0003). The durable dedupe of the inbox is the handoff key; this only
#: replays the original response bytes to a retried request.
owner_requests = request_dedupe_table(metadata, "owner_requests")
