"""Shared helpers of the record-engine integration tests: the metadata view (as the catalog
publishes it), row counters and a MariaDB lock-wait observer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.records import record_view_from_proto
from runtime_svc.records import RecordView
from runtime_svc.schema import audit_records, business_events, record_history_sequences, records
from services.proto import catalog_v1

F = catalog_v1.FieldType

#: A value that must never reach an audit row or event payload.
SECRET = "s3cr3t-hunter2-value"


def view_proto() -> catalog_v1.MetadataView:
    """Account (parent, self-hierarchy) / Contact (child) / Note — publishable in the real
    catalog, which keeps only lock-relevant relationships and names each by its child
    field, and refuses read-only fields and EMAIL/MULTI_PICKLIST/CURRENCY types."""
    return catalog_v1.MetadataView(
        schema_generation=1,
        objects=[
            catalog_v1.ObjectSchema(
                api_name="Account",
                fields=[
                    catalog_v1.FieldSchema(
                        api_name="Name", type=F.FIELD_TYPE_STRING, required=True, max_length=80
                    ),
                    catalog_v1.FieldSchema(api_name="Employees", type=F.FIELD_TYPE_INTEGER),
                    catalog_v1.FieldSchema(
                        api_name="Balance", type=F.FIELD_TYPE_DECIMAL, precision=18, scale=2
                    ),
                    catalog_v1.FieldSchema(
                        api_name="Tier",
                        type=F.FIELD_TYPE_PICKLIST,
                        picklist_values=["Gold", "Silver"],
                    ),
                    catalog_v1.FieldSchema(
                        api_name="ApiKey", type=F.FIELD_TYPE_STRING, max_length=200
                    ),
                    catalog_v1.FieldSchema(
                        api_name="ParentId",
                        type=F.FIELD_TYPE_REFERENCE,
                        reference_object_api_name="Account",
                    ),
                ],
            ),
            catalog_v1.ObjectSchema(
                api_name="Contact",
                fields=[
                    catalog_v1.FieldSchema(api_name="LastName", type=F.FIELD_TYPE_STRING),
                    catalog_v1.FieldSchema(
                        api_name="AccountId",
                        type=F.FIELD_TYPE_REFERENCE,
                        reference_object_api_name="Account",
                    ),
                ],
            ),
            catalog_v1.ObjectSchema(
                api_name="Note",
                fields=[
                    catalog_v1.FieldSchema(api_name="Body", type=F.FIELD_TYPE_TEXT),
                    catalog_v1.FieldSchema(
                        api_name="AboutId",
                        type=F.FIELD_TYPE_REFERENCE,
                        reference_object_api_name="Account",
                    ),
                ],
            ),
        ],
        relationships=[
            catalog_v1.Relationship(
                name="AccountId",
                kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_MASTER_DETAIL,
                parent_object_api_name="Account",
                child_object_api_name="Contact",
                child_field_api_name="AccountId",
                lock_relevant=True,
            ),
            catalog_v1.Relationship(
                name="ParentId",
                kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_LOOKUP,
                parent_object_api_name="Account",
                child_object_api_name="Account",
                child_field_api_name="ParentId",
                lock_relevant=True,
            ),
        ],
    )


def rich_view_proto() -> catalog_v1.MetadataView:
    """:func:`view_proto` plus what the proto contract allows but the current catalog
    refuses: a read-only field, an EMAIL field, a lookup that is not lock-relevant."""
    view = view_proto()
    contact = view.objects[1]
    contact.fields.append(catalog_v1.FieldSchema(api_name="Email", type=F.FIELD_TYPE_EMAIL))
    contact.fields.append(
        catalog_v1.FieldSchema(api_name="Score", type=F.FIELD_TYPE_INTEGER, read_only=True)
    )
    view.relationships.append(
        catalog_v1.Relationship(
            name="AboutId",
            kind=catalog_v1.RelationshipKind.RELATIONSHIP_KIND_LOOKUP,
            parent_object_api_name="Account",
            child_object_api_name="Note",
            child_field_api_name="AboutId",
        )
    )
    return view


def record_view() -> RecordView:
    view = rich_view_proto()
    view.runtime_metadata_view_digest = "runtime_metadata_view/v1:sha256:" + "ab" * 32
    return record_view_from_proto(view)


async def count(engine: AsyncEngine, table: Any, org: str, **where: Any) -> int:
    async with engine.connect() as conn:
        stmt = select(func.count()).select_from(table).where(table.c.org_id == org)
        for name, value in where.items():
            stmt = stmt.where(table.c[name] == value)
        return int((await conn.execute(stmt)).scalar_one())


async def sequences(engine: AsyncEngine, org: str, obj: str, rid: str) -> list[int]:
    """History sequences of the record's business events, in order."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(business_events.c.history_sequence)
            .where(
                business_events.c.org_id == org,
                business_events.c.object_name == obj,
                business_events.c.record_id == rid,
            )
            .order_by(business_events.c.history_sequence)
        )
        return [int(r[0]) for r in rows]


async def last_sequence(engine: AsyncEngine, org: str, obj: str, rid: str) -> int | None:
    t = record_history_sequences
    async with engine.connect() as conn:
        value = (
            await conn.execute(
                select(t.c.last_sequence).where(
                    t.c.org_id == org, t.c.object_name == obj, t.c.record_id == rid
                )
            )
        ).scalar_one_or_none()
    return None if value is None else int(value)


async def audit_and_event_text(engine: AsyncEngine, org: str) -> str:
    """Every audit ``details`` and event ``payload`` of ``org``, concatenated."""
    async with engine.connect() as conn:
        details = (
            await conn.execute(select(audit_records.c.details).where(audit_records.c.org_id == org))
        ).scalars()
        payloads = (
            await conn.execute(
                select(business_events.c.payload).where(business_events.c.org_id == org)
            )
        ).scalars()
        return "\n".join([*details, *payloads])


async def audit_details(engine: AsyncEngine, org: str, rid: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(audit_records.c.details)
                .where(audit_records.c.org_id == org, audit_records.c.record_id == rid)
                .order_by(audit_records.c.occurred_at)
            )
        ).scalars()
        return [json.loads(r) for r in rows]


async def record_count(engine: AsyncEngine, org: str) -> int:
    return await count(engine, records, org)


_LOCK_WAITERS = text(
    "SELECT COUNT(*) FROM information_schema.INNODB_TRX t "
    "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
    "WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()"
)


async def wait_for_lock_waiters(engine: AsyncEngine, n: int = 1, *, polls: int = 200) -> None:
    """Return once ``n`` transactions of this test database wait for a row lock (MariaDB).

    Bounded: fails after ``polls`` polls instead of hanging. Other databases on the same
    server (parallel suites) are excluded by the ``DATABASE()`` filter. InnoDB refreshes
    its ``INNODB_TRX`` snapshot only when it was last read more than 0.1 s ago, so the
    poll interval must be longer than that or the snapshot never changes.
    """
    for _ in range(polls):
        async with engine.connect() as conn:
            waiting = int((await conn.execute(_LOCK_WAITERS)).scalar_one())
        if waiting >= n:
            return
        await asyncio.sleep(0.15)
    raise AssertionError(f"no {n} lock waiter(s) appeared")
