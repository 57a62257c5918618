"""Completion receipts and their delivery message (spec §15.2, §14.1).

:func:`write_receipt_txn` runs inside the transaction that records a command's terminal
outcome: it inserts the immutable receipt keyed by ``(command, outcome_version)`` and,
last, enqueues the ``effect.completion.receipt`` message into the owner's producer
outbox (``OWNER_OUTBOX``) — so outcome, receipt and delivery intent commit together or
not at all. The message payload is exactly the ``SubmitWakeSignal`` request body of the
contract in :mod:`services.effect_contract` (the scope travels in the row's columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select
from sqlalchemy.ext.asyncio import AsyncConnection

from effect_owner_svc.commands.records import CommandRecord, ReceiptRecord, receipt_from_row
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.schema import completion_receipts
from services.auth import TrustedRuntimeWorkScope
from services.db import WORK_SCOPE, scoped_select
from services.db_batch import Write
from services.digest import canonical_json, versioned_digest
from services.effect_contract import (
    EFFECT_COMPLETION_FAMILY,
    EFFECT_COMPLETION_PRODUCER_KIND,
    CompletionEvidence,
)
from services.outbox import NewOutboxMessage, OutboxHint, PreClaim, enqueue_after, enqueue_write

__all__ = ["get_receipt_txn", "receipt_hint", "wake_request_doc", "write_receipt_txn"]


_INSERT_RECEIPT = completion_receipts.insert()


def _receipt_select(*, by_version: bool) -> Select[Any]:
    """The latest receipt of a command in exactly a scope (``by_version``: of one
    outcome version), with bound parameters named like the columns."""
    version = ("outcome_version",) if by_version else ()
    key = (*WORK_SCOPE[1:], "external_command_id", *version)
    stmt = scoped_select(completion_receipts, key)
    return stmt.order_by(completion_receipts.c.outcome_version.desc()).limit(1)


_LATEST_RECEIPT = _receipt_select(by_version=False)
_RECEIPT_OF_VERSION = _receipt_select(by_version=True)


def wake_request_doc(evidence: CompletionEvidence) -> dict[str, Any]:
    """The ``SubmitWakeSignal`` body (without scope and request id) of a receipt."""
    return {
        "producer_kind": EFFECT_COMPLETION_PRODUCER_KIND,
        "producer_key": evidence.effect_handoff_key,
        "wake_token": evidence.wake_token,
        "wake_version": evidence.outcome_version,
        "evidence_json": evidence.to_json(),
        "evidence_digest": evidence.digest(),
    }


def _message_id(command_id: str, outcome_version: int) -> str:
    digest = versioned_digest("owner-outbox-message", [command_id, outcome_version])
    return "oom_" + digest.rsplit(":", 1)[1][:32]


def receipt_hint(receipt: ReceiptRecord) -> OutboxHint:
    """The wakeup hint naming the owner-outbox message that delivers ``receipt``."""
    message_id = _message_id(receipt.command_id, receipt.outcome_version)
    key = ((OWNER_OUTBOX.id_column, message_id),)  # the table's key is (org, message id)
    return OutboxHint(OWNER_OUTBOX.table.name, receipt.org_id, key)


async def write_receipt_txn(
    conn: AsyncConnection,
    command: CommandRecord,
    evidence: CompletionEvidence,
    now: datetime,
    *,
    preclaim: PreClaim | None = None,
    before: Sequence[Write] = (),
) -> ReceiptRecord:
    """Insert the receipt of ``evidence`` and enqueue its delivery (caller's transaction;
    the command row must already be fenced by the caller); with ``preclaim`` the message
    is enqueued leased to this process's outbox dispatcher (``ReceiptRecord.delivery``).

    ``before``: the caller's writes that go first (the remote attempt's outcome), in the
    same round trip where the backend batches writes — every row here is the fenced
    command's, written only under its lock (ADR 0010)."""
    receipt = Write(
        _INSERT_RECEIPT,
        {
            "org_id": command.org_id,
            "app_installation_id": command.app_installation_id,
            "runtime_capability_id": command.runtime_capability_id,
            "runtime_work_binding_digest": command.runtime_work_binding_digest,
            "external_command_id": command.command_id,
            "outcome_version": evidence.outcome_version,
            "effect_handoff_key": command.effect_handoff_key,
            "outcome": evidence.outcome.value,
            "outcome_payload": evidence.to_json(),
            "outcome_digest": evidence.digest(),
            "created_at": now,
        },
    )
    body = canonical_json(wake_request_doc(evidence)).decode("utf-8")
    pending = enqueue_write(
        OWNER_OUTBOX,
        NewOutboxMessage(
            org_id=command.org_id,
            app_installation_id=command.app_installation_id,
            runtime_capability_id=command.runtime_capability_id,
            runtime_work_binding_digest=command.runtime_work_binding_digest,
            message_id=_message_id(command.command_id, evidence.outcome_version),
            family=EFFECT_COMPLETION_FAMILY,
            key=evidence.wake_token,
            payload=body,
            payload_digest=versioned_digest("owner-outbox-payload", body),
        ),
        now=now,
        preclaim=preclaim,
    )
    enqueued = await enqueue_after(conn, [*before, receipt], pending)
    return ReceiptRecord(
        org_id=command.org_id,
        app_installation_id=command.app_installation_id,
        runtime_capability_id=command.runtime_capability_id,
        runtime_work_binding_digest=command.runtime_work_binding_digest,
        command_id=command.command_id,
        outcome_version=evidence.outcome_version,
        effect_handoff_key=command.effect_handoff_key,
        outcome=evidence.outcome.value,
        evidence_json=evidence.to_json(),
        evidence_digest=evidence.digest(),
        created_at=now,
        delivery=enqueued.leased,
    )


async def get_receipt_txn(
    conn: AsyncConnection,
    scope: TrustedRuntimeWorkScope,
    command_id: str,
    outcome_version: int = 0,
) -> ReceiptRecord | None:
    """The receipt of ``command_id`` in exactly ``scope`` (latest when version is 0)."""
    params: dict[str, Any] = {
        "org_id": scope.org_id,
        "app_installation_id": scope.app_installation_id,
        "runtime_capability_id": scope.runtime_capability_id,
        "runtime_work_binding_digest": scope.runtime_work_binding_digest,
        "external_command_id": command_id,
    }
    stmt = _LATEST_RECEIPT
    if outcome_version:
        stmt, params["outcome_version"] = _RECEIPT_OF_VERSION, outcome_version
    row = (await conn.execute(stmt, params)).mappings().first()
    return None if row is None else receipt_from_row(row)
