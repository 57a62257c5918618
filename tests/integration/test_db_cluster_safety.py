"""Cluster-safe building blocks on the single-server backends (the 3-node proofs are in
``tests/cluster/``): COMMIT failures classified by what they prove, the row-based schema
lock, and the cluster check's no-op on servers that are not Galera nodes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pymysql
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services import db, db_cluster, migrate, schema_lock
from services.errors import CommitOutcomeUnknownError

_META = MetaData()
_ITEMS = Table(
    "cluster_items",
    _META,
    Column("id", String(32), primary_key=True),
    Column("n", Integer, nullable=False),
)
NO_WAIT = db.Backoff(initial_s=0.0001, max_s=0.0002)


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(db_url, pool_size=4)
    async with eng.begin() as conn:
        await conn.run_sync(_META.create_all)
    try:
        yield eng
    finally:
        await eng.dispose()


def _failing_commit(code: int, message: str) -> Any:
    calls = {"n": 0}

    def do_commit(dbapi_connection: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise pymysql.err.OperationalError(code, message)
        dbapi_connection.commit()

    return do_commit


async def test_a_certification_failure_at_commit_is_a_proven_rollback_retried_whole(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Galera reports a lost certification as 1213 at COMMIT: nothing was written, the
    whole transaction runs again — never a commit-unknown."""
    monkeypatch.setattr(
        engine.sync_engine.dialect,
        "do_commit",
        _failing_commit(1213, "Deadlock found when trying to get lock; try restarting"),
    )
    calls = 0

    async def body(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute(insert(_ITEMS).values(id=f"a{calls}", n=calls))

    await db.run_in_transaction(engine, body, backoff=NO_WAIT)
    assert calls == 2
    async with db.transaction(engine, readonly=True) as conn:
        assert (await conn.execute(select(_ITEMS.c.id))).scalars().all() == ["a2"]


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (1047, "WSREP has not yet prepared node for application use"),
        (1180, "Got error 6 during COMMIT"),
        (1927, "Connection was killed"),
    ],
    ids=["node-not-primary", "error-during-commit", "connection-killed"],
)
async def test_any_other_commit_failure_is_an_unknown_outcome_never_retried(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, code: int, message: str
) -> None:
    monkeypatch.setattr(engine.sync_engine.dialect, "do_commit", _failing_commit(code, message))
    calls = 0

    async def body(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute(insert(_ITEMS).values(id="x", n=1))

    with pytest.raises(CommitOutcomeUnknownError):
        await db.run_in_transaction(engine, body, backoff=NO_WAIT)
    assert calls == 1


async def test_the_cluster_check_is_a_no_op_off_galera(engine: AsyncEngine) -> None:
    assert await db_cluster.check_cluster(engine) is None


# --- schema lock (MySQL family: SQLite serialises upgrades with its writer lock) -----------


@pytest.fixture
async def lock_engine(mariadb_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(mariadb_url, pool_size=4)
    try:
        yield eng
    finally:
        await eng.dispose()


async def _holder(engine: AsyncEngine, name: str) -> str | None:
    async with db.transaction(engine, readonly=True) as conn:
        row = (
            await conn.execute(
                text("SELECT holder FROM flow_schema_lock WHERE lock_name = :n"), {"n": name}
            )
        ).first()
    return None if row is None else str(row[0])


async def test_schema_lock_serialises_holders_and_is_released(lock_engine: AsyncEngine) -> None:
    inside: list[str] = []
    overlap: list[bool] = []

    async def hold(tag: str) -> None:
        async with schema_lock.schema_lock(lock_engine, "t", wait_s=30, poll_s=0.05) as holder:
            overlap.append(bool(inside))
            inside.append(tag)
            assert await _holder(lock_engine, "t") == holder
            await asyncio.sleep(0.2)
            inside.remove(tag)

    await asyncio.gather(hold("a"), hold("b"), hold("c"))
    assert overlap == [False, False, False]
    assert await _holder(lock_engine, "t") is None


async def test_schema_lock_waits_then_times_out_naming_the_holder(
    lock_engine: AsyncEngine,
) -> None:
    async with schema_lock.schema_lock(lock_engine, "busy") as holder:
        with pytest.raises(schema_lock.SchemaLockTimeoutError, match=holder):
            async with schema_lock.schema_lock(lock_engine, "busy", wait_s=0.3, poll_s=0.05):
                pass


async def test_an_expired_lease_is_taken_over(lock_engine: AsyncEngine) -> None:
    async with schema_lock.schema_lock(lock_engine, "x"):
        pass  # creates the table
    async with db.transaction(lock_engine) as conn:
        past = await db.db_now(conn) - timedelta(minutes=5)
        await conn.execute(
            text(
                "INSERT INTO flow_schema_lock (lock_name, holder, acquired_at, expires_at) "
                "VALUES ('stale', 'dead-process', :t, :t)"
            ),
            {"t": past.replace(tzinfo=None)},
        )
    async with schema_lock.schema_lock(lock_engine, "stale", wait_s=5) as holder:
        assert await _holder(lock_engine, "stale") == holder != "dead-process"


async def test_db_verify_ignores_the_lock_table(mariadb_url: str) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    assert await migrate.verify(mariadb_url, "runtime_svc") == []
    # The table exists (the upgrade took the lock) and is not reported as drift.
    engine = db.create_engine(mariadb_url, pool_size=1)
    try:
        async with db.transaction(engine, readonly=True) as conn:
            tables = (await conn.execute(text("SHOW TABLES LIKE 'flow_schema_lock'"))).all()
    finally:
        await engine.dispose()
    assert len(tables) == 1
