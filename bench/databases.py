"""The databases a bench section runs on: a fresh SQLite file, then — when
``FLOW_TEST_MYSQL_URL`` is set — a throwaway MariaDB database (utf8mb4_bin), dropped
afterwards. Each section passes its per-database coroutine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from services import db

__all__ = ["on_each_database", "settle"]

#: How long :func:`settle` waits at most for MariaDB to write back a bulk load.
SETTLE_S = 45.0
#: Dirty InnoDB pages below which a bulk load counts as written back.
SETTLED_DIRTY_PAGES = 256


async def on_each_database(prefix: str, bench: Callable[[str, str], Awaitable[None]]) -> None:
    """Await ``bench(label, url)`` on SQLite, then on a fresh MariaDB database."""
    with tempfile.TemporaryDirectory() as tmp:
        await bench("sqlite", f"sqlite+aiosqlite:///{Path(tmp) / f'{prefix}.db'}")
    mysql = os.environ.get("FLOW_TEST_MYSQL_URL")
    if not mysql:
        print("mariadb  skipped (set FLOW_TEST_MYSQL_URL=mysql+asyncmy://root:@127.0.0.1:3307)")
        return
    name = f"bench_{prefix}_{uuid.uuid4().hex[:8]}"
    admin = db.create_engine(mysql.rstrip("/") + "/", pool_size=1)
    async with admin.connect() as conn:
        await conn.execute(
            sa.text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        )
    try:
        await bench("mariadb", f"{mysql.rstrip('/')}/{name}?charset=utf8mb4")
    finally:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f"DROP DATABASE {name}"))
        await admin.dispose()


async def settle(engine: AsyncEngine, tables: Sequence[sa.Table]) -> str:
    """Let the database finish what a bench's bulk load of ``tables`` started before
    anything is timed — a population is measured as it stands, not while the server is
    still writing it back: SQLite checkpoints its write-ahead log (else an automatic
    checkpoint of the whole load lands inside a timed COMMIT); MariaDB refreshes the
    statistics of the loaded tables (else their background recalculation can change
    plans mid-run) and waits, at most ``SETTLE_S``, for the load's dirty pages (else the
    page cleaner's writes compete with every COMMIT's log write). Returns what it did,
    for the report."""
    if engine.dialect.name == "sqlite":
        # Outside any transaction (the engine's connections begin one with their first
        # statement), on a connection of its own.
        with contextlib.closing(sqlite3.connect(str(engine.url.database))) as raw:
            busy, log_pages, _moved = raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return f"WAL checkpointed ({log_pages} pages{', busy' if busy else ''})"
    async with engine.connect() as conn:
        (await conn.exec_driver_sql("ANALYZE TABLE " + ", ".join(t.name for t in tables))).all()
        start = time.monotonic()
        dirty = SETTLED_DIRTY_PAGES + 1
        while dirty > SETTLED_DIRTY_PAGES and time.monotonic() - start < SETTLE_S:
            status = await conn.exec_driver_sql(
                "SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'"
            )
            dirty = int(status.one()._mapping["Value"])
            await conn.rollback()  # a fresh snapshot per poll
            if dirty > SETTLED_DIRTY_PAGES:
                await asyncio.sleep(0.5)
    return f"tables analyzed, {dirty} dirty pages left after {time.monotonic() - start:.0f} s"
