"""The pre-bridge application: the SQL an old (pre-bridge) FlowInterview binary issues.

It knows only the legacy columns of the interview table: it inserts without OrgID,
owner, epoch, state version or delete request, claims ``Paused`` rows by status alone and
updates without advancing any version — exactly the writer the §20.2 defaults and the
§20.3 drain gate exist for. Raw DB-API SQL on purpose: it is *not* this runtime's code.

Run as a script (``python -m tests.support.prebridge DB_URL COUNT``) it is a pre-bridge
*process*: it registers in the writer fleet with write-protocol generation 0 (as the
additive-schema release does) and exits 3 when the deployment refuses it, else inserts
``COUNT`` interviews and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.migration import fleet
from runtime_svc.migration.protocol import BinaryRefusedError
from services import db

__all__ = ["OLD_INSERT", "old_claim", "old_context", "old_insert", "old_update_status"]

#: The old binary's INSERT: legacy columns only.
OLD_INSERT = (
    "INSERT INTO flow_interviews (interview_id, flow_api_name, flow_version_number, "
    "interview_status, current_element, paused_at, resume_at, context_payload, "
    "created_at, updated_at) VALUES (:interview_id, :flow_api_name, :flow_version_number, "
    ":interview_status, :current_element, :paused_at, :resume_at, :context_payload, "
    ":created_at, :updated_at)"
)


def _naive(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(tzinfo=None)


def old_context(flow: str, version: int, position: str | None, variables: dict[str, Any]) -> str:
    """The legacy interview context an old binary persisted (the interpreter's layout)."""
    return json.dumps(
        {
            "v": 1,
            "frames": [{"flow": flow, "version": version, "prefix": "", "variables": variables}],
            "position": position,
        }
    )


async def old_insert(
    engine: AsyncEngine,
    *,
    flow: str,
    version: int = 1,
    status: str = "Paused",
    position: str | None = None,
    variables: dict[str, Any] | None = None,
    interview_id: str | None = None,
    resume_at: datetime | None = None,
    now: datetime | None = None,
) -> str:
    """One old-writer insert (no OrgID, owner, epoch, version or delete columns)."""
    interview_id = interview_id or f"int-{uuid.uuid4().hex[:16]}"
    moment = _naive(now or datetime.now(UTC))
    async with db.transaction(engine) as conn:
        await conn.execute(
            text(OLD_INSERT),
            {
                "interview_id": interview_id,
                "flow_api_name": flow,
                "flow_version_number": version,
                "interview_status": status,
                "current_element": position,
                "paused_at": moment if status == "Paused" else None,
                "resume_at": None if resume_at is None else _naive(resume_at),
                "context_payload": old_context(flow, version, position, variables or {}),
                "created_at": moment,
                "updated_at": moment,
            },
        )
    return interview_id


async def old_claim(engine: AsyncEngine, interview_id: str) -> bool:
    """The pre-bridge claim: rechecks the legacy status only, advances no version."""
    async with db.transaction(engine) as conn:
        result = await conn.execute(
            text(
                "UPDATE flow_interviews SET interview_status = 'Running' "
                "WHERE interview_id = :id AND interview_status = 'Paused'"
            ),
            {"id": interview_id},
        )
        return bool(result.rowcount == 1)


async def old_update_status(engine: AsyncEngine, interview_id: str, status: str) -> None:
    """An unversioned legacy status update by id alone."""
    async with db.transaction(engine) as conn:
        await conn.execute(
            text("UPDATE flow_interviews SET interview_status = :s WHERE interview_id = :id"),
            {"s": status, "id": interview_id},
        )


async def _main(db_url: str, count: int) -> int:
    engine = db.create_engine(db_url)
    process_id = f"prebridge-{uuid.uuid4().hex[:12]}"
    try:
        try:
            await fleet.register_writer(
                engine,
                fleet.WriterRegistration(process_id, "0.1.0", 0, "legacy", "prebridge-app"),
            )
        except BinaryRefusedError as exc:
            print(f"refusing to start: {exc.safe_message}", file=sys.stderr)
            return 3
        try:
            for i in range(count):
                await old_insert(engine, flow="prebridge_app", position="start")
                print(f"inserted {i + 1}", flush=True)
        finally:
            await fleet.stop_writer(engine, process_id)  # graceful shutdown
        return 0
    finally:
        await engine.dispose()


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1], int(sys.argv[2]))))
