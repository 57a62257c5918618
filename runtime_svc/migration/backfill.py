"""The trusted OrgID backfill of pre-bridge interviews, its receipt, and their adoption into
the org-keyed ``flow_runs`` (§20.2, §20.3 4).

* :func:`org_backfill_sweep` — repeatable and idempotent: every not-yet-adopted
  ``flow_interviews`` row with a NULL OrgID is stamped with the proven deployment org by a
  conditional ``UPDATE … WHERE interview_id = :id AND org_id IS NULL`` (a concurrent old
  insert is simply stamped by the next sweep; a row that gained an org meanwhile is
  re-read, never overwritten). A non-NULL OrgID that differs from the authority is never
  overwritten: it is counted, blocks the receipt and quarantines the rollout. An
  unprovable authority quarantines too. Batches are bounded transactions.
* :func:`adopt_prebridge_rows` — after the drain gate and a clean final sweep: every
  stamped row is inserted into ``flow_runs`` under ``(OrgID, interview id)`` through the
  legacy store's creation path (``LegacyInterpreter``/0, its carried state version, its
  legacy status/element/context; a row left ``Running`` by a drained process becomes
  ``Paused`` and due, resuming from its last persisted position) and marked adopted, one
  row per transaction. No run changes owner or epoch; nothing becomes a V2 checkpoint.
  A row is refused (left for an operator, the org-schema gate names it) when its interview
  id is not ASCII (``flow_run_id`` is an ASCII identifier, ADR 0015), its Flow version is
  missing, its legacy context does not parse, or another run already holds its identity.

Every receipt row is ``FlowInterviewOrgBackfillReceipt``: authority digest, exact OrgID,
scanned / stamped / already-matching counts, null and mismatch counts, schema generation,
completion time (and, for the final receipt, the adopted count).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.definitions import repository as repo
from runtime_svc.kernel.states import CompatibilityStatus
from runtime_svc.legacy.model import legacy_runtime_state
from runtime_svc.legacy.state import LegacyState
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration.authority import AuthorityUnproven, DeploymentOrgAuthority
from runtime_svc.migration.control import lock_control_txn, update_control_txn
from runtime_svc.migration.prebridge import PreBridgeInterview
from runtime_svc.schema_bridge import flow_interview_org_backfill_receipts, flow_interviews
from services.db import db_now, transaction

__all__ = [
    "SCHEMA_GENERATION",
    "AdoptionReport",
    "BackfillReceipt",
    "adopt_prebridge_rows",
    "count_unstamped_txn",
    "insert_receipt_txn",
    "org_backfill_sweep",
    "quarantine_txn",
]

#: The runtime schema revision that defines the pre-bridge shape and the receipt.
SCHEMA_GENERATION = "0009_legacy_bridge"
_BATCH = 200
_MAX_IDS = 20


@dataclass(frozen=True)
class BackfillReceipt:
    """``FlowInterviewOrgBackfillReceipt`` (see the module docstring)."""

    receipt_id: str
    kind: str
    outcome: str
    authority_digest: str | None
    org_id: str | None
    scanned: int
    stamped: int
    already_matching: int
    null_count: int
    mismatch_count: int
    adopted: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.outcome == "complete"

    def to_dict(self) -> dict[str, Any]:
        return {
            "receipt_id": self.receipt_id,
            "kind": self.kind,
            "outcome": self.outcome,
            "authority_digest": self.authority_digest,
            "org_id": self.org_id,
            "scanned": self.scanned,
            "stamped": self.stamped,
            "already_matching": self.already_matching,
            "null_count": self.null_count,
            "mismatch_count": self.mismatch_count,
            "adopted": self.adopted,
            "schema_generation": SCHEMA_GENERATION,
            "details": self.details,
        }


async def quarantine_txn(conn: AsyncConnection, reason: str) -> None:
    """Quarantine the rollout: V2 admission and every further gate are refused until an
    operator clears it (``flowctl deploy quarantine clear``)."""
    control = await lock_control_txn(conn)
    if control.quarantine_reason == reason[:128]:
        return
    now = await db_now(conn)
    await update_control_txn(
        conn,
        control.state_version,
        {"quarantine_reason": reason[:128], "v2_admission_enabled": False},
        now,
    )


async def insert_receipt_txn(
    conn: AsyncConnection, receipt: BackfillReceipt, now: datetime
) -> None:
    await conn.execute(
        flow_interview_org_backfill_receipts.insert().values(
            receipt_id=receipt.receipt_id,
            kind=receipt.kind,
            outcome=receipt.outcome,
            authority_digest=receipt.authority_digest,
            org_id=receipt.org_id,
            scanned_count=receipt.scanned,
            stamped_count=receipt.stamped,
            already_matching_count=receipt.already_matching,
            null_count=receipt.null_count,
            mismatch_count=receipt.mismatch_count,
            adopted_count=receipt.adopted,
            schema_generation=SCHEMA_GENERATION,
            details=json.dumps(receipt.details, sort_keys=True),
            completed_at=now,
        )
    )


async def count_unstamped_txn(conn: AsyncConnection, org_id: str | None) -> tuple[int, int]:
    """``(NULL OrgID rows, rows of another org)`` among not-yet-adopted pre-bridge rows."""
    t = flow_interviews.c
    pending = t.adopted_at.is_(None)
    nulls = (
        await conn.execute(select(func.count()).where(pending, t.org_id.is_(None)))
    ).scalar_one()
    mismatched = 0
    if org_id is not None:
        mismatched = (
            await conn.execute(
                select(func.count()).where(pending, t.org_id.is_not(None), t.org_id != org_id)
            )
        ).scalar_one()
    return int(nulls), int(mismatched)


async def _record(
    engine: AsyncEngine, receipt: BackfillReceipt, quarantine: str | None
) -> BackfillReceipt:
    async with transaction(engine) as conn:
        now = await db_now(conn)
        await insert_receipt_txn(conn, receipt, now)
        if quarantine is not None:
            await quarantine_txn(conn, quarantine)
    return receipt


async def org_backfill_sweep(
    engine: AsyncEngine,
    authority: DeploymentOrgAuthority | AuthorityUnproven,
    *,
    kind: str = "sweep",
    batch: int = _BATCH,
) -> BackfillReceipt:
    """One repeatable sweep (see the module docstring); records and returns its receipt."""
    receipt_id = f"obr-{uuid.uuid4().hex}"
    if isinstance(authority, AuthorityUnproven):
        receipt = BackfillReceipt(
            receipt_id, kind, "quarantined", None, None, 0, 0, 0, 0, 0, 0,
            {"authority": authority.reason, "orgs": list(authority.orgs)},
        )  # fmt: skip
        return await _record(engine, receipt, f"org_authority_unproven.{authority.reason}")
    org = authority.org_id
    t = flow_interviews.c
    scanned = stamped = matching = 0
    mismatched_ids: list[str] = []
    after = ""
    while True:
        async with transaction(engine) as conn:
            rows = list(
                await conn.execute(
                    select(t.interview_id, t.org_id)
                    .where(t.adopted_at.is_(None), t.interview_id > after)
                    .order_by(t.interview_id)
                    .limit(batch)
                )
            )
            for interview_id, row_org in rows:
                scanned += 1
                if row_org is None:
                    result = await conn.execute(
                        update(flow_interviews)
                        .where(t.interview_id == interview_id, t.org_id.is_(None))
                        .values(org_id=org)
                    )
                    if result.rowcount == 1:
                        stamped += 1
                        continue
                    # A writer set it meanwhile: read it back, never overwrite it.
                    row_org = (
                        await conn.execute(select(t.org_id).where(t.interview_id == interview_id))
                    ).scalar_one_or_none()
                if row_org == org:
                    matching += 1
                else:
                    mismatched_ids.append(interview_id)
        if len(rows) < batch:
            break
        after = rows[-1][0]
    async with transaction(engine, readonly=True) as conn:
        nulls, mismatches = await count_unstamped_txn(conn, org)
    outcome = "complete" if mismatches == 0 and not mismatched_ids else "quarantined"
    receipt = BackfillReceipt(
        receipt_id,
        kind,
        outcome,
        authority.digest,
        org,
        scanned,
        stamped,
        matching,
        nulls,
        mismatches,
        0,
        {"mismatched_interview_ids": mismatched_ids[:_MAX_IDS]},
    )
    quarantine = None if outcome == "complete" else "org_mismatch"
    return await _record(engine, receipt, quarantine)


@dataclass(frozen=True)
class AdoptionReport:
    """What adoption did: adopted ids, and the rows it could not adopt (with why)."""

    adopted: int
    refused: dict[str, str]


def _adoption_values(
    row: PreBridgeInterview, flow_version_id: str, now: datetime
) -> dict[str, Any]:
    status = CompatibilityStatus.from_code(row.status)
    run_after = row.resume_at
    paused_at = row.paused_at
    if status is CompatibilityStatus.RUNNING:
        # The drained process that ran it is gone: resume from the last persisted state.
        status, run_after, paused_at = CompatibilityStatus.PAUSED, now, now
    terminal = status in (CompatibilityStatus.FINISHED, CompatibilityStatus.ERROR)
    cause = "legacy_error" if status is CompatibilityStatus.ERROR else None
    return {
        "flow_run_id": row.interview_id,
        "flow_version_id": flow_version_id,
        "runtime_state": legacy_runtime_state(status, cause=cause).code,
        "state_version": row.state_version,
        "run_after": None if terminal else run_after,
        "priority": 0,
        "terminal_cause_code": cause,
        "is_deleted": row.is_deleted,
        "delete_requested_at": row.delete_requested_at,
        "interview_status": status.code,
        "current_element": row.current_element,
        "paused_at": paused_at,
        "legacy_context": row.context_payload,
        "completed_at": row.updated_at if terminal else None,
        "created_at": row.created_at,
        "updated_at": now,
    }


async def adopt_prebridge_rows(
    engine: AsyncEngine, authority: DeploymentOrgAuthority, store: LegacyInterviewStore
) -> AdoptionReport:
    """Adopt every stamped, not-yet-adopted pre-bridge row (see the module docstring)."""
    t = flow_interviews.c
    org = authority.org_id
    async with transaction(engine, readonly=True) as conn:
        ids = [
            r[0]
            for r in await conn.execute(
                select(t.interview_id)
                .where(t.adopted_at.is_(None), t.org_id == org)
                .order_by(t.interview_id)
            )
        ]
    adopted, refused = 0, {}
    for interview_id in ids:
        async with transaction(engine) as conn:
            raw = (
                (await conn.execute(select(flow_interviews).where(t.interview_id == interview_id)))
                .mappings()
                .first()
            )
            if raw is None or raw["adopted_at"] is not None:
                continue
            row = PreBridgeInterview.from_row(raw)
            if not interview_id.isascii():
                # It would become the run's ``flow_run_id``: an ASCII column on
                # MariaDB/MySQL (ADR 0015), and an ASCII identifier everywhere.
                refused[interview_id] = "interview_id_not_ascii"
                continue
            version = await repo.get_flow_version_by_number_txn(
                conn, org, row.flow_api_name, row.flow_version_number
            )
            if version is None:
                refused[interview_id] = "flow_version_missing"
                continue
            try:
                LegacyState.loads(row.context_payload)
                CompatibilityStatus.from_code(row.status)
            except (ValueError, KeyError):
                refused[interview_id] = "legacy_context_invalid"
                continue
            now = await db_now(conn)
            inserted = await store.adopt_txn(
                conn,
                authority.scope,
                _adoption_values(row, version.flow_version_id, now),
            )
            if not inserted:
                # Another run of this org already holds the identity: never merge.
                refused[interview_id] = "identity_collision"
                continue
            marked = await conn.execute(
                update(flow_interviews)
                .where(
                    t.interview_id == interview_id,
                    t.adopted_at.is_(None),
                    t.org_id == org,
                )
                .values(adopted_at=now)
            )
            if marked.rowcount != 1:
                raise RuntimeError(f"pre-bridge row {interview_id} changed during adoption")
            adopted += 1
    return AdoptionReport(adopted, refused)
