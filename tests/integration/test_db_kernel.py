"""The database kernel (services.db) against real SQLite and MariaDB databases: engine
settings, fencing, insert-if-absent, retries, the database clock and column types."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pymysql
import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db
from services.errors import CommitOutcomeUnknownError, ConflictError, FenceLostError
from tests.support.statements import watched_statements

metadata = db.new_metadata()
items = Table(
    "kernel_items",
    metadata,
    Column("org_id", String(db.ID_LEN), nullable=False),
    Column("item_id", String(db.ID_LEN), nullable=False),
    Column("external_key", String(db.KEY_LEN), nullable=False),
    Column("state_version", BigInteger, nullable=False),
    Column("counter", Integer, nullable=False),
    Column("lease_token", String(db.TOKEN_LEN), nullable=True),
    Column("note", db.JsonText(64), nullable=True),
    Column("seen_at", db.UtcDateTime(), nullable=True),
    PrimaryKeyConstraint("org_id", "item_id"),
    UniqueConstraint("org_id", "external_key", name="uq_kernel_items_external_key"),
    **db.TABLE_OPTIONS,
)

parts = Table(
    "kernel_parts",
    metadata,
    Column("org_id", String(db.ID_LEN), nullable=False),
    Column("part_id", String(db.ID_LEN), nullable=False),
    Column("state_version", BigInteger, nullable=False),
    Column("counter", Integer, nullable=False),
    Column("lease_token", String(db.TOKEN_LEN), nullable=True),
    PrimaryKeyConstraint("org_id", "part_id"),
    **db.TABLE_OPTIONS,
)

ORG, OTHER_ORG = "org-1", "org-2"
NO_WAIT = db.Backoff(initial_s=0.001, max_s=0.002)


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(db_url, pool_size=5)
    async with db.transaction(eng) as conn:
        await conn.run_sync(metadata.create_all)
    yield eng
    await eng.dispose()


def _row(item_id: str, **overrides: Any) -> dict[str, Any]:
    return {
        "org_id": ORG,
        "item_id": item_id,
        "external_key": f"key-{item_id}",
        "state_version": 0,
        "counter": 0,
        "lease_token": None,
        **overrides,
    }


async def _insert(engine: AsyncEngine, *rows: dict[str, Any]) -> None:
    async with db.transaction(engine) as conn:
        for row in rows:
            await conn.execute(insert(items).values(row))


async def _get(engine: AsyncEngine, item_id: str, org_id: str = ORG) -> Any:
    async with db.transaction(engine, readonly=True) as conn:
        query = select(items).where(items.c.org_id == org_id, items.c.item_id == item_id)
        return (await conn.execute(query)).one_or_none()


def _is_mysql(conn: AsyncConnection) -> bool:
    return conn.dialect.name in ("mysql", "mariadb")


# --- engine settings -------------------------------------------------------------------


async def test_engine_session_settings(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        if _is_mysql(conn):
            row = (
                await conn.execute(text("SELECT @@tx_isolation, @@innodb_lock_wait_timeout"))
            ).one()
            assert tuple(row) == ("READ-COMMITTED", db.LOCK_WAIT_TIMEOUT_S)
        else:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1
            # Inline statements never wait; one that would is re-run on the driver thread
            # with the 5 s busy timeout (services/db_sqlite.py).
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == 0
            raw = await conn.get_raw_connection()
            assert raw.dbapi_connection.busy_timeout_ms == 5000  # type: ignore[union-attr]


async def test_create_engine_rejects_unsupported_drivers() -> None:
    with pytest.raises(ValueError, match="unsupported database driver"):
        db.create_engine("sqlite+pysqlite:///x.db")
    with pytest.raises(ValueError, match="unsupported database dialect"):
        db.create_engine("postgresql+asyncpg://h/db")


# --- fencing ---------------------------------------------------------------------------


async def test_cas_update_advances_the_version_and_sets_values(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a", state_version=3))

    async with db.transaction(engine) as conn:
        new_version = await db.cas_update(
            conn, items, org_id=ORG, key={"item_id": "a"}, expected_version=3, values={"counter": 7}
        )

    assert new_version == 4
    row = await _get(engine, "a")
    assert (row.state_version, row.counter) == (4, 7)


async def test_cas_update_with_a_stale_version_loses_the_fence(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a", state_version=5))

    with pytest.raises(FenceLostError) as caught:
        async with db.transaction(engine) as conn:
            await db.cas_update(
                conn,
                items,
                org_id=ORG,
                key={"item_id": "a"},
                expected_version=4,
                values={"counter": 1},
            )

    assert (caught.value.entity, caught.value.key) == ("kernel_items", "item_id=a")
    assert (caught.value.expected_version, caught.value.found_version) == (4, 5)
    assert (await _get(engine, "a")).counter == 0


async def test_cas_update_in_the_wrong_org_matches_nothing(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a"))

    with pytest.raises(FenceLostError) as caught:
        async with db.transaction(engine) as conn:
            await db.cas_update(
                conn,
                items,
                org_id=OTHER_ORG,
                key={"item_id": "a"},
                expected_version=0,
                values={"counter": 1},
            )

    assert caught.value.found_version is None  # absent in that org: no disclosure
    assert (await _get(engine, "a")).state_version == 0


async def test_cas_update_extra_predicates_are_part_of_the_fence(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a", lease_token="t-new"))

    with pytest.raises(FenceLostError) as caught:
        async with db.transaction(engine) as conn:
            await db.cas_update(
                conn,
                items,
                org_id=ORG,
                key={"item_id": "a"},
                expected_version=0,
                values={"counter": 1},
                extra_predicates=[items.c.lease_token == "t-old"],
            )
    assert caught.value.found_version == 0

    async with db.transaction(engine) as conn:
        await db.cas_update(
            conn,
            items,
            org_id=ORG,
            key={"item_id": "a"},
            expected_version=0,
            values={"counter": 1},
            extra_predicates=[items.c.lease_token == "t-new"],
        )
    assert (await _get(engine, "a")).counter == 1


async def _fenced(
    engine: AsyncEngine, item: str, version: int, values: dict[str, Any], **fence: Any
) -> int:
    """One :func:`db.fenced_update` of ``item`` in its own transaction."""
    async with db.transaction(engine) as conn:
        return await db.fenced_update(
            conn,
            items,
            org_id=ORG,
            key={"item_id": item},
            expected_version=version,
            values=values,
            **fence,
        )


async def test_fenced_update_checks_its_equalities_null_tests_and_version(
    engine: AsyncEngine,
) -> None:
    await _insert(engine, _row("a", lease_token="t-new"), _row("b"))

    async def update(item: str, version: int, **equal: Any) -> int:
        values = {"counter": 1, "seen_at": datetime(2026, 1, 2, tzinfo=UTC)}
        return await _fenced(engine, item, version, values, equal=equal)

    for stale in ({"lease_token": "t-old"}, {"lease_token": None}):
        with pytest.raises(FenceLostError) as caught:
            await update("a", 0, **stale)
        assert caught.value.found_version == 0
    with pytest.raises(FenceLostError) as caught:
        await update("a", 1, lease_token="t-new")  # the statement is reused: same shape
    assert caught.value.found_version == 0
    with pytest.raises(FenceLostError):
        await update("b", 0, lease_token="t-new")  # NULL never equals a value
    assert (await _get(engine, "a")).counter == 0

    assert await update("a", 0, lease_token="t-new") == 1
    assert await update("b", 0, lease_token=None) == 1
    row = await _get(engine, "a")
    assert (row.state_version, row.counter, row.seen_at) == (
        1,
        1,
        datetime(2026, 1, 2, tzinfo=UTC),
    )


async def test_fenced_update_switch_on_null_is_decided_by_the_row(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a", lease_token="t"), _row("b"))
    switch = db.SwitchOnNull("lease_token", '"held"', '"free"')
    async with db.transaction(engine) as conn:
        for item in ("a", "b"):
            await db.fenced_update(
                conn,
                items,
                org_id=ORG,
                key={"item_id": item},
                expected_version=0,
                values={"note": switch},
                equal={},
            )
    assert (await _get(engine, "a")).note == '"held"'
    assert (await _get(engine, "b")).note == '"free"'


async def test_fenced_update_bounds_are_part_of_the_fence(engine: AsyncEngine) -> None:
    due = datetime(2026, 1, 2, 12, 0, tzinfo=UTC)
    await _insert(engine, _row("a", seen_at=due), _row("b", seen_at=due))

    async def update(item: str, version: int, **bounds: Any) -> int:
        return await _fenced(engine, item, version, {"counter": 1}, equal={}, **bounds)

    early = due - timedelta(microseconds=1)
    for bound in ({"at_most": {"seen_at": early}}, {"less_than": {"seen_at": due}}):
        with pytest.raises(FenceLostError) as caught:
            await update("a", 0, **bound)  # not due yet / not yet expired
        assert caught.value.found_version == 0
    assert (await _get(engine, "a")).counter == 0

    assert await update("a", 0, at_most={"seen_at": due}) == 1  # <= includes the bound
    later = due + timedelta(microseconds=1)
    assert await update("b", 0, less_than={"seen_at": later}) == 1
    with pytest.raises(FenceLostError):
        await update("b", 1, at_most={"seen_at": None})  # <= NULL matches nothing
    assert [(await _get(engine, i)).state_version for i in ("a", "b")] == [1, 1]


async def _lock_both(conn: AsyncConnection) -> None:
    """Lock item ``a`` then part ``p`` (what a caller of fenced_updates does first)."""
    await conn.execute(
        select(items.c.item_id)
        .where(items.c.org_id == ORG, items.c.item_id == "a")
        .with_for_update()
    )
    await conn.execute(
        select(parts.c.part_id)
        .where(parts.c.org_id == ORG, parts.c.part_id == "p")
        .with_for_update()
    )


def _both(item_version: int, part_version: int, **item_equal: Any) -> list[db.FencedWrite]:
    return [
        db.FencedWrite(
            items,
            org_id=ORG,
            key={"item_id": "a"},
            expected_version=item_version,
            values={"counter": 5, "note": db.SwitchOnNull("lease_token", '"held"', '"free"')},
            equal=item_equal,
            at_most={"seen_at": datetime(2026, 1, 2, tzinfo=UTC)},
        ),
        db.FencedWrite(
            parts,
            org_id=ORG,
            key={"part_id": "p"},
            expected_version=part_version,
            values={"counter": 7},
            equal={"lease_token": None},
        ),
    ]


async def _part(engine: AsyncEngine) -> Any:
    async with db.transaction(engine, readonly=True) as conn:
        query = select(parts).where(parts.c.org_id == ORG, parts.c.part_id == "p")
        return (await conn.execute(query)).one()


async def test_fenced_updates_write_every_row_in_one_statement_where_the_backend_can(
    engine: AsyncEngine,
) -> None:
    await _insert(engine, _row("a", lease_token="t", seen_at=datetime(2026, 1, 1, tzinfo=UTC)))
    async with db.transaction(engine) as conn:
        await conn.execute(
            insert(parts).values(org_id=ORG, part_id="p", state_version=3, counter=0)
        )
    together = db.strategy_for(engine.dialect).multi_table_update
    assert together is _is_mysql_engine(engine)
    async with db.transaction(engine) as conn:
        await _lock_both(conn)
        with watched_statements(engine) as seen:
            assert await db.fenced_updates(conn, _both(0, 3, lease_token="t")) == [1, 4]
    assert [s.split()[0] for s in seen] == ["UPDATE"] * (1 if together else 2)
    if together:
        assert seen[0].startswith("UPDATE kernel_items, kernel_parts SET")
    item, part = await _get(engine, "a"), await _part(engine)
    assert (item.state_version, item.counter, item.note, item.lease_token) == (1, 5, '"held"', "t")
    assert (part.state_version, part.counter) == (4, 7)


@pytest.mark.parametrize("stale", ["item", "part", "item_predicate", "part_bound"])
async def test_fenced_updates_lost_fence_writes_nothing_and_names_the_row_that_lost(
    engine: AsyncEngine, stale: str
) -> None:
    due = datetime(2026, 1, 1, tzinfo=UTC)
    await _insert(engine, _row("a", lease_token="t", seen_at=due))
    async with db.transaction(engine) as conn:
        await conn.execute(
            insert(parts).values(org_id=ORG, part_id="p", state_version=3, counter=0)
        )
    writes = _both(1 if stale == "item" else 0, 2 if stale == "part" else 3, lease_token="t")
    if stale == "item_predicate":
        writes = _both(0, 3, lease_token="t-old")
    if stale == "part_bound":
        writes[1] = dataclasses.replace(writes[1], at_most={"state_version": 2})
    with pytest.raises(FenceLostError) as caught:
        async with db.transaction(engine) as conn:
            await _lock_both(conn)
            await db.fenced_updates(conn, writes)
    # The error one-by-one fenced updates raise: the first write whose fence is lost.
    lost_part = stale.startswith("part")
    assert caught.value.attributes["entity"] == ("kernel_parts" if lost_part else "kernel_items")
    assert caught.value.found_version == (3 if lost_part else 0)
    item, part = await _get(engine, "a"), await _part(engine)
    assert (item.state_version, item.counter, part.state_version, part.counter) == (0, 0, 3, 0)


async def test_fenced_updates_writes_one_by_one_what_one_statement_could_not_express(
    engine: AsyncEngine,
) -> None:
    await _insert(engine, _row("a", lease_token="t"), _row("b"), _row("c", org_id=OTHER_ORG))

    def write(item: str, org: str = ORG, **values: Any) -> db.FencedWrite:
        return db.FencedWrite(
            items,
            org_id=org,
            key={"item_id": item},
            expected_version=0,
            values=values or {"counter": 1},
            equal={},
        )

    same_table = [write("a"), write("b")]
    async with db.transaction(engine) as conn:
        await conn.execute(
            insert(parts).values(org_id=ORG, part_id="p", state_version=0, counter=0)
        )
    part = db.FencedWrite(
        parts, org_id=ORG, key={"part_id": "p"}, expected_version=0, values={"counter": 1}, equal={}
    )
    two_orgs = [write("c", OTHER_ORG), part]
    # A value chosen on a column the same write sets: a multi-table UPDATE assigns in no
    # defined order (a single-table one in SET order), so it stays a statement of its own.
    self_switch = [
        dataclasses.replace(
            write("a", lease_token=None, note=db.SwitchOnNull("lease_token", '"held"', '"free"')),
            expected_version=1,
        ),
        dataclasses.replace(part, expected_version=1),
    ]
    for writes in (same_table, two_orgs, self_switch):
        async with db.transaction(engine) as conn:
            with watched_statements(engine) as seen:
                await db.fenced_updates(conn, writes)
        assert len(seen) == 2, seen
    assert (await _get(engine, "c", OTHER_ORG)).counter == 1


def _is_mysql_engine(engine: AsyncEngine) -> bool:
    return engine.dialect.name in ("mysql", "mariadb")


async def test_scoped_select_is_built_once_and_reads_only_its_org(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a"), _row("a", org_id=OTHER_ORG, counter=7))
    stmt = db.scoped_select(items, ("item_id",))
    assert db.scoped_select(items, ("item_id",)) is stmt
    versions = db.scoped_select(items, ("item_id",), columns=("state_version", "counter"))
    async with db.transaction(engine, readonly=True) as conn:
        row = (await conn.execute(stmt, {"org_id": OTHER_ORG, "item_id": "a"})).one()
        assert (row.org_id, row.counter) == (OTHER_ORG, 7)
        assert (await conn.execute(versions, {"org_id": ORG, "item_id": "a"})).all() == [(0, 0)]
        missing = await conn.execute(stmt, {"org_id": "org-3", "item_id": "a"})
        assert missing.first() is None
    locking = db.scoped_select(items, ("item_id",), for_update=True)
    assert locking is not stmt
    assert "FOR UPDATE" in str(locking.compile(dialect=mysql.dialect()))


async def test_fenced_update_in_the_wrong_org_matches_nothing_and_refuses_misuse(
    engine: AsyncEngine,
) -> None:
    await _insert(engine, _row("a"))
    async with db.transaction(engine) as conn:
        with pytest.raises(FenceLostError) as caught:
            await db.fenced_update(
                conn,
                items,
                org_id=OTHER_ORG,
                key={"item_id": "a"},
                expected_version=0,
                values={"counter": 1},
                equal={},
            )
        assert caught.value.found_version is None
        with pytest.raises(ValueError, match="not a unique key"):
            await db.fenced_update(
                conn, items, org_id=ORG, key={"counter": 0}, expected_version=0, values={}, equal={}
            )
        with pytest.raises(ValueError, match="may not set"):
            await db.fenced_update(
                conn,
                items,
                org_id=ORG,
                key={"item_id": "a"},
                expected_version=0,
                values={"state_version": 9},
                equal={},
            )


async def test_cas_update_accepts_a_unique_key_and_refuses_misuse(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a"))
    async with db.transaction(engine) as conn:
        await db.cas_update(
            conn,
            items,
            org_id=ORG,
            key={"external_key": "key-a"},
            expected_version=0,
            values={"counter": 2},
        )
        with pytest.raises(ValueError, match="not a unique key"):
            await db.cas_update(
                conn, items, org_id=ORG, key={"counter": 2}, expected_version=1, values={}
            )
        with pytest.raises(ValueError, match="may not set"):
            await db.cas_update(
                conn,
                items,
                org_id=ORG,
                key={"item_id": "a"},
                expected_version=1,
                values={"state_version": 9},
            )
    assert (await _get(engine, "a")).counter == 2


# --- insert-if-absent ------------------------------------------------------------------


async def test_insert_if_absent_duplicate_keeps_the_transaction_usable(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a", counter=1))

    async with db.transaction(engine) as conn:
        assert await db.insert_if_absent(conn, items, _row("b")) is True
        assert await db.insert_if_absent(conn, items, _row("a", counter=99)) is False  # PK
        assert (
            await db.insert_if_absent(
                conn,
                items,
                _row("z", external_key="key-b"),  # unique key taken by "b"
            )
            is False
        )
        assert await db.insert_if_absent(conn, items, _row("c")) is True

    assert (await _get(engine, "a")).counter == 1
    assert await _get(engine, "b") is not None
    assert await _get(engine, "c") is not None
    assert await _get(engine, "z") is None


async def test_insert_if_absent_is_scoped_by_org(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a"))
    async with db.transaction(engine) as conn:
        assert await db.insert_if_absent(conn, items, _row("a", org_id=OTHER_ORG)) is True


async def test_insert_if_absent_propagates_other_integrity_errors(engine: AsyncEngine) -> None:
    with pytest.raises(IntegrityError):
        async with db.transaction(engine) as conn:
            await db.insert_if_absent(conn, items, _row("a", counter=None))


# --- transactions and retries ----------------------------------------------------------


async def test_concurrent_read_modify_write_increments_are_not_lost(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a"))

    async def increment() -> None:
        async with db.transaction(engine) as conn:
            query = select(items.c.counter).where(items.c.org_id == ORG, items.c.item_id == "a")
            current = (await conn.execute(query.with_for_update())).scalar_one()
            await asyncio.sleep(0)  # let the others run between the read and the write
            await conn.execute(
                items.update()
                .where(items.c.org_id == ORG, items.c.item_id == "a")
                .values(counter=current + 1)
            )

    await asyncio.gather(*(increment() for _ in range(20)))

    assert (await _get(engine, "a")).counter == 20


def _pymysql_error(code: int) -> Exception:
    return pymysql.err.OperationalError(code, "fabricated")


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: _pymysql_error(1213),  # deadlock
        lambda: _pymysql_error(9007),  # TiDB write conflict
        lambda: _pymysql_error(1205),  # lock wait timeout
        lambda: sqlite3.OperationalError("database is locked"),
    ],
    ids=["deadlock", "tidb-write-conflict", "lock-wait-timeout", "sqlite-busy"],
)
async def test_run_in_transaction_retries_conflicts_from_a_clean_slate(
    engine: AsyncEngine, make_error: Callable[[], Exception]
) -> None:
    calls = 0

    async def body(conn: AsyncConnection) -> str:
        nonlocal calls
        calls += 1
        await conn.execute(insert(items).values(_row(f"attempt-{calls}")))
        if calls < 3:
            raise make_error()
        return "done"

    assert await db.run_in_transaction(engine, body, max_attempts=5, backoff=NO_WAIT) == "done"

    assert calls == 3
    async with db.transaction(engine, readonly=True) as conn:
        ids = (await conn.execute(select(items.c.item_id))).scalars().all()
    assert ids == ["attempt-3"]  # the failed attempts were rolled back


async def test_run_in_transaction_gives_up_after_max_attempts(engine: AsyncEngine) -> None:
    calls = 0

    async def body(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        raise _pymysql_error(1213)

    with pytest.raises(ConflictError) as caught:
        await db.run_in_transaction(engine, body, max_attempts=3, backoff=NO_WAIT)

    assert calls == 3
    assert db.classify_db_error(caught.value.__cause__) is db.DbErrorClass.RETRYABLE_CONFLICT


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: _pymysql_error(2013),  # connection lost: outcome unknown class
        lambda: FenceLostError("kernel_items", "item_id=a", 1, 2),
        lambda: ValueError("bug"),
    ],
    ids=["outcome-unknown", "fence-lost", "other"],
)
async def test_run_in_transaction_does_not_retry_other_failures(
    engine: AsyncEngine, make_error: Callable[[], Exception]
) -> None:
    calls = 0
    error = make_error()

    async def body(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        raise error

    with pytest.raises(type(error)):
        await db.run_in_transaction(engine, body, max_attempts=5, backoff=NO_WAIT)
    assert calls == 1


async def test_connection_lost_during_commit_is_outcome_unknown_and_not_retried(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lost_during_commit(dbapi_connection: Any) -> None:
        raise pymysql.err.OperationalError(2013, "Lost connection to server during query")

    monkeypatch.setattr(engine.sync_engine.dialect, "do_commit", lost_during_commit)
    calls = 0

    async def body(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute(insert(items).values(_row("a")))

    with pytest.raises(CommitOutcomeUnknownError):
        await db.run_in_transaction(engine, body, max_attempts=5, backoff=NO_WAIT)
    assert calls == 1


# --- clock and column types ------------------------------------------------------------


async def test_db_now_is_utc_whatever_the_session_time_zone(engine: AsyncEngine) -> None:
    async with db.transaction(engine) as conn:
        if _is_mysql(conn):
            await conn.execute(text("SET time_zone = '+05:00'"))
        first = await db.db_now(conn)
        second = await db.db_now(conn)

    assert first.tzinfo is UTC
    assert first <= second
    # A session-zone clock would be off by five hours; allow for a generous clock skew.
    assert abs(first - datetime.now(UTC)) < timedelta(minutes=30)


async def test_db_now_is_read_once_per_transaction(engine: AsyncEngine) -> None:
    statements: list[str] = []

    def count(*args: Any) -> None:
        if not str(args[2]).startswith("BEGIN"):  # SQLite's own BEGIN IMMEDIATE
            statements.append(args[2])

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        async with db.transaction(engine) as conn:
            first = await db.db_now(conn)
            asked = len(statements)
            again = await db.db_now(conn)
            assert len(statements) == asked  # no second round trip in the transaction
        async with db.transaction(engine) as conn:
            later = await db.db_now(conn)
            assert len(statements) == asked + 1  # a new transaction asks the database
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)

    assert again == first  # every durable time one transaction writes is one instant
    assert later >= first


async def test_utc_datetime_round_trips_instants_with_microseconds(engine: AsyncEngine) -> None:
    instant = datetime(2026, 3, 1, 12, 30, 45, 123456, tzinfo=timezone(timedelta(hours=2)))
    await _insert(engine, _row("a", seen_at=instant))

    stored = (await _get(engine, "a")).seen_at

    assert stored == instant
    assert stored.tzinfo is UTC
    assert stored.hour == 10


async def test_naive_datetimes_are_refused(engine: AsyncEngine) -> None:
    with pytest.raises(StatementError, match="naive datetime"):
        await _insert(engine, _row("a", seen_at=datetime(2026, 1, 1)))


async def test_json_text_enforces_its_byte_bound(engine: AsyncEngine) -> None:
    await _insert(engine, _row("a", note="é" * 32))  # 64 bytes: at the bound
    with pytest.raises(StatementError) as caught:
        await _insert(engine, _row("b", note="é" * 33))
    assert isinstance(caught.value.orig, db.PayloadTooLargeError)


# --- real lock conflicts ---------------------------------------------------------------


async def test_sqlite_busy_writer_is_classified_retryable(sqlite_url: str) -> None:
    engine = db.create_engine(sqlite_url)
    try:
        async with db.transaction(engine) as holder:
            await holder.execute(text("CREATE TABLE t (x INTEGER)"))
        async with engine.connect() as holder, engine.connect() as waiter:
            # BEGIN IMMEDIATE goes with the first statement (services/db_sqlite.py): from
            # then on the holder has the write lock.
            await holder.begin()
            await holder.execute(text("SELECT COUNT(*) FROM t"))
            raw = await waiter.get_raw_connection()
            await raw.driver_connection.execute("PRAGMA busy_timeout = 0")
            with pytest.raises(DBAPIError) as caught:
                await waiter.begin()
                await waiter.execute(text("SELECT COUNT(*) FROM t"))
            await holder.rollback()
        assert db.classify_db_error(caught.value) is db.DbErrorClass.RETRYABLE_CONFLICT
    finally:
        await engine.dispose()


async def _wait_for_lock_wait(engine: AsyncEngine) -> None:
    query = text("SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'")
    for _ in range(200):  # bounded: ~10 s
        async with engine.connect() as probe:
            if (await probe.execute(query)).scalar():
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the first transaction never started waiting")


@pytest.mark.mariadb
async def test_mariadb_crossed_row_locks_deadlock_is_retryable_conflict(mariadb_url: str) -> None:
    engine = db.create_engine(mariadb_url, pool_size=3)
    try:
        async with db.transaction(engine) as conn:
            await conn.run_sync(metadata.create_all)
            await conn.execute(insert(items).values([_row("a"), _row("b")]))

        def lock(item_id: str) -> Any:
            return (
                select(items.c.counter)
                .where(items.c.org_id == ORG, items.c.item_id == item_id)
                .with_for_update()
            )

        async with db.transaction(engine) as first, db.transaction(engine) as second:
            await first.execute(lock("a"))
            await second.execute(lock("b"))
            first_crosses = asyncio.ensure_future(first.execute(lock("b")))
            await _wait_for_lock_wait(engine)
            outcomes = await asyncio.gather(
                second.execute(lock("a")), first_crosses, return_exceptions=True
            )
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(errors) == 1, outcomes
            assert db.classify_db_error(errors[0]) is db.DbErrorClass.RETRYABLE_CONFLICT
            await first.rollback()
            await second.rollback()
    finally:
        await engine.dispose()


@pytest.mark.mariadb
async def test_mariadb_lock_wait_timeout_is_classified(mariadb_url: str) -> None:
    engine = db.create_engine(mariadb_url, pool_size=2)
    try:
        async with db.transaction(engine) as conn:
            await conn.run_sync(metadata.create_all)
            await conn.execute(insert(items).values(_row("a")))
        query = select(func.count()).select_from(items).where(items.c.item_id == "a")
        async with db.transaction(engine) as holder, db.transaction(engine) as waiter:
            await holder.execute(query.with_for_update())
            await waiter.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
            with pytest.raises(DBAPIError) as caught:
                await waiter.execute(query.with_for_update())
            await holder.rollback()
            await waiter.rollback()
        assert db.classify_db_error(caught.value) is db.DbErrorClass.LOCK_WAIT_TIMEOUT
    finally:
        await engine.dispose()


async def test_a_commit_with_unknown_outcome_never_returns_its_connection_to_the_pool(
    engine: AsyncEngine,
) -> None:
    """The driver reports a lost connection during COMMIT without flagging a disconnect:
    the transaction raises CommitOutcomeUnknownError and the connection is invalidated,
    so the next transaction gets a clean one (a reused connection could still hold the
    unknown transaction)."""
    fired: list[bool] = []

    def on_commit(sync_conn: Any) -> None:
        if not fired:
            fired.append(True)
            raise pymysql.err.OperationalError(2013, "Lost connection during COMMIT")

    event.listen(engine.sync_engine, "commit", on_commit)
    try:
        with pytest.raises(CommitOutcomeUnknownError):
            async with db.transaction(engine) as conn:
                await conn.execute(items.insert().values(**_row("lost-commit")))
    finally:
        event.remove(engine.sync_engine, "commit", on_commit)
    assert engine.pool.checkedout() == 0
    # Every pooled connection is usable: a write transaction on each succeeds.
    for i in range(3):
        await _insert(engine, _row(f"after-{i}"))
    assert (await _get(engine, "after-2")) is not None


async def test_a_failed_begin_holds_no_connection(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Check-out and BEGIN are one hand-off (``services.db._open``): a BEGIN that fails
    returns the connection to the pool and raises; nothing ran."""
    real_begin = Connection.begin

    def failing_begin(self: Connection) -> Any:
        raise RuntimeError("BEGIN refused")

    monkeypatch.setattr(Connection, "begin", failing_begin)
    with pytest.raises(RuntimeError, match="BEGIN refused"):
        async with db.transaction(engine) as conn:
            await conn.execute(items.insert().values(**_row("never")))
    assert engine.pool.checkedout() == 0
    monkeypatch.setattr(Connection, "begin", real_begin)
    await _insert(engine, _row("after"))
    assert (await _get(engine, "never")) is None
    assert (await _get(engine, "after")) is not None


async def test_a_failed_check_in_after_commit_raises_but_the_commit_stands(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMMIT and the check-in are one hand-off (``services.db._commit_and_close``): a
    check-in that fails after a successful COMMIT is raised as itself — never read as a
    COMMIT failure (no CommitOutcomeUnknownError, no rollback) — and the connection is
    still returned to the pool."""
    real_close = Connection.close
    failures: list[bool] = []

    def close_failing_once(self: Connection) -> None:
        if not failures:
            failures.append(True)
            raise RuntimeError("check-in failed")
        real_close(self)

    monkeypatch.setattr(Connection, "close", close_failing_once)
    with pytest.raises(RuntimeError, match="check-in failed"):
        async with db.transaction(engine) as conn:
            await conn.execute(items.insert().values(**_row("committed")))
    monkeypatch.setattr(Connection, "close", real_close)
    assert failures == [True]
    assert engine.pool.checkedout() == 0
    assert (await _get(engine, "committed")) is not None
