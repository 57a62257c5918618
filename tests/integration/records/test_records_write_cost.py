"""The cost of one deduplicated record write, pinned by count (never by time), on SQLite and
MariaDB: what ``RecordService`` pays per create and per update, that a create's history
row starts at its own sequence, and that every row of the write — record, history, event,
audit, request ledger — carries the transaction's one clock reading.

Counts come from SQLAlchemy engine events (``begin``, ``before_cursor_execute``; SQLite's
own ``BEGIN`` statement is not counted), as ``bench/sync_bench.py`` prints them. A change
that adds a statement to the write path fails here and has to say why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.records import (
    Actor,
    MutationResult,
    RecordEngine,
    StaleVersionError,
    prepare_create,
    prepare_delete,
    prepare_update,
)
from runtime_svc.records.store import lock_record_history_txn
from runtime_svc.schema import (
    audit_records,
    business_events,
    record_history_sequences,
    records,
    runtime_requests,
)
from services.db import db_now, strategy_for, transaction
from services.db_batch import statements_of
from services.db_mysql import carried_commit
from services.digest import versioned_digest
from services.errors import NotFoundError
from services.request_dedupe import DedupeScope, RequestKey
from tests.integration.records.support import last_sequence, record_view, sequences

VIEW = record_view()
ACTOR = Actor("workload", "records-cost-test")

#: A deduplicated create: ledger lookup + clock (one statement), record INSERT, history
#: INSERT at sequence 1, event INSERT, audit INSERT, ledger INSERT.
CREATE_STATEMENTS = 6
#: A deduplicated update: ledger lookup + clock, plain read, record lock with its history
#: row's lock (the plan's next key; one statement), record CAS UPDATE, history advance,
#: event INSERT, audit INSERT, ledger INSERT.
UPDATE_STATEMENTS = 8
#: The same for an object without lock-relevant relationships: its read is its lock,
#: taken with its history row's lock in one statement.
UNPARENTED_UPDATE_STATEMENTS = 7
#: Without a request id: the record and history lock carries the clock as well, then the
#: record CAS UPDATE, history advance, event INSERT, audit INSERT.
UNPARENTED_PLAIN_UPDATE_STATEMENTS = 5


def _update_statements(engine: AsyncEngine, count: int, *, carried: bool = True) -> int:
    """``count`` on a backend with multi-table UPDATE (MariaDB) is one less: the record's
    CAS UPDATE and its history advance are one statement there (both rows held by the
    lock phase; ``store.advancing_history_write``) — and, ``carried``, one more: where that
    UPDATE rides in the round trip that carries the COMMIT (a deduplicated write's last
    round trip), the statement after it guards its row count on the server
    (``services.db_batch.row_guard``, ADR 0014)."""
    if not strategy_for(engine.dialect).multi_table_update:
        return count
    return count if carried else count - 1


@dataclass
class _Counts:
    transactions: int = 0
    statements: int = 0
    round_trips: int = 0
    #: COMMITs sent on their own (not carried by the last writes' round trip, ADR 0013)
    commits_sent: int = 0


@contextmanager
def _counting(engine: AsyncEngine) -> Iterator[_Counts]:
    counts = _Counts()

    def begin(_conn: sa.Connection) -> None:
        counts.transactions += 1

    def statement(*args: Any) -> None:
        if not (isinstance(args[2], str) and args[2].startswith("BEGIN")):
            # A batched round trip of writes is several statements (services/db_batch.py).
            counts.statements += len(statements_of(str(args[2])))
            counts.round_trips += 1

    def commit(conn: sa.Connection) -> None:
        if not carried_commit(conn.connection.dbapi_connection):
            counts.commits_sent += 1

    sa.event.listen(engine.sync_engine, "begin", begin)
    sa.event.listen(engine.sync_engine, "before_cursor_execute", statement)
    sa.event.listen(engine.sync_engine, "commit", commit)
    try:
        yield counts
    finally:
        sa.event.remove(engine.sync_engine, "begin", begin)
        sa.event.remove(engine.sync_engine, "before_cursor_execute", statement)
        sa.event.remove(engine.sync_engine, "commit", commit)


def _encode(result: MutationResult) -> bytes:
    return f"{result.record.record_id}@{result.record.version}".encode()


def _key(org: str, request_id: str) -> RequestKey:
    return RequestKey(DedupeScope(org), "CreateRecord", request_id, f"digest-{request_id}")


async def test_a_deduplicated_create_and_update_cost_one_transaction_each(
    engine: AsyncEngine, org: str
) -> None:
    rec = RecordEngine(engine)
    create = prepare_create(VIEW, "Account", "", {"Name": "Acme", "Employees": 3})
    with _counting(engine) as counts:
        done = await rec.mutate_once(
            org, VIEW, create, actor=ACTOR, key=_key(org, "c1"), encode=_encode
        )
    assert done.value is not None
    rid = done.value.record.record_id
    assert (counts.transactions, counts.statements) == (1, CREATE_STATEMENTS)
    # Where writes are batched: the lookup; the record and its history row (the create's
    # locks); the event, audit and ledger rows (the ledger's joined last).
    batched = strategy_for(engine.dialect).multi_statements
    assert counts.round_trips == (3 if batched else CREATE_STATEMENTS)
    # The last of them carries the COMMIT (ADR 0013): the frame sends none of its own.
    assert counts.commits_sent == (0 if batched else 1)
    # The create's history row was inserted at its own sequence; an update advances it.
    assert done.value.history_sequence == 1
    assert await last_sequence(engine, org, "Account", rid) == 1

    update = prepare_update(VIEW, "Account", rid, 1, {"Employees": 4})
    with _counting(engine) as counts:
        again = await rec.mutate_once(
            org, VIEW, update, actor=ACTOR, key=_key(org, "u1"), encode=_encode
        )
    assert (counts.transactions, counts.statements) == (
        1,
        _update_statements(engine, UPDATE_STATEMENTS),
    )
    # The lookup, the plain read, the record + history lock; the CAS with its history
    # advance, event, audit and ledger rows.
    assert counts.round_trips == (4 if batched else UPDATE_STATEMENTS)
    # The CAS UPDATE's row count is checked on the server before the COMMIT that rides
    # with it (ADR 0014): the frame sends none of its own.
    assert counts.commits_sent == (0 if batched else 1)
    assert again.value is not None and again.value.history_sequence == 2
    assert await last_sequence(engine, org, "Account", rid) == 2
    assert await sequences(engine, org, "Account", rid) == [1, 2]

    # A replay answers from the ledger: one transaction, one statement (lookup + clock).
    with _counting(engine) as counts:
        replay = await rec.mutate_once(
            org, VIEW, create, actor=ACTOR, key=_key(org, "c1"), encode=_encode
        )
    assert replay.replayed and replay.response == done.response
    assert (counts.transactions, counts.statements) == (1, 1)


async def test_an_object_without_lock_relevant_parents_reads_its_row_once_under_lock(
    engine: AsyncEngine, org: str
) -> None:
    """Note has no lock-relevant relationship: an update's read is the record's
    ``FOR UPDATE`` (the plan's first lock), not a plain read followed by the lock. The
    fences are the same: a stale version is refused, a deleted record is not found."""
    rec = RecordEngine(engine)
    created = await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Note", "", {"Body": "one"}), actor=ACTOR
    )
    rid = created.record.record_id
    with _counting(engine) as counts:
        updated = await rec.mutate_once(
            org,
            VIEW,
            prepare_update(VIEW, "Note", rid, 1, {"Body": "two"}),
            actor=ACTOR,
            key=_key(org, "note-u1"),
            encode=_encode,
        )
    assert (counts.transactions, counts.statements) == (
        1,
        _update_statements(engine, UNPARENTED_UPDATE_STATEMENTS),
    )
    assert updated.value is not None and updated.value.record.version == 2
    assert updated.value.history_sequence == 2
    with _counting(engine) as counts:
        again = await rec.mutate(
            org, VIEW, prepare_update(VIEW, "Note", rid, 2, {"Body": "three"}), actor=ACTOR
        )
    # Not deduplicated: its frame commits (no ledger row joins a last round trip).
    assert (counts.transactions, counts.statements) == (
        1,
        _update_statements(engine, UNPARENTED_PLAIN_UPDATE_STATEMENTS, carried=False),
    )
    assert again.history_sequence == 3 and again.record.version == 3
    with pytest.raises(StaleVersionError):
        await rec.mutate(
            org, VIEW, prepare_update(VIEW, "Note", rid, 1, {"Body": "late"}), actor=ACTOR
        )
    await rec.mutate(org, VIEW, prepare_delete(VIEW, "Note", rid, 3), actor=ACTOR)
    with pytest.raises(NotFoundError):
        await rec.mutate(
            org, VIEW, prepare_update(VIEW, "Note", rid, None, {"Body": "gone"}), actor=ACTOR
        )
    assert await sequences(engine, org, "Note", rid) == [1, 2, 3, 4]


async def test_every_row_of_a_write_carries_the_transactions_one_clock_reading(
    engine: AsyncEngine, org: str
) -> None:
    rec = RecordEngine(engine)
    create = prepare_create(VIEW, "Account", "", {"Name": "Clocked"})
    done = await rec.mutate_once(
        org, VIEW, create, actor=ACTOR, key=_key(org, "clock-1"), encode=_encode
    )
    assert done.value is not None
    rid = done.value.record.record_id
    checks: list[tuple[sa.Table, str, sa.ColumnElement[bool]]] = [
        (records, "created_at", records.c.record_id == rid),
        (records, "updated_at", records.c.record_id == rid),
        (record_history_sequences, "updated_at", record_history_sequences.c.record_id == rid),
        (business_events, "occurred_at", business_events.c.record_id == rid),
        (audit_records, "occurred_at", audit_records.c.record_id == rid),
        (runtime_requests, "created_at", runtime_requests.c.request_id == "clock-1"),
    ]
    async with transaction(engine, readonly=True) as conn:
        times = [
            (
                await conn.execute(sa.select(table.c[column]).where(table.c.org_id == org, where))
            ).scalar_one()
            for table, column, where in checks
        ]
    assert len(set(times)) == 1, times
    assert times[0] == done.value.record.created_at


async def test_a_clocked_lock_carries_the_transactions_clock_in_its_one_statement(
    engine: AsyncEngine, org: str
) -> None:
    """``lock_record_history_txn`` (a durable step's first lock, ``worker/executor.py``):
    the record's ``FOR UPDATE`` also returns its history row's last sequence and, when
    ``clocked``, the database clock, kept as the transaction's ``db_now`` — no clock
    statement follows; a reading already taken in the transaction wins; an absent row
    reads no clock (the next ``db_now`` does)."""
    rec = RecordEngine(engine)
    created = await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Note", "", {"Body": "one"}), actor=ACTOR
    )
    rid = created.record.record_id
    with _counting(engine) as counts:
        async with transaction(engine) as conn:
            row, last = await lock_record_history_txn(conn, org, "Note", rid, clocked=True)
            now = await db_now(conn)
    assert row is not None and row.version == 1 and row.fields["Body"] == "one"
    assert last == 1
    assert (counts.transactions, counts.statements) == (1, 1)
    assert now >= created.record.updated_at

    async with transaction(engine) as conn:
        first = await db_now(conn)
        assert (await lock_record_history_txn(conn, org, "Note", rid, clocked=True))[0]
        assert await db_now(conn) == first
    with _counting(engine) as counts:
        async with transaction(engine) as conn:
            missing = await lock_record_history_txn(conn, org, "Note", "no-such-note", clocked=True)
            assert missing == (None, None)
            await db_now(conn)
    assert counts.statements == 2
    # Unclocked, the lock reads no clock: the transaction's db_now is its own statement.
    with _counting(engine) as counts:
        async with transaction(engine) as conn:
            row, last = await lock_record_history_txn(conn, org, "Note", rid, clocked=False)
            await db_now(conn)
    assert row is not None and last == 1 and counts.statements == 2


async def test_a_record_without_a_history_row_is_locked_with_none_and_starts_one(
    engine: AsyncEngine, org: str
) -> None:
    """A record written before the engine kept history rows: the joined lock finds no
    history row (``None``), and the update creates it at sequence 1 under the record's
    lock, as the separate history lock did."""
    rec = RecordEngine(engine)
    created = await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Note", "", {"Body": "old"}), actor=ACTOR
    )
    rid = created.record.record_id
    async with transaction(engine) as conn:  # as if written before history rows existed
        for table in (business_events, record_history_sequences):
            t = table.c
            await conn.execute(
                sa.delete(table).where(t.org_id == org, t.object_name == "Note", t.record_id == rid)
            )
    async with transaction(engine) as conn:
        row, last = await lock_record_history_txn(conn, org, "Note", rid, clocked=False)
    assert row is not None and last is None
    done = await rec.mutate(
        org, VIEW, prepare_update(VIEW, "Note", rid, 1, {"Body": "new"}), actor=ACTOR
    )
    assert done.history_sequence == 1 and done.record.version == 2
    assert await last_sequence(engine, org, "Note", rid) == 1


async def test_the_events_fields_digest_is_the_digest_of_the_stored_fields(
    engine: AsyncEngine, org: str
) -> None:
    """A write encodes its fields once: the event's ``fields_digest`` (hashed over the
    JSON the write stored) equals ``versioned_digest`` of the record's fields, after a
    create and after an update."""
    rec = RecordEngine(engine)
    created = await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Account", "", {"Name": "Dg", "Employees": 2}), actor=ACTOR
    )
    rid = created.record.record_id
    updated = await rec.mutate(
        org, VIEW, prepare_update(VIEW, "Account", rid, 1, {"Employees": 7}), actor=ACTOR
    )
    e = business_events.c
    async with transaction(engine, readonly=True) as conn:
        payloads = [
            json.loads(p)
            for p in (
                await conn.execute(
                    sa.select(e.payload)
                    .where(e.org_id == org, e.record_id == rid)
                    .order_by(e.history_sequence)
                )
            ).scalars()
        ]
    expected = [
        versioned_digest("record-fields", created.record.fields),
        versioned_digest("record-fields", updated.record.fields),
    ]
    assert [p["fields_digest"] for p in payloads] == expected
    assert expected[0] != expected[1]
