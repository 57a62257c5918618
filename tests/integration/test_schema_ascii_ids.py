"""Run, step, attempt, checkpoint and record identifiers and object API names are ASCII
columns on MariaDB (ADR 0015, revision ``0015_ascii_ids``): what the migration converts,
how it refuses data it cannot convert before any DDL, how an interrupted run completes,
what ``db verify`` reports, and how a non-ASCII value is bound (a lookup finds nothing
instead of failing on a collation mix; an INSERT fails instead of storing anything)."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.schema import flow_runs, metadata, records
from services import db, migrate

pytestmark = pytest.mark.mariadb

ASCII = importlib.import_module("runtime_svc.migrations.versions.0015_ascii_ids")
BEFORE = "0014_run_subject"


def _declared() -> set[tuple[str, str]]:
    return {
        (table.name, column.name)
        for table in metadata.tables.values()
        for column in table.columns
        if isinstance(column.type, db.AsciiId)
    }


@pytest.fixture
async def engine(mariadb_url: str) -> AsyncIterator[AsyncEngine]:
    eng = db.create_engine(mariadb_url, pool_size=2)
    try:
        yield eng
    finally:
        await eng.dispose()


async def _execute(engine: AsyncEngine, *statements: str) -> None:
    async with db.transaction(engine) as conn:
        for statement in statements:
            await conn.execute(text(statement))


async def _charsets(engine: AsyncEngine) -> dict[tuple[str, str], str]:
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            text(
                "SELECT table_name, column_name, character_set_name"
                " FROM information_schema.columns WHERE table_schema = DATABASE()"
            )
        )
        found = {(str(t), str(c)): str(cs) for t, c, cs in rows}
    return {key: found[key] for key in _declared()}


async def _foreign_keys(engine: AsyncEngine) -> set[str]:
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            text(
                "SELECT constraint_name FROM information_schema.referential_constraints"
                " WHERE constraint_schema = DATABASE()"
            )
        )
        return {str(r[0]) for r in rows}


def _declared_foreign_keys() -> set[str]:
    return {str(fk.name) for t in metadata.tables.values() for fk in t.foreign_key_constraints}


async def test_the_migration_converts_exactly_the_declared_identifier_columns(
    mariadb_url: str, engine: AsyncEngine
) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc", BEFORE)
    assert set((await _charsets(engine)).values()) == {"utf8mb4"}

    await migrate.upgrade(mariadb_url, "runtime_svc")

    converted = {(t, c) for t, columns in ASCII.COLUMNS.items() for c, _ in columns}
    assert converted == _declared()
    assert set((await _charsets(engine)).values()) == {"ascii"}
    # Every foreign key is back, each over columns of one character set.
    assert await _foreign_keys(engine) == _declared_foreign_keys()
    assert set(ASCII.FOREIGN_KEYS) <= _declared_foreign_keys()
    assert await migrate.verify(mariadb_url, "runtime_svc") == []

    await migrate.downgrade(mariadb_url, "runtime_svc", BEFORE)
    assert set((await _charsets(engine)).values()) == {"utf8mb4"}
    assert await _foreign_keys(engine) == _declared_foreign_keys()


async def test_a_non_ascii_identifier_stops_the_migration_before_any_ddl(
    mariadb_url: str, engine: AsyncEngine
) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc", BEFORE)
    await _execute(
        engine,
        "INSERT INTO records (org_id, object_name, record_id, record_version, fields,"
        " is_deleted, created_at, updated_at) VALUES ('org-1', 'Account', 'rëc-1', 1, '{}',"
        " 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
    )

    # (Alembic loads the revision as a module of its own: the class is compared by name.)
    with pytest.raises(RuntimeError, match=r"records\.record_id: 1 row") as refused:
        await migrate.upgrade(mariadb_url, "runtime_svc")
    assert type(refused.value).__name__ == ASCII.NonAsciiIdentifierError.__name__

    # Nothing changed: still at the revision before, every column and foreign key as it was.
    assert await migrate.current(mariadb_url, "runtime_svc") == [BEFORE]
    assert set((await _charsets(engine)).values()) == {"utf8mb4"}
    assert await _foreign_keys(engine) == _declared_foreign_keys()


async def test_an_interrupted_migration_completes_when_run_again(
    mariadb_url: str, engine: AsyncEngine
) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc", BEFORE)
    # What a process killed half-way leaves: some foreign keys dropped, one table converted.
    await _execute(
        engine,
        "ALTER TABLE record_history_sequences DROP FOREIGN KEY fk_record_history_sequences_records",
        "ALTER TABLE business_events DROP FOREIGN KEY fk_business_events_records",
        "ALTER TABLE records MODIFY object_name VARCHAR(64) CHARACTER SET ascii"
        " COLLATE ascii_bin NOT NULL",
    )

    await migrate.upgrade(mariadb_url, "runtime_svc")

    assert set((await _charsets(engine)).values()) == {"ascii"}
    assert await _foreign_keys(engine) == _declared_foreign_keys()
    assert await migrate.verify(mariadb_url, "runtime_svc") == []


async def test_verify_reports_an_identifier_column_that_is_not_ascii(
    mariadb_url: str, engine: AsyncEngine
) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    await _execute(
        engine,
        "ALTER TABLE audit_records MODIFY record_id VARCHAR(64) CHARACTER SET utf8mb4"
        " COLLATE utf8mb4_bin NULL",
    )

    assert await migrate.verify(mariadb_url, "runtime_svc") == [
        "modify_charset: column audit_records.record_id is utf8mb4, declared ascii"
    ]


async def test_a_non_ascii_identifier_finds_nothing_and_is_never_stored(
    mariadb_url: str, engine: AsyncEngine
) -> None:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    # Compared as it is, MariaDB would refuse the statement (error 1267, an illegal mix of
    # collations): the bound value is one that equals no stored identifier.
    async with db.transaction(engine, readonly=True) as conn:
        run = await conn.execute(
            select(flow_runs.c.flow_run_id).where(
                flow_runs.c.org_id == "org-1", flow_runs.c.flow_run_id.in_(["run_ü", "run_1"])
            )
        )
        assert run.all() == []
        assert db.NON_ASCII_ID.isascii() and len(db.NON_ASCII_ID) > db.ID_LEN

    row = {
        "org_id": "org-1",
        "object_name": "Account",
        "record_id": "rëc-1",
        "record_version": 1,
        "fields": "{}",
        "is_deleted": False,
        "created_at": None,
        "updated_at": None,
    }
    async with db.transaction(engine, readonly=True) as conn:
        now = await db.db_now(conn)
    row["created_at"] = row["updated_at"] = now
    with pytest.raises(DBAPIError, match="too long"):
        async with db.transaction(engine) as conn:
            await conn.execute(records.insert().values(row))
    async with db.transaction(engine, readonly=True) as conn:
        assert (await conn.execute(select(records.c.record_id))).all() == []
